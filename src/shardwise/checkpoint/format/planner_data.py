"""DCP's `planner_data` in a manifest: plain JSON where it is, else a pickle.

The manifest keeps its own copy (never `.metadata`'s), so the two records never
depend on each other; a pickle is read back with the unpickler of stock
`.metadata` (`safe_pickle`).
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

from ...errors import CorruptCheckpointError
from .field_table import FieldError
from .manifest_entries import MANIFEST
from .safe_pickle import load_metadata

__all__ = ["encode_planner_data", "pickled", "unpickled", "untag"]


def encode_planner_data(value: Any) -> Any:
    """DCP's `planner_data` as JSON, tuples tagged so they come back as tuples
    (the default planner maps keys to tuple paths); `FieldError` (a `ValueError`) when it holds
    anything else than plain containers, strings and numbers."""
    kind = type(
        value
    )  # exact types: an Enum, namedtuple or OrderedDict would come back as its base
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is tuple:
        return {"__tuple__": [encode_planner_data(v) for v in value]}
    if kind is list:
        return [encode_planner_data(v) for v in value]
    if kind is dict and all(type(k) is str for k in value) and "__tuple__" not in value:
        return {k: encode_planner_data(v) for k, v in value.items()}
    raise FieldError(
        "planner_data", f"planner data of type {type(value).__name__} is not plain JSON"
    )


def pickled(value: Any) -> tuple[Any, str | None]:
    """(planner_data, planner_data_pickle) of `value`: itself when it is plain JSON (a
    manifest keeps it decoded and encodes it as it writes: tags are a third of a
    large manifest's planner data), else pickled."""
    try:
        encode_planner_data(value)
    except FieldError:
        return None, base64.b64encode(pickle.dumps(value)).decode()
    return value, None


def untag(pairs: list[tuple[str, Any]]) -> Any:
    """`json.loads`'s `object_pairs_hook` for a manifest: a tagged tuple
    `{"__tuple__": [...]}` read as the tuple it stands for, object by object as
    they are parsed (the tags are never built), any other object
    as a dict. Only planner data holds such an object; anywhere else a tuple is no
    JSON object, and the manifest's tables refuse it as they refuse a list there."""
    if len(pairs) == 1 and pairs[0][0] == "__tuple__" and type(pairs[0][1]) is list:
        return tuple(pairs[0][1])
    return dict(pairs)


def unpickled(planner_data: Any, planner_data_pickle: str | None) -> Any:
    """The value `pickled` stored."""
    if planner_data_pickle is None:
        return planner_data
    try:
        return load_metadata(
            io.BytesIO(base64.b64decode(planner_data_pickle)), f"{MANIFEST}: planner data"
        )
    except (ValueError, pickle.UnpicklingError) as e:
        raise CorruptCheckpointError(f"{MANIFEST}: unreadable planner data: {e}") from e

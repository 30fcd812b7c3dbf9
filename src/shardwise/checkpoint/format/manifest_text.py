"""A manifest's text parsed: compactly, its format, version and checksum checked.

From format version 4 a tensor is its head: dtype, shape and section. Parsed as
JSON objects, 100,000 heads are 100,000 dicts and lists (50 MiB) that live beside
the entries made from them; `json.loads` calls `Compact` with each object's
pairs as it completes, so a head is a small tuple from the start (equal dtypes
and shapes one object) and planner data's tags are tuples (`untag`). A head is
only made of an object whose fields and types are a head's; `fast_entries`
checks its values as it checks an object's, and gives it back as the object it
was (`Head.as_object`) wherever a table must name what is wrong. An object shaped
like a head outside "tensors" (planner data may hold any JSON) is found by count
and the text parsed again as plain objects.
"""

from __future__ import annotations

import json
import re
from typing import Any

import crc32c

from .field_table import FieldError
from .manifest_entries import FORMAT, READS, VERSION
from .planner_data import untag

__all__ = ["Compact", "Head", "checksum", "parse"]

# The end of a document as the writer writes it: its checksum is the last field.
_TAIL = re.compile(rb',"crc32c":(0|[1-9][0-9]{0,9})\}$')


def parse(data: bytes) -> tuple[dict[str, Any], int] | None:
    """The document in `data` and its format version, parsed compactly (`Compact`),
    its checksum checked; None when it is no JSON object (`ValueError` when it is no
    JSON, `FieldError` when its format, version or checksum is wrong)."""
    compact = Compact()
    doc = json.loads(data, object_pairs_hook=compact)
    if not isinstance(doc, dict):
        return None
    if not compact.all_in(doc):  # a head-shaped object elsewhere: plain objects
        doc = json.loads(data, object_pairs_hook=untag)
    version = _check_version(doc)
    if not _checksum_matches(data, doc):
        raise FieldError("crc32c", "does not match the contents (damaged)")
    return doc, version


def checksum(doc: dict[str, Any]) -> int:
    """The crc32c of `doc`'s compact text with "crc32c" 0 (what the writer seals)."""
    # compact, no indent: json's C encoder (10x faster), and canonical, so re-encoding is exact
    return crc32c.crc32c(json.dumps(dict(doc, crc32c=0), separators=(",", ":")).encode())


def _checksum_matches(text: bytes, doc: dict[str, Any]) -> bool:
    """Whether `doc`'s "crc32c" checksums its compact form: the writer's text as it is
    (its bytes are that form), anything else (indented, reordered) encoded again."""
    found = _TAIL.search(text, max(0, len(text) - 32))
    if found is not None and int(found.group(1)) == doc.get("crc32c"):
        if crc32c.crc32c(b"0}", crc32c.crc32c(memoryview(text)[: found.start(1)])) == doc["crc32c"]:
            return True
    # parsed again as plain JSON: `doc` holds heads and planner data's tuples (`Compact`)
    return checksum(json.loads(text)) == doc.get("crc32c")


def _check_version(doc: dict[str, Any]) -> int:
    """Format and version first: they keep their meaning in every version, and
    which other fields exist depends on them."""
    if doc.get("format") != FORMAT:
        raise FieldError("format", f"is {doc.get('format')!r}, not {FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or version not in READS:
        newer = type(version) is int and version > VERSION
        raise FieldError(
            "version",
            f"format version {version!r} is not supported: this shardwise reads versions "
            f"{', '.join(map(str, READS))}"
            + (" (a newer shardwise wrote it: upgrade to read it)" if newer else ""),
        )
    return version


class Head(tuple):
    """A tensor head as parsed: (dtype, shape, section, requires_grad, whether the object
    named requires_grad), shape and section as tuples of what the JSON lists held."""

    __slots__ = ()

    def as_object(self) -> dict[str, Any]:
        """The JSON object it was parsed from."""
        dtype, shape, section, grad, named = self
        out: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
        if named:
            out["requires_grad"] = grad
        out["section"] = list(section)
        return out


class Compact:
    """`json.loads`'s `object_pairs_hook` for one manifest: heads as `Head` (`heads`:
    how many), planner data's tags as tuples, any other object as a dict."""

    def __init__(self) -> None:
        self.heads = 0
        self._same: dict[Any, Any] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> Any:
        n = len(pairs)
        if n == 1:
            return untag(pairs)
        if (
            (n == 3 or (n == 4 and pairs[2][0] == "requires_grad"))
            and pairs[0][0] == "dtype"
            and pairs[1][0] == "shape"
            and pairs[-1][0] == "section"
        ):
            dtype, shape, section = pairs[0][1], pairs[1][1], pairs[-1][1]
            grad = pairs[2][1] if n == 4 else False
            if (
                type(dtype) is str
                and type(shape) is list
                and type(section) is list
                and len(section) == 5
                and type(grad) is bool
            ):
                try:  # an element no tuple can be hashed by (a list): an object, refused later
                    shape = self._same.setdefault(tuple(shape), tuple(shape))
                except TypeError:
                    return dict(pairs)
                self.heads += 1
                dtype = self._same.setdefault(dtype, dtype)
                return Head((dtype, shape, tuple(section), grad, n == 4))
        return dict(pairs)

    def all_in(self, doc: dict[str, Any]) -> bool:
        """Whether every head made is a tensor of `doc` (none elsewhere)."""
        tensors = doc.get("tensors")
        if not self.heads:
            return True
        return type(tensors) is dict and self.heads == sum(
            type(t) is Head for t in tensors.values()
        )

"""`.metadata` and `shardwise.json` assembled from parts that different ranks encode.

A save's records list every chunk of every rank: O(W × N) entries, 1,000,000
at 1,024 ranks × 1,000 tensors. Encoding them on one rank puts seconds of
pickling and JSON on its critical path, so each key's owner (`engine.key_owners`)
encodes the entries of its own keys and the committing rank only joins bytes.

`.metadata` parts are protocol-2 pickle fragments: a dict's items with their
own memo, whose `BINPUT`/`BINGET` carry explicit indices. Concatenated inside an
empty dict, each fragment re-stores the memo slots it uses before it reads
them, so no fragment ever sees another's objects. The frame around them is
pickled without a memo (`Pickler.fast`), so nothing after a fragment reads a
slot it overwrote. Any unpickler reads the result: stock `dcp.load`'s
`pickle.load` and shardwise's safe one alike.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .field_table import encode
from .manifest import Manifest, seal
from .manifest_entries import VERSION
from .manifest_fields import TOP

__all__ = [
    "ManifestPart",
    "MetadataPart",
    "manifest_from_parts",
    "manifest_part",
    "metadata_from_parts",
    "pickled_items",
]

MetadataPart = tuple[bytes, bytes]  # the items of `state_dict_metadata`, of `storage_data`
ManifestPart = tuple[str, str]  # the members of "tensors", of "objects" (JSON, no braces)

_HEAD = b"\x80\x02}q\x00"  # PROTO 2, EMPTY_DICT, BINPUT 0
_MARKS = ("\x00shardwise part: state\x00", "\x00shardwise part: storage\x00")
_TAIL = '"tensors":{},"objects":{},"crc32c":0}'


def pickled_items(items: dict[Any, Any]) -> bytes:
    """`items` as a fragment: the opcodes that fill an empty dict with them."""
    data = pickle.dumps(items, protocol=2)
    assert data.startswith(_HEAD) and data.endswith(b"."), "protocol 2 opens and ends so"
    return data[len(_HEAD) : -1]


def _hole(mark: str) -> bytes:
    """How the memo-less frame pickles `{mark: None}` (BINUNICODE, NONE, SETITEM)."""
    text = mark.encode()
    return b"}X" + len(text).to_bytes(4, "little") + text + b"Ns"


def metadata_from_parts(
    parts: list[MetadataPart], planner_data: Any, storage_meta: StorageMeta
) -> bytes:
    """DCP's pickled `Metadata` whose two dicts hold every part's items, in order."""
    frame = Metadata(
        state_dict_metadata={_MARKS[0]: None},  # type: ignore[dict-item]  # holes, spliced below
        planner_data=planner_data,
        storage_data={_MARKS[1]: None},
        storage_meta=storage_meta,
        version=CURRENT_DCP_VERSION,
    )
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo in the frame: see the module's docstring
    pickler.dump(frame)
    out = buffer.getvalue()
    for which, mark in enumerate(_MARKS):
        before, hole, after = out.partition(_hole(mark))
        if not hole or _hole(mark) in after:  # the caller's planner data spells a mark
            return _whole(parts, planner_data, storage_meta)
        out = before + b"}" + b"".join(p[which] for p in parts) + after
    return out


def _whole(parts: list[MetadataPart], planner_data: Any, storage_meta: StorageMeta) -> bytes:
    """The same `Metadata`, its parts decoded and pickled again in one piece."""
    state, storage = (
        pickle.loads(_HEAD + b"".join(p[which] for p in parts) + b".")  # our own fragments
        for which in (0, 1)
    )
    metadata = Metadata(state, planner_data, storage, storage_meta, CURRENT_DCP_VERSION)
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def manifest_part(manifest: Manifest) -> ManifestPart:
    """The encoded members of `manifest`'s "tensors" and "objects"."""
    doc = encode(TOP, manifest, VERSION)
    return tuple(  # type: ignore[return-value]
        json.dumps(doc[name], separators=(",", ":"))[1:-1] for name in ("tensors", "objects")
    )


def manifest_from_parts(frame: Manifest, parts: list[ManifestPart]) -> bytes:
    """`shardwise.json`, sealed: `frame`'s fields (its tensors and objects empty) and
    every part's members, in order."""
    text = frame.unsealed_json()
    assert text.endswith(_TAIL) and not frame.tensors and not frame.objects
    tensors = ",".join(p[0] for p in parts if p[0])
    objects = ",".join(p[1] for p in parts if p[1])
    body = f'{text[: -len(_TAIL)]}"tensors":{{{tensors}}},"objects":{{{objects}}},"crc32c":0}}'
    return seal(body).encode()

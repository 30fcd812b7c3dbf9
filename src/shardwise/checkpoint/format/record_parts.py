"""`.metadata` and `shardwise.json` assembled from parts that different ranks encode.

A save's records list every chunk of every rank: O(W × N) entries, 1,000,000
at 1,024 ranks × 1,000 tensors. Encoding them on one rank puts seconds of
pickling and JSON on its critical path, and gathering them there puts the
whole records in its memory. So each key's owner (`engine.key_owners`) encodes
the entries of its own keys into a part (`part_trailer`), writes it beside the
checkpoint, and the committing rank only copies bytes: a fixed frame with
three holes in each record, the parts' sections poured into them in order
(`io.record_join`).

`.metadata` sections are protocol-2 pickle fragments: a dict's items with their
own memo, whose `BINPUT`/`BINGET` carry explicit indices. Concatenated inside an
empty dict, each fragment re-stores the memo slots it uses before it reads
them, so no fragment ever sees another's objects. The frame around them is
pickled without a memo (`Pickler.fast`), so nothing after a fragment reads a
slot it overwrote. Any unpickler reads the result: stock `dcp.load`'s
`pickle.load` and shardwise's safe one alike. Manifest sections are the
members of its three objects ("planner_data", "tensors", "objects"), joined
by commas. The seventh section is the owner's block of the index (format
version 4: its keys' chunk sections, `manifest_index`), which the committing rank
copies into the index file; the manifest's members point into the block.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...errors import CorruptCheckpointError
from .field_table import encode
from .manifest import Manifest
from .manifest_entries import VERSION
from .manifest_fields import TOP
from .planner_data import encode_planner_data

__all__ = [
    "SECTIONS",
    "TRAILER",
    "manifest_frame",
    "manifest_sections",
    "metadata_frame",
    "metadata_sections",
    "pickled_items",
    "part_spans",
    "part_trailer",
]

# A part's sections, in the order the frames' holes take them, then its index block.
SECTIONS = 7  # .metadata: state, planner, storage; manifest: planner, tensors, objects; index
_LENGTHS = struct.Struct(f"<{SECTIONS}Q")  # one batch's section lengths
_COUNT = struct.Struct("<Q")  # the number of batches, the part's last bytes
TRAILER = _COUNT.size
_HEAD = b"\x80\x02}q\x00"  # PROTO 2, EMPTY_DICT, BINPUT 0
_MARKS = tuple(f"\x00shardwise part: {n}\x00" for n in ("state", "planner", "storage"))
_EMPTY_TAIL = '"planner_data":{},"tensors":{},"objects":{},"crc32c":0}'


def pickled_items(items: dict[Any, Any]) -> bytes:
    """`items` as a fragment: the opcodes that fill an empty dict with them."""
    data = pickle.dumps(items, protocol=2)
    assert data.startswith(_HEAD) and data.endswith(b"."), "protocol 2 opens and ends so"
    return data[len(_HEAD) : -1]


def _hole(mark: str) -> bytes:
    """How the memo-less frame pickles `{mark: None}` (BINUNICODE, NONE, SETITEM)."""
    text = mark.encode()
    return b"}X" + len(text).to_bytes(4, "little") + text + b"Ns"


def metadata_sections(
    state: dict[str, Any], planner_data: dict[str, Any], storage: dict[Any, Any]
) -> list[bytes]:
    """A part's three `.metadata` sections."""
    return [pickled_items(state), pickled_items(planner_data), pickled_items(storage)]


def manifest_sections(manifest: Manifest, planner_data: dict[str, Any]) -> list[bytes]:
    """A part's three manifest sections: the members of "planner_data" (key: DCP's
    flattened path, a tuple of names and indices: plain JSON), "tensors" and "objects"."""
    doc = encode(TOP, manifest, VERSION)
    paths = {key: encode_planner_data(path) for key, path in planner_data.items()}
    members = [paths, doc["tensors"], doc["objects"]]
    return [json.dumps(m, separators=(",", ":"))[1:-1].encode() for m in members]


def part_trailer(lengths: list[list[int]]) -> bytes:
    """The end of a part written a batch of keys at a time (`io.record_join.write_part`):
    each batch's seven section lengths, then the number of batches. An owner of 50,000
    keys that built all their entries, `.metadata` objects and encodings at once would
    hold hundreds of MiB, and the part's bytes; a batch at a time it holds one batch's.
    A section's batches join as parts do: pickle fragments back to back, manifest
    members with commas, index blocks back to back."""
    return b"".join(_LENGTHS.pack(*n) for n in lengths) + _COUNT.pack(len(lengths))


def part_spans(
    read: Callable[[int, int], bytes], size: int, where: str
) -> list[list[tuple[int, int]]]:
    """Each section's (offset, length) pieces, batch by batch, in a part file of `size`
    bytes (`read(n, offset)`); refused unless its batches and trailer fill it exactly."""
    count = _COUNT.unpack(read(TRAILER, size - TRAILER))[0] if size >= TRAILER else -1
    if count < 0 or TRAILER + count * _LENGTHS.size > size:
        raise CorruptCheckpointError(f"{where}: a record part cut short ({size} bytes)")
    table = read(count * _LENGTHS.size, size - TRAILER - count * _LENGTHS.size)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(SECTIONS)]
    at = 0
    for lengths in _LENGTHS.iter_unpack(table):
        for section, n in enumerate(lengths):
            if n:
                spans[section].append((at, n))
            at += n
    if at + len(table) + TRAILER != size:
        raise CorruptCheckpointError(f"{where}: a record part whose sections do not fill it")
    return spans


def metadata_frame(storage_meta: StorageMeta) -> list[bytes]:
    """DCP's pickled `Metadata` cut at its three holes (state, planner data, storage):
    four pieces, each part's `.metadata` sections going between them in order."""
    frame = Metadata(
        state_dict_metadata={_MARKS[0]: None},  # type: ignore[dict-item]  # holes
        planner_data={_MARKS[1]: None},
        storage_data={_MARKS[2]: None},
        storage_meta=storage_meta,
        version=CURRENT_DCP_VERSION,
    )
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo in the frame: see the module's docstring
    pickler.dump(frame)
    pieces, rest = [], buffer.getvalue()
    for mark in _MARKS:
        before, hole, rest = rest.partition(_hole(mark))
        assert hole and _hole(mark) not in rest, "the frame holds nothing of the caller's"
        pieces.append(before + b"}")
    return [*pieces, rest]


def manifest_frame(frame: Manifest) -> list[bytes]:
    """`frame`'s manifest text (no entries, no planner data) cut at its holes: four
    pieces, each part's manifest sections going between them, comma-separated. The
    last piece ends `"crc32c":0}`: the writer seals it (`manifest.seal`)."""
    assert not frame.tensors and not frame.objects and frame.planner_data == {}
    text = frame.unsealed_json()
    assert text.endswith(_EMPTY_TAIL)
    head = text[: -len(_EMPTY_TAIL)]
    return [
        f'{head}"planner_data":{{'.encode(),
        b'},"tensors":{',
        b'},"objects":{',
        b'},"crc32c":0}',
    ]

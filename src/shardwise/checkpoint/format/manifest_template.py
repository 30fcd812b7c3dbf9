"""`shardwise.json` encoded before its checksums are known, and filled once they are.

A save knows all of its manifest but the checksums before it writes a byte: the
chunks' tiles, crc32cs and frame crc32c, and the crc32c of `.metadata`, arrive
from the writers at the end. Encoding 100,000 tensors then would put a second of
JSON encoding on the coordinator's critical path. So it encodes the manifest
through the field tables while the others write, with a hole where each late
value goes, and fills the holes in order when the writers report.

The late fields are declared by the tables themselves: `metadata_crc32c` at the
top, and a chunk's last three fields (`fast_entries.FAST_CHUNK`), which the fill
writes as `json.dumps` would. Anything else (an old version, a transformed chunk,
a key that spells a hole) is encoded whole after filling instead, so the result
is always byte for byte `Manifest.to_json()` (held to it by a test).
"""

from __future__ import annotations

import json

from .fast_entries import FAST_CHUNK
from .field_table import encode
from .gc_pause import gc_paused
from .manifest import Manifest, seal
from .manifest_entries import VERSION, ChunkEntry
from .manifest_fields import TOP

__all__ = ["ManifestTemplate"]

_LATE_CHUNK = ("tile", "tiles", "frame")  # a chunk's late fields, the last of its table
_HOLE = "\x00late\x00"  # never a valid field value; a key spelling it disables the template
_ENCODED_HOLE = json.dumps(_HOLE)


def _ints(values: tuple[int, ...] | list[int]) -> str:
    return f"[{','.join(map(str, values))}]"


class ManifestTemplate:
    """`manifest`'s text with holes for its checksums; `fill` once they are set."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._chunks: list[ChunkEntry] = [c for t in manifest.tensors.values() for c in t.chunks]
        self._parts = self._holed_text() if self._templatable() else None

    def _templatable(self) -> bool:
        return (
            self.manifest.version == VERSION
            and FAST_CHUNK[-len(_LATE_CHUNK) :] == _LATE_CHUNK
            and all(c.transform is None and c.payload is not None for c in self._chunks)
        )

    def _holed_text(self) -> list[str] | None:
        """The encoded manifest cut at its holes: `metadata_crc32c`'s, then one per chunk."""
        m = self.manifest
        saved = m.metadata_crc32c, [(c.tile, c.crcs, c.frame) for c in self._chunks]
        try:
            m.metadata_crc32c = _HOLE  # type: ignore[assignment]  # a placeholder, encoded
            for c in self._chunks:
                c.tile, c.crcs, c.frame = (), [], 0  # the table encodes them; replaced below
            with gc_paused():
                doc = encode(TOP, m, VERSION)
                for tensor in doc.get("tensors", {}).values():
                    for chunk in tensor["chunks"]:
                        del chunk["tiles"], chunk["frame"]
                        chunk["tile"] = _HOLE
                parts = json.dumps(doc, separators=(",", ":")).split(_ENCODED_HOLE)
        finally:
            m.metadata_crc32c = saved[0]
            for c, (tile, crcs, frame) in zip(self._chunks, saved[1]):
                c.tile, c.crcs, c.frame = tile, crcs, frame
        return parts if len(parts) == len(self._chunks) + 2 else None

    def fill(self) -> str:
        """`self.manifest.to_json()`, from the holed text and the values set since."""
        m = self.manifest
        if self._parts is None or m.metadata_crc32c == 0:  # 0: a default, not written
            return m.to_json()
        parts = self._parts
        out = [parts[0], str(m.metadata_crc32c), parts[1]]
        for c, after in zip(self._chunks, parts[2:]):
            if c.tile is None:
                return m.to_json()  # the tables refuse it, naming the chunk
            out.append(f'{_ints(c.tile)},"tiles":{_ints(c.crcs)},"frame":{c.frame}')
            out.append(after)
        return seal("".join(out))

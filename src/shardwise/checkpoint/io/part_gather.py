"""Parts of many small stored chunks gathered into their targets, a window at a time.

A reshard onto another layout reads, on each rank, parts of many small chunks:
loading by columns what was saved by rows takes a band of every row chunk of
every tensor (32,000 parts a rank for 1,000 tensors of 32 chunks). Verifying,
each part reads its whole chunk anyway (one checksum tile). One read request,
one scratch tensor and one copy a part cost about 50 µs of Python each; here a
window of parts (`GatherRead`s, at most `WINDOW` bytes of chunks) costs a few
numpy calls a target:

* the distinct chunks are read whole, neighbours in a file by one `preadv` (gaps
  into one junk buffer), each payload into a 16-byte-aligned slot of one scratch
  buffer, and each verified against its checksum;
* the parts go from scratch into their targets as words (`word_gather`).

Host memory: the window's scratch (its chunks, at least one target's) and
`word_gather`'s index arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import crc32c
import numpy as np
import torch

from ...errors import CorruptCheckpointError
from ...storage import Folder, RandomAccess
from ..format.byte_runs import MERGE_GAP
from ..format.chunk_table import file_of
from ..format.row_boxes import Boxes, row_strides
from .read_requests import GatherRead
from .whole_chunks import GAP
from .word_gather import gather

__all__ = ["Window", "extents", "windows", "words_of"]

WINDOW = 8 << 20  # bytes of chunks a window reads into scratch
_IOVECS = 511  # chunks a preadv fills (each with a gap before it: under IOV_MAX)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words_of(target: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """`target`'s memory as a flat array of words and the words an element takes; None
    when it has no such view (not a plain, contiguous, non-empty CPU tensor)."""
    size = target.element_size()
    word = min(size, 8)
    if (
        target.device.type != "cpu"
        or target.layout != torch.strided
        or not target.dim()
        or not target.numel()
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.is_quantized
        or size % word
        or word not in _WORDS
    ):
        return None
    try:
        return target.detach().view(_WORDS[word]).numpy().reshape(-1), size // word
    except (RuntimeError, TypeError):  # a dtype with no integer view
        return None


def extents(reads: list[GatherRead]) -> dict[str, tuple[int, int, str]]:
    """Each data file the gathers read: the record that ends last in it (start, end) and
    its key, as `read_locate.open_files` names a file too short for it."""
    if not reads:
        return {}
    files = np.concatenate([r.boxes.file for r in reads])
    record = np.concatenate([r.boxes.record for r in reads])
    owner = np.repeat(np.arange(len(reads)), [len(r.boxes.crc) for r in reads])
    end = record.sum(axis=1)
    order = np.lexsort((end, files[:, 2], files[:, 1], files[:, 0]))  # by file, then end
    ranked = files[order]
    last = order[np.append((ranked[1:] != ranked[:-1]).any(axis=1), True)]
    return {
        file_of(*files[i].tolist()): (int(record[i, 0]), int(end[i]), reads[owner[i]].name)
        for i in last.tolist()
    }


def windows(
    reads: list[GatherRead],
    folder: Folder,
    files: dict[str, RandomAccess],
    verify: bool,
    count: Callable[[int], None],
) -> list[Window]:
    """`reads` in windows, each a read job (`Window.ranges`, `Window.run`) that reads
    from `files` once they are open. The reads go in the order their first chunks are
    stored (a file holds its tensors in key order, a state dict need not), so that a
    window's chunks lie side by side."""
    reads = sorted(reads, key=lambda r: (*r.boxes.file[0].tolist(), int(r.boxes.payload[0, 0])))
    out: list[Window] = []
    start = 0
    while start < len(reads):
        end, size = start, 0
        while end < len(reads) and (end == start or size < WINDOW):
            size += int(reads[end].boxes.payload[:, 1].sum())
            end += 1
        out.append(Window(reads[start:end], folder, files, verify, count))
        start = end
    return out


class Window:
    """Gathers whose chunks are read together into one scratch buffer."""

    def __init__(
        self,
        reads: list[GatherRead],
        folder: Folder,
        files: dict[str, RandomAccess],
        verify: bool,
        count: Callable[[int], None],
    ) -> None:
        self.reads, self.folder, self.files, self.verify, self.count = (
            reads,
            folder,
            files,
            verify,
            count,
        )
        boxes = [r.boxes for r in reads]
        self.owner = np.repeat(np.arange(len(reads)), [len(b.crc) for b in boxes])
        stored = np.column_stack(
            [np.concatenate([b.file for b in boxes]), np.concatenate([b.payload for b in boxes])]
        )
        self.chunks, first, inverse = _distinct(stored)
        inverse = inverse.reshape(-1)
        self.crcs = np.concatenate([b.crc for b in boxes])[first].tolist()
        self.first = self.owner[first].tolist()  # a read of each chunk, for errors
        skip = np.zeros(len(self.chunks), dtype=np.int64)  # payload bytes not read, at its start
        if not verify:  # each chunk from its parts' first byte to their last, no more
            skip = _needed(reads, boxes, inverse, self.chunks)
        self.spans = _chunk_spans(self.chunks, GAP if verify else MERGE_GAP)
        self.slot, self.dense, self.total = _slots(self.chunks, self.spans)
        # where each part's chunk's payload starts in scratch, in bytes (before the
        # scratch when its first bytes are not read: they are never indexed)
        self.at = (self.slot - skip)[inverse]
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for a, b in self.spans:
            lo, hi = int(self.chunks[a, 3]), int(self.chunks[b - 1, 3:5].sum())
            self.ranges.setdefault(self._name(a), []).append((lo, hi))

    def _name(self, i: int) -> str:
        return file_of(*self.chunks[i, :3].tolist())

    def run(self) -> None:
        scratch = np.empty(self.total, dtype=np.uint8)
        view = scratch.data
        offsets, lengths, slots = (
            self.chunks[:, 3].tolist(),
            self.chunks[:, 4].tolist(),
            self.slot.tolist(),
        )
        for (a, b), dense in zip(self.spans, self.dense):
            name = self._name(a)
            lo, hi = offsets[a], offsets[b - 1] + lengths[b - 1]
            file = self.files[name]
            if dense:  # gaps and all, straight into place
                got, wanted = file.readinto([view[slots[a] : slots[a] + hi - lo]], lo), hi - lo
            else:
                got, wanted = _read_apart(file, view, offsets[a:b], lengths[a:b], slots[a:b])
            self.count(got)
            if got != wanted:
                where = self.folder.where(name)
                raise CorruptCheckpointError(f"{where}: short read of bytes {lo}..{hi}: truncated")
            if self.verify:
                self._check(view, range(a, b), offsets, lengths, slots, name)
        gather(self.reads, self.owner, self.at, scratch)

    def _check(
        self,
        view: memoryview,
        chunks: range,
        offsets: list[int],
        lengths: list[int],
        slots: list[int],
        name: str,
    ) -> None:
        for i in chunks:
            if crc32c.crc32c(view[slots[i] : slots[i] + lengths[i]]) != self.crcs[i]:
                lo, hi = offsets[i], offsets[i] + lengths[i]
                raise CorruptCheckpointError(
                    f"'{self.reads[self.first[i]].name}': bytes {lo}..{hi} of "
                    f"{self.folder.where(name)} fail their checksum"
                )


def _distinct(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct rows of `rows` in order (by column), where each first is, and which
    distinct row each row is: `np.unique(axis=0)`, a fraction of its cost."""
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ranked[new], order[new], inverse


def _needed(
    reads: list[GatherRead], boxes: list[Boxes], inverse: np.ndarray, chunks: np.ndarray
) -> np.ndarray:
    """Narrow each chunk's range (`chunks[:, 3:5]`) to the bytes its parts need, from
    the first to the last; the bytes skipped at each chunk's start."""
    itemsize = np.repeat([r.words.itemsize * r.factor for r in reads], [len(b.crc) for b in boxes])
    sizes, inner, lengths = (np.concatenate([getattr(b, f) for b in boxes]) for f in _BOX)
    strides = row_strides(sizes)
    first = (inner * strides).sum(axis=1) * itemsize
    last = first + (((lengths - 1) * strides).sum(axis=1) + 1) * itemsize
    lo = np.full(len(chunks), np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(len(chunks), dtype=np.int64)
    np.minimum.at(lo, inverse, first)
    np.maximum.at(hi, inverse, last)
    chunks[:, 3] += lo
    chunks[:, 4] = hi - lo
    return lo


_BOX = ("sizes", "inner", "lengths")


def _chunk_spans(chunks: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Runs of chunks (sorted by file, then offset) one read takes: same file, in
    order, gaps under `gap`."""
    n = len(chunks)
    end = chunks[:, 3] + chunks[:, 4]
    cut = np.ones(n, dtype=bool)
    space = chunks[1:, 3] - end[:-1]
    cut[1:] = (chunks[1:, :3] != chunks[:-1, :3]).any(axis=1) | (space < 0) | (space >= gap)
    bounds = np.append(np.flatnonzero(cut), n).tolist()
    return list(zip(bounds, bounds[1:]))


def _slots(chunks: np.ndarray, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[bool], int]:
    """Where each chunk's payload lands in scratch, whether each span is read as one
    range (dense: gaps at most as large as the payloads; its payloads where the file
    has them, aligned or not), the bytes. Apart, each payload is 16-byte aligned."""
    slot = np.empty(len(chunks), dtype=np.int64)
    dense, pos = [], 0
    for a, b in spans:
        at, n = chunks[a:b, 3], chunks[a:b, 4]
        length = int(at[-1] + n[-1] - at[0])
        if length <= 2 * int(n.sum()) + 4096:
            slot[a:b] = pos + (at - at[0])
            dense.append(True)
        else:
            room = (n + 15) & ~15
            slot[a:b] = pos + np.cumsum(room) - room
            dense.append(False)
            length = int(room.sum())
        pos += (length + 15) & ~15
    return slot, dense, max(16, pos)


def _read_apart(
    file: RandomAccess, view: memoryview, at: list[int], n: list[int], slots: list[int]
) -> tuple[int, int]:
    """Read chunks `at`/`n` of one span into their slots, the gaps into junk: one `preadv`
    a `_IOVECS` chunks. The bytes read and asked for, gaps included."""
    junk, got, wanted = memoryview(bytearray(GAP)), 0, 0
    for first in range(0, len(at), _IOVECS):
        buffers: list[memoryview] = []
        pos = lo = at[first]
        for i in range(first, min(first + _IOVECS, len(at))):
            if at[i] > pos:
                buffers.append(junk[: at[i] - pos])
            buffers.append(view[slots[i] : slots[i] + n[i]])
            pos = at[i] + n[i]
        read = file.readinto(buffers, lo)
        got, wanted = got + read, wanted + pos - lo
        if read != pos - lo:
            break
    return got, wanted

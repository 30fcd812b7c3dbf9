"""Raw writes and page checksums: the byte-level rules every writer, reader and verifier shares.

One definition each, so what a writer checksums is exactly what a reader checks.
Pages of `PAGE_SIZE` are the checksums of format versions 1 and 2, still read and
verified; version 3 checksums tiles (`tiles`).
"""

from __future__ import annotations

import crc32c
import torch

from .manifest_entries import PAGE_SIZE

__all__ = ["bad_page", "byte_view", "frame_crc", "pages_of"]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in C order, without a copy (through numpy's
    buffer where the dtype has one: a third of the cost, which counts at 100,000 tensors)."""
    if t.dtype in _NUMPY_DTYPES and t.numel():
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data


_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def pages_of(payload: memoryview, page_size: int = PAGE_SIZE) -> list[int]:
    """crc32c of each `page_size` slice of a payload; an empty payload is one empty page."""
    if len(payload) == 0:
        return [crc32c.crc32c(b"")]
    return [crc32c.crc32c(payload[i : i + page_size]) for i in range(0, len(payload), page_size)]


def frame_crc(head: bytes | memoryview, tail: bytes | memoryview) -> int:
    """crc32c of a record's bytes around its payload, as one stream."""
    return crc32c.crc32c(tail, crc32c.crc32c(head))


def bad_page(data: memoryview | bytes, start: int, page: int, pages: list[int]) -> int | None:
    """Offset in `data` of its first page that fails its checksum, else None; `data`
    holds whole pages (the last may be short) from the page-aligned payload offset `start`."""
    for k in range(0, max(len(data), 1), page):  # empty: the one empty page `pages_of` sums
        if crc32c.crc32c(data[k : k + page]) != pages[(start + k) // page]:
            return k
    return None

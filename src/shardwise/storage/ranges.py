"""Planning ranged GETs: which byte ranges to fetch together, and in what parts.

`prefetch` merges neighbouring ranges only while the bytes between them stay
under a share (`WASTE`) of the bytes wanted, so at most 1.1x the needed bytes
cross the network, and cuts long ranges into parts fetched concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_GAP", "PART", "WASTE", "coalesce", "parts", "scatter"]

WASTE = 0.1  # bytes fetched between two wanted ranges, at most this share of the bytes wanted
MAX_GAP = 4 << 20  # never merge across more than this, whatever the ranges around it
PART = 8 << 20  # ranges longer than this are fetched as concurrent parts (of up to 1.25x)


def coalesce(
    ranges: Sequence[tuple[int, int]], waste: float = WASTE, max_gap: int = MAX_GAP
) -> list[tuple[int, int]]:
    """`(start, end)` ranges merged into fewer GETs: neighbours join while the gap
    bytes of the merged range stay within `waste` of its wanted bytes (so the
    whole costs at most `1 + waste` times the bytes wanted); overlaps always join."""
    out: list[list[int]] = []  # start, end, wanted bytes
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out:
            last = out[-1]
            gap = start - last[1]
            if gap <= 0:
                last[2] += max(0, end - last[1])
                last[1] = max(last[1], end)
                continue
            wanted = last[2] + end - start
            spent = (last[1] - last[0]) - last[2] + gap
            if gap <= max_gap and spent <= waste * wanted:
                last[1], last[2] = end, wanted
                continue
        out.append([start, end, end - start])
    return [(s, e) for s, e, _ in out]


def parts(ranges: list[tuple[int, int]], part: int = PART) -> list[tuple[int, int]]:
    """The ranges cut into parts of `part` bytes, in order; a last part under a quarter
    of that joins the one before (a file's few KiB of checksums after its chunks are
    no request of their own)."""
    out = []
    for start, end in ranges:
        cuts = list(range(start, end, part))
        if len(cuts) > 1 and end - cuts[-1] < part // 4:
            cuts.pop()
        out += [(s, e) for s, e in zip(cuts, [*cuts[1:], end])]
    return out


def scatter(source: list[memoryview], buffers: Sequence[memoryview]) -> int:
    """Copy the concatenation of `source` into `buffers` in order; the bytes copied."""
    copied, k, at = 0, 0, 0
    for piece in source:
        while len(piece) and k < len(buffers):
            dest = buffers[k]
            n = min(len(piece), len(dest) - at)
            dest[at : at + n] = piece[:n]
            piece, at, copied = piece[n:], at + n, copied + n
            if at == len(dest):
                k, at = k + 1, 0
    return copied

"""Parts of one-tile chunks read as whole chunks, once per chunk, on the whole-chunk path.

Verifying, a part of a chunk costs the checksum tiles it touches, and a chunk of
up to 256 KiB is one tile (`format.tiles`): a part of it reads the whole payload
anyway. A reshard reads many such parts (a column band of each row chunk of
every tensor): one `read_box` each, a dozen steps per part for a few hundred
bytes, and a chunk read again for each of this rank's pieces it overlaps. So
such parts become one whole-chunk read per chunk into scratch, batched with its
file's neighbours into one `preadv` and verified once (`whole_chunks`), whose
`done` copies each part's box into its target: the same bytes read, the same
checks, a fraction of the steps.
"""

from __future__ import annotations

import torch

from ..format.manifest import StoredChunk
from ..format.record_read import RecordLayout
from .read_requests import ChunkRead

__all__ = ["as_whole", "read_whole"]


def read_whole(read: ChunkRead, layout: RecordLayout, verify: bool) -> bool:
    """Whether part `read` reads its whole chunk anyway: verifying a one-tile chunk,
    into a tensor on the CPU (a device target keeps its staged path)."""
    info = read.info
    return (
        verify
        and isinstance(info, StoredChunk)
        and info.crcs is not None
        and len(info.crcs) == 1
        and info.tile == tuple(layout.shape)
        and read.done is None
        and isinstance(read.target, torch.Tensor)
        and read.target.device.type == "cpu"
    )


def as_whole(parts: list[ChunkRead], layout: RecordLayout) -> ChunkRead:
    """One read of the whole chunk `parts` (all `read_whole`) are parts of, into scratch;
    its `done` copies each part's box into that part's target."""
    first = parts[0]

    def done(chunk: torch.Tensor) -> None:
        for part in parts:
            box = tuple(slice(o, o + n) for o, n in zip(part.offsets, part.lengths))
            target = part.target
            assert isinstance(target, torch.Tensor)
            target.copy_(chunk[box])

    scratch = torch.empty(layout.shape, dtype=layout.dtype)
    zero = (0,) * len(layout.shape)
    return ChunkRead(
        first.name, first.info, first.shape, first.dtype, zero, layout.shape, scratch, done
    )

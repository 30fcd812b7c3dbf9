"""How a dimension splits into parts, and where a rank sits on a device mesh.

The integer rules every layout builder shares: `torch.chunk`'s part sizes
(which DTensor `Shard` uses), checked user sizes, dimension normalisation and
row-major mesh coordinates.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LayoutError

__all__ = ["check_sizes", "chunk_sizes", "mesh_coordinates", "normalize_dim"]


def chunk_sizes(extent: int, parts: int) -> list[int]:
    """Part sizes exactly as `torch.chunk` (and DTensor `Shard`) produce them."""
    if parts <= 0:
        raise LayoutError(f"the number of parts (world size) must be positive, got {parts}")
    step = -(-extent // parts) if extent else 0
    sizes = []
    for i in range(parts):
        start = min(i * step, extent)
        sizes.append(min(step, extent - start))
    return sizes


def check_sizes(sizes: Sequence[int], extent: int, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise LayoutError(f"{what} sizes {sizes} must be non-negative (0 is allowed)")
    if sum(sizes) != extent:
        raise LayoutError(
            f"{what} sizes {sizes} add up to {sum(sizes)}, not the dimension's {extent}; "
            f"give sizes that add up to {extent} (0 is allowed)"
        )
    return sizes


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        valid = f"valid: {-ndim} to {ndim - 1}" if ndim else "it has no dimension to split"
        raise LayoutError(f"dimension {dim} is out of range for a {ndim}-d tensor ({valid})")
    return dim % ndim


def mesh_coordinates(index: int, extents: Sequence[int]) -> tuple[int, ...]:
    """The row-major coordinates of rank `index` in a mesh of shape `extents` (as DeviceMesh)."""
    coords = []
    for extent in reversed(extents):
        index, c = divmod(index, extent)
        coords.append(c)
    return tuple(reversed(coords))

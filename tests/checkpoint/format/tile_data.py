"""Tensors of known bytes and byte flips, shared by the tests of `format.checksums` and `io.chunks`."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded values of `dtype` (random bytes for integer dtypes)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:  # values, not random bytes: no NaN, so torch.equal compares
        return torch.randn(shape, generator=g).to(dtype)
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype).reshape(shape)


WIDE = (64, 65536)  # float32, 256 KiB rows: tiles (1, 16384), 64 KiB each


def flip_byte(path: Path, at: int) -> None:
    """Invert the byte at `at` of the file `path` (twice: restored)."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))

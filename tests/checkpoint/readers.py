"""Every way a checkpoint of one 3 x 4 float tensor `a` is read, by name: each callable
gives what the reader returned (a load fills a fresh target) or raises what it raised."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardwise.checkpoint as swc

__all__ = ["READERS"]

READERS: dict[str, Callable[[Path], Any]] = {
    "verify": lambda p: swc.verify(p),
    "verify_report": lambda p: swc.verify(p, raise_on_error=False),
    "load": lambda p: swc.load({"a": torch.zeros(3, 4)}, p),
    "read_tensor": lambda p: swc.read_tensor(p, "a"),
    "inspect": lambda p: swc.inspect(p),
}

"""The progress bar of a long command: bytes done on stderr, off with `--quiet` or
when stderr is no terminal (a log file gets no carriage-return noise)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_quiet", "progress_bar"]


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def progress_bar(total: int | None, desc: str, quiet: bool) -> Any:
    """A tqdm bar counting bytes (its `update(n)` is the offline tools' `progress=`);
    `disable=None` is tqdm's "only on a terminal"."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=desc,
        disable=quiet or None,
        file=sys.stderr,
    )

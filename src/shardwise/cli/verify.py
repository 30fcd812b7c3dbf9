"""`shardwise verify PATH`: recompute every checksum and check every tensor is covered once."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import inspect, verify
from .storage_options import add_storage_options, storage_options

__all__ = ["add_parser", "main", "one_line"]


def one_line(text: str) -> str:
    """`text` as one printable line: a crafted checkpoint's names and keys may hold
    newlines or terminal escapes, which must neither split a report nor reach the
    terminal raw (each such character is shown escaped, as `repr` does)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="recompute checksums; exit 1 listing each bad chunk",
        description=__doc__,
        epilog="example: shardwise verify ckpt/step_100",
    )
    p.add_argument("path", help="checkpoint folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        total = inspect(args.path, storage_options=storage_options(args)).nbytes
    except Exception:
        total = None  # verify() reports why the checkpoint cannot be opened
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="verify",
        disable=args.quiet or None,
        file=sys.stderr,
    ) as bar:
        problems = verify(  # not raised: to print each one
            args.path,
            progress=bar.update,
            raise_on_error=False,
            storage_options=storage_options(args),
        )
    for line in problems:
        print(f"shardwise verify: {one_line(line)}", file=sys.stderr)
    if not problems:
        print(f"{args.path}: OK")
    return 1 if problems else 0

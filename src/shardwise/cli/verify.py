"""`shardwise verify PATH`: recompute every checksum and check every tensor is covered once.

A stock DCP checkpoint has no checksums: its structure is checked (coverage, data
files as long as `.metadata` says, every record readable), not its data, and the
command says so rather than "OK".
"""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import inspect, verify
from .progress import add_quiet, progress_bar
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
    add_quiet(p)
    add_storage_options(p)
    p.set_defaults(func=main)


# A stock DCP checkpoint has no checksums: "OK" would claim what was never checked.
STOCK_OK = "structure OK; no checksums in a stock checkpoint: data not verified"


def main(args: argparse.Namespace) -> int:
    try:
        info = inspect(args.path, storage_options=storage_options(args))
    except Exception:
        info = None  # verify() reports why the checkpoint cannot be opened
    total = info.nbytes if info is not None else None
    with progress_bar(total, "verify", args.quiet) as bar:
        problems = verify(  # not raised: to print each one
            args.path,
            progress=bar.update,
            raise_on_error=False,
            storage_options=storage_options(args),
        )
    for line in problems:
        print(f"shardwise verify: {one_line(line)}", file=sys.stderr)
    if not problems:
        stock = info is not None and info.kind == "stock DCP"
        print(f"{args.path}: {STOCK_OK if stock else 'OK'}")
    return 1 if problems else 0

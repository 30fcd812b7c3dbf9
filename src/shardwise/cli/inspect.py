"""`shardwise inspect PATH`: what a checkpoint holds, as a table or `--json`."""

from __future__ import annotations

import argparse
import json

from ..checkpoint import inspect
from .sizes import format_size
from .storage_options import add_storage_options, storage_options

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors: dtype, shape, chunks, bytes, sharding",
        description=__doc__,
        epilog="example: shardwise inspect ckpt/step_100 --json",
    )
    p.add_argument("path", help="checkpoint folder (shardwise or stock DCP)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_storage_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    info = inspect(args.path, storage_options=storage_options(args))
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
        return 0
    version = f", format version {info.format_version}" if info.format_version else ""
    saved = f", saved by {info.world_size} ranks" if info.world_size else ""
    print(f"{info.path}: {info.kind} checkpoint{version}{saved}")
    rows = [
        (
            t.key,
            t.dtype,
            "x".join(map(str, t.shape)) or "scalar",
            str(t.chunks),
            format_size(t.nbytes),
            t.sharding,
        )
        for t in info.tensors
    ]
    head = ("key", "dtype", "shape", "chunks", "bytes", "sharding")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i in (0, 1, 5) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            )
        )
    print(
        f"  {len(info.tensors)} tensors, {format_size(info.nbytes)}; "
        f"{len(info.objects)} Python objects"
        + (f": {', '.join(info.objects)}" if info.objects else "")
    )
    return 0

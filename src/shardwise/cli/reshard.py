"""`shardwise reshard PATH OUT --world-size M`: rewrite a checkpoint offline for M ranks.

Each tensor is chunked along `--dim` (default 0; a tensor with no such
dimension, a bias or a scalar, is replicated; a dim no tensor has is refused)
over M ranks, or split as a
layout given in `--layout FILE.json` (`{"key": <Layout.to_json()>, ...}`);
rank r's blocks go to one file, so a job at M ranks reads one contiguous file
per rank. No process group; memory bounded by the largest block.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..checkpoint import inspect, reshard
from ..errors import InvalidArgumentError
from ..layout import Layout
from .progress import add_quiet, progress_bar
from .storage_options import add_storage_options, storage_options

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint into the per-rank files of another layout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: shardwise reshard ckpt/step_100 ckpt/step_100_m8 --world-size 8 --dim 1",
    )
    p.add_argument("path", help="checkpoint folder (shardwise or stock DCP)")
    p.add_argument("out", help="new checkpoint folder")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--dim", type=int, default=0, help="dimension to chunk along (default 0)")
    p.add_argument("--layout", type=Path, default=None, help="JSON file: key -> layout JSON")
    p.add_argument("--overwrite", action="store_true")
    add_quiet(p)
    add_storage_options(p)
    p.set_defaults(func=main)


def _read_layouts(path: Path) -> dict[str, Layout]:
    """`--layout FILE`: a JSON object, key -> layout JSON; refused naming the file otherwise."""
    try:
        spec = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"--layout {path} is not readable JSON: {e}") from None
    if not isinstance(spec, dict):
        raise InvalidArgumentError(
            f"--layout {path} holds a JSON {type(spec).__name__}; give an object: "
            "key -> layout JSON"
        )
    return {k: Layout.from_json(json.dumps(v)) for k, v in spec.items()}


def main(args: argparse.Namespace) -> int:
    layouts = None if args.layout is None else _read_layouts(args.layout)
    try:
        total = inspect(args.path, storage_options=storage_options(args)).nbytes
    except Exception:
        total = None  # reshard() refuses the path with its own reason
    with progress_bar(total, "reshard", args.quiet) as bar:
        out = reshard(
            args.path,
            args.out,
            args.world_size,
            dim=args.dim,
            layouts=layouts,
            overwrite=args.overwrite,
            storage_options=storage_options(args),
            progress=bar.update,
        )
    print(f"wrote {out} for {args.world_size} ranks")
    return 0

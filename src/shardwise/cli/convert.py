"""`shardwise convert PATH OUT --format ...`: one consolidated file, or back to a checkpoint.

Checkpoint -> `safetensors` (split by `--max-file-size`, with an index, as
Hugging Face does) or `torch`; a `.safetensors` file -> `shardwise` or `torch`.
Streams tensor by tensor. A checkpoint's non-tensor values (`step`,
`param_groups`) have no place in either file: each one dropped is named in a
warning.
"""

from __future__ import annotations

import argparse

from ..checkpoint.offline import TARGETS, convert, inspect
from .progress import add_quiet, progress_bar
from .sizes import parse_size
from .storage_options import add_storage_options, storage_options

__all__ = ["add_parser", "main"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="to one safetensors/torch file, or a safetensors file to a checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  shardwise convert ckpt/step_100 model.safetensors --format safetensors "
        "--max-file-size 5GiB\n"
        "  shardwise convert model.safetensors ckpt/imported --format shardwise",
    )
    p.add_argument("path", help="checkpoint folder or .safetensors file")
    p.add_argument("out", help="output file (or checkpoint folder for --format shardwise)")
    p.add_argument("--format", required=True, choices=list(TARGETS))
    p.add_argument(
        "--max-file-size", type=parse_size, default=None, help="split safetensors output, e.g. 5GiB"
    )
    p.add_argument("--overwrite", action="store_true")
    add_quiet(p)
    add_storage_options(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        total = inspect(args.path, storage_options=storage_options(args)).nbytes
    except Exception:
        total = None  # a .safetensors input, or one convert() refuses with its reason
    with progress_bar(total, "convert", args.quiet) as bar:
        written = convert(
            args.path,
            args.out,
            args.format,
            max_file_size=args.max_file_size,
            overwrite=args.overwrite,
            storage_options=storage_options(args),
            progress=bar.update,
        )
    for f in written:
        print(f"wrote {f}")
    return 0

"""The `shardwise` command: `main(argv) -> int`, one module per subcommand."""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence

from ..errors import ShardwiseError
from . import bench, convert, demo, inspect, reshard, verify

__all__ = ["main", "run"]

_SUBCOMMANDS = {
    "demo": demo,
    "inspect": inspect,
    "verify": verify,
    "convert": convert,
    "reshard": reshard,
    "bench": bench,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Sharded tensors and resharding checkpoints on PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; return its exit code. Bad input prints one line, exit 2."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (OSError, ValueError, KeyError, ShardwiseError, pickle.UnpicklingError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"shardwise {args.command}: error: {message}", file=sys.stderr)
        return 1


def run() -> None:
    sys.exit(main())

"""`shardwise bench NAME`: run a benchmark from the repository's `benchmarks/` folder.

Benchmarks compare shardwise with stock PyTorch side by side in one run and
report ratios; they live beside the package, not in it, and need a checkout.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from ..errors import InvalidArgumentError

__all__ = ["add_parser", "benchmarks_dir", "main"]


def benchmarks_dir() -> Path:
    """`benchmarks/` of the checkout this package was installed from (editable install)."""
    return Path(__file__).resolve().parents[3] / "benchmarks"


def _available() -> list[str]:
    folder = benchmarks_dir()
    return sorted(p.stem.removeprefix("bench_") for p in folder.glob("bench_*.py"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark against stock PyTorch (needs a source checkout)",
        description=__doc__,
        epilog="example: shardwise bench layout --quick",
    )
    p.add_argument("name", help="benchmark name, e.g. layout")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"shardwise bench needs a source checkout: no benchmarks/ folder at {folder} "
            "(install with `pip install -e .` from a clone of the repository)"
        )
    # Benchmarks import the soak helpers under tests/ of the same checkout.
    sys.path.insert(0, str(folder.parent))
    script = benchmarks_dir() / f"bench_{args.name}.py"
    if not script.is_file():
        names = ", ".join(_available()) or "none found"
        raise InvalidArgumentError(
            f"no benchmark {args.name!r} in {benchmarks_dir()} (available: {names})"
        )
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0

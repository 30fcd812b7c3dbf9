"""`shardwise bench NAME`: run a benchmark from a source checkout's `benchmarks/` folder.

Benchmarks compare shardwise with stock PyTorch side by side in one run and
report ratios. They live beside the package, not in it (they import the test
harness and peers' code), so a wheel does not carry them: `bench` finds them in
`SHARDWISE_BENCHMARKS` (a checkout's `benchmarks/` folder), in the checkout an
editable install came from, or in `./benchmarks` of the current folder, and
otherwise says how to get them.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from ..errors import InvalidArgumentError, UsageError

__all__ = ["add_parser", "benchmarks_dir", "main"]

ENV = "SHARDWISE_BENCHMARKS"


def _candidates() -> list[Path]:
    """Where benchmarks are looked for, in order: the environment's folder alone when
    it names one (a wrong one is an error, never a silent fallback), else the checkout
    of an editable install, then `./benchmarks`."""
    if os.environ.get(ENV):
        return [Path(os.environ[ENV])]
    return [Path(__file__).resolve().parents[3] / "benchmarks", Path.cwd() / "benchmarks"]


def benchmarks_dir() -> Path:
    """The `benchmarks/` folder `bench` runs from; `UsageError` saying how to get one
    when there is none (an install from a wheel, outside a checkout)."""
    candidates = _candidates()
    if os.environ.get(ENV) and not any(candidates[0].glob("bench_*.py")):
        raise UsageError(f"{ENV}={candidates[0]} holds no bench_*.py: not a benchmarks/ folder")
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("bench_*.py")):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise UsageError(
        "shardwise bench runs the benchmarks of a source checkout, which a wheel does not "
        f"carry (looked in {looked}): run it in a clone of the shardwise repository "
        f"(`pip install -e .` there), or set {ENV} to a clone's benchmarks/ folder"
    )


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
    # Benchmarks import the soak helpers under tests/ of the same checkout.
    sys.path.insert(0, str(folder.parent))
    script = folder / f"bench_{args.name.replace('-', '_')}.py"  # read-once: bench_read_once.py
    if not script.is_file():
        names = ", ".join(_available()) or "none found"
        raise InvalidArgumentError(f"no benchmark {args.name!r} in {folder} (available: {names})")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0

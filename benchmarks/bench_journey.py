"""How many of a package's modules one save or load runs code in: shardwise vs stock DCP.

Run: `shardwise bench journey` (or `.venv/bin/python benchmarks/bench_journey.py`).
One process, one rank, no process group. The same state is saved and loaded by
stock `dcp.save` / `dcp.load` and by `swc.save` / `swc.load` (the load into
another layout, so that it reshards), each traced by `sys.setprofile` on every
thread (`threading.setprofile`); a warm-up call of each kind first runs on a
different state to other folders, so that lazy imports and first-call caches
are not counted as the journey. It reports, per journey, the package's modules
and functions that ran code, on the calling thread and on all threads, and with
`--list` the modules themselves. A reader walking the code meets these modules:
fewer is easier to walk (the bound set by issue 36 is 25 for a plain save and a
resharding load).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PACKAGES = {"shardwise": "shardwise.", "stock DCP": "torch.distributed.checkpoint."}


class Tracer:
    """Modules and functions of one package prefix that ran code, per thread kind."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.main = threading.get_ident()
        self.modules: dict[str, set[str]] = {"main": set(), "all": set()}
        self.functions: dict[str, set[tuple[str, str]]] = {"main": set(), "all": set()}

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not (module + ".").startswith(self.prefix):
            return
        function = (module, frame.f_code.co_qualname)
        kinds = ("main", "all") if threading.get_ident() == self.main else ("all",)
        for kind in kinds:
            self.modules[kind].add(module)
            self.functions[kind].add(function)

    def run(self, call: Callable[[], Any]) -> None:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        try:
            call()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def _states(scale: int) -> tuple[dict, dict, dict]:
    """A saved state, a state of another layout to load it into, and stock's."""
    import shardwise as sw

    shape = (8 * scale, 6)
    saved_layout = sw.Layout.row_wise(shape, [3 * scale, 5 * scale])
    saved_layout = sw.Layout(
        shape, {0: list(saved_layout.blocks_of(0)) + list(saved_layout.blocks_of(1))}
    )
    target_layout = sw.Layout(
        shape,
        {
            0: list(sw.Layout.column_wise(shape, [4, 2]).blocks_of(0))
            + list(sw.Layout.column_wise(shape, [4, 2]).blocks_of(1))
        },
    )
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)

    def pieces(layout: Any) -> list[torch.Tensor]:
        return [
            full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].clone()
            for b in layout.blocks_of(0)
        ]

    saved = {
        "w": sw.ShardedTensor.from_layout(saved_layout, pieces(saved_layout)),
        "bias": torch.ones(6),
        "step": 7,
    }
    target = {
        "w": sw.ShardedTensor.from_layout(
            target_layout, [torch.zeros(b.sizes) for b in target_layout.blocks_of(0)]
        ),
        "bias": torch.zeros(6),
        "step": 0,
    }
    stock = {"w": full.clone(), "bias": torch.ones(6), "step": 7}
    return saved, target, stock


def _journeys(root: Path) -> dict[str, tuple[str, Callable[[], Any]]]:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    def warm() -> None:
        saved, target, stock = _states(2)
        swc.save(saved, root / "warm-sw")
        swc.load(target, root / "warm-sw")
        dcp.save(stock, checkpoint_id=root / "warm-dcp", no_dist=True)
        dcp.load(stock, checkpoint_id=root / "warm-dcp", no_dist=True)

    warm()
    saved, target, stock = _states(1)
    stock_target = {"w": torch.zeros_like(stock["w"]), "bias": torch.zeros(6), "step": 0}
    return {
        "stock dcp.save": (
            "stock DCP",
            lambda: dcp.save(stock, checkpoint_id=root / "dcp", no_dist=True),
        ),
        "stock dcp.load": (
            "stock DCP",
            lambda: dcp.load(stock_target, checkpoint_id=root / "dcp", no_dist=True),
        ),
        "swc.save": ("shardwise", lambda: swc.save(saved, root / "sw")),
        "swc.load, resharded": ("shardwise", lambda: swc.load(target, root / "sw")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the modules of each journey")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        journeys = _journeys(Path(tmp))
        print(
            f"{'journey':<22} {'modules':>8} {'(all threads)':>14} {'functions':>10} {'(all)':>6}"
        )
        listed: dict[str, list[str]] = {}
        for name, (package, call) in journeys.items():
            tracer = Tracer(PACKAGES[package])
            tracer.run(call)
            print(
                f"{name:<22} {len(tracer.modules['main']):>8} {len(tracer.modules['all']):>14} "
                f"{len(tracer.functions['main']):>10} {len(tracer.functions['all']):>6}"
            )
            listed[name] = sorted(tracer.modules["all"])
    if args.list:
        for name, modules in listed.items():
            print(f"\n{name}: {len(modules)} modules")
            for module in modules:
                print(f"  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

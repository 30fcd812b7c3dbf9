"""Layout math at scale: validation, JSON and transfer planning, with growth curves.

Run: `shardwise bench layout` (or `python benchmarks/bench_layout.py`), `--quick`
for smaller sizes. For each size it reports the time and the time per block,
so linear (n log n) growth shows as a flat per-block column. Stock PyTorch has
no layout object to compare with; the nearest thing, DCP's own global-plan
validation (`_validate_global_plan`, a sweep over chunks), is timed on the
same blocks for reference.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from shardwise import Layout, plan_transfers


def _timed(fn, repeat: int = 3) -> float:
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _dcp_validate(layout: Layout) -> None:
    chunks = [
        ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
        for b in layout.distinct_blocks
    ]
    md = Metadata(
        state_dict_metadata={
            "t": TensorStorageMetadata(TensorProperties(), torch.Size(layout.global_shape), chunks)
        }
    )
    _validate_global_plan([], md)


def bench_validation(sizes: list[int]) -> None:
    print("validation of n blocks (2-D grid, n/100 x 100), best of 3")
    print(
        f"{'blocks':>9} {'shardwise s':>12} {'us/block':>9} {'json rt s':>10} {'DCP check s':>12} {'ratio':>6}"
    )
    for n in sizes:
        rows = n // 100
        layout = Layout.grid((rows * 4, 400), (rows, 100))
        t_validate = _timed(lambda: Layout(layout.global_shape, layout.blocks))
        t_json = _timed(lambda: Layout.from_json(layout.to_json()), repeat=1)
        t_dcp = _timed(lambda: _dcp_validate(layout), repeat=1)
        print(
            f"{n:>9} {t_validate:>12.3f} {t_validate / n * 1e6:>9.2f} {t_json:>10.3f}"
            f" {t_dcp:>12.3f} {t_dcp / t_validate:>5.1f}x"
        )


def bench_planning(world_sizes: list[int]) -> None:
    print("\nplan_transfers between layouts of R ranks, best of 3")
    print(f"{'ranks':>6} {'case':<26} {'transfers':>10} {'seconds':>9} {'us/transfer':>12}")
    for ws in world_sizes:
        side = int(math.isqrt(ws))
        shape = (ws * 8, ws * 8)
        cases = {
            "row-wise -> column-wise": (Layout.chunked(shape, 0, ws), Layout.chunked(shape, 1, ws)),
            "row-wise -> grid": (
                Layout.chunked(shape, 0, ws),
                Layout.grid(shape, (side, ws // side)),
            ),
            "grid -> grid (transposed)": (
                Layout.grid(shape, (side, ws // side)),
                Layout.grid(shape, (ws // side, side)),
            ),
        }
        for name, (src, dst) in cases.items():
            plan: list = []
            t = _timed(lambda: plan.append(plan_transfers(src, dst)))
            n = len(plan[-1])
            print(f"{ws:>6} {name:<26} {n:>10} {t:>9.3f} {t / n * 1e6:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args()
    if args.quick:
        bench_validation([1_000, 10_000])
        bench_planning([64, 256])
    else:
        bench_validation([1_000, 10_000, 100_000])
        bench_planning([64, 256, 1024])


if __name__ == "__main__":
    main()

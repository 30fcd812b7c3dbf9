"""The real save/load engine for W ranks as threads of one process, beside stock's planning.

Each rank runs `save_state` / `load_state` on `ThreadedWorld`'s in-memory
communicator, so what one rank computes, and what it receives, is measured as
W processes would see it, without W processes:

1. first save of the state into folder A;
2. the same state saved again into folder B (a training loop's next save);
3. same-layout load of A into fresh targets;
4. reshard load of A on W/2 ranks (a new world) in another layout.

Per phase: each rank's own CPU (`time.thread_time`: its critical path, not the
engine's I/O threads, not the time it waits at a collective), the bytes each
rank received (pickled, as a process group carries them), collectives, wall
time, the process's CPU over W (helper threads included), and the process's
peak RSS growth (VmHWM reset through `clear_refs`) over W. Loaded values are
checked bit for bit. States are tiny (see `scale_states`): the planning is what
grows with W and N. The ranks' states are frozen out of the garbage collector's
scans during a phase, and the collector is off while a phase runs: one process
holds W ranks' objects where a real rank holds its own, so a collection one rank
triggers would be charged the scan of every rank's objects.

Stock: `scale_stock` plans the same per-rank states with DCP's own planners.

Run: `python benchmarks/scale_threads.py --worlds 16 --tensors 100`; `--phases save
save_again` skips the loads (every rank's load in one process: minutes at W = 256).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import plan_clock  # noqa: E402
from scale_curve import print_curve  # noqa: E402
from scale_states import Spec, build, check, fsdp, targets, torchrec  # noqa: E402
from scale_stock import stock_load, stock_save  # noqa: E402

from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.save import save_state
from shardwise.comm.agreement import Agreement  # noqa: E402
from shardwise.comm.in_process import ThreadedRank, ThreadedWorld  # noqa: E402

__all__ = ["PHASES", "run_threads"]

PHASES = ("save", "save_again", "load", "reshard_load")
_TIMEOUT = 1800.0  # seconds a collective waits for the slowest of 1,024 threads
_STACK = 2 * 2**20  # per rank thread; the default 8 MiB x 1,024 threads is a lot to map


def _specs(kind: str, world: int, tensors: int) -> tuple[Spec, Spec]:
    if kind == "fsdp":
        return fsdp(world, tensors), fsdp(world, tensors, reshard=True)
    if kind == "torchrec":
        return torchrec(world), torchrec(world // 2, reshard=True)
    raise ValueError(f"unknown kind {kind!r}; pick fsdp or torchrec")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the process's peak RSS to its current RSS, which it returns."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _phase(world: ThreadedWorld, fn: Callable[[ThreadedRank], Any]) -> dict[str, float]:
    """Run `fn` on every rank once; what each rank spent (a save: its planning share
    too, `plan_clock`) and received."""

    def timed(comm: ThreadedRank) -> tuple[float, float]:
        start = time.thread_time()
        plan_clock.begin()
        fn(comm)
        return time.thread_time() - start, plan_clock.planned()

    gc.collect()
    gc.freeze()
    gc.disable()  # one process's collector would scan all W ranks' objects, a rank's its own
    received, calls, joined = list(world.received), len(world.calls), plan_clock.joined()
    rss = _reset_peak()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        with plan_clock.clocked():
            both = world.run(timed)
    finally:
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        gc.enable()
        gc.unfreeze()
    peak = _status("VmHWM")
    failed = [(r, e) for r, e in enumerate(both) if isinstance(e, BaseException)]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(f"{len(failed)} ranks failed; rank {rank}: {error!r}") from error
    out, plans = [cpu for cpu, _plan in both], [plan for _cpu, plan in both]
    got = [after - before for after, before in zip(world.received, received)]
    return {
        "cpu_max_s": max(out),
        "cpu_max_rank": out.index(max(out)),
        "cpu_median_s": statistics.median(out),
        "cpu_rank0_s": out[0],
        "join_s": plan_clock.joined() - joined,  # rank 0's join, on its own thread
        "plan_max_s": max(plans),  # a load's: meaningless (it writes nothing)
        "plan_median_s": statistics.median(plans),
        "recv_max": max(got),
        "recv_rank0": got[0],
        "recv_median": statistics.median(got),
        "collectives": len(world.calls) - calls,
        "wall_s": wall,
        "process_cpu_per_rank_s": cpu / world.world_size,
        "rss_per_rank": max(0, peak - rss) / world.world_size,  # VmRSS is read after the reset
    }


def _saves(states: list[dict[str, Any]], path: Path) -> Callable[[ThreadedRank], None]:
    def save(comm: ThreadedRank) -> None:
        save_state(states[comm.rank], path, Agreement(comm), overwrite=True, sync=False)

    return save


def _loads(states: list[dict[str, Any]], path: Path) -> Callable[[ThreadedRank], Any]:
    def load(comm: ThreadedRank) -> Any:
        agreement = Agreement(comm)
        return load_state(
            states[comm.rank], path, agreement, strict=True, verify=False, cast_dtype=False
        )

    return load


def _load_checked(world: ThreadedWorld, spec: Spec, path: Path) -> dict[str, Any]:
    """A load phase into fresh (NaN) targets, then the bit-exact check of every rank;
    {"error": why} where the simulation itself cannot run it."""
    loaded = [targets(spec, world.rank(r), r) for r in range(world.world_size)]
    try:
        figures = _phase(world, _loads(loaded, path))
    except RuntimeError as e:  # one process holds every rank's open files: its limit ran out
        if "Too many open files" not in str(e.__cause__):
            raise
        return {"error": f"{world.world_size} ranks' open files exceed one process's limit"}
    for rank, state in enumerate(loaded):
        check(spec, state, rank)
    return figures


def _sample(ranks: Sequence[int]) -> list[int]:
    """First, middle and last rank: stock's load planning is timed on these."""
    last = len(ranks) - 1
    return sorted({ranks[0], ranks[last // 2], ranks[last]})


def run_threads(
    world: int,
    tensors: int = 1000,
    kind: str = "fsdp",
    folder: str = "/dev/shm",
    *,
    phases: Sequence[str] = PHASES,
) -> dict:
    """`phases` (the first save always runs: loads read it) on `world` threaded ranks,
    and stock's planning of the same states.

    Returns {"kind", "world", "tensors", "phases": {phase: figures}, "stock": {phase:
    figures}, "index_files": {name: bytes} (folder A's files other than data, which a
    load may parse), "bit_exact": [the load phases checked bit for bit]}; raises if a rank
    fails or a loaded value differs.
    """
    if world < 2:
        raise ValueError("the reshard load needs world >= 2 (it runs on world // 2 ranks)")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; pick from {PHASES}")
    spec, reshard = _specs(kind, world, tensors)
    old_stack = threading.stack_size(_STACK)
    root = Path(tempfile.mkdtemp(prefix="scale_threads_", dir=folder))
    try:
        ranks = ThreadedWorld(world, timeout=_TIMEOUT)
        half = ThreadedWorld(world // 2, timeout=_TIMEOUT)
        states = [build(spec, ranks.rank(r), r, fill=True) for r in range(world)]
        done = {"save": _phase(ranks, _saves(states, root / "a"))}
        if "save_again" in phases:
            done["save_again"] = _phase(ranks, _saves(states, root / "b"))
        index = {f.name: f.stat().st_size for f in (root / "a").iterdir() if f.suffix != ".distcp"}
        if "load" in phases:
            done["load"] = _load_checked(ranks, spec, root / "a")
        if "reshard_load" in phases:
            done["reshard_load"] = _load_checked(half, reshard, root / "a")
        moved = {r: targets(reshard, half.rank(r), r) for r in _sample(range(world // 2))}
        gc.collect()
        gc.freeze()  # as for the threaded phases
        try:
            stock, metadata = stock_save(states)
            stock["load"] = stock_load({r: states[r] for r in _sample(range(world))}, metadata)
            stock["reshard_load"] = stock_load(moved, metadata)
        finally:
            gc.unfreeze()
    finally:
        threading.stack_size(old_stack)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "kind": kind,
        "world": world,
        "tensors": len(spec),
        "phases": done,
        "stock": stock,
        "index_files": index,
        "bit_exact": [p for p in ("load", "reshard_load") if "cpu_max_s" in done.get(p, {})],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--tensors", type=int, default=1000, help="FSDP tensors (TorchRec: 200 tables)")
    p.add_argument("--kind", nargs="+", choices=["fsdp", "torchrec"], default=["fsdp", "torchrec"])
    p.add_argument("--folder", default="/dev/shm")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    args = p.parse_args(argv)
    results = []
    for kind in args.kind:
        for world in args.worlds:
            results.append(run_threads(world, args.tensors, kind, args.folder, phases=args.phases))
            print_curve(results[-1:])  # each run as it ends: big worlds take minutes
    print()
    print_curve(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

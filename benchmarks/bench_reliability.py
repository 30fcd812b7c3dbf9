"""Reliability soak: crashes, corruption, bad input on one rank, dead ranks, scale.

Run: `shardwise bench reliability [--rounds N] [--small 50000]`. Prints
figures: kills tried / checkpoints lost; corruptions tried / detected / loaded
wrong; the bad-input table (every collective entry point, bad input on ONE
rank: the error every rank raised); how fast survivors of a dead rank fail;
and planning/scale timings with their growth.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import Counter
from pathlib import Path


def crashes(folder: Path, rounds: int) -> None:
    from tests.reliability import chaos

    tried = lost = hung = foreign = 0
    states: Counter[str] = Counter()
    bad = []
    rng = random.Random(0)
    start = time.monotonic()
    for _ in range(rounds):
        for point in chaos.CRASH_POINTS:
            ranks = (None, 0) if point in chaos.COORDINATOR_POINTS else (None, 0, 1)
            for kill in ranks:
                # the commit-phase points matter most while the previous checkpoint is replaced
                for overwrite in (
                    (False, True)
                    if point in chaos.COORDINATOR_POINTS
                    else (False, rng.random() < 0.3)
                ):
                    try:
                        o = chaos.crash_save(folder, point, kill_rank=kill, overwrite=overwrite)
                    except TimeoutError:
                        hung += 1
                        continue
                    tried += 1
                    lost += o.lost_previous
                    foreign += len(o.foreign_lost)
                    states[f"{o.target}: {o.new_state}"] += 1
                    if not o.ok or o.new_state not in chaos.expected_states(point, overwrite):
                        bad.append(o)
        point = rng.choice(["mid-data", "after-data", "before-commit"])
        o = chaos.crash_save(folder, point, use_async=True)
        tried += 1
        lost += o.lost_previous
        foreign += len(o.foreign_lost)
        states[f"async: {o.new_state}"] += 1
        if not o.ok or o.new_state not in chaos.expected_states(point, False):
            bad.append(o)
    print(
        f"crashes: {tried} kills tried (SIGKILL of one or all ranks at "
        f"{len(chaos.CRASH_POINTS)} points, overwrites, async saves; every folder also holds "
        f"{len(chaos.FOREIGN_FILES)} user files), {lost} checkpoints lost, "
        f"{foreign} user files lost, {hung} hung, {len(bad)} other failures "
        f"({time.monotonic() - start:.0f}s)"
    )
    print(
        "  state of the interrupted save's path, as loading it found: "
        + ", ".join(f"{k} {v}" for k, v in sorted(states.items()))
    )
    for o in bad:
        print(f"  FAILED: {o}")


def corruption(folder: Path, rounds: int) -> None:
    from tests.reliability import chaos

    ref = folder / "ref"
    chaos.save_reference(ref)
    rng = random.Random(1)
    by_kind: dict[str, Counter[str]] = {}
    for _ in range(rounds * 8):
        for kind in chaos.CORRUPTIONS:
            o = chaos.corrupt_and_load(ref, folder / "scratch", rng, kind)
            result = (
                "silent WRONG"
                if o.load.startswith("loaded WRONG")
                else "other error"
                if o.load.startswith("other error")
                else "detected by load"
                if o.load.startswith("detected")
                else "detected by verify"
                if o.verify_found
                else "undetected"
            )
            by_kind.setdefault(kind, Counter())[result] += 1
    total = sum(sum(c.values()) for c in by_kind.values())
    detected = sum(c["detected by load"] + c["detected by verify"] for c in by_kind.values())
    print(
        f"corruption: {total} cases tried, {detected} detected, "
        f"{sum(c['silent WRONG'] for c in by_kind.values())} loaded wrong silently, "
        f"{sum(c['other error'] + c['undetected'] for c in by_kind.values())} other"
    )
    for kind, c in by_kind.items():
        print(f"  {kind:<18} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))


def bad_input(folder: Path) -> None:
    from tests.reliability.bad_input_cases import CASES, prepare, run_case

    from shardwise.testing import run_ranks

    prepare(folder)
    print(f"bad input on ONE rank: {len(CASES)} cases, 2 ranks each")
    print(f"  {'entry point':<18} {'what is wrong':<52} {'error on every rank':<28} {'s':>5}")
    ok = 0
    for name, case in CASES.items():
        entry, what = case.entry, case.what
        start = time.monotonic()
        try:
            results = run_ranks(run_case, 2, name, str(folder), timeout=30)
            kinds = {k for k, _ in results}
            error = kinds.pop() if len(kinds) == 1 else f"MIXED {sorted(kinds)}"
        except TimeoutError:
            error = "HUNG"
        seconds = time.monotonic() - start
        ok += error not in ("no error", "HUNG") and not error.startswith("MIXED")
        print(f"  {entry:<18} {what:<52} {error:<28} {seconds:5.1f}")
    print(
        f"  {ok} of {len(CASES)} raised the same error on every rank; none hung"
        if ok == len(CASES)
        else f"  {len(CASES) - ok} cases FAILED"
    )


def _die(rank: int, world: int, op: str) -> tuple[str, float]:
    import os

    from shardwise import Layout, ShardedTensor

    st = ShardedTensor.zeros(Layout.chunked((64, 8), 0, world))
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        st.redistribute(
            Layout.chunked((64, 8), 1, world)
        ) if op == "redistribute" else st.full_tensor()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start


def dead_ranks() -> None:
    from shardwise.testing import run_ranks

    for op in ("redistribute", "full_tensor"):
        kind, seconds = run_ranks(_die, 2, op, timeout=60, allow_dead=True)[0]
        print(
            f"dead rank during {op}: the survivor raised {kind} after {seconds:.2f}s "
            f"(bounded by the process group's timeout)"
        )


def _many(rank: int, world: int, path: str, count: int) -> tuple[float, float]:
    import torch

    import shardwise.checkpoint as swc
    from shardwise import Layout, ShardedTensor

    layout = Layout.chunked((4, 16), 0, world)
    state = {
        f"t{i}": ShardedTensor.full(layout, float(i), dtype=torch.float32) for i in range(count)
    }
    start = time.perf_counter()
    swc.save(state, path)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    swc.load(state, path)
    return saved, time.perf_counter() - start


def scale(folder: Path, small: int) -> None:
    from tests.reliability.scale_sim import simulate_load_planning

    from shardwise import Layout, plan_transfers
    from shardwise.testing import run_ranks

    layout = Layout.grid((4000, 400), (1000, 100))
    start = time.perf_counter()
    Layout(layout.global_shape, layout.blocks)
    validate = time.perf_counter() - start
    start = time.perf_counter()
    Layout.from_json(layout.to_json())
    json_rt = time.perf_counter() - start
    start = time.perf_counter()
    plan_transfers(layout, Layout.grid((4000, 400), (100, 1000)))
    plan = time.perf_counter() - start
    print(
        f"scale: 100,000 blocks: validate {validate:.2f}s, JSON round trip {json_rt:.2f}s, "
        f"plan_transfers to a transposed grid {plan:.2f}s"
    )
    saved, loaded = run_ranks(_many, 2, str(folder / "many"), small, timeout=3600)[0]
    print(f"  {small:,} small tensors on 2 ranks: save {saved:.1f}s, load {loaded:.1f}s")
    print("  load planning, simulated in one process (1,000 saved chunks -> R ranks):")
    base = None
    for ranks in (256, 512, 1024):
        s = simulate_load_planning(ranks, 1000)
        per = s.seconds / s.read_items * 1e6
        base = base or per
        print(
            f"    {ranks:>5} ranks: {s.read_items:>9,} read items in {s.seconds:6.2f}s "
            f"({per:.1f} us/item, {per / base:.2f}x the 256-rank cost per item)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--small", type=int, default=50_000, help="count of small tensors for the scale run"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="shardwise-reliability-"))
    crashes(folder / "crash", args.rounds)
    corruption(folder / "corrupt", args.rounds)
    bad_input(folder / "bad")
    dead_ranks()
    scale(folder, args.small)


if __name__ == "__main__":
    main()

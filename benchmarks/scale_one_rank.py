"""One rank's load of its share of a W-rank checkpoint, alone: its own CPU at any W.

`scale_threads` runs every rank of a load, which at W = 1,024 one process cannot
do in reasonable time (each thread rank reads its tensors' index sections). A
load plans and reads alone between its two verdicts, so one rank loading its
pieces of the W-rank layout in a world of its own does exactly a rank's work:
this saves the FSDP-style state on W thread ranks, then times that one load.

With `--reshard` the rank then loads its share of the reshard target as well
(`scale_states.fsdp(..., reshard=True)`: columns over W/2 ranks, so each piece is a
band of all W row chunks of its tensor: the gathered parts, `io.chunks`).

Run: `python benchmarks/scale_one_rank.py --world 1024 --tensors 1000 [--rank 5] [--reshard]`.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

from scale_states import build, check, fsdp, targets  # noqa: E402

from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.save import save_state
from shardwise.comm.agreement import Agreement  # noqa: E402
from shardwise.comm.in_process import ThreadedRank, ThreadedWorld  # noqa: E402


def _save(state: dict, path: Path, comm: ThreadedRank) -> None:
    save_state(state, path, Agreement(comm), overwrite=True, sync=False)


def _load_alone(spec, path: Path, alone: ThreadedRank, rank: int, verify: bool) -> float:
    """Rank `rank`'s share of `spec` loaded in a world of its own: its CPU seconds, checked.
    The saved states' garbage is collected first: it is no part of a load's work."""
    mine = targets(spec, alone, rank)
    gc.collect()
    start = time.thread_time()
    load_state(mine, path, Agreement(alone), strict=True, verify=verify, cast_dtype=False)
    cpu = time.thread_time() - start
    check(spec, mine, rank)
    return cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--rank", type=int, default=5, help="whose share is loaded")
    p.add_argument("--folder", default="/dev/shm")
    p.add_argument("--reshard", action="store_true", help="then load by columns too")
    args = p.parse_args(argv)
    spec = fsdp(args.world, args.tensors)
    path = Path(tempfile.mkdtemp(dir=args.folder)) / "ckpt"
    try:
        world = ThreadedWorld(args.world, 1800.0)
        states = [build(spec, world.rank(r), r, fill=True) for r in range(args.world)]
        threads = [
            threading.Thread(target=_save, args=(states[r], path, world.rank(r)))
            for r in range(args.world)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del states
        alone = ThreadedWorld(1, 60.0).rank(0)
        for verify in (False, True):
            cpu = _load_alone(spec, path, alone, args.rank, verify)
            print(
                f"{args.world} ranks x {args.tensors} tensors, verify={verify}: rank "
                f"{args.rank}'s load alone, its own CPU {cpu:.3f} s (target <= 0.5 s); bit-exact"
            )
            if args.reshard:
                columns = fsdp(args.world, args.tensors, reshard=True)
                moved = _load_alone(columns, path, alone, args.rank % (args.world // 2), verify)
                print(
                    f"  the same rank's share by columns over {args.world // 2} ranks: "
                    f"its own CPU {moved:.3f} s ({moved / cpu:.2f}x), bit-exact"
                )
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

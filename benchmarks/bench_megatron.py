"""shardwise checkpoints against Megatron-Core's own (torch_dist), same sharded state dict.

Run: `shardwise bench megatron [--size 256MiB] [--repeat 3] [--quick] [--dir /tmp]`.
On 2 local ranks (gloo), one Megatron sharded state dict (tensor-parallel
column splits, a replicated bias): Megatron's `dist_checkpointing.save` vs
`swc.save` (through the Megatron value adapter, and with `megatron=True`, the
checkpoint Megatron's load also opens), then `dist_checkpointing.load` vs
`swc.load` into the same Megatron ShardedTensors, and `swc.load` of the
checkpoint Megatron wrote. Every load is checked bit for bit against the saved
values. Times are the slowest rank's, median of `--repeat`. Ratios > 1 mean
shardwise is faster. On CPU, Megatron's CUDA calls get the stand-ins of
tests/clients/megatron_harness.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.cli.sizes import parse_size
from shardwise.testing import seconds_across_ranks


def _median(fn, repeat: int, before=None) -> float:
    """No warm-up: each save writes a fresh checkpoint, as a training job's would."""
    return seconds_across_ranks(fn, repeat, before=before, warmup=False)


def _clean(path: Path) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()


def _values(rank: int, world: int, nbytes: int, n_tensors: int = 8) -> dict[str, torch.Tensor]:
    """This rank's column block of each weight (distinct values per key and column)."""
    rows = 1024
    cols = max(world, nbytes // 4 // n_tensors // rows // world * world)
    width = cols // world
    out = {}
    for i in range(n_tensors):
        block = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
        out[f"layer{i}.weight"] = block + (i * 1e6 + rank * rows * width)
    out["final.bias"] = torch.arange(4096, dtype=torch.float32)
    return out


def _mcore_sd(rank: int, world: int, values: dict[str, torch.Tensor]) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {}
    for key, t in values.items():
        if key.endswith("bias"):
            sd[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=rank)
        else:
            sd[key] = ShardedTensor.from_rank_offsets(key, t, (1, rank, world))
    return sd


def _bench_rank(rank: int, world: int, folder: str, nbytes: int, repeat: int) -> dict:
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from tests.clients.megatron_harness import patch_for_cpu

    patch_for_cpu()
    import megatron.core.dist_checkpointing as mdc

    import shardwise.checkpoint as swc

    torch.set_num_threads(1)
    base = Path(folder)
    values = _values(rank, world, nbytes)
    source = _mcore_sd(rank, world, values)
    theirs, ours, ours_mg = base / "megatron", base / "shardwise", base / "shardwise_megatron"
    out: dict[str, float] = {"local MiB": sum(t.nbytes for t in values.values()) / 2**20}

    out["megatron save"] = _median(
        lambda: mdc.save(source, str(theirs)), repeat, before=lambda: _clean(theirs)
    )
    out["shardwise save"] = _median(lambda: swc.save(source, ours, overwrite=True), repeat)
    out["shardwise save megatron=True"] = _median(
        lambda: swc.save(source, ours_mg, overwrite=True, megatron=True), repeat
    )

    targets = _mcore_sd(rank, world, {k: torch.full_like(v, -1.0) for k, v in values.items()})

    def exact() -> bool:
        ok = all(torch.equal(targets[k].data, values[k]) for k in values)
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        for t in targets.values():
            t.data.fill_(-1.0)
        return bool(flag.item())

    checks = {}
    out["megatron load"] = _median(lambda: mdc.load(targets, str(theirs)), repeat)
    checks["megatron load"] = exact()
    out["shardwise load"] = _median(lambda: swc.load(targets, ours), repeat)
    checks["shardwise load"] = exact()
    out["shardwise load of megatron's checkpoint"] = _median(
        lambda: swc.load(targets, theirs), repeat
    )
    checks["shardwise load of megatron's checkpoint"] = exact()
    out["megatron load of shardwise megatron=True"] = _median(
        lambda: mdc.load(targets, str(ours_mg)), repeat
    )
    checks["megatron load of shardwise megatron=True"] = exact()
    out["checks"] = checks
    return out


def _ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.2f}x" if ours > 0 else "n/a"


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="global state size (default 256MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the median is reported")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="16MiB, 1 repeat: a smoke run")
    args = parser.parse_args()
    nbytes, repeat = (
        (parse_size("16MiB"), 1) if args.quick else (parse_size(args.size), args.repeat)
    )
    folder = tempfile.mkdtemp(prefix="shardwise-bench-megatron-", dir=args.dir)
    try:
        r = run_ranks(_bench_rank, 2, folder, nbytes, repeat, timeout=3600)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    mib = r["local MiB"]
    print(
        f"\n== {args.dir}: {nbytes / 2**20:.0f} MiB Megatron sharded state dict, 2 ranks "
        f"({mib:.0f} MiB per rank), median of {repeat}"
    )
    print(f"{'':46}{'seconds':>9}{'MiB/s/rank':>12}{'vs Megatron':>13}{'bit exact':>11}")
    rows = [
        ("megatron dist_checkpointing.save", "megatron save", None),
        ("swc.save (value adapter)", "shardwise save", "megatron save"),
        ("swc.save(megatron=True)", "shardwise save megatron=True", "megatron save"),
        ("megatron dist_checkpointing.load", "megatron load", None),
        ("swc.load (value adapter)", "shardwise load", "megatron load"),
        (
            "swc.load of Megatron's checkpoint",
            "shardwise load of megatron's checkpoint",
            "megatron load",
        ),
        (
            "megatron load of swc.save(megatron=True)",
            "megatron load of shardwise megatron=True",
            "megatron load",
        ),
    ]
    for label, key, ref in rows:
        exact = r["checks"].get(key)
        print(
            f"  {label:44}{r[key]:9.3f}{mib / r[key]:12.0f}{(_ratio(r[ref], r[key]) if ref else ''):>13}"
            f"{('' if exact is None else 'yes' if exact else 'NO'):>11}"
        )
    if not all(r["checks"].values()):
        raise SystemExit("a load was not bit exact")


if __name__ == "__main__":
    main()

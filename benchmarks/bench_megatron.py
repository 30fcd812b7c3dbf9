"""shardwise checkpoints against Megatron-Core's own (torch_dist, fully parallel), same GPT state.

Run: `shardwise bench megatron [--hidden 512] [--layers 4] [--vocab 16000] [--tp 1]
[--repeat 3] [--quick] [--dir /tmp]`.

On 2 local ranks (gloo; TP 1 gives DP 2, so Megatron's fully parallel strategies
have replicas to spread), the state Megatron's training loop checkpoints: a real
`GPTModel`'s `sharded_state_dict()` with its optimizer's (Megatron's own
`get_megatron_optimizer`, Adam `exp_avg` / `exp_avg_sq` after two steps), the
iteration, args and RNG state (`tests/clients/megatron_gpt.py` builds it).

Megatron saves and loads it the way its training does with
`--ckpt-fully-parallel-save/load`: `dist_checkpointing.save/load` with the
`torch_dist` strategy wrapped in `FullyParallelSaveStrategyWrapper` /
`FullyParallelLoadStrategyWrapper` over the data-parallel group. shardwise:
`swc.save` / `swc.load` of the same state, and each reading the other's
checkpoint. Every load is checked bit for bit against the saved global values
(targets reset to -1 first). Times are the slowest rank's, median of
`--repeat`; ratios > 1 mean shardwise is faster. The physical limit is the
storage's write / read bandwidth for the bytes stored once (main replicas
only, by both). On CPU, Megatron's CUDA calls get the stand-ins of
tests/clients/megatron_harness.py, and its fully parallel load hands shards to
the other replicas by `all_gather_object` (its broadcast exchange needs CUDA):
the row "each replica reads" is Megatron's load without that exchange.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.testing import seconds_across_ranks

_REPO = Path(__file__).resolve().parents[1]
# how Megatron's fully parallel load hands loaded shards to the other replicas: by NCCL
# broadcast on a GPU (its default); on CPU ranks by `all_gather_object` (its broadcast
# and gather exchanges allocate on the CUDA device)
_EXCHANGE = "broadcast" if torch.cuda.is_available() else "gather_object"


def _clean(path: Path) -> None:
    """An empty folder (Megatron's save wants it to exist, as its training makes it)."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()


def _reset(state: Any) -> None:
    """Every sharded tensor of `state` (parameters, optimizer state) set to -1."""
    from tests.clients.megatron_gpt import sharded_leaves

    with torch.no_grad():
        for leaf in sharded_leaves(state, tensors_only=True).values():
            leaf.data.fill_(-1.0)


def _bench_rank(rank: int, world: int, folder: str, shape: dict, repeat: int) -> dict:
    sys.path.insert(0, str(_REPO))
    warnings.simplefilter("ignore")  # Megatron warns about Apex / TE on every import
    import megatron.core.dist_checkpointing as mdc
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from tests.clients.megatron_gpt import (
        Setup,
        build,
        global_shapes,
        setup_parallel,
        state_dict,
        unwrapped,
        wrong_values,
    )

    import shardwise.checkpoint as swc

    torch.set_num_threads(1)
    s = Setup(**shape)
    setup_parallel(s)
    chunks, optimizer = build(s)
    source = state_dict(s, chunks, optimizer, 100)
    saved = global_shapes(source)
    dp = ps.get_data_parallel_group(with_context_parallel=True)
    base = Path(folder)
    theirs, ours = base / "megatron", base / "shardwise"
    local = sum(leaf.data.numel() * leaf.data.element_size() for leaf in _leaves(source))
    out: dict[str, Any] = {"local MiB": local / 2**20}

    def megatron_save() -> None:
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), dp)
        mdc.save(source, str(theirs), sharded_strategy=strategy)

    out["megatron save"] = seconds_across_ranks(
        megatron_save, repeat, before=lambda: _clean(theirs), warmup=False
    )
    out["shardwise save"] = seconds_across_ranks(  # into an empty folder, as Megatron's
        lambda: swc.save(source, ours), repeat, before=lambda: _clean(ours), warmup=False
    )
    out["bytes"] = {
        "megatron": _stored_bytes(theirs),
        "shardwise": _stored_bytes(ours),
    }

    # loads: into freshly built models, as a resumed job has them
    targets, target_opt = build(s, trained=False)
    held: dict[str, Any] = {}

    def fresh() -> None:  # untimed: a state dict to load into, every value -1
        held["state"] = state_dict(s, targets, target_opt, None, loading=True, rng=False)
        _reset(held["state"])

    def megatron_load(path: Path) -> None:
        strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(path), dp, exchange_algo=_EXCHANGE
        )
        held["loaded"] = mdc.load(held["state"], str(path), sharded_strategy=strategy)

    def megatron_plain_load(path: Path) -> None:  # every replica reads its own
        held["loaded"] = mdc.load(held["state"], str(path))

    def shardwise_load(path: Path) -> None:
        swc.load(held["state"], path)
        held["loaded"] = unwrapped(held["state"])

    checks: dict[str, bool] = {}
    for label, load, path in (
        ("megatron load", megatron_load, theirs),
        ("megatron plain load", megatron_plain_load, theirs),
        ("shardwise load", shardwise_load, ours),
        ("shardwise load of megatron's checkpoint", shardwise_load, theirs),
        ("megatron load of shardwise's checkpoint", megatron_load, ours),
    ):
        out[label] = seconds_across_ranks(lambda: load(path), repeat, before=fresh, warmup=False)
        wrong = wrong_values(held["state"], held["loaded"], saved)
        flag = torch.tensor([int(not wrong)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        checks[label] = bool(flag.item())
    out["checks"] = checks
    return out


def _leaves(state: Any) -> list[Any]:
    from tests.clients.megatron_gpt import sharded_leaves

    return list(sharded_leaves(state, tensors_only=True).values())


def _stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _ratio(theirs: float, ours: float) -> str:
    return f"{theirs / ours:.2f}x" if ours > 0 else "n/a"


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--vocab", type=int, default=16000, help="vocabulary (default 16000)")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1, help="TP (DP = 2 / TP)")
    parser.add_argument("--repeat", type=int, default=3, help="repeats; the median is reported")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 repeat: a smoke run")
    args = parser.parse_args()
    shape = dict(tp=args.tp, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                 heads=8, seq=64)  # fmt: skip
    repeat = args.repeat
    if args.quick:
        shape.update(hidden=32, layers=2, vocab=256, heads=2)
        repeat = 1
    folder = tempfile.mkdtemp(prefix="shardwise-bench-megatron-", dir=args.dir)
    try:
        r = run_ranks(_bench_rank, 2, folder, shape, repeat, timeout=3600)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    mib = r["local MiB"]
    stored = r["bytes"]
    print(
        f"\n== {args.dir}: GPT (hidden {shape['hidden']}, {shape['layers']} layers, vocab "
        f"{shape['vocab']}) + Adam state, 2 ranks at TP {args.tp} / DP {2 // args.tp} "
        f"({mib:.0f} MiB of sharded state per rank; stored: Megatron "
        f"{stored['megatron'] / 2**20:.0f} MiB, shardwise {stored['shardwise'] / 2**20:.0f} MiB), "
        f"median of {repeat}"
    )
    print(f"{'':50}{'seconds':>9}{'MiB/s/rank':>12}{'vs Megatron':>13}{'bit exact':>11}")
    rows = [
        ("megatron save (torch_dist, fully parallel)", "megatron save", None),
        ("swc.save", "shardwise save", "megatron save"),
        ("megatron load (torch_dist, fully parallel)", "megatron load", None),
        (
            "megatron load (torch_dist, each replica reads)",
            "megatron plain load",
            "megatron load",
        ),  # fmt: skip
        ("swc.load", "shardwise load", "megatron load"),
        (
            "swc.load of Megatron's checkpoint",
            "shardwise load of megatron's checkpoint",
            "megatron load",
        ),  # fmt: skip
        (
            "megatron load of swc's checkpoint",
            "megatron load of shardwise's checkpoint",
            "megatron load",
        ),  # fmt: skip
    ]
    for label, key, ref in rows:
        exact = r["checks"].get(key)
        print(
            f"  {label:48}{r[key]:9.3f}{mib / r[key]:12.0f}"
            f"{(_ratio(r[ref], r[key]) if ref else ''):>13}"
            f"{('' if exact is None else 'yes' if exact else 'NO'):>11}"
        )
    if not all(r["checks"].values()):
        raise SystemExit("a load was not bit exact")


if __name__ == "__main__":
    main()

"""A TorchRec model saved under one sharding plan, loaded under another on another world size.

    torchrun --nproc-per-node 2 examples/torchrec_reshard.py save --root /tmp/tr --plan row_wise
    torchrun --nproc-per-node 3 examples/torchrec_reshard.py load --root /tmp/tr --plan column_wise

`save`: a `DistributedModelParallel` over an `EmbeddingBagCollection` of three tables,
sharded by `--plan` over this job's ranks, with a fused Adagrad (TorchRec's optimizer in
backward) takes a training step, then `swc.save({"model": dmp, "optim":
dmp.fused_optimizer}, root/ckpt)`: both are `Stateful`, so shardwise goes through
TorchRec's own `state_dict()`. Rank 0 also writes the pooled embeddings of a fixed batch,
before and after one more training step, to `root/expected.pt`.

`load`: a DMP under another plan on any number of ranks, whose tables start from other
random values, `swc.load`s the checkpoint (TorchRec's `load_state_dict` fills its shards
and the Adagrad state), then checks, printing one `PASS`/`FAIL` line each:

- every local shard of every table and of its Adagrad state equals the saved tensor's
  region (`swc.read_tensor` reads the saved tensor whole, offline), bit for bit;
- the pooled embeddings of the fixed batch equal the saved run's (up to the order in which
  a row-wise plan sums partial poolings: the largest difference is printed);
- after one more training step they equal the saved run's after that step (the Adagrad
  state came back too).

Plans: `table_wise` (table i on rank i mod N), `row_wise`, `column_wise` (each table split
in N column blocks, one per rank), `mixed` (t0 row-wise, t1 column-wise, t2 on the last
rank). Column-wise plans need each table's dimension divisible by N (defaults: 12, 24, 12).
On CPU the fused tables support only SGD and Adagrad variants (fbgemm-gpu-cpu). `--cuda`
uses one GPU per rank with NCCL where CUDA is available.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import shardwise.checkpoint as swc

TABLES = {"t0": (60, 12), "t1": (45, 24), "t2": (80, 12)}  # name -> (rows, dim)
PLANS = ("table_wise", "row_wise", "column_wise", "mixed")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=("save", "load"))
    p.add_argument("--root", required=True, help="a local folder for the checkpoint")
    p.add_argument("--plan", choices=PLANS, default="row_wise")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--cuda", action="store_true", help="NCCL and one GPU per rank")
    return p.parse_args()


def plan_of(name: str, world: int) -> dict[str, Any]:
    """Per-table sharding of plan `name` over `world` ranks (TorchRec's plan generators)."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    everyone = list(range(world))
    if name == "table_wise":
        return {t: table_wise(rank=i % world) for i, t in enumerate(TABLES)}
    if name == "row_wise":
        return {t: row_wise() for t in TABLES}
    if name == "column_wise":
        return {t: column_wise(ranks=everyone) for t in TABLES}
    return {"t0": row_wise(), "t1": column_wise(ranks=everyone), "t2": table_wise(rank=world - 1)}


def build(plan: str, lr: float, device: torch.device) -> Any:
    """The EBC with a fused Adagrad, sharded by `plan` over the default group. Collective."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    world = dist.get_world_size()
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[f"f_{t}"])
            for t, (n, d) in TABLES.items()
        ],
        device=torch.device("meta"),
    )
    _apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": lr})
    sharder = EmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(
        ebc,
        plan_of(plan, world),
        sharder=sharder,
        world_size=world,
        local_size=world,
        device_type=device.type,
    )
    return DistributedModelParallel(
        ebc, plan=ShardingPlan({"": module_plan}), sharders=[sharder], device=device
    )


def batch(seed: int, device: torch.device, samples: int = 4) -> Any:
    """A fixed KeyedJaggedTensor (1 to 3 ids per sample and feature), the same on every rank."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for t, (rows, _) in TABLES.items():
        keys.append(f"f_{t}")
        for _ in range(samples):
            n = int(torch.randint(1, 4, (1,), generator=g))
            lengths.append(n)
            values.append(torch.randint(0, rows, (n,), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.tensor(lengths)
    ).to(device)


def pooled(dmp: Any, device: torch.device) -> torch.Tensor:
    """The pooled embeddings of the fixed evaluation batch, [samples, sum of dims], on CPU."""
    with torch.no_grad():
        return dmp(batch(0, device)).values().detach().cpu().clone()


def train_step(dmp: Any, device: torch.device, seed: int) -> None:
    dmp(batch(seed, device)).values().square().sum().backward()  # the fused Adagrad steps here


def local_pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, tensor) of this rank's pieces of a TorchRec state-dict value."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as LegacyShardedTensor

    if isinstance(value, LegacyShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    return [((0,) * value.dim(), value)]


def state_mismatches(dmp: Any, path: Path) -> tuple[list[str], list[str]]:
    """(keys checked, keys whose pieces differ) over every rank: each local piece of every
    table and Adagrad state against the saved tensor there (`swc.read_tensor` reads it
    whole from the checkpoint, offline). Collective."""
    flat = {f"model.{k}": v for k, v in dmp.state_dict().items()}
    for param, state in dmp.fused_optimizer.state_dict()["state"].items():
        flat.update({f"optim.state.{param}.{k}": v for k, v in state.items()})
    wrong = []
    for key, value in sorted(flat.items()):
        saved = swc.read_tensor(path, key)
        for offsets, t in local_pieces(value):
            region = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
            if not torch.equal(t.detach().cpu(), saved[region]):
                wrong.append(key)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(flat), wrong))
    return sorted({k for keys, _ in everyone for k in keys}), sorted(
        {k for _, bad in everyone for k in bad}
    )


def main() -> int:
    args = parse_args()
    logging.disable(logging.WARNING)  # TorchRec and fbgemm are chatty on CPU
    warnings.filterwarnings("ignore")
    cuda = args.cuda and torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)
    path, expected_file = root / "ckpt", root / "expected.pt"
    dmp = build(args.plan, args.lr, device)
    status = 0

    if args.phase == "save":
        train_step(dmp, device, seed=1)
        before = pooled(dmp, device)
        swc.save({"model": dmp, "optim": dmp.fused_optimizer}, path)  # collective
        train_step(dmp, device, seed=2)
        after = pooled(dmp, device)
        if rank == 0:
            torch.save({"pooled": before, "after_step": after, "world": world}, expected_file)
            print(f"saved under plan {args.plan} on {world} ranks: {path}", flush=True)
    else:
        expected = torch.load(expected_file)
        swc.load({"model": dmp, "optim": dmp.fused_optimizer}, path)  # collective, in place
        checked, wrong = state_mismatches(dmp, path)
        before = pooled(dmp, device)
        train_step(dmp, device, seed=2)
        after = pooled(dmp, device)
        if rank == 0:
            print(
                f"loaded plan {args.plan} on {world} ranks (saved on {expected['world']}): {path}",
                flush=True,
            )
            lines = [
                (
                    not wrong,
                    f"state: {len(checked) - len(wrong)} of {len(checked)} tensors (tables, "
                    f"Adagrad state) equal the saved ones bit for bit"
                    + (f"; differing: {', '.join(wrong)}" if wrong else ""),
                ),
                close(before, expected["pooled"], "pooled embeddings of the fixed batch"),
                close(after, expected["after_step"], "pooled embeddings after one more step"),
            ]
            for ok, line in lines:
                print(f"{'PASS' if ok else 'FAIL'}: {line}", flush=True)
            status = 0 if all(ok for ok, _ in lines) else 1
    dist.destroy_process_group()
    return status


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> tuple[bool, str]:
    """Equal, up to float summation order (row-wise plans sum partial poolings)."""
    if got.shape != want.shape:
        return False, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return ok, f"{what} {tuple(got.shape)} match (max |difference| {diff:.1e})"


if __name__ == "__main__":
    sys.exit(main())

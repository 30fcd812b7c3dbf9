"""Real TorchRec `DistributedModelParallel` models on CPU/gloo for the checkpoint tests.

Everything here is TorchRec's own public API (no stand-ins): an
`EmbeddingBagCollection` plus a dense `nn.Linear`, sharded by
`construct_module_sharding_plan` with the `table_wise` / `row_wise` /
`column_wise` / `table_row_wise` generators, fused optimizers chosen per table
with `apply_optimizer_in_backward` (the FUSED compute kernel, fbgemm-gpu-cpu
TBEs), the dense part under DDP with Adam through `KeyedOptimizerWrapper`, and
`CombinedOptimizer` over both, as a TorchRec training script builds them.

CPU notes (fbgemm-gpu-cpu 1.8): the CPU TBE supports only EXACT_SGD,
EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD and EMAINPLACE_ROWWISE_ADAGRAD, so ADAM is
out. EXACT_ROWWISE_ADAGRAD's momentum of a column-wise table is one row vector
per column shard, concatenated (global shape rows * shards): its shape depends on
the plan, so the row-wise Adagrad tables below are never column-wise in any plan,
and the tables that are get EXACT_ADAGRAD (momentum shaped like the weight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# name -> (rows, dim, optimizer); RW-Adagrad tables never go column-wise (see above)
TABLES: dict[str, tuple[int, int, str]] = {
    "t0": (40, 8, "adagrad"),
    "t1": (27, 12, "rowwise_adagrad"),
    "t2": (34, 16, "adagrad"),
    "t3": (41, 12, "rowwise_adagrad"),
    "t4": (55, 8, "adagrad"),
}
DENSE_IN = sum(dim for _, dim, _ in TABLES.values())
DENSE_OUT = 3


def _plans() -> dict[str, Callable[[int], dict[str, Any]]]:
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_row_wise, table_wise

    return {
        # saved on 2 ranks: every sharding type, t4 two column shards on one rank
        "A2": lambda ws: {
            "t0": table_wise(rank=1),
            "t1": row_wise(),
            "t2": column_wise(ranks=[0, 1]),
            "t3": table_row_wise(host_index=0),
            "t4": column_wise(ranks=[1, 1]),
        },
        # loaded on 3 ranks: every table under another sharding type
        "B3": lambda ws: {
            "t0": column_wise(ranks=[2, 0]),
            "t1": table_row_wise(host_index=0),
            "t2": row_wise(),
            "t3": table_wise(rank=2),
            "t4": column_wise(ranks=[0, 1, 2, 0]),
        },
        # loaded on 1 rank
        "C1": lambda ws: {
            "t0": row_wise(),
            "t1": table_wise(rank=0),
            "t2": column_wise(ranks=[0, 0, 0, 0]),
            "t3": row_wise(),
            "t4": table_wise(rank=0),
        },
    }


class Model(nn.Module):
    """Sparse arch (an EBC) + dense arch (a Linear over the pooled embeddings)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{name}"]
                )
                for name, (rows, dim, _) in TABLES.items()
            ],
            device=torch.device("meta"),
        )
        self.dense = nn.Linear(DENSE_IN, DENSE_OUT, device=device)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.dense(self.ebc(kjt).values())


def build(plan_name: str, *, output_dtensor: bool = False) -> tuple[Any, Any]:
    """A DMP of `Model` under plan `plan_name` on the default group, and its
    CombinedOptimizer (fused per-table Adagrads + dense Adam). Collective."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")
    model = Model(device)
    for name, (_, _, opt) in TABLES.items():
        cls, kwargs = (
            (RowWiseAdagrad, {"lr": 0.01})
            if opt == "rowwise_adagrad"
            else (torch.optim.Adagrad, {"lr": 0.01})
        )
        _apply_optimizer_in_backward(cls, [model.ebc.embedding_bags[name].weight], kwargs)
    sharder = EmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(
        model.ebc,
        _plans()[plan_name](world_size),
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    env = ShardingEnv(world_size, rank, dist.group.WORLD, output_dtensor=output_dtensor)
    dmp = DistributedModelParallel(
        model,
        env=env,
        device=device,
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return dmp, optimizer


def batch(seed: int) -> Any:
    """The same small KeyedJaggedTensor batch on every rank (2 samples)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for name, (rows, _, _) in TABLES.items():
        keys.append(f"f_{name}")
        for _sample in range(2):
            n = int(torch.randint(1, 4, (1,), generator=g))
            lengths.append(n)
            values.append(torch.randint(0, rows, (n,), generator=g))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.tensor(lengths)
    )


def train_step(dmp: Any, optimizer: Any, seed: int = 0) -> None:
    optimizer.zero_grad()
    loss = dmp(batch(seed)).sum()
    loss.backward()  # the fused optimizers step here
    optimizer.step()  # the dense Adam


# --- whole tensors from sharded state, and deterministic distinct values -----


def _pieces(value: Any) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """(global shape, [(offsets, local tensor)]) of a legacy ShardedTensor, a
    DTensor (LocalShardsWrapper or plain local tensor) or a plain tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as LegacyST
    from torch.distributed.tensor import DTensor

    if isinstance(value, LegacyST):
        return tuple(value.size()), [
            (tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()
        ]
    if isinstance(value, DTensor):
        local = value._local_tensor
        if hasattr(local, "local_shards"):
            return tuple(value.shape), [
                (tuple(o), t) for o, t in zip(local.local_offsets(), local.local_shards())
            ]
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return tuple(value.shape), [(tuple(offsets), local)]
    return tuple(value.shape), [((0,) * value.dim(), value)]


def _region(offsets: tuple[int, ...], tensor: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor leaf of a nested state dict, by dotted path."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def gather_full(tree: Any) -> dict[str, torch.Tensor]:
    """Every tensor of `tree` (this rank's keys, the union over ranks) as a whole
    tensor on every rank, assembled from all ranks' local shards. Collective.
    Raises if any element is missing or held twice with different values."""
    mine = {}
    for key, value in flat_tensors(tree).items():
        shape, pieces = _pieces(value)
        mine[key] = (shape, value.dtype, [(o, t.detach().clone()) for o, t in pieces])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for rank_view in everyone:
        for key, (shape, dtype, pieces) in rank_view.items():
            if key not in full:
                full[key] = torch.zeros(shape, dtype=dtype)
                seen[key] = torch.zeros(shape, dtype=torch.bool)
            assert tuple(full[key].shape) == shape, f"{key}: ranks disagree on the global shape"
            for offsets, t in pieces:
                region = _region(offsets, t)
                if seen[key][region].any():  # a replica: must agree
                    assert torch.equal(
                        full[key][region][seen[key][region]], t[seen[key][region]]
                    ), key
                full[key][region] = t
                seen[key][region] = True
    holes = [k for k, s in seen.items() if not bool(s.all())]
    assert not holes, f"no rank holds part of {holes}"
    return full


def state_keys() -> list[str]:
    """Every tensor of `{"model": dmp.state_dict(), "optim": optimizer.state_dict()}`
    (the union over ranks), by dotted path, sorted: the same under every plan."""
    keys = ["model.dense.bias", "model.dense.weight"]
    for name in TABLES:
        keys.append(f"model.ebc.embedding_bags.{name}.weight")
        keys.append(f"optim.state.ebc.embedding_bags.{name}.weight.{name}.momentum1")
    for p in ("weight", "bias"):
        keys += [f"optim.state.dense.{p}.{s}" for s in ("exp_avg", "exp_avg_sq", "step")]
    return sorted(keys)


def pattern(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor for `key`: distinct integers, exact in float32,
    no value shared by two elements of any two keys (each key has its own range)."""
    base = (state_keys().index(key) + 1) * 4096
    numel = 1
    for n in shape:
        numel *= n
    assert numel < 4096 and base + numel < 2**24
    return (torch.arange(numel, dtype=torch.float64) + base).reshape(shape).to(dtype)


def fill_with_pattern(tree: Any) -> None:
    """Write `pattern` into every tensor of `tree` in place (this rank's shards only)."""
    for key, value in flat_tensors(tree).items():
        shape, pieces = _pieces(value)
        whole = pattern(key, shape, value.dtype)
        for offsets, t in pieces:
            t.copy_(whole[_region(offsets, t)])


def zero_all(tree: Any) -> None:
    for value in flat_tensors(tree).values():
        for _, t in _pieces(value)[1]:
            t.zero_()

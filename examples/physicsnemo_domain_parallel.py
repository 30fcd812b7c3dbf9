"""A domain-parallel PhysicsNeMo field and model: trained, saved on 2 ranks, resumed on 3.

    torchrun --nproc-per-node 2 examples/physicsnemo_domain_parallel.py save --root /tmp/pn
    torchrun --nproc-per-node 3 examples/physicsnemo_domain_parallel.py load --root /tmp/pn

The physical field, [batch, channel, H, W], is split along H over the "domain" dimension
of a `DeviceMesh`, as a PhysicsNeMo `ShardTensor` with uneven pieces (H = 29 by default:
15 + 14 rows on 2 ranks, 10 + 10 + 9 on 3). A small convolutional surrogate learns one
explicit step of the heat equation on it; its weights are replicated on every rank.

The forward and backward passes run on `shardwise.from_shard_tensor(field)` (a
`ShardedTensor` sharing the ShardTensor's memory): each 3x3 convolution exchanges one halo
row with its neighbours, and the weights' gradients are summed over the domain. (PhysicsNeMo
2.2.2 registers its own domain-parallel convolution only when CUDA is available; on a CPU
job its ShardTensor would convolve each piece alone.)

`save`: `--steps` Adam steps, then `swc.save({"model": ..., "optim": ..., "field":
field}, root/ckpt)`: the ShardTensor is saved as it is. Rank 0 writes the prediction on the
saved field, gathered whole, before and after one more training step, to
`root/expected.pt`.

`load`: another world size, so another split of the field; a fresh model (other weights)
and Adam. `swc.load` fills the field's pieces, the weights and Adam's state in place;
then the prediction, and the prediction after one more step, are compared with the saved
run's (`PASS`/`FAIL` lines, with the largest difference: the halo exchanges and gradient
sums add in another order on another split).

`--cuda` uses one GPU per rank with NCCL where CUDA is available; the default is the CPU
with gloo.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Shard

import shardwise as sw
import shardwise.checkpoint as swc

SPLIT = 2  # the field is split along H


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=("save", "load"))
    p.add_argument("--root", required=True, help="a local folder for the checkpoint")
    p.add_argument("--height", type=int, default=29)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="training steps before the save")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda", action="store_true", help="NCCL and one GPU per rank")
    return p.parse_args()


def surrogate(channels: int, seed: int, device: Any) -> nn.Module:
    """Three 3x3 convolutions, the same weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(channels, 1, 3, padding=1),
    ).to(device)


def whole_field(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The initial field and its target, one explicit heat-equation step (the same in every
    process; a real job would read its own rows from its data)."""
    g = torch.Generator().manual_seed(args.seed)
    u = torch.randn(args.batch, 1, args.height, args.width, generator=g)
    laplacian = F.conv2d(
        F.pad(u, (1, 1, 1, 1), mode="replicate"),
        torch.tensor([[[[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]]]),
    )
    return u, u + 0.1 * laplacian


def shard_rows(value: torch.Tensor, mesh: Any, device: Any) -> Any:
    """A PhysicsNeMo ShardTensor of `value`, its rows split as `torch.chunk` splits them
    (uneven where the domain size does not divide H), sizes stated explicitly."""
    from physicsnemo.domain_parallel import ShardTensor

    pieces = value.chunk(mesh.size(), dim=SPLIT)
    shapes = [tuple(p.shape) for p in pieces]
    shapes += [(*shapes[0][:SPLIT], 0, *shapes[0][SPLIT + 1 :])] * (mesh.size() - len(pieces))
    mine = mesh.get_local_rank()
    local = pieces[mine] if mine < len(pieces) else value.narrow(SPLIT, 0, 0)
    return ShardTensor.from_local(
        local.clone().to(device), mesh, [Shard(SPLIT)], sharding_shapes={0: shapes}
    )


def predict(model: nn.Module, field: Any) -> Any:
    """The model on the domain-split field: a ShardedTensor, split as the field is."""
    return model(sw.from_shard_tensor(field))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, field: Any, target: Any) -> float:
    loss = F.mse_loss(predict(model, field), sw.from_shard_tensor(target))
    opt.zero_grad(set_to_none=True)
    loss.backward()  # the weights' gradients: plain tensors, summed over the whole domain
    opt.step()
    return float(loss.detach())


def gathered(t: Any) -> torch.Tensor:
    """The whole tensor on every rank, on the CPU. Collective."""
    return t.full_tensor().detach().cpu()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> tuple[bool, str]:
    if got.shape != want.shape:
        return False, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = float((got - want).abs().max())
    ok = torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    return ok, f"{what} {tuple(got.shape)} match (max |difference| {diff:.1e})"


def main() -> int:
    args = parse_args()
    warnings.filterwarnings("ignore")  # PhysicsNeMo warns about optional packages on import
    cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,), mesh_dim_names=("domain",))
    domain = mesh["domain"]
    root = Path(args.root)
    path, expected_file = root / "ckpt", root / "expected.pt"

    u, next_u = whole_field(args)
    target = shard_rows(next_u, domain, device)
    status = 0
    if args.phase == "save":
        field = shard_rows(u, domain, device)
        model = surrogate(args.channels, args.seed + 1, device)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        for step in range(1, args.steps + 1):
            loss = train_step(model, opt, field, target)
            if rank == 0:
                print(f"step {step} loss {loss:.6f}", flush=True)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "field": field}
        swc.save(state, path)  # collective; the ShardTensor as it is
        before = gathered(predict(model, field))
        train_step(model, opt, field, target)
        after = gathered(predict(model, field))
        if rank == 0:
            pieces = [s[SPLIT] for s in field._spec.sharding_shapes()[0]]
            torch.save({"before": before, "after": after, "world": world}, expected_file)
            print(f"saved on {world} ranks, field rows split {pieces}: {path}", flush=True)
    else:
        field = shard_rows(torch.zeros_like(u), domain, device)  # this split, to load into
        model = surrogate(args.channels, args.seed + 2, device)  # other weights
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        swc.init_optimizer_state(opt)  # Adam's state, for the load to fill
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "field": field}
        swc.load(state, path)  # collective, in place
        loaded = torch.equal(gathered(field), u)
        before = gathered(predict(model, field))
        with torch.no_grad():
            undivided = model(u.to(device)).cpu()  # the same model on the whole field, here
        train_step(model, opt, field, target)
        after = gathered(predict(model, field))
        if rank == 0:
            expected = torch.load(expected_file)
            pieces = [s[SPLIT] for s in field._spec.sharding_shapes()[0]]
            print(
                f"loaded on {world} ranks (saved on {expected['world']}), "
                f"field rows split {pieces}: {path}",
                flush=True,
            )
            lines = [
                (loaded, "field: the ShardTensor holds the saved field, bit for bit"),
                close(before, expected["before"], "prediction on the loaded field"),
                close(before, undivided, "it equals the model's on the undivided field"),
                close(after, expected["after"], "prediction after one more Adam step"),
            ]
            for ok, line in lines:
                print(f"{'PASS' if ok else 'FAIL'}: {line}", flush=True)
            status = 0 if all(ok for ok, _ in lines) else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Megatron-Core 0.19.2's DistributedOptimizer on CPU gloo ranks, for the checkpoint tests.

Everything that makes the state is Megatron's own: `parallel_state`, a
`MegatronModule` of `ColumnParallelLinear` / `RowParallelLinear`, Megatron's
`DistributedDataParallel` (`use_distributed_optimizer=True`: one contiguous
param/grad buffer, cut into buckets) and `get_megatron_optimizer` (a
`ChainedOptimizer` over one `DistributedOptimizer` over torch's `AdamW`, the
fallback without TE / Apex), stepped through `finish_grad_sync()` and
`optimizer.step()`. The params are bf16 (fp32 main params in the optimizer),
as in a Megatron bf16 run, so the buffer key is `(torch.bfloat16, torch.float32)`.

The CPU stand-ins (`patch_distopt_for_cpu`), on top of `megatron_harness`'s,
each because Megatron 0.19.2 assumes a CUDA device there:

- `torch.tensor` / `torch.zeros` with `device='cuda'` (a literal, not
  `current_device()`) in `optimizer/optimizer.py` (found-inf flag, unity loss
  scale, overflow buffer), `optimizer/clip_grads.py` (grad norm) and
  `core/utils.py` (the local `multi_tensor_l2_norm`, reached by
  `ChainedOptimizer.step`'s grad norm): those three modules get a `torch` whose
  `tensor` / `zeros` put `'cuda'` on the CPU; nothing else in them changes.
- `param.type()` compared with `'torch.cuda.BFloat16Tensor'` /
  `'torch.cuda.FloatTensor'` to sort params into fp16/fp32 groups
  (`DistributedOptimizer.__init__`, `_build_model_and_main_param_groups`): each
  model param (only those) answers `type()` with the CUDA name of its type.
- `Tensor.cuda()` on the send buffer of `get_parameter_state_dp_zero`'s
  all-gather (the `fully_reshardable` save): the CPU tensor itself (gloo
  gathers CPU tensors); a CPU-only torch cannot run `.cuda()` at all.
- `torch.cuda.current_stream()` (waited on for CUDA-graph events in
  `start_grad_sync`, none here): an object whose waits do nothing.

One stand-in is for the optimizer, not the device: Megatron 0.19.2's
`load_parameter_state_from_fully_reshardable` leaves each parameter's `step` out
and `_set_main_param_and_optimizer_states` then asks for every key of the
optimizer's state, which with torch's Adam (the fallback without TE / Apex,
whose FusedAdam keeps `step` in the param groups) holds `step` too: `KeyError:
'step'`. The job's DistributedOptimizer keeps that `step` as it is
(`_keep_step_when_not_given`).

Not used: `clip_grad` is 0 (Megatron's clipping asserts `grad.type() ==
'torch.cuda.FloatTensor'` on the main grads, plain CPU tensors). A loading job
steps once before it loads: torch Adam's `state_dict()` (which Megatron's
`sharded_state_dict(is_loading=True)` calls) asserts one `step` over a state
that a fresh optimizer does not have yet. `fully_reshardable` runs use one
bucket: with several, where a bucket's end is padded, Megatron 0.19.2 reads each
param's state at its padded buffer offset from the concatenation of the unpadded
buckets ("param range exceeds unpadded buffer ... padded with zeros"), its own
corruption. Every DP rank must own part of every bucket (a rank without optimizer
state fails that same `state_dict()` assert): hence the sizes below, for DP 3. `fully_sharded_model_space`
(the default sharding type) is rejected by 0.19.2's own
`validate_metadata_integrity` ("ShardedTensor.flattened_range is not supported").
A GPU run under torchrun needs none of the device stand-ins; with TE / Apex not
the `step` one either.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DP_RESHARDABLE",
    "FULLY_RESHARDABLE",
    "ITERATION",
    "Job",
    "build",
    "checkpoint_state",
    "clone_tree",
    "local_objects",
    "model_space_state",
    "patch_distopt_for_cpu",
    "path_of",
    "scramble",
]

DP_RESHARDABLE = "dp_reshardable"
FULLY_RESHARDABLE = "fully_reshardable"
# fc1: (40, 8) + (40,), fc2: (8, 40) + (8,): 384 elements a bucket (param starts padded
# to 64), so on DP 3 every rank owns part of every bucket (module docstring).
HIDDEN, FFN = 8, 40
ITERATION = 2
# Per-bucket element budget: with overlap_grad_reduce, fc2 and fc1 land in two buckets.
BUCKET_SIZE = 100


class _CpuDeviceTorch:
    """`torch` for one Megatron module: `tensor` / `zeros` take `device='cuda'` as the CPU."""

    def __init__(self, real: types.ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def tensor(self, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return self._real.tensor(*args, device=_on_cpu(device), **kwargs)

    def zeros(self, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return self._real.zeros(*args, device=_on_cpu(device), **kwargs)


def _on_cpu(device: Any) -> Any:
    return "cpu" if device == "cuda" else device


class _NoStream:
    """`torch.cuda.current_stream()` where there is no CUDA: nothing to wait for."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


def patch_distopt_for_cpu() -> None:
    """Install `megatron_harness`'s stand-ins and the optimizer's (module docstring); idempotent."""
    from tests.clients.megatron_harness import patch_for_cpu

    patch_for_cpu()
    if torch.cuda.is_available():
        return
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as utils

    for module in (optimizer, clip_grads, utils):
        if not isinstance(module.torch, _CpuDeviceTorch):
            module.torch = _CpuDeviceTorch(torch)  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()  # type: ignore[assignment]


def _claim_cuda_type(param: torch.nn.Parameter) -> None:
    """`param.type()` answers `torch.cuda.<Type>` (Megatron sorts params by that name)."""
    real = torch.Tensor.type

    def cuda_type(dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            return real(param).replace("torch.", "torch.cuda.", 1)
        return real(param, dtype, non_blocking, **kwargs)

    param.type = cuda_type  # type: ignore[method-assign]


def _global_value(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """A value of a param's global shape that depends only on (name, salt): the same on
    every rank and for every TP / DP size."""
    g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)) + salt)
    return torch.randn(shape, generator=g)


def _tp_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's piece of `full`, by Megatron's own param attributes."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=param.partition_dim)[rank]


def _global_shape(param: torch.Tensor) -> tuple[int, ...]:
    from megatron.core import parallel_state

    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


def _tiny_mlp(config: Any) -> Any:
    """fc1 (column parallel, bias split) -> fc2 (row parallel, bias replicated)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class TinyMLP(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            keep = lambda weight: None  # noqa: E731 - values are set from _global_value
            self.fc1 = ColumnParallelLinear(
                HIDDEN, FFN, config=config, init_method=keep, bias=True, gather_output=False
            )
            self.fc2 = RowParallelLinear(
                FFN, HIDDEN, config=config, init_method=keep, bias=True,
                input_is_parallel=True, skip_bias_add=False,
            )  # fmt: skip

    return TinyMLP()


@dataclass
class Job:
    """One rank's model and optimizer, as a Megatron training script holds them."""

    model: Any  # megatron.core.distributed.DistributedDataParallel
    optimizer: Any  # megatron.core.optimizer.ChainedOptimizer (one DistributedOptimizer)

    @property
    def dist_opt(self) -> Any:
        """The `DistributedOptimizer` under the `ChainedOptimizer`."""
        return self.optimizer.chained_optimizers[0]


def build(tp: int = 1, *, buckets: int = 1, steps: int = 2, salt: int = 0) -> Job:
    """Megatron's model parallel state (TP `tp`, PP 1, DP world/tp), the tiny model in
    DDP and its distributed Adam, after `steps` steps with fixed gradients.

    The weights are the same global values for any TP / DP; the gradients depend on
    (param, step, salt) only and are the same on every DP rank (so the averaging
    reduce-scatter keeps them). `buckets` is 1 or 2 (two: `overlap_grad_reduce`
    with a small bucket size, as Megatron buckets a large model)."""
    patch_distopt_for_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.bfloat16, bf16=True,
    )  # fmt: skip
    module = _tiny_mlp(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(_tp_piece(p, _global_value(name, _global_shape(p), 0)))
            _claim_cuda_type(p)
    assert buckets in (1, 2), buckets
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=buckets > 1,
        bucket_size=BUCKET_SIZE if buckets > 1 else None,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    assert [len(b.buckets) for b in model.buffers] == [buckets], "bucketing changed"
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=0.01,
            weight_decay=0.1,
            clip_grad=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
        ),  # fmt: skip
        [model],
    )
    job = Job(model, optimizer)
    _keep_step_when_not_given(job.dist_opt)
    for step in range(steps):
        train_step(job, 1000 * (salt + 1) + step)
    return job


def _keep_step_when_not_given(dist_opt: Any) -> None:
    """Let the fully_reshardable load run with torch's Adam (module docstring): a
    parameter's `step`, which that load leaves out, stays as the optimizer has it
    (`load_state_dict` has just set it from the saved param groups)."""
    set_states = dist_opt._set_main_param_and_optimizer_states

    def set_given(model_param: Any, tensors: dict[str, Any]) -> None:
        if "step" not in tensors:
            current = dist_opt._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        set_states(model_param, tensors)

    dist_opt._set_main_param_and_optimizer_states = set_given


def train_step(job: Job, salt: int) -> None:
    """One step with fixed gradients: written into DDP's grad buffer (`main_grad`), synced
    by DDP (reduce-scatter), stepped by the optimizer."""
    job.model.zero_grad_buffer()
    job.optimizer.zero_grad()
    for name, p in job.model.module.named_parameters():
        p.main_grad.copy_(_tp_piece(p, _global_value(name, _global_shape(p), salt)))
    job.model.finish_grad_sync()
    ok, _, _ = job.optimizer.step()
    assert ok


def checkpoint_state(
    job: Job, sharding_type: str, *, is_loading: bool, mem_efficient: bool = False
) -> dict[str, Any]:
    """What a Megatron training script checkpoints: the model's and the optimizer's
    sharded state dicts (the optimizer's with `distrib_optim_sharding_type`), and an
    iteration (common state). `mem_efficient`: fully_reshardable gathered on DP rank 0
    only (`distrib_optim_fully_reshardable_mem_efficient`; the other ranks' `param_state`
    is None)."""
    model = job.model.sharded_state_dict()
    metadata = {
        "distrib_optim_sharding_type": sharding_type,
        "distrib_optim_fully_reshardable_mem_efficient": mem_efficient,
    }
    optimizer = job.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
    return {"model": model, "optimizer": optimizer, "iteration": ITERATION}


def clone_tree(value: Any) -> Any:
    """A copy of nested dicts / lists / tuples whose tensors are cloned (loads fill the
    optimizer's own tensors in place: a later load would change an earlier result)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return value


def local_objects(sd: Any, keys: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """{keys to it: the object} of each `LocalNonpersistentObject` in `sd`: not saved, so a
    load gives back the passed object itself (dp_reshardable's `padding` flags and
    per-entry `step` tensors, a padding entry's uninitialised memory)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    if isinstance(sd, LocalNonpersistentObject):
        return {keys: sd.unwrap()}
    if isinstance(sd, dict):
        items: Any = sd.items()
    elif isinstance(sd, (list, tuple)):
        items = enumerate(sd)
    else:
        return {}
    return {p: o for k, v in items for p, o in local_objects(v, (*keys, k)).items()}


def path_of(keys: tuple[Any, ...]) -> str:
    """`keys` as `differences` names a place."""
    return "".join(f"[{k!r}]" for k in keys)


def _param_states(job: Job) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    """(name, model param, this rank's fp32 main param / exp_avg / exp_avg_sq / step)."""
    opt = job.dist_opt
    out = []
    for name, p in job.model.module.named_parameters():
        if p in opt.model_param_gbuf_map:
            out.append((name, p, opt._get_main_param_and_optimizer_states(p)))
    return out


def scramble(job: Job) -> None:
    """Overwrite this rank's optimizer state (main params, Adam moments) and model params
    with -7, so a load that leaves any of it alone shows (loads fill them in place)."""
    with torch.no_grad():
        for _, _, tensors in _param_states(job):
            for key, t in tensors.items():
                if key != "step":
                    t.fill_(-7.0)
        for p in job.model.module.parameters():
            p.fill_(-7.0)


def model_space_state(job: Job) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state per parameter of the global model, whatever the TP / DP
    layout: {param name: {"param" (fp32 main), "exp_avg", "exp_avg_sq": global shape,
    "step"}}, the same on every rank. Collective (gathers over DP, then TP)."""
    from megatron.core import parallel_state

    opt = job.dist_opt
    mine = {}
    for name, p, tensors in _param_states(job):
        r = opt._get_model_param_range_map(p)["param"]
        mine[name] = (r.start, r.end, {k: v.detach().clone() for k, v in tensors.items()})
    dp_group = opt.data_parallel_group
    pieces: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(pieces, mine, group=dp_group)
    local = {}
    for name, p in job.model.module.named_parameters():
        state: dict[str, torch.Tensor] = {}
        for piece in pieces:
            if name not in piece:
                continue
            start, end, tensors = piece[name]
            for key, t in tensors.items():
                if key == "step":
                    state["step"] = t
                    continue
                flat = state.setdefault(key, torch.full((p.numel(),), float("nan"), dtype=t.dtype))
                flat[start:end] = t
        local[name] = {k: v if k == "step" else v.view(p.shape) for k, v in state.items()}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_pieces: list[Any] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(tp_pieces, local, group=tp_group)
    whole = {}
    for name, p in job.model.module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            whole[name] = {
                k: v if k == "step" else torch.cat([t[name][k] for t in tp_pieces], p.partition_dim)
                for k, v in local[name].items()
            }
        else:
            whole[name] = tp_pieces[0][name]
    return whole

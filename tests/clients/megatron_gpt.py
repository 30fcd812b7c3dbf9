"""A real Megatron-Core `GPTModel` + Adam, as Megatron's training loop checkpoints it, on CPU ranks.

Test-only harness for `test_megatron_gpt.py`. Each rank body (under
`shardwise.testing.run_ranks`, gloo already initialised) calls `setup_parallel`,
then `build` gives the model chunks (DDP-wrapped, as `megatron.training.get_model`
returns them) and the Megatron optimizer (`get_megatron_optimizer`: a
`ChainedOptimizer` of one `FP32Optimizer` over torch's AdamW, Megatron's
fallback for Apex's FusedAdam), and `state_dict` the dict that
`megatron.training.checkpointing.generate_state_dict` builds for the `torch_dist`
format: `args`, `checkpoint_version`, `iteration`, `model` (or `model0`, `model1`
with virtual pipeline stages), `optimizer`, `opt_param_scheduler`, `rng_state`,
`num_floating_point_operations_so_far`.

Values are a function of the GLOBAL tensor, never of the rank: after two Adam
steps with a fixed gradient, every sharded tensor in the state (parameters,
`exp_avg`, `exp_avg_sq`) is overwritten with its slice of `global_value(key,
global_shape)`, so a checkpoint saved at one TP/PP/VPP can be checked at another
against values computed independently of any checkpoint (`wrong_values`).

`megatron.training` itself does not import here (Python 3.11; it needs
`typing.override`), so the few lines of it used (`generate_state_dict`,
`get_rng_state`, `calculate_padded_vocab_size`, `_set_random_seed`) are mirrored
below, each naming its original.

CPU stand-ins, besides `megatron_harness.patch_for_cpu()`'s (all only where no
CUDA device is present):

- `FP32Optimizer.__init__` puts its constant loss scale (`torch.tensor([1.0],
  device='cuda')`) on the CUDA device: `_CpuFP32Optimizer` puts it on the CPU
  and `get_megatron_optimizer` is made to build that one.
- `ChainedOptimizer.step()` computes the gradient norm (for the log) on the CUDA
  device: the steps call its `prepare_grads()` and `step_with_ready_grads()`, what
  `step()` does besides (no clipping: `clip_grad=0`).
- `model_parallel_cuda_manual_seed` seeds CUDA RNG trackers: Megatron's own
  `_set_random_seed` skips it when no CUDA device is present, and so do we. The
  weights are built with `use_cpu_initialization=True` (CPU RNG).
"""

from __future__ import annotations

import io
import math
import random
import zlib
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from tests.clients.megatron_harness import patch_for_cpu

__all__ = [
    "Setup",
    "at",
    "args_of",
    "build",
    "differences",
    "fill_global",
    "global_shapes",
    "global_value",
    "model_state",
    "padded_vocab_size",
    "rng_state",
    "setup_parallel",
    "sharded_leaves",
    "state_dict",
    "unwrapped",
    "wrong_values",
]

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Setup:
    """One parallel layout and model shape. Layers: `layers` in all, split over the
    `pp * (vpp or 1)` pipeline stages (at least two per stage, per rank)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    swiglu: bool = False
    layers: int = 4
    hidden: int = 16
    heads: int = 2
    vocab: int = 50  # padded to a multiple of divisible_by * tp, as Megatron's training does
    divisible_by: int = 8
    seq: int = 8
    seed: int = 1234


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """`megatron.training.vocab_utils.calculate_padded_vocab_size`: the vocabulary
    padded to a multiple of `make_vocab_size_divisible_by * TP`."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


# -- the parallel state, the model and the optimizer ---------------------------------------


def setup_parallel(s: Setup) -> None:
    """Megatron's parallel groups for `s` on this gloo job, and the seeds
    (`megatron.training.initialize._set_random_seed`: seed + 100 * PP rank)."""
    patch_for_cpu()
    _patch_optimizer_for_cpu()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(s.tp, s.pp, virtual_pipeline_model_parallel_size=s.vpp)
    seed = s.seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():  # as _set_random_seed: only with a CUDA device
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def _patch_optimizer_for_cpu() -> None:
    """`get_megatron_optimizer` builds `_CpuFP32Optimizer` (see the module docstring)."""
    if torch.cuda.is_available():
        return
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class _CpuFP32Optimizer(FP32Optimizer):
        """`FP32Optimizer` with its constant loss scale (1.0) on the CPU."""

        def __init__(self, optimizer: Any, config: Any, init_state_fn: Callable) -> None:
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0], dtype=torch.float)
            self.is_stub_optimizer = optimizer is None

    if not getattr(mopt.FP32Optimizer, "_cpu_stand_in", False):
        _CpuFP32Optimizer._cpu_stand_in = True  # type: ignore[attr-defined]
        mopt.FP32Optimizer = _CpuFP32Optimizer


def _config(s: Setup) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    assert s.layers >= 2 * s.pp * (s.vpp or 1), "at least two layers per pipeline stage"
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        virtual_pipeline_model_parallel_size=s.vpp,
        gated_linear_unit=s.swiglu,
        activation_func=F.silu if s.swiglu else F.gelu,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build(s: Setup, trained: bool = True) -> tuple[list[Any], Any]:
    """The DDP-wrapped model chunks (one per virtual stage) and the Megatron optimizer,
    as `megatron.training.setup_model_and_optimizer` makes them. `trained`: after two
    Adam steps, every sharded value set to its global value (`fill_global`), Adam
    state included; else as built (random weights, no optimizer state), to load into."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = _config(s)
    vocab = padded_vocab_size(s.vocab, s.divisible_by, s.tp)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    stages = s.vpp or 1
    chunks = []
    for i in range(stages):  # megatron.training.training.get_model's build_model
        gpt = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=vocab,
            max_sequence_length=s.seq,
            pre_process=first and i == 0,
            post_process=last and i == stages - 1,
            vp_stage=i if s.vpp else None,
        )
        chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(), gpt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0), chunks
    )
    if trained:
        # two steps with a fixed gradient (a function of the parameter's value), so the
        # Adam state (exp_avg, exp_avg_sq, step) exists; then global values everywhere
        for _ in range(2):
            for chunk in chunks:
                for p in chunk.parameters():
                    p.main_grad.copy_(torch.sin(p.detach()) * 0.1)
            # `optimizer.step()` less its gradient norm (logged, or for clip_grad > 0):
            # `get_grad_norm_fp32` allocates on the CUDA device
            assert not optimizer.prepare_grads()
            assert optimizer.step_with_ready_grads()
        fill_global(state_dict(s, chunks, optimizer, 0))
    return chunks, optimizer


def model_chunks(chunks: list[Any]) -> list[Any]:
    """The GPT models inside the DDP wrappers (`megatron.core.utils.unwrap_model`)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunks)


# -- the state dict Megatron's training checkpoints ------------------------------------------


def model_state(chunks: list[Any]) -> dict[str, Any]:
    """`{"model": ...}`, or `{"model0": ..., "model1": ...}` with virtual pipeline
    stages: each chunk's `sharded_state_dict()`, whose tensors are its parameters."""
    models = model_chunks(chunks)
    return {
        f"model{i}" if len(models) > 1 else "model": m.sharded_state_dict(metadata=_metadata())
        for i, m in enumerate(models)
    }


def _metadata() -> dict[str, Any]:
    """`megatron.training.checkpointing._build_sharded_state_dict_metadata` (no
    distributed optimizer)."""
    from megatron.core import parallel_state as ps

    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def args_of(s: Setup) -> Namespace:
    """The training arguments Megatron stores in its common state (a few of them)."""
    return Namespace(
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        virtual_pipeline_model_parallel_size=s.vpp,
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        swiglu=s.swiglu,
        padded_vocab_size=padded_vocab_size(s.vocab, s.divisible_by, s.tp),
        make_vocab_size_divisible_by=s.divisible_by,
        lr=1e-2,
        ckpt_format="torch_dist",
        seed=s.seed,
    )


def rng_state() -> Any:
    """`megatron.training.checkpointing.get_rng_state` for `torch_dist` on a CPU job
    (no CUDA RNG): one ShardedObject per (PP, TP) rank, replicated over DP."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": {},
    }
    return ShardedObject(
        "rng_state",
        [state],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def state_dict(
    s: Setup,
    chunks: list[Any],
    optimizer: Any,
    iteration: int | None,
    *,
    loading: bool = False,
    rng: bool = True,
) -> dict[str, Any]:
    """`megatron.training.checkpointing.generate_state_dict` for `torch_dist`: to save
    (`iteration` given) or to load into (`loading=True`, `iteration=None`, as
    `load_checkpoint` calls it: the stored iteration comes back from the checkpoint).
    `rng=False` leaves out the RNG state, as Megatron does when the parallel layout
    changed (`--no-load-rng`)."""
    state: dict[str, Any] = {"args": args_of(s), "checkpoint_version": 3.0}
    if iteration is not None:
        state["iteration"] = iteration
    state.update(model_state(chunks))
    state["optimizer"] = optimizer.sharded_state_dict(
        state, metadata=_metadata(), is_loading=loading
    )
    state["opt_param_scheduler"] = {  # OptimizerParamScheduler.state_dict()
        "max_lr": 1e-2,
        "lr_warmup_steps": 0,
        "num_steps": 2 if iteration is not None else 0,
        "lr_decay_style": "cosine",
        "lr_decay_steps": 100,
        "min_lr": 0.0,
    }
    if rng:
        state["rng_state"] = rng_state()
    state["num_floating_point_operations_so_far"] = 0 if loading else 12345
    return state


# -- global values -------------------------------------------------------------------------


def global_value(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor `key` of `shape`: the same in every process, for any layout."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}{shape}".encode()))
    t = torch.randn(shape, generator=g)
    return (t.abs() if "exp_avg_sq" in key else t).to(dtype)


def _pieces(leaf: Any, data: torch.Tensor | None = None) -> list[Any]:
    """A ShardedTensor, or a factory's built ShardedTensors (over `data`, else the
    factory's own tensor): their `.data` are views of the parameter."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if isinstance(leaf, ShardedTensor):
        return [leaf if data is None else replace(leaf, data=data)]
    built = (leaf if data is None else replace(leaf, data=data)).build()
    return [p for v in nested_values(built) for p in _pieces(v)]


def fill_global(state: dict[str, Any]) -> None:
    """Every ShardedTensor (and factory piece) of `state` set, in place, to its slice
    of `global_value` (parameters and optimizer state alike)."""
    for leaf in sharded_leaves(state, tensors_only=True).values():
        for piece in _pieces(leaf):
            whole = global_value(piece.key, tuple(piece.global_shape), piece.dtype)
            with torch.no_grad():
                piece.data.copy_(whole[piece.global_slice()])


def global_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each ShardedTensor key's global shape in `state` (factories' built pieces)."""
    return {
        piece.key: tuple(piece.global_shape)
        for leaf in sharded_leaves(state, tensors_only=True).values()
        for piece in _pieces(leaf)
    }


def wrong_values(
    sharded: dict[str, Any], values: Any, saved: dict[str, tuple[int, ...]]
) -> list[str]:
    """Where the tensors at `sharded`'s ShardedTensor / factory paths in `values` (a
    loaded state: `sharded` itself after `swc.load`, or what `dist_checkpointing.load`
    returned) differ from the global value saved with shape `saved[key]`: its overlap
    with the target's global shape, the rest zeros (a padded vocabulary,
    `allow_shape_mismatch`)."""
    wrong = []
    for path, leaf in sharded_leaves(sharded, tensors_only=True).items():
        got = at(values, path)
        if not isinstance(got, torch.Tensor):
            wrong.append(f"{_dotted(path)}: {type(got).__name__}")
            continue
        for piece in _pieces(leaf, got):
            shape = tuple(piece.global_shape)
            stored = global_value(piece.key, saved[piece.key], piece.dtype)
            whole = torch.zeros(shape, dtype=piece.dtype)
            overlap = tuple(slice(0, min(a, b)) for a, b in zip(shape, stored.shape))
            whole[overlap] = stored[overlap]
            want = whole[piece.global_slice()]
            data = piece.data
            if data.shape != want.shape or data.dtype != want.dtype or not torch.equal(data, want):
                wrong.append(f"{_dotted(path)} ({piece.key})")
    return wrong


# -- walking Megatron state dicts --------------------------------------------------------------


def _children(node: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, dict):
        yield from node.items()
    elif isinstance(node, list):
        yield from enumerate(node)


def sharded_leaves(state: Any, tensors_only: bool = False) -> dict[Path, Any]:
    """Path -> Megatron value (ShardedTensor, ShardedTensorFactory, and unless
    `tensors_only` ShardedObject and LocalNonpersistentObject), through dicts and lists
    as Megatron's `dict_list_map_inplace` walks them."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensorFactory,
    )

    kinds: tuple[type, ...] = (ShardedTensor, ShardedTensorFactory)
    if not tensors_only:
        kinds += (ShardedObject, LocalNonpersistentObject)
    out: dict[Path, Any] = {}

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, kinds):
            out[path] = node
        for k, v in _children(node):
            walk(v, (*path, k))

    walk(state, ())
    return out


def at(node: Any, path: Path) -> Any:
    """The value in nested dicts / lists at `path`."""
    for k in path:
        node = node[k]
    return node


def _dotted(path: Path) -> str:
    return ".".join(map(str, path))


def unwrapped(state: Any) -> Any:
    """`state` as `dist_checkpointing.load` returns it: ShardedTensor, factory and
    ShardedObject replaced by their `.data`, LocalNonpersistentObject by `.unwrap()`;
    dicts and lists copied (the tensors are not), everything else as it is."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensorFactory,
    )

    if isinstance(state, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
        return state.data
    if isinstance(state, LocalNonpersistentObject):
        return state.unwrap()
    if isinstance(state, dict):
        return {k: unwrapped(v) for k, v in state.items()}
    if isinstance(state, list):
        return [unwrapped(v) for v in state]
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def differences(
    got: Any, want: Any, path: Path = (), skip: frozenset[Path] = frozenset()
) -> list[str]:
    """Where `got` and `want` differ, bit for bit: the same keys, tensors of the same
    dtype, shape and bits (a NaN equals the same NaN), numpy arrays `array_equal`,
    `BytesIO` by their bytes, other values `==` and of the same type. At the paths in
    `skip` only the type is compared."""
    where = _dotted(path) or "<root>"
    if path in skip:
        same = type(got) is type(want)
        return [] if same else [f"{where}: {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{where}.{k!r}: only in the first" for k in got if k not in want]
        out += [f"{where}.{k!r}: only in the second" for k in want if k not in got]
        return out + [
            d for k in want if k in got for d in differences(got[k], want[k], (*path, k), skip)
        ]
    if isinstance(want, (list, tuple)) and type(got) is type(want):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want))
            for d in differences(g, w, (*path, i), skip)
        ]
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        if got.dtype != want.dtype:
            return [f"{where}: dtype {got.dtype} != {want.dtype}"]
        if got.shape != want.shape:
            return [f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
        if not torch.equal(_bits(got), _bits(want)):
            return [f"{where}: {tuple(got.shape)} values differ"]
        return []
    if isinstance(want, np.ndarray) and isinstance(got, np.ndarray):
        same = got.dtype == want.dtype and np.array_equal(got, want)
        return [] if same else [f"{where}: array differs"]
    if isinstance(want, io.BytesIO) and isinstance(got, io.BytesIO):
        return [] if got.getvalue() == want.getvalue() else [f"{where}: bytes differ"]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r:.80} != {want!r:.80}"]
    return []

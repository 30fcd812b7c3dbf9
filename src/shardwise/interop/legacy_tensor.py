"""`shardwise.legacy.ShardedTensor`: the legacy `torch.distributed._shard` ShardedTensor's
class, constructors and answers on a shardwise tensor, for code that swaps its import.

It is `shardwise.ShardedTensor` (a subclass: the same layout, shards, ops and
collectives) with the legacy answers where the two APIs differ, so that legacy
code runs unchanged:

- `local_shards()` returns torch's `Shard(tensor, metadata)` objects (the very shard
  tensors: in-place edits are visible), zero-size chunks of the spec included;
- `sharding_spec()` / `metadata()` return the spec the tensor was built with (shard
  order and zero-size chunks kept), not one derived from the layout;
- `reshard(spec)` changes the tensor in place and returns it;
- torch functions consult the legacy op tables first: `custom_sharded_op_impl` and
  torch's `custom_sharding_spec_op`, handlers called as `(types, args, kwargs,
  process_group)`;
- the constructors (`ShardedTensor(spec, *size, ...)`, `_init_from_local_shards`,
  `_init_from_local_tensor`, `_init_from_local_shards_and_global_metadata`) validate
  with torch's own legacy checks, so the messages and the builtin classes an
  `except` clause catches are legacy's; the collective one raises a problem found on
  one rank on every rank (legacy leaves the others waiting).

Op results on it stay legacy tensors where the op keeps or remaps blocks
(`_with_layout`); internal code reads `_shards`, never `local_shards()`, because
this class answers that one with `Shard` objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex, cast

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor import (
    custom_sharded_op_impl as torch_custom_sharded_op_impl,
)
from torch.distributed._shard.sharded_tensor.api import _CUSTOM_SHARDED_OPS
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.utils import (
    _flatten_tensor_size,
    _parse_and_validate_remote_device,
    build_global_metadata,
    build_metadata_from_local_shards,
)
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardingSpec,
)
from torch.distributed._shard.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from torch.distributed._shard.sharding_spec.api import (
    _CUSTOM_SHARDING_SPEC_OPS,
    _infer_sharding_spec_from_shards_metadata,
)
from torch.distributed.remote_device import _remote_device as RemoteDevice
from torch.utils._pytree import tree_map

from ..comm.agreement import exchange
from ..comm.group import resolve_group
from ..errors import (
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    ShardCountError,
    ShardMismatchError,
    SingleShardError,
    UsageError,
)
from ..layout import Block, Layout
from ..tensor import ShardedTensor as _ShardedTensor
from .dtensor import from_torch_sharded_tensor
from .legacy import gather_into, metadata, reshard_in_place, spec_layout

__all__ = [
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "TensorProperties",
    "as_legacy",
    "custom_sharded_op_impl",
    "init_from_local_shards",
]


class _Placement:
    """A shard's placement, checked present (legacy requires one): rank and device."""

    def __init__(self, m: ShardMetadata) -> None:
        if m.placement is None:
            raise ShardMismatchError(f"Must specify placement for `Shard`! ({m})")
        self._placement = m.placement

    def rank(self) -> int:
        rank = self._placement.rank()
        if rank is None:
            raise ShardMismatchError(f"placement {self._placement} names no rank")
        return rank

    def device(self) -> torch.device:
        return self._placement.device()


def _global_rank(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _group_rank(group: Any, global_rank: int) -> int:
    return dist.get_group_rank(group, global_rank) if group is not None else global_rank


def _default_group(group: Any) -> Any:
    """Legacy `_normalize_pg`: None means the default group."""
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _check_rrefs(init_rrefs: bool) -> None:
    if init_rrefs:
        raise UsageError(
            "init_rrefs=True: shardwise keeps no RPC references to remote shards (legacy needs "
            "torch.distributed.rpc.init_rpc for them); collectives reach every shard instead"
        )


def _moved(spec: ShardingSpec, device: torch.device) -> ShardingSpec:
    """`spec` with every placement on `device`'s type (as legacy `cpu()` / `cuda()` do)."""

    def place(p: Any) -> RemoteDevice:
        p = p if isinstance(p, RemoteDevice) else RemoteDevice(p)
        return RemoteDevice(f"rank:{p.rank()}/{device}")

    if isinstance(spec, ChunkShardingSpec):
        return ChunkShardingSpec(spec.dim, [place(p) for p in spec.placements])
    shards = spec.shards  # type: ignore[attr-defined]
    return EnumerableShardingSpec(
        [
            ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), place(m.placement))
            for m in shards
        ]
    )


class ShardedTensor(_ShardedTensor):
    """The legacy `torch.distributed._shard.sharded_tensor.ShardedTensor`, as shardwise.

    `ShardedTensor(sharding_spec, *size, dtype=None, layout=torch.strided,
    requires_grad=False, pin_memory=False, memory_format=torch.contiguous_format,
    process_group=None, init_rrefs=False)` makes an uninitialised one, as legacy;
    see the module docstring for where it answers as legacy rather than as
    `shardwise.ShardedTensor`.
    """

    # The spec the tensor was built with (None: derived from the layout when asked) and
    # its metadata, built once per spec.
    _legacy_spec: ShardingSpec | None
    _legacy_metadata: ShardedTensorMetadata | None

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> ShardedTensor:
        if args and isinstance(args[0], Layout):  # shardwise's own (internal) form
            out: Any = _ShardedTensor.__new__(cls, *args, **kwargs)
            out._legacy_spec = None
            out._legacy_metadata = None
            return cast(ShardedTensor, out)
        return _legacy_empty(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    # -- the legacy constructors ---------------------------------------------

    @classmethod
    def _init_from_local_shards(
        cls,
        local_shards: list[Shard],
        *global_size: Any,
        process_group: Any = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """Collective, as legacy: see `init_from_local_shards`."""
        return init_from_local_shards(
            local_shards, *global_size, process_group=process_group, init_rrefs=init_rrefs
        )

    @classmethod
    def _init_from_local_tensor(
        cls,
        local_tensor: torch.Tensor,
        sharding_spec: ShardingSpec,
        *global_size: Any,
        process_group: Any = None,
        init_rrefs: bool = False,
    ) -> ShardedTensor:
        """This rank's one tensor in `sharding_spec` (no communication; the caller vouches
        for the other ranks, as legacy)."""
        if not local_tensor.is_contiguous():
            raise ShardMismatchError("local_tensor is not a contiguous Tensor.")
        size = _sizes(global_size)
        props = TensorProperties(
            dtype=local_tensor.dtype,
            layout=local_tensor.layout,
            requires_grad=local_tensor.requires_grad,
            memory_format=torch.contiguous_format,
            pin_memory=local_tensor.is_pinned(),
        )
        md = sharding_spec.build_metadata(size, props)
        group = _default_group(process_group)
        me = dist.get_rank()
        local = [
            Shard(local_tensor, m)
            for m in md.shards_metadata
            if _parse_and_validate_remote_device(group, m.placement)[0] == me
        ]
        return cls._init_from_local_shards_and_global_metadata(
            local,
            md,
            process_group=process_group,
            init_rrefs=init_rrefs,
            sharding_spec=sharding_spec,
        )

    @classmethod
    def _init_from_local_shards_and_global_metadata(
        cls,
        local_shards: list[Shard],
        sharded_tensor_metadata: ShardedTensorMetadata,
        process_group: Any = None,
        init_rrefs: bool = False,
        sharding_spec: ShardingSpec | None = None,
    ) -> ShardedTensor:
        """Local shards and the global metadata every rank holds (no communication; the
        caller vouches that the ranks agree, as legacy). Checked here as legacy checks."""
        md = sharded_tensor_metadata
        group = _default_group(process_group)
        me = dist.get_rank()
        mine = [
            m
            for m in md.shards_metadata
            if _parse_and_validate_remote_device(group, m.placement)[0] == me
        ]
        if len(local_shards) != len(mine):
            raise ShardCountError(
                f"Number of local shards ({len(local_shards)}) does not match number of local "
                f"shards metadata in sharded_tensor_metadata ({len(mine)}) on rank ({me}) "
            )
        if not md.shards_metadata:
            raise InvalidArgumentError("shards_metadata must not be empty!")
        props = md.tensor_properties
        if props.layout != torch.strided:
            raise InvalidArgumentError("Only torch.strided layout is currently supported")
        for shard in local_shards:
            _check_shard(shard, props)
        try:
            validate_non_overlapping_shards_metadata(md.shards_metadata)
            check_tensor(md.shards_metadata, list(md.size))
        except ValueError as e:
            raise LayoutError(str(e)) from None
        _check_rrefs(init_rrefs)
        spec = sharding_spec or _infer_sharding_spec_from_shards_metadata(md.shards_metadata)
        return _from_metadata(cls, local_shards, md, spec, process_group)

    # -- what legacy answers differently ----------------------------------------

    def local_shards(self) -> list[Shard]:  # type: ignore[override]
        """This rank's `Shard(tensor, metadata)` objects in the spec's order: the live shard
        tensors (in-place edits are visible); an empty tensor for a zero-size chunk."""
        me = _global_rank(self._group, self._rank)
        mine = {(b.offsets, b.sizes): s for b, s in zip(self.local_blocks, self._shards)}
        spec = self._legacy_spec
        if spec is None:  # no spec given: the blocks themselves, placed here
            return [
                Shard(s, ShardMetadata(list(b.offsets), list(b.sizes), f"rank:{me}/{s.device}"))
                for b, s in zip(self.local_blocks, self._shards)
            ]
        out = []
        for m in self.metadata().shards_metadata:
            if _Placement(m).rank() != me:
                continue
            t = mine.get((tuple(m.shard_offsets), tuple(m.shard_sizes)))
            if t is None:  # a zero-size chunk: the layout holds no block for it
                if 0 not in m.shard_sizes:
                    raise ShardMismatchError(
                        f"rank {self._rank}: the spec places {m} here but the tensor's layout "
                        f"holds no such block (was it resharded behind this tensor's back?)"
                    )
                t = torch.empty(
                    m.shard_sizes,
                    dtype=self.dtype,
                    device=_Placement(m).device(),
                    requires_grad=self.requires_grad,
                )
            out.append(Shard(t, m))
        return out

    def sharding_spec(self) -> ShardingSpec:
        """The spec the tensor was built with (or reshard to); else one for its layout."""
        if self._legacy_spec is None:
            self._legacy_spec = super().sharding_spec()
        return self._legacy_spec

    def metadata(self) -> ShardedTensorMetadata:
        """`sharding_spec().build_metadata(...)`, as legacy keeps it (one object per spec)."""
        md = self._legacy_metadata
        if md is None:
            md = metadata(self, self.sharding_spec())
            self._legacy_metadata = md
        md.tensor_properties.requires_grad = self.requires_grad
        return md

    def reshard(self, resharding_spec: ShardingSpec) -> ShardedTensor:
        """In place, as legacy: the tensor takes the layout of `resharding_spec` (any
        chunk or enumerable spec, any number of shards per rank) and is returned.
        Collective."""
        reshard_in_place(self, resharding_spec)
        self._legacy_spec = resharding_spec
        self._legacy_metadata = None
        md = self.metadata()  # legacy lists a reshard's shards by rank, not in spec order
        md.shards_metadata.sort(key=lambda m: _Placement(m).rank())
        return self

    def local_tensor(self) -> torch.Tensor:
        if len(self._shards) == 1 and self._legacy_spec is None:
            return self._shards[0]
        shards = self.local_shards()
        if len(shards) != 1:
            raise SingleShardError(
                f"Only single local shard is supported. Number of shards: {len(shards)} "
                f"(rank {self._rank}, tensor of shape {tuple(self.shape)})"
            )
        return shards[0].tensor

    def gather(  # type: ignore[override]
        self,
        dst: int = 0,
        out: torch.Tensor | None = None,
        enforce_dtype: bool = False,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor | None:
        """Legacy `gather`: the whole tensor into `out` on `dst` (and returned; legacy
        returns None); `dtype` casts the pieces first. Collective."""
        src = self.to(dtype) if dtype is not None and dtype != self.dtype else self
        if out is None:
            return _ShardedTensor.gather(src, dst)
        return gather_into(src, dst, out)

    def requires_grad_(self, requires_grad: bool = True) -> ShardedTensor:
        """As legacy: the tensor and its local shard tensors."""
        super().requires_grad_(requires_grad)
        for shard in self._shards:
            if shard.is_leaf:
                shard.requires_grad_(requires_grad)
        return self

    def cpu(
        self, memory_format: torch.memory_format = torch.preserve_format, process_group: Any = None
    ) -> ShardedTensor:
        """A copy on the CPU (`self` when already there), placements rewritten, on
        `process_group` when given (legacy's: a CPU tensor may want a gloo group)."""
        _check_memory_format(memory_format)
        if self.device.type == "cpu":
            return self
        return _regrouped(cast(_ShardedTensor, super().cpu()), process_group)

    def cuda(
        self,
        device: Any = None,
        non_blocking: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
        process_group: Any = None,
    ) -> ShardedTensor:
        """A copy on this rank's current CUDA device, on `process_group` when given."""
        _check_memory_format(memory_format)
        target = torch.device("cuda", torch.cuda.current_device())
        return _regrouped(
            cast(_ShardedTensor, super().to(target, non_blocking=non_blocking)), process_group
        )

    def to(self, *args: Any, **kwargs: Any) -> ShardedTensor:
        """`Tensor.to`, plus legacy's `process_group=` for the result."""
        process_group = kwargs.pop("process_group", None)
        if len(args) == 1 and not isinstance(args[0], (torch.dtype, torch.device, str, int)):
            if not isinstance(args[0], torch.Tensor):
                raise UsageError(f"ShardedTensor.to() have wrong arguments: {args}")
        out = super().to(*args, **kwargs)
        return self if out is self else _regrouped(cast(_ShardedTensor, out), process_group)

    def remote_shards(self) -> dict[int, list[Any]]:
        raise UsageError(
            "ShardedTensor created with init_rrefs=False, no RRefs to remote shards available"
        )

    @property
    def _process_group(self) -> Any:
        """Legacy's attribute: the group (the default group for None)."""
        return _default_group(self._group)

    @property
    def _sharding_spec(self) -> ShardingSpec:
        return self.sharding_spec()

    @property
    def _metadata(self) -> ShardedTensorMetadata:
        return self.metadata()

    @property
    def _local_shards(self) -> list[Shard]:
        return self.local_shards()

    # -- op results and torch functions -------------------------------------

    def _with_layout(
        self,
        layout: Layout,
        shards: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> _ShardedTensor:
        return as_legacy(super()._with_layout(layout, shards, dtype=dtype, device=device))

    def _with_shards(
        self,
        shards: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> _ShardedTensor:
        out = super()._with_shards(shards, dtype=dtype, device=device)
        spec = self._legacy_spec
        if isinstance(out, ShardedTensor) and spec is not None:  # same blocks: same spec
            out._legacy_spec = spec if out.device == self.device else _moved(spec, out.device)
        return out

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # Legacy's order: a user's op for the function, then one for the spec's class,
        # then shardwise's own dispatch (legacy's built-in ops are covered by it). The
        # tables are torch's; their entries wrap the user's function in a check that the
        # operands are torch's class, so the function itself (`__wrapped__`) is called.
        kwargs = kwargs or {}
        if _CUSTOM_SHARDED_OPS or _CUSTOM_SHARDING_SPEC_OPS:
            st = _first_legacy(args, kwargs)
            if st is not None:
                handler = _CUSTOM_SHARDED_OPS.get(func)
                if handler is None and any(func in o for o in _CUSTOM_SHARDING_SPEC_OPS.values()):
                    handler = _spec_op(st, func)
                if handler is not None:
                    return _call_legacy_op(handler, types, args, kwargs, st._process_group)
        return super().__torch_function__(func, types, args, kwargs)

    # -- pickling ---------------------------------------------------------------

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        rebuild, fields = super().__reduce_ex__(protocol)
        me = _global_rank(self._group, self._rank)
        return (_rebuild_legacy, (rebuild, fields, self._legacy_spec, me))


def _rebuild_legacy(
    rebuild: Callable[..., _ShardedTensor], fields: tuple, spec: Any, global_rank: int
) -> ShardedTensor:
    """A pickled legacy tensor; as legacy, it loads only on the rank that saved it
    (when a process group is up: shardwise needs none to load)."""
    if dist.is_initialized() and dist.get_rank() != global_rank:
        raise UsageError(
            f"Global rank at save time was {global_rank}, but at load time was "
            f"{dist.get_rank()}: a legacy ShardedTensor holds that rank's shards"
        )
    out = as_legacy(rebuild(*fields))
    out._legacy_spec = spec
    return out


def _call_legacy_op(
    handler: Callable[..., Any], types: Any, args: tuple, kwargs: dict, group: Any
) -> Any:
    """Call a legacy op table's handler. A user's function gets the shardwise legacy
    tensors (its table entry's check for torch's class is skipped). torch's own
    (the sharded `embedding` / `embedding_bag` of a chunk spec) gets torch's legacy
    tensors over the same shards (no copy, no communication) and its tensors come back
    as shardwise's, so the op runs exactly as legacy runs it."""
    function = getattr(handler, "__wrapped__", handler)
    if not function.__module__.startswith("torch."):
        return function(types, args, kwargs, group)

    def to_torch(value: Any) -> Any:
        return value.to_torch_sharded_tensor() if isinstance(value, ShardedTensor) else value

    def back(value: Any) -> Any:
        if not isinstance(value, TorchShardedTensor):
            return value
        out = as_legacy(from_torch_sharded_tensor(value))
        out._legacy_spec = value.sharding_spec()
        return out

    args, kwargs = tree_map(to_torch, (args, kwargs))
    return tree_map(back, handler(types, args, kwargs, group))


def custom_sharded_op_impl(
    func: Callable[..., Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Legacy's decorator: register a handler `(types, args, kwargs, process_group)` for
    the torch function `func` (in torch's own table, so torch's legacy tensors see it too).
    A handler with another signature is refused with `InvalidTypeError` (a TypeError)."""

    def register(handler: Callable[..., Any]) -> Callable[..., Any]:
        if len(inspect.signature(handler).parameters) != 4:
            raise InvalidTypeError(
                f"Custom sharded op function expects signature: (types, args, kwargs, "
                f"process_group), but received signature: {inspect.signature(handler)}"
            )
        return torch_custom_sharded_op_impl(func)(handler)

    return register


def _spec_op(st: ShardedTensor, func: Any) -> Callable[..., Any] | None:
    """The op registered for `func` on the class of `st`'s spec (none for a layout no
    spec expresses, such as a reduction's replicated result)."""
    try:
        spec = st.sharding_spec()
    except LayoutError:
        return None
    return _CUSTOM_SHARDING_SPEC_OPS.get(type(spec).__qualname__, {}).get(func)


def _first_legacy(args: Sequence[Any], kwargs: dict[str, Any]) -> ShardedTensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, ShardedTensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, ShardedTensor):
                    return item
    return None


def as_legacy(st: _ShardedTensor) -> ShardedTensor:
    """`st` as a legacy tensor: the same state (layout, shards, group), no copy.
    A new wrapper, so for results being built (not for tensors in an autograd graph)."""
    if isinstance(st, ShardedTensor):
        return st
    out = ShardedTensor(
        st._layout,
        st._shards,
        st._rank,
        dtype=st.dtype,
        device=st.device,
        group=st._group,
        requires_grad=st.requires_grad,
        mesh=st._mesh,
    )
    out.__dict__.update(st.__dict__)  # a plain tensor's state holds no legacy spec
    return out


def _regrouped(out: _ShardedTensor, process_group: Any) -> ShardedTensor:
    legacy = as_legacy(out)
    if process_group is not None:
        legacy._group, legacy._mesh = resolve_group(process_group)
    return legacy


def _check_memory_format(memory_format: torch.memory_format) -> None:
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        raise UsageError(  # legacy's RuntimeError
            "Only `torch.contiguous_format` or `torch.preserve_format` is supported!"
        )


def _sizes(size: tuple[Any, ...]) -> torch.Size:
    try:
        return _flatten_tensor_size(size)
    except TypeError as e:
        raise InvalidTypeError(str(e)) from None


def _check_shard(shard: Shard, props: TensorProperties) -> None:
    """Legacy's checks of one local shard against the tensor's properties (ValueError)."""
    t, m = shard.tensor, shard.metadata
    rank = _Placement(m).rank()
    if t.layout != props.layout:
        raise ShardMismatchError(
            f"Local shards' tensor layout property is incompatible with tensor property on "
            f"rank {rank}: tensor property layout={props.layout}, local shard tensor "
            f"layout={t.layout}."
        )
    if not t.is_contiguous():
        raise ShardMismatchError(
            "Only torch.contiguous_format memory_format is currently supported "
            f"(rank {rank}, shard at offsets {list(m.shard_offsets)} is not contiguous)"
        )
    checks = (
        ("size", m.shard_sizes, list(t.size()), "local ShardMetadata"),
        ("pin_memory", props.pin_memory, t.is_pinned(), "tensor property"),
        ("device", _Placement(m).device(), t.device, "local ShardMetadata"),
        ("dtype", props.dtype, t.dtype, "tensor property"),
        ("requires_grad", props.requires_grad, t.requires_grad, "tensor property"),
    )
    for name, expected, actual, what in checks:
        if expected != actual:
            raise ShardMismatchError(
                f"Local shards' tensor {name} property is incompatible with {what} on rank "
                f"{rank}: {what} {name}={expected}, local shard tensor {name}={actual}."
            )


def _from_metadata(
    cls: type[ShardedTensor],
    local_shards: list[Shard],
    md: ShardedTensorMetadata,
    spec: ShardingSpec,
    process_group: Any,
) -> ShardedTensor:
    """The tensor of checked local shards and global metadata (placements name global
    ranks; the layout's ranks are the group's)."""
    group, mesh = resolve_group(process_group) if process_group is not None else (None, None)
    world = dist.get_world_size(group)
    blocks: dict[int, list[Block]] = {}
    for m in md.shards_metadata:
        if 0 in m.shard_sizes:
            continue
        rank = _group_rank(group, _Placement(m).rank())
        blocks.setdefault(rank, []).append(Block(m.shard_offsets, m.shard_sizes))
    layout = Layout(tuple(md.size), blocks, world)
    rank = dist.get_rank(group)
    held = {
        (tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)): s.tensor
        for s in local_shards
    }
    shards = [held[(b.offsets, b.sizes)] for b in layout.blocks_of(rank)]
    props = md.tensor_properties
    out = cls(
        layout,
        shards,
        rank,
        dtype=props.dtype,
        device=shards[0].device if shards else torch.device("cpu"),
        group=group,
        requires_grad=props.requires_grad,
        mesh=mesh,
    )
    out._legacy_spec = spec
    return out


def init_from_local_shards(
    local_shards: list[Shard],
    *global_size: Any,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """A legacy tensor from each rank's `Shard`s. Collective, as legacy: one all-gather
    of every rank's shard metadata, checked by legacy's own rules (placements, sizes,
    dtype, requires_grad, pin_memory, overlaps, coverage); a problem found on any rank
    is raised on every rank, as a ValueError (`ShardMismatchError`) like legacy's.
    A None in `global_size` is computed from the shards (legacy's row-wise recalculation)."""
    recalc = any(d is None for d in global_size)
    if recalc:
        global_size = tuple(0 if d is None else d for d in global_size)
    group = _default_group(process_group)
    me = dist.get_rank()
    problem: BaseException | None = None
    local_md = None
    try:
        size = _sizes(global_size)
        if recalc and len(local_shards) != 1:
            raise ShardMismatchError(
                f"rank {me}: a None in global_size needs exactly one shard per rank "
                f"(legacy's row-wise recalculation); it holds {len(local_shards)}"
            )
        if local_shards:
            local_md = build_metadata_from_local_shards(local_shards, size, me, group)
    except (InvalidTypeError, ShardMismatchError) as e:
        problem = e
    except (ValueError, AssertionError) as e:
        problem = ShardMismatchError(f"{e}")
    everyone = exchange(problem, local_md, process_group)
    try:
        global_md = build_global_metadata(everyone, recalc_metadata=recalc)
    except ValueError as e:
        raise ShardMismatchError(str(e)) from None
    if recalc:  # every rank holds one shard (checked in the exchange): one entry each
        local_shards[0].metadata = next(
            m for m in global_md.shards_metadata if _Placement(m).rank() == me
        )
    _check_rrefs(init_rrefs)
    spec = _infer_sharding_spec_from_shards_metadata(global_md.shards_metadata)
    return _from_metadata(ShardedTensor, local_shards, global_md, spec, process_group)


def _legacy_empty(
    cls: type[ShardedTensor],
    sharding_spec: Any,
    *size: Any,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    pin_memory: bool = False,
    memory_format: torch.memory_format = torch.contiguous_format,
    process_group: Any = None,
    init_rrefs: bool = False,
) -> ShardedTensor:
    """`ShardedTensor(spec, *size, ...)`: uninitialised shards on their placements'
    devices, with legacy's argument checks (ValueError; TypeError for sizes)."""
    if not isinstance(sharding_spec, ShardingSpec):
        raise InvalidArgumentError(f"Expecting ShardingSpec but got: {type(sharding_spec)}")
    sizes = _sizes(size)
    if layout != torch.strided:
        raise InvalidArgumentError("Only torch.strided layout is currently supported")
    if memory_format != torch.contiguous_format:
        raise InvalidArgumentError(
            "Only torch.contiguous_format memory_format is currently supported"
        )
    _check_rrefs(init_rrefs)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    group, mesh = resolve_group(process_group) if process_group is not None else (None, None)
    world = dist.get_world_size(group)
    full_layout = spec_layout(sharding_spec, tuple(sizes), world, group)
    rank = dist.get_rank(group)
    me = _global_rank(group, rank)
    md = sharding_spec.build_metadata(sizes, TensorProperties(dtype, layout, requires_grad))
    devices = {
        (tuple(m.shard_offsets), tuple(m.shard_sizes)): _Placement(m).device()
        for m in md.shards_metadata
        if _Placement(m).rank() == me
    }
    shards = [
        torch.empty(
            b.sizes, dtype=dtype, device=devices[(b.offsets, b.sizes)], pin_memory=pin_memory
        )
        for b in full_layout.blocks_of(rank)
    ]
    for shard in shards:
        shard.requires_grad_(requires_grad)
    out = cls(
        full_layout,
        shards,
        rank,
        dtype=dtype,
        device=shards[0].device if shards else _first_device(md, me),
        group=group,
        requires_grad=requires_grad,
        mesh=mesh,
    )
    out._legacy_spec = sharding_spec
    return out


def _first_device(md: ShardedTensorMetadata, me: int) -> torch.device:
    """A rank holding nothing: its zero-size chunk's device, else the CPU."""
    for m in md.shards_metadata:
        if _Placement(m).rank() == me:
            return _Placement(m).device()
    return torch.device("cpu")

"""`ShardedTensor`: a `torch.Tensor` subclass with a global shape, holding any
number of blocks per rank.

The class, its local view (this rank's shards and their blocks, the
`LocalShardsWrapper` accessors), and the dispatch of torch functions on it
(`__torch_function__` handlers, registered by function or by name).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

import torch

from ..errors import InvalidArgumentError, InvalidTypeError, UsageError
from ..layout import Block, Layout
from .checkpointable import Checkpointable
from .construction import PendingLayout, check_shards, filled_shards
from .pending import Arriving, Pending
from .provided import provided
from .provided_methods import ProvidedMethods

__all__ = [
    "AUTOGRAD_FUNCTIONS",
    "LocalView",
    "ShardedTensor",
    "handler_for",
    "register_function_handler",
    "register_named_function_handler",
    "torch_function",
    "unregister_function_handler",
]


# -----------------------------------------------------------------------------
# What one rank of a `ShardedTensor` holds: its blocks, shards, offsets, group.
# -----------------------------------------------------------------------------


class LocalView:
    """`ShardedTensor`'s view of this rank's part; the state is set by `ShardedTensor.__new__`."""

    __slots__ = ()

    _layout: Layout
    _rank: int
    # This rank's shards as stored; for a pending result (below) its parts, not its values.
    _local: list[torch.Tensor]
    # A reduction's result whose combine across ranks waits for first use (DTensor's
    # `Partial`), else None. Its layout is the result's (replicated); its values are
    # `_shards`, which combines it (collective) the first time they are read.
    _pending: Pending | None
    # A move posted with `async_op=True` whose messages have not been waited for, else
    # None: `_local` is allocated, its remote elements still in flight until `_shards`.
    _arriving: Arriving | None
    _group: Any
    # The DeviceMesh (or sub-mesh) the tensor was built on, else None: then its mesh is a
    # 1-d one over `_group`. Layout rank r is the mesh's row-major position r.
    _mesh: Any
    # Per mesh dimension, this rank's offset along the tensor dimension it shards (PhysicsNeMo's
    # `offsets()`), once known (set by `scatter_tensor`, `from_shard_tensor`, or computed).
    _mesh_offsets: tuple[int, ...] | None
    # The placements the tensor was built with (DTensor, ShardTensor, `from_local`), a hint
    # for `placements` where several express the layout; None: found from the layout.
    _placements: tuple[Any, ...] | None

    @property
    def _shards(self) -> list[torch.Tensor]:
        """This rank's shards, with their values: a pending result is combined across
        the group first (once, collectively; every rank of the group reads them alike);
        the messages of a move posted with `async_op=True` are waited for."""
        if self._arriving is not None:
            self._landed()
        pending = self._pending
        if pending is None:
            return self._local
        combine = provided("combine_pending")
        local = pending.values(lambda record: combine(self, record))
        self._local = local  # type: ignore[misc]  # set on the instance
        self._pending = None  # type: ignore[misc]
        return local

    @_shards.setter
    def _shards(self, shards: list[torch.Tensor]) -> None:
        if self._arriving is not None:
            self._landed()  # nothing is left writing into the shards replaced
        self._local = shards  # type: ignore[misc]  # set on the instance
        self._pending = None  # type: ignore[misc]

    def _landed(self) -> None:
        """Wait for the messages of the move posted into the shards (`async_op=True`)."""
        arriving = self._arriving
        if arriving is not None:
            arriving.wait()
            self._arriving = None  # type: ignore[misc]  # set on the instance

    @property
    def pending_reduce(self) -> str | None:
        """For a reduction's result whose combine across ranks has not run (DTensor's
        `Partial`): "sum", "max" or "min"; else None. Reading its values runs it."""
        pending = self._pending
        return None if pending is None or pending.done else pending.op

    @property
    def _held(self) -> list[torch.Tensor]:
        """What this rank holds, read without a collective: the values, or while the
        tensor is pending its parts (the same shapes, dtype and device)."""
        pending = self._pending
        if pending is None or pending.done:
            return self._shards  # known: no collective
        return pending.parts

    @property
    def layout_spec(self) -> Layout:
        """The global `Layout` (named so to leave `Tensor.layout` alone). For a tensor
        built by `from_local_blocks`, learned on first access: collective then."""
        layout = self._layout
        return layout.learn() if isinstance(layout, PendingLayout) else layout

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def group(self) -> Any:
        """The process group every collective on this tensor runs over (None: the default
        group); for a tensor on a (sub-)mesh, a group of exactly the mesh's ranks."""
        return self._group

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The shape of the tensor's device mesh: its mesh's, else `(world size,)`."""
        if self._mesh is not None:
            return tuple(int(n) for n in self._mesh.shape)
        return (self._layout.world_size,)

    @property
    def device_mesh(self) -> Any:
        """DTensor's `device_mesh`: the mesh the tensor was built on, else a 1-d mesh over
        its process group (`DeviceMesh.from_group`, no communication)."""
        return provided("device_mesh")(self)

    @property
    def placements(self) -> tuple[Any, ...]:
        """DTensor's `placements` of the layout on `device_mesh`: `Shard(d)` (uneven sizes
        allowed, as PhysicsNeMo's) or `Replicate()` per mesh dimension; `LayoutError`,
        naming the layout, where no placements express it."""
        return provided("placements")(self)

    @property
    def local_blocks(self) -> tuple[Block, ...]:
        return self._layout.blocks_of(self._rank)

    def local_shards(self) -> list[torch.Tensor]:
        """The live shard tensors (in-place edits are visible), in block order."""
        return self._shards

    def local_offsets(self) -> list[torch.Size]:
        return [torch.Size(b.offsets) for b in self.local_blocks]

    def local_sizes(self) -> list[torch.Size]:
        return [torch.Size(b.sizes) for b in self.local_blocks]

    def offsets(self, mesh_dim: int | None = None) -> tuple[int, ...] | int:
        """PhysicsNeMo's `ShardTensor.offsets`: per mesh dimension, this rank's offset along
        the tensor dimension it shards (0 where it replicates); one int for `mesh_dim`.

        Computed from the layout and `mesh_shape` (no communication); a layout no
        placements express raises `LayoutError` naming it. `local_offsets()` gives
        every tensor's block offsets per tensor dimension.
        """
        offsets = self._mesh_offsets
        if offsets is None:
            offsets = provided("mesh_offsets")(self)
            self._mesh_offsets = offsets  # type: ignore[misc]  # set on the instance
        if mesh_dim is None:
            return offsets
        return offsets[mesh_dim]

    def is_empty_shard(self) -> bool:
        """True when this rank holds no element of the tensor."""
        return all(b.is_empty() for b in self.local_blocks)

    def is_pinned(self, device: Any = None) -> bool:
        return bool(self._held) and all(s.is_pinned() for s in self._held)

    def _get_tensor_size_bytes(self) -> int:
        """Bytes of this rank's shards (`LocalShardsWrapper`'s, read by DCP's planners)."""
        return sum(s.nelement() * s.element_size() for s in self._held)


# -----------------------------------------------------------------------------
# Function-level handlers: `torch.*` / `torch.nn.functional` calls on ShardedTensors.
#
# `register_op` (in `shardwise.ops`) acts on aten ops, after autograd and
# decomposition; some computations are only expressible one level up, where
# `F.softmax(x, dim=1)` or `torch.sum(x)` is still one call: a softmax along an
# unsharded dimension is per shard, a sum over every element is one collective.
# These handlers are PhysicsNeMo's `ShardTensor.register_function_handler` /
# `register_named_function_handler`, with its calling convention,
# `handler(func, types, args, kwargs)`, so PhysicsNeMo handlers port unchanged
# (they receive plain tensors as they are; PhysicsNeMo promotes them to
# replicated DTensors first).
#
# `ShardedTensor.__torch_function__` asks `handler_for(func)` first (by object,
# then by `str(func)` for `torch.library.custom_op`s, as PhysicsNeMo); without a
# handler the call goes on exactly as before, to `__torch_dispatch__`. The
# registry lives in the tensor layer because the type consults it; it imports
# nothing above.
# -----------------------------------------------------------------------------

# handler(func, types, args, kwargs) -> result, as PhysicsNeMo's ShardTensor calls it.
FunctionHandler = Callable[[Any, tuple, tuple, dict], Any]

_BY_FUNCTION: dict[Any, FunctionHandler] = {}

_BY_NAME: dict[str, FunctionHandler] = {}


def register_function_handler(func: Callable[..., Any], handler: FunctionHandler) -> None:
    """Run `handler(func, types, args, kwargs)` whenever `func` is called on a ShardedTensor.

    `func` is the Python-level callable (`torch.nn.functional.gelu`,
    `torch.sum`, `torch.Tensor.sum`, ...); its result is returned as is.
    """
    if not callable(func) or isinstance(func, str):
        raise InvalidTypeError(
            f"register_function_handler needs the function itself (e.g. torch.nn.functional.gelu), "
            f"got {func!r}; use register_named_function_handler for a name"
        )
    if not callable(handler):
        raise InvalidTypeError(f"the handler for {func!r} must be callable, got {handler!r}")
    _BY_FUNCTION[func] = handler


def register_named_function_handler(func_name: str, handler: FunctionHandler) -> None:
    """As `register_function_handler`, keyed by `str(func)`: a `torch.library.custom_op`
    called as `torch.ops.mylib.op(...)` is matched by its name, `"mylib.op.default"`."""
    if not isinstance(func_name, str):
        raise InvalidTypeError(
            f"register_named_function_handler needs a name such as 'mylib.op.default', "
            f"got {func_name!r}; use register_function_handler for a function"
        )
    if not callable(handler):
        raise InvalidTypeError(f"the handler for {func_name!r} must be callable, got {handler!r}")
    _BY_NAME[func_name] = handler


def unregister_function_handler(func: Callable[..., Any] | str) -> None:
    """Remove the handler registered for `func` (a function, or a name); `KeyError` if none."""
    registry: dict[Any, FunctionHandler] = _BY_NAME if isinstance(func, str) else _BY_FUNCTION
    try:
        del registry[func]
    except KeyError:
        raise KeyError(
            f"no function handler registered for {func!r}; register_function_handler / "
            f"register_named_function_handler install one"
        ) from None


def handler_for(func: Any) -> FunctionHandler | None:
    """The handler for `func`: by the object, then by its name; None without one."""
    if not (_BY_FUNCTION or _BY_NAME):
        return None
    try:
        handler = _BY_FUNCTION.get(func)
    except TypeError:  # an unhashable callable is never registered
        handler = None
    if handler is None and _BY_NAME:
        handler = _BY_NAME.get(str(func))
        if handler is None and isinstance(func, torch._ops.OpOverloadPacket):
            handler = _BY_NAME.get(f"{func}.default")  # torch.ops.mylib.op(...) called bare
    return handler


def torch_function(func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`ShardedTensor.__torch_function__`: a registered handler, else `shardwise.ops`'
    (plain parameters promoted, `sum`/`mean` with a layout-keeping backward), which
    runs `func` with torch functions disabled so that it reaches `__torch_dispatch__`
    (as for DTensor: no subclass wrapping of results at this level)."""
    kwargs = kwargs or {}
    handler = handler_for(func)
    if handler is not None:
        return handler(func, types, args, kwargs)
    if torch.is_grad_enabled() and (
        func in AUTOGRAD_FUNCTIONS or _plain_requiring_grad(args) or _plain_requiring_grad(kwargs)
    ):
        return provided("torch_function")(func, types, args, kwargs)
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)


# What reads a tensor's metadata and nothing else: its getters (`x.shape` calls
# `__torch_function__` with the descriptor's `__get__`) and `size`/`dim`/`numel`.
_METADATA = frozenset(
    [
        getattr(torch.Tensor, name).__get__
        for name in (
            "shape",
            "ndim",
            "dtype",
            "device",
            "layout",
            "requires_grad",
            "is_leaf",
            "grad_fn",
            "is_cuda",
            "is_meta",
            "is_sparse",
            "is_quantized",
            "itemsize",
        )
    ]
    + [torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel]
)


# Functions `shardwise.ops` handles at the autograd level (`sum`, `mean`: a backward that
# keeps the layout); it fills the set when imported. Any other call goes straight on
# unless a plain operand requires grad (then `ops` promotes it).
AUTOGRAD_FUNCTIONS: set[Any] = set()


def _plain_requiring_grad(values: Any) -> bool:
    items = values.values() if isinstance(values, dict) else values
    for x in items:
        if isinstance(x, (list, tuple)):
            if _plain_requiring_grad(x):
                return True
        elif (
            isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor) and x.requires_grad
        ):  # a ShardedTensor's own `requires_grad` would come back here: never asked
            return True
    return False


# -----------------------------------------------------------------------------
# `ShardedTensor`: a `torch.Tensor` whose shape is global and whose data is
# this rank's blocks of a `Layout`.
#
# The wrapper holds no storage of its own; `__torch_dispatch__` sends each op to
# `shardwise.ops`, which applies it shard by shard. Nothing in this module
# communicates: building from a layout is local, and the collective and
# conversion methods call the code `shardwise.comm` and `shardwise.interop`
# install in `shardwise.tensor.provided` (they sit above this module).
# -----------------------------------------------------------------------------


class ShardedTensor(LocalView, ProvidedMethods, Checkpointable, torch.Tensor):
    """A tensor split into blocks held by the ranks of a group.

    `shape`, `dtype` and `device` are those of the global tensor; the data on
    this rank is `local_shards()`, one tensor per block of
    `layout_spec.blocks_of(rank)`, in that order. Build one with
    `from_layout`, `empty`, `zeros` or `full`. Its collective and conversion
    methods are `ProvidedMethods`, what this rank holds `LocalView`.
    """

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # A function handler (shardwise.register_function_handler) if one is registered,
        # otherwise straight to __torch_dispatch__ (as for DTensor). Reading `shape`,
        # `dtype`, ... goes straight on unless a handler claims it: op rules read them
        # many times a call (a tenth of a small op's time through the general path).
        if func in _METADATA and func not in _BY_FUNCTION:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})
        return torch_function(func, types, args, kwargs)

    # PhysicsNeMo's ShardTensor registration classmethods, under the same names.
    register_function_handler = staticmethod(register_function_handler)
    register_named_function_handler = staticmethod(register_named_function_handler)

    @staticmethod
    def __new__(
        cls,
        layout: Layout,
        shards: list[torch.Tensor],
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: Any = None,
        requires_grad: bool = False,
        mesh: Any = None,
    ) -> ShardedTensor:
        # Internal: callers go through from_layout, which validates. `group` is the process
        # group of `mesh`'s ranks when a mesh is given (`shardwise.comm.resolve_group`).
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            layout.global_shape,
            dtype=dtype,
            device=device,
            requires_grad=requires_grad,
        )
        out._layout = layout
        out._rank = rank
        out._local = shards
        out._pending = None
        out._arriving = None
        out._group = group
        out._mesh = mesh
        out._mesh_offsets = None
        out._placements = None
        return out

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_local_blocks(
        cls,
        shards: Sequence[torch.Tensor],
        offsets: Sequence[Sequence[int]],
        global_shape: Sequence[int],
        *,
        group: Any = None,
        check: str = "later",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> ShardedTensor:
        """This rank's shards at their global `offsets`, built with no communication,
        as `LocalShardsWrapper(shards, offsets)` is: no process group need exist.

        Why: TorchRec and FSDP build their wrappers where each rank knows only
        its own pieces (and DCP saves them from those alone); `from_local_shards`
        needs every rank at once, `from_layout` the whole layout. Shards may be
        strided views (a column slice of a bigger tensor); they are held, not copied.

        The tensor knows its blocks and the global shape; the global layout is
        learned, checked as `from_local_shards` checks it (one all-gather of
        block metadata over `group`; a problem raises the same error on every
        rank), the first time an operation spanning ranks needs it
        (`redistribute`, `full_tensor`, `gather`, op rules, `layout_spec`,
        `learn_layout()`), once for the tensor and every result of its local ops.
        `check="now"` learns it here (collective); "later" (default) when
        needed, or never if nothing needs it. What one rank may call alone never
        learns: `repr`, `local_shards()`, `local_offsets()`, `local_sizes()`,
        `local_chunks`, `local_blocks`, `is_empty_shard()`, the DCP hooks and
        `to_dtensor` (over `LocalShardsWrapper`).

        `dtype` / `device` are needed only on a rank that holds no shard (learning
        checks that the ranks agree). Learning reads only what is global, so some
        calls that look local learn too: `torch.equal` of two tensors built
        separately, `mesh_shape`, `placements`, `offsets()`.

        A problem with this rank's own input raises here, on this rank only. With
        no process group initialised the tensor is rank 0's. `group`: a
        ProcessGroup or None (the default group); see `shardwise.comm.from_local_blocks`.
        """
        if check not in ("now", "later"):
            raise InvalidArgumentError(
                f"check must be 'now' (learn the layout here, collectively) or 'later' (when "
                f"an operation needs it), got {check!r}"
            )
        out = provided("from_local_blocks")(
            shards, offsets, global_shape, group, dtype=dtype, device=device
        )
        if check == "now":
            out.learn_layout()
        return out

    def learn_layout(self) -> Layout:
        """The global layout; for a tensor built by `from_local_blocks` and not learned yet,
        learned now. Collective then (every rank of its group must call it)."""
        return self.layout_spec

    @property
    def is_layout_learned(self) -> bool:
        """False for a tensor built by `from_local_blocks` whose layout is not learned yet."""
        layout = self._layout
        return not isinstance(layout, PendingLayout) or layout.is_learned

    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        shards: Sequence[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool | None = None,
    ) -> ShardedTensor:
        """Wrap this rank's shards, one per block of `layout.blocks_of(rank)`.

        No communication: every rank calls it with its own shards, and the
        caller vouches that the ranks agree on `layout`. `dtype` / `device`
        are needed only on a rank that holds no shard. The rank is `rank`, or
        this process's rank in `group` (or the default group), or 0. `group`
        is a ProcessGroup or a DeviceMesh / sub-mesh (layout rank r = its
        row-major position r; for an n-d sub-mesh the first call on its ranks
        makes its group, collectively over them).
        """
        mesh = None
        if group is not None:
            group, mesh = provided("resolve_group")(group)
        if rank is None:
            rank = provided("current_rank")(group, layout)
        shards = list(shards)
        dtype, device = check_shards(layout, shards, rank, dtype, device, ShardedTensor)
        if requires_grad is None:
            requires_grad = any(s.requires_grad for s in shards)
        return cls(
            layout,
            shards,
            rank,
            dtype=dtype,
            device=device,
            group=group,
            requires_grad=requires_grad,
            mesh=mesh,
        )

    @classmethod
    def empty(
        cls,
        layout: Layout,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        """Uninitialised shards for this rank's blocks (default dtype as `torch.empty`)."""
        return cls._filled(torch.empty, (), layout, dtype, device, group, rank, requires_grad)

    @classmethod
    def zeros(
        cls,
        layout: Layout,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        return cls._filled(torch.zeros, (), layout, dtype, device, group, rank, requires_grad)

    @classmethod
    def full(
        cls,
        layout: Layout,
        fill_value: Any,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        rank: int | None = None,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        """Like `torch.full`: the dtype is inferred from `fill_value` when not given."""
        if dtype is None:
            dtype = torch.full((), fill_value).dtype
        return cls._filled(
            torch.full, (fill_value,), layout, dtype, device, group, rank, requires_grad
        )

    @classmethod
    def _filled(
        cls,
        factory: Any,
        extra: tuple[Any, ...],
        layout: Layout,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        group: Any,
        rank: int | None,
        requires_grad: bool,
    ) -> ShardedTensor:
        if rank is None:
            rank = provided("current_rank")(_process_group(group), layout)
        shards, dtype, device = filled_shards(factory, extra, layout, rank, dtype, device)
        return cls.from_layout(
            layout,
            shards,
            dtype=dtype,
            device=device,
            group=group,
            rank=rank,
            requires_grad=requires_grad,
        )

    def _with_shards(
        self,
        shards: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> ShardedTensor:
        """A new ShardedTensor of this layout, rank and group around `shards`."""
        out = self._with_layout(self._layout, shards, dtype=dtype, device=device)
        # same layout, rank and mesh: same mesh offsets and placements
        out._mesh_offsets, out._placements = self._mesh_offsets, self._placements
        return out

    def _with_layout(
        self,
        layout: Layout,
        shards: list[torch.Tensor],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> ShardedTensor:
        """A new ShardedTensor of `layout` on this tensor's rank and group around `shards`
        (an op's result whose blocks differ from its input's)."""
        if shards:
            dtype, device = shards[0].dtype, shards[0].device
        # the same group and mesh; offsets and placements belong to the old layout
        return ShardedTensor(
            layout,
            shards,
            self._rank,
            dtype=dtype or self.dtype,
            device=device or self.device,
            group=self._group,
            mesh=self._mesh,
        )

    # Shadows torch.Tensor.gather (so not in `ProvidedMethods`: mypy checks bases agree).
    # The legacy ShardedTensor's collective, or torch's indexing op by its arguments.
    def gather(  # type: ignore[override]
        self, dst: int = 0, out: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """The whole tensor on rank `dst`, None on the others. Collective.

        With `out` (on `dst` only, as the legacy API) it is filled and returned.
        `st.gather(dim, index)` with an integer `index` on a non-integer tensor, or
        any of `dim=` / `index=` / `sparse_grad=`, is `torch.gather` (on every rank);
        on an integer tensor the positional form is the legacy collective."""
        torch_form = bool(kwargs)  # dim=, index=, sparse_grad=: torch's names
        index = kwargs.pop("index", None)
        if "dim" in kwargs:
            dst = kwargs.pop("dim")
        if index is None and isinstance(out, torch.Tensor) and _an_index(out, self):
            index, out = out, None
        if index is not None or torch_form:  # torch's own TypeError for a missing index
            if out is not None:
                kwargs["out"] = out
            return torch.gather(self, dst, index, **kwargs)
        if out is None:
            return provided("gather")(self, dst)
        return provided("gather_into")(self, dst, out)

    # -- ops, printing, pickling ---------------------------------------------

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # Below autograd nothing is for `__torch_function__` to decide, and the rules read
        # `shape`/`dtype`/`device` many times a call: without it each read is a Python call.
        with torch._C.DisableTorchFunctionSubclass():
            return provided("dispatch")(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        # never combines a pending result: one rank may print alone
        pending = self.pending_reduce
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, rank={self._rank}, layout={self._layout}, "
            f"local_shards={len(self._held)}"
            + (f", pending={pending!r})" if pending is not None else ")")
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # The group and mesh are process-local and not pickled: a loaded tensor has none.
        if self.pending_reduce is not None:
            # its values need every rank (often only rank 0 pickles: it would wait alone),
            # and its parts alone are not its value
            raise UsageError(
                f"rank {self._rank}: this ShardedTensor of shape {tuple(self.shape)} is a "
                f"reduction's result whose {self.pending_reduce} across ranks has not run yet "
                f"(pending_reduce={self.pending_reduce!r}); read it on every rank first "
                f"(st.full_tensor(), st.local_shards()), then pickle or torch.save it"
            )
        return (
            _rebuild,
            (
                self._layout,
                self._shards,
                self._rank,
                self.dtype,
                str(self.device),
                self.requires_grad,
            ),
        )

    def requires_grad_(self, requires_grad: bool = True) -> ShardedTensor:
        """As `LocalShardsWrapper.requires_grad_`: the flag is set on the tensor (the
        autograd leaf) and on its shards that are leaves (a view's flag follows its base).

        Ops run shard by shard below autograd and build no graph on shards, so
        the shards' flag only tells code that holds them (`local_shards()`, a
        DCP planner reading `requires_grad`) what the tensor is."""
        super().requires_grad_(requires_grad)
        for shard in self._held:
            if shard.is_leaf:
                shard.requires_grad_(requires_grad)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedTensor:
        with torch.no_grad():
            out = self._with_shards([s.clone() for s in self._held])
            if self.pending_reduce is not None:  # a copy of the parts, combined on its own
                out._pending = Pending(self.pending_reduce, out._local)
        out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out


def _process_group(group: Any) -> Any:
    """The process group of what a caller passed as `group` (a mesh's own group)."""
    return provided("resolve_group")(group)[0] if group is not None else None


def _rebuild(
    layout: Layout,
    shards: list[torch.Tensor],
    rank: int,
    dtype: torch.dtype,
    device: str,
    requires_grad: bool,
) -> ShardedTensor:
    return ShardedTensor(
        layout,
        shards,
        rank,
        dtype=dtype,
        device=torch.device(device),
        requires_grad=requires_grad,
    )


def _an_index(t: torch.Tensor, st: ShardedTensor) -> bool:
    """Whether `t`, passed where the legacy `gather` takes `out`, is `torch.gather`'s
    index: integers, and not what a legacy `out` is (a plain tensor of the tensor's
    global shape and dtype). Only an integer plain tensor of exactly that shape, for an
    integer ShardedTensor, is taken as `out`."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return False
    return isinstance(t, ShardedTensor) or t.dtype != st.dtype or t.shape != st.shape

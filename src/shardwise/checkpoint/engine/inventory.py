"""What one rank holds of a flattened state dict, as plain data the ranks exchange
once, and the adapters that describe other libraries' values.

Every value of a state dict becomes pieces (a tensor's blocks with their
global offsets) or an object; values of other libraries (DTensor,
PhysicsNeMo's ShardTensor, Megatron-Core's) are described by a registered
`ValueAdapter`, chosen by the value's type, so the engine never asks what a
value is.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.utils import find_tensor_shard

from ...comm.agreement import exchange, odd_ranks, require_same
from ...errors import InvalidArgumentError, InvalidTypeError
from ...tensor import ShardedTensor
from ..format import dtype_name

__all__ = [
    "Entry",
    "Held",
    "LocalPieces",
    "Piece",
    "Route",
    "Serialized",
    "Targets",
    "ValueAdapter",
    "adapter_of",
    "adapted_for_load",
    "adapted_for_save",
    "dcp_pieces",
    "describe",
    "held_adapted",
    "is_plain_tensor",
    "pieces_in_place",
    "pieces_of",
    "register_route",
    "register_value_adapter",
    "require_same_adapted",
    "route_named",
    "route_of",
    "routes",
    "serialize_objects",
    "unregister_value_adapter",
]


# -----------------------------------------------------------------------------
# Other libraries' sharded values in `swc.save` / `swc.load` state dicts.
#
# A client library's sharded type (PhysicsNeMo's `ShardTensor`, Megatron-Core's
# wrappers) is swapped for a ShardedTensor before DCP sees the state dict, and
# loaded data is written back after. The built-in adapters
# (`checkpoint.physicsnemo`, `checkpoint.megatron`) register when
# `shardwise.checkpoint` is imported; neither imports its library first.
# -----------------------------------------------------------------------------

Finish = Callable[[], None]


TypeName = type | str  # a class, or "module.QualName" of one its library need not import


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _type_names(owner: str, types: TypeName | tuple[TypeName, ...]) -> tuple[str, ...]:
    """`types` as qualified class names, each checked (one validator for adapters and routes)."""
    given = types if isinstance(types, tuple) else (types,)
    names = []
    for t in given:
        if isinstance(t, type):
            names.append(_qualified(t))
        elif isinstance(t, str) and "." in t.strip(".") and " " not in t:
            names.append(t)
        else:
            raise InvalidArgumentError(
                f"{owner}: types must be classes or qualified class names "
                f"('package.module.Class'), not {t!r}"
            )
    if not names:
        raise InvalidArgumentError(f"{owner}: give at least one type it takes")
    return tuple(names)


@dataclass(frozen=True)
class ValueAdapter:
    """How values of the classes `types` (their subclasses too) go through a
    checkpoint, in one of two ways. A value's adapter is found by its class alone
    (a registry, not a question asked of every adapter), so a plain state dict
    runs no client's code.

    Converted: `for_save(value)` gives what the engine saves (usually a
    ShardedTensor sharing the value's storage); `for_load(value)` gives the target
    the engine fills and a `finish()` that copies the loaded data into `value`
    (None when the target shares `value`'s storage). Both are collective when the
    conversion needs the global layout, so every rank must hold the same such keys
    (agreed at the API edge, `held_adapted`).

    Described in place: `pieces(value)` gives the (tensor, offsets, sizes) boxes
    this rank holds of the value's global tensor, read and written where they are
    (DTensor, `LocalShardsWrapper`). Nothing collective, so nothing to agree on.
    Only tensor classes can be described in place: the engine treats any other
    value as an object, so `types` must be `torch.Tensor` subclasses, given as
    classes (checked when the adapter is made).
    """

    name: str
    types: TypeName | tuple[TypeName, ...]
    for_save: Callable[[Any], Any] | None = None
    for_load: Callable[[Any], tuple[Any, Finish | None]] | None = None
    hint: str = ""  # added to the error when ranks hold different values of this kind
    pieces: Callable[[Any], list[Any] | None] | None = None

    def __post_init__(self) -> None:
        converts = self.for_save is not None and self.for_load is not None
        if converts == (self.pieces is not None) or (self.for_save is None) != (
            self.for_load is None
        ):
            raise InvalidArgumentError(
                f"value adapter {self.name!r}: give for_save and for_load (converted), "
                "or pieces (described in place), not both"
            )
        names = _type_names(f"value adapter {self.name!r}", self.types)
        if self.pieces is not None:
            given = self.types if isinstance(self.types, tuple) else (self.types,)
            odd = [t for t in given if not (isinstance(t, type) and issubclass(t, torch.Tensor))]
            if odd:
                shown = odd[0].__name__ if isinstance(odd[0], type) else repr(odd[0])
                raise InvalidArgumentError(
                    f"value adapter {self.name!r}: pieces= describes tensors in place, and "
                    f"{shown} is not a torch.Tensor subclass given as a class (a save would "
                    "pickle such a value as an object and a load refuse it); convert it with "
                    "for_save and for_load instead"
                )
        object.__setattr__(self, "_names", names)

    def takes(self, value: Any) -> bool:
        """Whether `value`'s class, or one of its bases, is one of `types`."""
        return any(_qualified(c) in self._names for c in type(value).__mro__)  # type: ignore[attr-defined]


class Targets(NamedTuple):
    """What a route hands the load engine: the flat targets it fills (`flat`), what
    to run after (`finishers`), the keys that may load only their overlap with a
    stored shape of the same rank (`shape_mismatch`), and the keys that may be
    missing from the checkpoint (`optional`: key -> a key whose presence excuses it,
    None when nothing needs to be), and this rank's problem making them, which the
    load's first exchange raises on every rank."""

    flat: dict[str, Any]
    finishers: list[Finish]
    shape_mismatch: frozenset[str] = frozenset()
    optional: dict[str, str | None] = {}
    problem: BaseException | None = None


@dataclass(frozen=True)
class Route:
    """A client that saves and loads a whole state dict its own way once any of its
    values (`types`, subclasses too) is in it, e.g. Megatron-Core by Megatron key.
    `save_targets(state_dict, group)` gives the flat state dict the engine saves;
    `load_targets(state_dict, group)` the `Targets` it fills. Both collective.
    Found by class, like adapters."""

    name: str
    types: TypeName | tuple[TypeName, ...]
    save_targets: Callable[[Any, Any], dict[str, Any]]
    load_targets: Callable[[Any, Any], Targets]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_names", _type_names(f"route {self.name!r}", self.types))


_REGISTERED: list[ValueAdapter] = []
_ROUTES: list[Route] = []
# class -> its adapter (None: none), filled on first sight, emptied on (un)registering
_BY_CLASS: dict[type, ValueAdapter | None] = {}
_ROUTE_OF_CLASS: dict[type, Route | None] = {}


def _forget() -> None:
    _BY_CLASS.clear()
    _ROUTE_OF_CLASS.clear()


def register_value_adapter(adapter: ValueAdapter) -> None:
    """Make `swc.save`/`swc.load` convert or describe values of `adapter.types`
    (the first registered adapter whose type is nearest in a value's class wins)."""
    if any(a.name == adapter.name for a in _REGISTERED):
        raise InvalidArgumentError(f"a value adapter named {adapter.name!r} is already registered")
    _REGISTERED.append(adapter)
    _forget()


def unregister_value_adapter(name: str) -> None:
    """Remove the adapter registered under `name`."""
    for i, a in enumerate(_REGISTERED):
        if a.name == name:
            del _REGISTERED[i]
            _forget()
            return
    raise KeyError(f"no value adapter named {name!r}")


def register_route(route: Route) -> None:
    """Make state dicts holding values of `route.types` go by `route`."""
    if any(r.name == route.name for r in _ROUTES):
        raise InvalidArgumentError(f"a route named {route.name!r} is already registered")
    _ROUTES.append(route)
    _forget()


def routes() -> list[Route]:
    """The registered routes, in registration order (every rank registers alike)."""
    return list(_ROUTES)


def route_named(name: str) -> Route:
    for route in _ROUTES:
        if route.name == name:
            return route
    raise KeyError(f"no route named {name!r}")


def _nearest(cls: type, found: list[Any]) -> Any:
    """The first of `found` (adapters or routes) naming `cls` or its nearest base."""
    for base in cls.__mro__:
        name = _qualified(base)
        for item in found:
            if name in item._names:
                return item
    return None


def _seen(cache: dict[type, Any], cls: type, found: list[Any]) -> Any:
    """`_nearest(cls, found)`, kept in `cache`: one dict lookup once a class was seen."""
    try:
        return cache[cls]
    except KeyError:
        item = cache[cls] = _nearest(cls, found)
        return item


def adapter_of(value: Any) -> ValueAdapter | None:
    """The adapter registered for `value`'s class."""
    return _seen(_BY_CLASS, type(value), _REGISTERED)


def route_of(value: Any) -> Route | None:
    """The route of the first value in `value` (mappings, lists and tuples walked)
    whose class has one; None for a plain state dict, which asks no client."""
    cls = type(value)
    if cls in _NEVER_ADAPTED:
        return None
    if isinstance(value, Mapping):
        return next((r for r in map(route_of, value.values()) if r is not None), None)
    if isinstance(value, (list, tuple)):
        return next((r for r in map(route_of, value) if r is not None), None)
    return _seen(_ROUTE_OF_CLASS, cls, _ROUTES)


def _adapter_for(value: Any) -> ValueAdapter | None:
    """The converting adapter of `value`, if its adapter converts."""
    adapter = adapter_of(value)
    return adapter if adapter is not None and adapter.pieces is None else None


def pieces_in_place(value: Any) -> list[Any] | None:
    """The boxes this rank holds of `value` by its in-place adapter
    (`ValueAdapter.pieces`); None when it has none."""
    adapter = adapter_of(value)
    if adapter is not None and adapter.pieces is not None:
        return adapter.pieces(value)
    return None


def _children(container: Any) -> list[tuple[Any, Any]]:
    if isinstance(container, MutableMapping):
        return list(container.items())
    if isinstance(container, list):
        return list(enumerate(container))
    return []


@dataclass(frozen=True)
class _Leaf:
    path: tuple[Any, ...]
    container: Any
    key: Any
    value: Any
    adapter: ValueAdapter


# Values no client converts: plain tensors and shardwise's own, skipped by type alone.
_NEVER_ADAPTED = frozenset({torch.Tensor, torch.nn.Parameter, ShardedTensor})


def _leaves(container: Any, path: tuple[Any, ...] = ()) -> list[_Leaf]:
    """Adapted values (dicts and lists walked, as DCP walks them), in an order every
    rank shares: adapters may be collective, one collective per value."""
    found = []
    for key, value in _children(container):
        if type(value) in _NEVER_ADAPTED:  # most of a state at scale: no matcher asked
            continue
        if isinstance(value, (MutableMapping, list)):
            found.extend(_leaves(value, path + (key,)))
        elif (adapter := _adapter_for(value)) is not None:
            found.append(_Leaf(path + (key,), container, key, value, adapter))
    return sorted(found, key=lambda leaf: tuple(map(str, leaf.path)))


def held_adapted(state_dict: Any, statefuls: tuple[str, ...] = ()) -> tuple[Any, ...]:
    """What this rank holds of adapted values (dotted path, adapter) and top-level
    `Stateful` keys: what every rank must hold alike, exchanged at the API edge."""
    mine = tuple((".".join(map(str, leaf.path)), leaf.adapter.name) for leaf in _leaves(state_dict))
    return mine + tuple((key, "Stateful") for key in statefuls)


def require_same_adapted(everyone: list[tuple[Any, ...]]) -> None:
    """Refuse, naming ranks, unless every rank's `held_adapted` is the same: the
    per-value collectives of the adapters would pair one rank's value with another's.
    `everyone` came from one exchange, so every rank raises the same message."""
    ref, odd = odd_ranks(everyone)
    if odd:
        theirs = everyone[odd[0]]
        differ = sorted(set(theirs) ^ set(everyone[ref]))
        kinds = sorted({a for _, a in differ})
        first, _adapter = differ[0]
        hints = {a.name: a.hint for a in _REGISTERED}
        hint = "".join(f"; {hints[k]}" for k in kinds if hints.get(k))
        require_same(
            everyone,
            f"the {', '.join(kinds)} values they hold (first difference: '{first}')",
            shown=lambda held: f"{len(held)} of them",
            verb="held",
            fix="every rank must hold every such value, under the same key (a rank holding "
            f"nothing of it passes an empty one){hint}",
        )


def _agree_on(
    state_dict: Any,
    group: Any,
    problem: BaseException | None = None,
    statefuls: tuple[str, ...] = (),
) -> None:
    """`require_same_adapted` over one exchange of its own (for callers that did not
    agree at their edge); `problem`, this rank's failure so far, rides on it."""
    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise problem
        return
    require_same_adapted(exchange(problem, held_adapted(state_dict, statefuls), group))


def adapted_for_save(
    state_dict: Any,
    group: Any = None,
    problem: BaseException | None = None,
    *,
    agreed: bool = False,
) -> Any:
    """A copy of the containers of `state_dict` (dicts and lists, as DCP walks
    them) with adapted leaves; the caller's containers are left as they are.
    Collective when distributed: one small exchange, which also raises `problem`,
    this rank's own failure so far, on every rank, unless the caller `agreed`
    already (`require_same_adapted` over its own exchange); then the adapters'
    own collectives only."""
    if not agreed:
        _agree_on(state_dict, group, problem)
    leaves = _leaves(state_dict)
    if not leaves:  # nothing to replace: the caller's containers serve as they are
        return state_dict
    copies: dict[int, Any] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, MutableMapping):
            out: Any = {k: copy(v) for k, v in value.items()}
        elif isinstance(value, list):
            out = [copy(v) for v in value]
        else:
            return value
        copies[id(value)] = out
        return out

    root = copy(state_dict)
    for leaf in leaves:
        assert leaf.adapter.for_save is not None  # `_leaves` holds converting adapters only
        copies[id(leaf.container)][leaf.key] = leaf.adapter.for_save(leaf.value)
    return root


class adapted_for_load:
    """Context manager: inside, `state_dict`'s adapted leaves are replaced in place
    by load targets (DCP writes loaded objects into the caller's own containers);
    `finish()` copies loaded data into the original values; leaving restores them.
    Collective when distributed (one small exchange, none when the caller `agreed`)."""

    def __init__(
        self,
        state_dict: Any,
        group: Any = None,
        problem: BaseException | None = None,
        statefuls: tuple[str, ...] = (),
        *,
        agreed: bool = False,
    ) -> None:
        self.state_dict = state_dict
        self.agreed = agreed
        self.group = group
        self.problem, self.statefuls = problem, statefuls
        self._swapped: list[tuple[Any, Any, Any, Any]] = []  # container, key, original, target
        self._finishers: list[Finish] = []

    def __enter__(self) -> adapted_for_load:
        try:
            self._swap(self.state_dict)
        except BaseException:  # __exit__ does not run when __enter__ raises: restore here
            self._restore()
            raise
        return self

    def _swap(self, container: Any) -> None:
        if not self.agreed:
            _agree_on(container, self.group, self.problem, self.statefuls)
        leaves = _leaves(container)
        for leaf in leaves:
            assert leaf.adapter.for_load is not None  # converting adapters only
            target, finish = leaf.adapter.for_load(leaf.value)
            leaf.container[leaf.key] = target
            self._swapped.append((leaf.container, leaf.key, leaf.value, target))
            if finish is not None:
                self._finishers.append(finish)

    def finish(self) -> None:
        """After a successful load: copy loaded data into the original values."""
        for finish in self._finishers:
            finish()

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for container, key, original, target in reversed(self._swapped):
            if container[key] is target:  # DCP may have replaced it (a stored object)
                container[key] = original


# -----------------------------------------------------------------------------
# What one rank holds of a flattened state dict, as plain data the ranks exchange once.
#
# The save and load engines (`engine.save`, `engine.load`) never build DCP's per-item
# `WriteItem`/`ReadItem` objects. Each rank describes its values compactly —
# per key: dtype, global shape and the (offsets, sizes) of the pieces it holds,
# or the byte length of a serialized object — and keeps the tensors beside
# that description. One `all_gather_object` of these tuples is the whole
# planning exchange of a save.
#
# Values: shardwise `ShardedTensor`, plain tensors (replicated: one piece, the
# whole tensor), types a client describes in place (DTensor, `clients.dtensor`),
# any other tensor type through DCP's own per-item protocol (`dcp_pieces`), and any other
# value as an object: its `torch.save` bytes, or its own bytes when it comes
# `Serialized` (Megatron's pre-serialized common state).
# -----------------------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


class Piece(NamedTuple):
    """A local tensor holding the box `offsets`/`sizes` of a global tensor (a
    NamedTuple: a save or load makes one per shard, 100,000 of them at scale)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class LocalPieces(torch.Tensor):
    """A tensor known only by its global shape and dtype and by the pieces this rank
    holds of it: what a client hands the engine when building a global layout would
    mean gathering every rank's pieces (Megatron-Core's, by key). Described in place
    (its own `ValueAdapter`): the engine writes and reads the pieces where they are
    and checks the key across ranks (shapes, dtypes, overlaps, holes) with its own
    exchanges, as for any tensor. Pieces several ranks hold alike (replicas) are
    written once and read by each. A rank holding no piece of a tensor passes no
    value for it. No op runs on it."""

    key: str
    pieces: list[Piece]

    @staticmethod
    def __new__(
        cls, key: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[Piece]
    ) -> LocalPieces:
        device = pieces[0].tensor.device if pieces else torch.device("cpu")
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        out.key, out.pieces = key, pieces
        return out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        raise NotImplementedError(f"{func} on {args[0]!r}: it is a checkpoint's value only")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"LocalPieces({self.key!r}, {tuple(self.shape)}, {len(self.pieces)} pieces)"

    def with_pieces(self, pieces: list[Piece]) -> LocalPieces:
        """The same tensor over other storage (the stager's copies)."""
        return LocalPieces(self.key, tuple(self.shape), self.dtype, pieces)


# One key as exchanged: (key, path, dtype name, global shape, requires_grad, boxes
# held) for a tensor; (key, path, None, None, False, (byte length, crc32c)) for an
# object, whose bytes every rank serializes before the exchange. `path` is DCP's
# (`format.entries`), None where it is `(key,)` (a flat state's). Tuples of builtins:
# they pickle fast and compare exactly (a NamedTuple pickles 2x slower and 13%
# larger: 0.35 s more per 100,000 keys in the exchange and the plan signature).
# Read by name all the same: unpacked (`key, path, dtype, shape, grad, held = entry`),
# never indexed.
Entry = tuple[str, tuple[Any, ...] | None, str | None, tuple[int, ...] | None, bool, Any]


@dataclass(frozen=True)
class Serialized:
    """An object its owner serialized already (Megatron's common state, `torch.save`d
    as Megatron-Core stores it): stored as these bytes, never pickled again."""

    data: bytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def is_plain_tensor(value: Any) -> bool:
    """A tensor (or Parameter) of no subclass: its memory is its values, read and
    written as they are."""
    return type(value) in _PLAIN


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def pieces_of(value: Any) -> list[Piece] | None:
    """The pieces this rank holds of a tensor value: a plain tensor or a ShardedTensor
    here, other types by the client that describes them in place (`clients.dtensor`);
    None for a type only DCP's own write items describe (`dcp_pieces`)."""
    if type(value) in _PLAIN:
        return [Piece(value, (0,) * value.dim(), tuple(value.shape))]
    if isinstance(value, ShardedTensor):
        return [
            Piece(shard, block.offsets, block.sizes)
            for shard, block in zip(value._shards, value.local_blocks)
        ]
    return pieces_in_place(value)  # DTensor and other clients' types; None: DCP's items


def dcp_pieces(key: str, value: torch.Tensor) -> list[Piece]:
    """The pieces of a tensor type `pieces_of` leaves to DCP, through DCP's own per-item
    protocol: its write items (a `_Checkpointable`'s `__create_write_items__`; any other
    tensor, whole), each resolved as `DefaultSavePlanner.resolve_data` resolves it
    (`__get_tensor_shard__`)."""
    pieces = []
    for item in _create_write_items(key, value):
        assert item.tensor_data is not None  # a tensor's items are never bytes
        chunk = item.tensor_data.chunk
        shard = find_tensor_shard(value, item.index)
        pieces.append(Piece(shard, tuple(chunk.offsets), tuple(chunk.sizes)))
    return pieces


def serialize_objects(flat: dict[str, Any]) -> tuple[dict[str, bytes], BaseException | None]:
    """Each non-tensor value as the bytes DCP stores (`torch.save`; a `Serialized`
    value's own bytes), or the first failure."""
    objects: dict[str, bytes] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, Serialized):
            objects[key] = value.data
            continue
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's to fix
            why = f"object '{key}' cannot be pickled ({type(e).__name__}: {e})"
            return objects, InvalidTypeError(why)
        objects[key] = buffer.getvalue()
    return objects, None


class Held:
    """The tensors a rank's entries describe, found again by (key, box index) when
    written. A plain tensor or a `ShardedTensor` is looked up in the flattened state
    itself: a `Piece` per shard kept for the whole save would be 100,000 objects
    (12 MiB) at scale; other types keep the pieces their protocol returned."""

    def __init__(self, flat: dict[str, Any], pieces: dict[str, list[Piece]]) -> None:
        self.flat, self.pieces = flat, pieces

    def tensor(self, key: str, index: int) -> torch.Tensor:
        """The local tensor of box `index` of `key`'s entry."""
        pieces = self.pieces.get(key)
        if pieces is not None:
            return pieces[index].tensor
        value = self.flat[key]
        return value if type(value) in _PLAIN else value._shards[index]


def combine_pending(state: Any) -> None:
    """Every reduction's result in `state` still pending (`ShardedTensor.pending_reduce`)
    combined now, on every rank in one order: a replicated value is read later by the
    one rank that writes it, which must not combine alone. Run before anything that can
    fail on one rank alone, so that a failure never leaves the others in a collective.
    O(values), no copy of the state."""
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, ShardedTensor):
            if value.pending_reduce is not None:
                value._shards  # noqa: B018 - combined here, collectively
        elif isinstance(value, Mapping):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))


def describe(
    flat: dict[str, Any], mappings: dict[str, tuple[Any, ...]], objects: dict[str, bytes]
) -> tuple[list[Entry], Held]:
    """`(entries, the tensors they describe)` for a flattened state dict. `format.pickles`
    holds the serialized bytes of each non-tensor value (`serialize_objects`). Like
    shapes and boxes are one tuple (10,000 tensors sharded alike share theirs): held
    once here, and pickled once to their owners."""
    entries: list[Entry] = []
    pieces: dict[str, list[Piece]] = {}
    same: dict[Any, Any] = {}
    for key, value in flat.items():
        path = mappings.get(key)
        path = None if path is None or path == (key,) else tuple(path)
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            shape = same.setdefault(shape, shape)
            if type(value) in _PLAIN:
                boxes: tuple[Box, ...] = (((0,) * len(shape), shape),)
            elif isinstance(value, ShardedTensor):
                boxes = tuple((b.offsets, b.sizes) for b in value.local_blocks)
            else:
                held = pieces_of(value)
                if held is None:
                    held = dcp_pieces(key, value)
                pieces[key] = held
                if len(held) == 1 and held[0].sizes == shape:  # whole: no copies
                    boxes = ((held[0].offsets, shape),)
                else:
                    boxes = tuple((p.offsets, p.sizes) for p in held)
            boxes = same.setdefault(boxes, boxes)
            entries.append((key, path, _dtype_name(value.dtype), shape, value.requires_grad, boxes))
        else:
            data = objects[key]
            entries.append((key, path, None, None, False, (len(data), crc32c.crc32c(data))))
    return entries, Held(flat, pieces)


register_value_adapter(ValueAdapter("local pieces", LocalPieces, pieces=lambda v: v.pieces))

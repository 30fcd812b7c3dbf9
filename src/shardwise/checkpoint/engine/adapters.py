"""Other libraries' sharded values in `swc.save` / `swc.load` state dicts.

A client library's sharded type (PhysicsNeMo's `ShardTensor`, Megatron-Core's
wrappers) is swapped for a ShardedTensor before DCP sees the state dict, and
loaded data is written back after. The built-in adapters
(`checkpoint.physicsnemo`, `checkpoint.megatron`) register when
`shardwise.checkpoint` is imported; neither imports its library first.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...comm.agreement import exchange, odd_ranks, require_same
from ...errors import InvalidArgumentError
from ...tensor import ShardedTensor

__all__ = [
    "ValueAdapter",
    "adapted_for_load",
    "adapted_for_save",
    "held_adapted",
    "pieces_in_place",
    "register_value_adapter",
    "require_same_adapted",
    "unregister_value_adapter",
]

Finish = Callable[[], None]


@dataclass(frozen=True)
class ValueAdapter:
    """How one foreign type goes through a checkpoint, in one of two ways.

    Converted: `for_save(value)` gives what the engine saves (usually a
    ShardedTensor sharing the value's storage); `for_load(value)` gives the target
    the engine fills and a `finish()` that copies the loaded data into `value`
    (None when the target shares `value`'s storage). Both are collective when the
    conversion needs the global layout, so every rank must hold the same such keys
    (agreed at the API edge, `held_adapted`).

    Described in place: `pieces(value)` gives the (tensor, offsets, sizes) boxes
    this rank holds of the value's global tensor, read and written where they are
    (DTensor, `LocalShardsWrapper`). Nothing collective, so nothing to agree on.
    """

    name: str
    matches: Callable[[Any], bool]
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


_REGISTERED: list[ValueAdapter] = []


def register_value_adapter(adapter: ValueAdapter) -> None:
    """Make `swc.save`/`swc.load` convert values `adapter.matches` (first match wins)."""
    if any(a.name == adapter.name for a in _REGISTERED):
        raise InvalidArgumentError(f"a value adapter named {adapter.name!r} is already registered")
    _REGISTERED.append(adapter)


def unregister_value_adapter(name: str) -> None:
    """Remove the adapter registered under `name`."""
    for i, a in enumerate(_REGISTERED):
        if a.name == name:
            del _REGISTERED[i]
            return
    raise KeyError(f"no value adapter named {name!r}")


def _adapter_for(value: Any) -> ValueAdapter | None:
    """The first converting adapter that matches `value`."""
    for adapter in _REGISTERED:
        if adapter.pieces is None and adapter.matches(value):
            return adapter
    return None


def pieces_in_place(value: Any) -> list[Any] | None:
    """The boxes this rank holds of `value` by the first in-place adapter matching it
    (`ValueAdapter.pieces`); None when none does."""
    for adapter in _REGISTERED:
        if adapter.pieces is not None and adapter.matches(value):
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
        hints = {a.name: a.hint for a in _REGISTERED}
        hint = "".join(f"; {hints[k]}" for k in kinds if hints.get(k))
        require_same(
            everyone,
            f"the {', '.join(kinds)} values they hold (first difference: '{differ[0][0]}')",
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

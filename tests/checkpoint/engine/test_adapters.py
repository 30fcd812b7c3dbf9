"""Value adapters: foreign values swapped for load/save targets, in one process."""

from __future__ import annotations

import pathlib

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.engine.inventory import (
    ValueAdapter,
    adapted_for_load,
    adapted_for_save,
    adapter_of,
    held_adapted,
    pieces_in_place,
    register_value_adapter,
    require_same_adapted,
    unregister_value_adapter,
)
from shardwise.errors import ArgumentMismatchError, InvalidArgumentError

pytestmark = pytest.mark.spawned


class Holder:
    """A wrapper that, like Megatron's, reports a placeholder dtype and keeps its data apart."""

    dtype = torch.float64  # placeholder: the data is float32

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __reduce__(self):  # pickled only if an adapter fails to swap it
        raise TypeError("a Holder must never reach DCP")


@pytest.fixture
def holder_adapter():
    calls = {"save": 0, "load": 0, "finish": 0}

    def for_save(h: Holder) -> torch.Tensor:
        calls["save"] += 1
        return h.data

    def for_load(h: Holder):
        calls["load"] += 1
        target = torch.empty_like(h.data)  # not shared: finish must copy

        def finish() -> None:
            calls["finish"] += 1
            h.data.copy_(target)

        return target, finish

    register_value_adapter(ValueAdapter("holder", Holder, for_save, for_load))
    yield calls
    unregister_value_adapter("holder")


def test_save_swaps_leaves_without_touching_callers_containers(holder_adapter):
    h = Holder(torch.arange(6.0))
    sd = {"a": {"h": h, "n": 3}, "l": [h, torch.ones(2)]}
    out = adapted_for_save(sd)
    assert out["a"]["h"] is h.data and out["l"][0] is h.data and out["a"]["n"] == 3
    assert sd["a"]["h"] is h and sd["l"][0] is h  # the caller's dict is unchanged
    assert holder_adapter["save"] == 2


def test_round_trip_through_swc_fills_holders_and_restores_containers(tmp_path, holder_adapter):
    saved = {
        "h": Holder(torch.arange(12.0).reshape(3, 4)),
        "nested": {"step": 7, "h": Holder(torch.ones(5))},
    }
    swc.save(saved, tmp_path / "ck")
    assert torch.equal(swc.read_tensor(tmp_path / "ck", "h"), torch.arange(12.0).reshape(3, 4))

    target = {"h": Holder(torch.zeros(3, 4)), "nested": {"step": 0, "h": Holder(torch.zeros(5))}}
    h, inner = target["h"], target["nested"]["h"]
    swc.load(target, tmp_path / "ck")
    assert target["h"] is h and target["nested"]["h"] is inner  # originals back in place
    assert torch.equal(h.data, torch.arange(12.0).reshape(3, 4))
    assert torch.equal(inner.data, torch.ones(5))
    assert target["nested"]["step"] == 7  # objects DCP replaced stay replaced
    assert holder_adapter == {"save": 2, "load": 2, "finish": 2}


def test_failed_load_restores_originals_and_finishes_nothing(tmp_path, holder_adapter):
    swc.save({"h": Holder(torch.ones(4))}, tmp_path / "ck")
    h = Holder(torch.zeros(5))  # wrong shape: refused before any target is modified
    target = {"h": h}
    with pytest.raises(swc.CheckpointMismatchError, match="'h' shape"):
        swc.load(target, tmp_path / "ck")
    assert target["h"] is h and holder_adapter["finish"] == 0
    assert torch.equal(h.data, torch.zeros(5))


def test_context_restores_on_exception(holder_adapter):
    h = Holder(torch.ones(2))
    sd = {"x": [h]}
    with pytest.raises(RuntimeError):
        with adapted_for_load(sd):
            assert isinstance(sd["x"][0], torch.Tensor)
            raise RuntimeError("load failed")
    assert sd["x"][0] is h


def test_names_are_unique(holder_adapter):
    with pytest.raises(ValueError, match="already registered"):
        register_value_adapter(ValueAdapter("holder", bool, id, id))
    with pytest.raises(KeyError, match="no value adapter named 'nope'"):
        unregister_value_adapter("nope")


def test_a_failing_swap_restores_what_it_swapped(holder_adapter):
    first = Holder(torch.ones(2))
    sd = {"a": first, "b": Holder(torch.ones(3))}

    def refuse_b(h: Holder):
        if h is sd["b"]:
            raise ValueError("b cannot be loaded")
        return torch.empty_like(h.data), None

    unregister_value_adapter("holder")
    register_value_adapter(ValueAdapter("holder", Holder, id, refuse_b))
    with pytest.raises(ValueError, match="b cannot be loaded"):
        with adapted_for_load(sd):
            pass
    assert sd["a"] is first  # swapped before b failed: put back


def _rank_missing_a_value(rank: int, world: int, path: str) -> tuple[str, bool]:
    register_value_adapter(
        ValueAdapter("holder", Holder, lambda h: h.data, lambda h: (h.data, None))
    )
    sd = (
        {"b": Holder(torch.ones(2))}
        if rank
        else {"a": Holder(torch.ones(2)), "b": Holder(torch.ones(2))}
    )
    try:
        swc.save(sd, path)
        return "saved", False
    except ArgumentMismatchError as e:
        return str(e), (pathlib.Path(path) / ".metadata").exists()


def test_ranks_holding_other_adapted_values_refuse_together(tmp_path):
    """Adapters may be collective per value: a rank lacking one would pair its next
    value with another rank's; every rank refuses instead, before anything is written."""
    from shardwise.testing import run_ranks

    results = run_ranks(_rank_missing_a_value, 2, str(tmp_path / "ck"), timeout=60)
    message = (
        "ranks disagree on the holder values they hold (first difference: 'a'): ranks [1] held 1 "
        "of them, rank 0 held 2 of them; every rank must hold every such value, under the same key "
        "(a rank holding nothing of it passes an empty one)"
    )
    assert results == [(message, False), (message, False)]


_BOTH = (
    "value adapter 'x': give for_save and for_load (converted), or pieces (described in "
    "place), not both"
)


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"for_save": id},
        {"for_save": id, "for_load": id, "pieces": id},
        {"for_load": id, "pieces": id},
    ],
    ids=["neither", "save-only", "all", "load-and-pieces"],
)
def test_an_adapter_converts_or_describes_in_place_never_both(given):
    with pytest.raises(InvalidArgumentError) as info:
        ValueAdapter("x", bool, **given)
    assert str(info.value) == _BOTH


def test_held_adapted_lists_paths_and_statefuls_in_one_order(holder_adapter):
    sd = {"b": [Holder(torch.ones(1)), 1], "a": {"h": Holder(torch.ones(1)), "t": torch.ones(1)}}
    assert held_adapted(sd, ("opt",)) == (("a.h", "holder"), ("b.0", "holder"), ("opt", "Stateful"))
    assert held_adapted({"t": torch.ones(1)}) == ()


def test_require_same_adapted_names_the_odd_ranks_and_the_adapters_hint():
    register_value_adapter(ValueAdapter("hinted", bool, id, id, hint="pass them on every rank"))
    try:
        require_same_adapted([(("a", "hinted"),), (("a", "hinted"),)])  # the same: passes
        with pytest.raises(ArgumentMismatchError) as info:
            require_same_adapted([(("a", "hinted"),), (("a", "hinted"),), ()])
    finally:
        unregister_value_adapter("hinted")
    assert str(info.value) == (
        "ranks disagree on the hinted values they hold (first difference: 'a'): ranks [2] held "
        "0 of them, rank 0 held 1 of them; every rank must hold every such value, under the same "
        "key (a rank holding nothing of it passes an empty one); pass them on every rank"
    )


class Boxed(torch.Tensor):
    """A tensor subclass a client describes in place."""


def test_pieces_in_place_asks_the_adapter_of_the_values_class():
    boxes = [(torch.ones(2), (0,), (2,))]
    register_value_adapter(ValueAdapter("boxed", Boxed, pieces=lambda v: boxes))
    try:
        assert pieces_in_place(torch.ones(2).as_subclass(Boxed)) is boxes
        assert pieces_in_place(torch.ones(2)) is None
    finally:
        unregister_value_adapter("boxed")
    assert pieces_in_place(torch.ones(2).as_subclass(Boxed)) is None


@pytest.mark.parametrize(
    "types, shown",
    [(str, "str"), ((Boxed, Holder), "Holder"), ("tests.Boxed", "'tests.Boxed'")],
    ids=["a-plain-type", "one-of-two", "a-name"],
)
def test_an_in_place_adapter_for_anything_but_tensor_classes_is_refused(types, shown):
    """A value that is no tensor would be pickled at save and refused at load: the
    adapter is refused when it is made instead, naming the type."""
    with pytest.raises(InvalidArgumentError) as info:
        ValueAdapter("boxed", types, pieces=lambda v: [])
    assert str(info.value) == (
        f"value adapter 'boxed': pieces= describes tensors in place, and {shown} is not a "
        "torch.Tensor subclass given as a class (a save would pickle such a value as an object "
        "and a load refuse it); convert it with for_save and for_load instead"
    )


@pytest.mark.parametrize("types", [(), "Holder", 3], ids=["none", "unqualified", "not-a-type"])
def test_an_adapters_types_are_classes_or_qualified_names(types):
    with pytest.raises(InvalidArgumentError, match="value adapter 'x': "):
        ValueAdapter("x", types, id, id)


def test_the_nearest_class_decides_and_a_name_stands_for_an_unimported_class():
    class Sub(Holder):
        pass

    register_value_adapter(ValueAdapter("named", f"{__name__}.Holder", id, id))
    try:
        assert adapter_of(Sub(torch.ones(1))).name == "named"  # a base named, not imported
        register_value_adapter(ValueAdapter("sub", Sub, id, id))
        assert adapter_of(Sub(torch.ones(1))).name == "sub"  # its own class is nearer
        assert adapter_of(Holder(torch.ones(1))).name == "named"
        assert adapter_of(torch.ones(1)) is None
    finally:
        unregister_value_adapter("named")
        unregister_value_adapter("sub")
    assert adapter_of(Sub(torch.ones(1))) is None  # forgotten with the registration

"""Repeated saves reuse their plan (`engine.plan`), and any change of structure replans.

Ranks run as threads (ThreadedWorld): the collectives each save makes are
observed exactly (`world.calls`), so a reused plan is seen as the two
planning `all_to_all`s missing, and a replan as them present. Every
checkpoint is read back bit for bit: a reused plan never makes a wrong one.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest
import torch

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import plan as plan_cache
from shardwise.checkpoint.engine.inventory import describe
from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.plan import owner_of
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.comm.agreement import Agreement
from shardwise.comm.communicator import SingleProcess
from shardwise.testing import shard_of

from ...comm.threaded_world import ThreadedRank, ThreadedWorld

FIRST = ["all_reduce", "all_to_all_object", "all_to_all_object"]  # agree, then plan
# reports (places), parts written, data durable, verdict
SAVE = ["all_to_all_object", "all_reduce", "all_reduce", "all_reduce"]
# a repeated save reports nothing: the owners keep the places, the checksums stay in the
# writers' files, and each object's owner writes it
PLANNED, REUSED = FIRST + SAVE, FIRST[:1] + SAVE[1:]


def _rows(sizes: list[int]) -> Layout:
    return Layout.row_wise((sum(sizes), 4), sizes)


def _state(rank: int, layout: Layout, step: float, extra: dict | None = None) -> dict:
    full = (
        torch.arange(layout.global_shape[0] * 4, dtype=torch.float32).reshape(layout.global_shape)
        + step
    )
    emb = ShardedTensor.from_layout(layout, shard_of(full, layout, rank), rank=rank)
    return {"emb": emb, "bias": torch.full((3,), step), "step": int(step), **(extra or {})}


class _Loop:
    """One group of thread ranks saving again and again, as a training loop does."""

    def __init__(self, world: int | ThreadedWorld) -> None:
        self.world = ThreadedWorld(world) if isinstance(world, int) else world

    def save(self, path: Path | str, state_of: Callable[[int], dict]) -> list[str]:
        calls = len(self.world.calls)
        results = self.world.run(
            lambda comm: save_state(state_of(comm.rank), path, Agreement(comm))
        )
        assert results == [None] * self.world.world_size
        return self.world.calls[calls:]

    def load(self, path: Path | str, state_of: Callable[[int], dict]) -> list[dict]:
        def one(comm: ThreadedRank) -> dict:
            target = state_of(comm.rank)
            load_state(target, path, Agreement(comm), strict=True, verify=True, cast_dtype=False)
            return target

        return self.world.run(one)


def _same(got: dict, want: dict) -> bool:
    for key, value in want.items():
        if isinstance(value, ShardedTensor):
            pairs = zip(got[key].local_shards(), value.local_shards(), strict=True)
            if not all(torch.equal(a, b) for a, b in pairs):
                return False
        elif isinstance(value, torch.Tensor):
            if not torch.equal(got[key], value):
                return False
        elif got[key] != value:
            return False
    return True


def _blank(rank: int, layout: Layout, extra: dict | None = None) -> dict:
    state = _state(rank, layout, -100.0, extra)
    state["step"] = 0
    return state


@pytest.fixture(autouse=True)
def _fresh() -> None:
    plan_cache.forget()


def test_a_repeated_save_reuses_the_plan_and_writes_the_new_values(tmp_path: Path) -> None:
    loop, rows = _Loop(3), _rows([3, 0, 5])  # rank 1 holds nothing of `emb`
    assert loop.save(tmp_path / "a", lambda r: _state(r, rows, 1.0)) == PLANNED
    assert loop.save(tmp_path / "b", lambda r: _state(r, rows, 2.0)) == REUSED
    assert loop.save(tmp_path / "b", lambda r: _state(r, rows, 3.0)) == REUSED  # overwrite
    for path, step in ((tmp_path / "a", 1.0), (tmp_path / "b", 3.0)):
        got = loop.load(path, lambda r: _blank(r, rows))
        assert all(_same(got[r], _state(r, rows, step)) for r in range(3))


def test_the_records_of_a_reused_plan_name_the_new_save(tmp_path: Path) -> None:
    """Token, save id and checkpoint id are never part of a plan."""
    loop, rows = _Loop(2), _rows([2, 2])
    loop.save(tmp_path / "a", lambda r: _state(r, rows, 1.0))
    assert loop.save(tmp_path / "b", lambda r: _state(r, rows, 1.0)) == REUSED
    a, b = (pickle.loads((tmp_path / n / ".metadata").read_bytes()) for n in "ab")
    assert str(b.storage_meta.checkpoint_id).endswith("b")
    assert a.storage_meta.save_id != b.storage_meta.save_id
    files = {n: {i.relative_path for i in m.storage_data.values()} for n, m in zip("ab", (a, b))}
    assert len(files["a"]) == len(files["b"]) == 2 and not files["a"] & files["b"]
    index = Manifest.read(tmp_path / "b").index
    assert index is not None  # named in the new save, as its data files are
    assert {n.split(".")[1] for n in files["b"]} == {index.file.split(".")[1]}
    assert {p.name for p in (tmp_path / "b").glob("*.distcp")} == files["b"] | {index.file}


def _spoiled(state: dict) -> dict:
    """`state` with every tensor filled with -1 and every object replaced: a load target."""
    out = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            blocks = [torch.full_like(s, -1.0) for s in value.local_shards()]
            out[key] = ShardedTensor.from_layout(
                value.layout_spec, blocks, dtype=value.dtype, rank=value.rank
            )
        elif isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value, -1.0)
        else:
            out[key] = type(value)()
    return out


@pytest.mark.parametrize(
    "change", ["key", "layout", "dtype", "one rank's keys", "object length", "storage"]
)
def test_any_change_of_structure_replans(tmp_path: Path, change: str) -> None:
    loop, rows = _Loop(2), _rows([2, 2])
    assert loop.save(tmp_path / "a", lambda r: _state(r, rows, 1.0, {"note": "abc"})) == PLANNED
    path = f"memory://{tmp_path}/b" if change == "storage" else tmp_path / "b"

    def later(rank: int) -> dict:
        extra: dict = {"note": "abc" * 200 if change == "object length" else "abc"}
        if change == "key":
            extra["new"] = torch.ones(2)
        if change == "one rank's keys" and rank == 1:  # rank 0 alone would find its plan
            extra["mine"] = torch.ones(1)
        state = _state(rank, _rows([1, 3]) if change == "layout" else rows, 2.0, extra)
        if change == "dtype":
            state["bias"] = state["bias"].double()
        return state

    assert loop.save(path, later) == PLANNED
    got = loop.load(path, lambda r: _spoiled(later(r)))
    assert all(_same(got[r], later(r)) for r in range(2))


class _SameKeyRank(ThreadedRank):
    @property
    def key(self) -> Hashable:
        return ("restarted", self.rank)


class _Restarted(ThreadedWorld):
    """A world whose ranks keep their group key at any world size: as a job restarted in
    its processes at another size, whose new process group may take the id (the key) of
    the old one. Only the signature's world size then tells the plans apart."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._ranks = [_SameKeyRank(self, r) for r in range(world_size)]


def test_a_save_at_another_world_size_replans(tmp_path: Path) -> None:
    """Ranks 0 and 1 describe the same entries at 3 ranks and at 2 (rank 2 holds no rows),
    so at 2 each finds a kept plan under its group key: only the world size in the
    signature makes them replan, where a reused plan would route keys to a rank 2 that is
    gone. Both plans stay kept: back at 3 ranks, the first is reused."""
    three, two = _Loop(_Restarted(3)), _Loop(_Restarted(2))
    wide, narrow = _rows([2, 2, 0]), _rows([2, 2])
    assert three.save(tmp_path / "a", lambda r: _state(r, wide, 1.0)) == PLANNED
    assert two.save(tmp_path / "b", lambda r: _state(r, narrow, 2.0)) == PLANNED
    got = two.load(tmp_path / "b", lambda r: _blank(r, narrow))
    assert all(_same(got[r], _state(r, narrow, 2.0)) for r in range(2))
    assert three.save(tmp_path / "c", lambda r: _state(r, wide, 3.0)) == REUSED
    got = three.load(tmp_path / "c", lambda r: _blank(r, wide))
    assert all(_same(got[r], _state(r, wide, 3.0)) for r in range(3))


def test_an_object_with_new_bytes_of_the_same_length_reuses_the_plan(tmp_path: Path) -> None:
    loop, rows = _Loop(2), _rows([1, 3])
    loop.save(tmp_path / "a", lambda r: _state(r, rows, 1.0, {"note": "abc"}))
    assert loop.save(tmp_path / "b", lambda r: _state(r, rows, 1.0, {"note": "xyz"})) == REUSED
    got = loop.load(tmp_path / "b", lambda r: _blank(r, rows, {"note": ""}))
    assert [g["note"] for g in got] == ["xyz", "xyz"]


def test_the_signature_covers_world_size_rank_and_storage() -> None:
    entries = describe({"w": torch.zeros(2)}, {"w": ("w",)}, {})[0]
    sigs = {
        plan_cache.signature(entries, w, r, kind)
        for w, r, kind in [(2, 0, "Local"), (3, 0, "Local"), (2, 1, "Local"), (2, 0, "Remote")]
    }
    assert len(sigs) == 4


def test_saves_without_a_process_group_share_one_group_of_plans(tmp_path: Path) -> None:
    """Each call makes its own `SingleProcess`: they are one world, so a repeated save
    reuses its plan and the kept plans do not grow with the number of saves."""
    state = {"w": torch.ones(3), "step": 1}
    for i in range(3):
        save_state(state, tmp_path / str(i), Agreement(SingleProcess()))
    assert list(plan_cache._KEPT) == [("single process",)]
    assert len(plan_cache._KEPT[("single process",)]) == 1


def test_an_object_its_owner_does_not_hold_is_reported_at_every_save(tmp_path: Path) -> None:
    """Rank 1 alone holds an object rank 0 owns: rank 0 needs its crc32c at each save,
    so a repeated save still routes the reports (and loads the new bytes, verified)."""
    key = next(k for k in (f"solo{i}" for i in range(100)) if owner_of(k, 2) == 0)
    loop, rows = _Loop(2), _rows([2, 2])

    def state(rank: int, note: str) -> dict:
        return _state(rank, rows, 1.0, {key: note} if rank == 1 else {})

    assert loop.save(tmp_path / "a", lambda r: state(r, "abc")) == PLANNED
    assert loop.save(tmp_path / "a", lambda r: state(r, "xyz")) == FIRST[:1] + SAVE
    got = loop.load(tmp_path / "a", lambda r: _blank(r, rows, {key: ""} if r == 1 else {}))
    assert got[1][key] == "xyz" and key not in got[0]

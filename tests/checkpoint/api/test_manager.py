"""`swc.CheckpointManager`: step folders, `latest()` of committed steps only, restore,
and retention that deletes only committed step folders nobody is restoring (issue 40, 3)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.api import _ASYNC
from shardwise.checkpoint.manager import RETIRING, step_folder, step_of
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

SHAPE = (24, 8)


def reference(step: int) -> torch.Tensor:
    """The values saved at `step`: different at every step, bit for bit."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(SHAPE, generator=g)


def _state(step: int) -> dict[str, Any]:
    return {"w": reference(step), "step": step}


def _folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# -- two ranks ---------------------------------------------------------------------------------


def _refuse_listing() -> list[str]:
    raise AssertionError("only rank 0 lists the root")


def _save_five_and_restore(rank: int, world: int, root: str) -> dict[str, Any]:
    manager = swc.CheckpointManager(root, keep_last=2, keep_every=2)
    if rank != 0:
        manager.root.folders = _refuse_listing  # type: ignore[method-assign]
    saved = Layout.row_wise(SHAPE, [15, 9])
    for step in range(1, 6):
        value = ShardedTensor.from_layout(saved, shard_of(reference(step), saved, rank))
        manager.save(step, {"w": value, "step": step})
    target = Layout.chunked(SHAPE, 1, world)  # row-wise -> column-wise
    state: dict[str, Any] = {"w": ShardedTensor.full(target, 0.0), "step": -1}
    restored = manager.restore(state)
    full = reference(5)
    exact = [
        torch.equal(shard, full[block.slices()])
        for shard, block in zip(state["w"].local_shards(), state["w"].local_blocks)
    ]
    return {"restored": restored, "step": state["step"], "exact": exact}


def test_two_ranks_keep_the_last_two_and_every_second_step_and_restore_the_latest(tmp_path):
    out = run_ranks(_save_five_and_restore, 2, str(tmp_path), timeout=60)
    assert out == [{"restored": 5, "step": 5, "exact": [True]}] * 2
    assert _folders(tmp_path) == ["step_00000002", "step_00000004", "step_00000005"]
    manager = swc.CheckpointManager(tmp_path)
    assert manager.steps() == [2, 4, 5] and manager.latest() == 5
    assert manager.path(4) == tmp_path / "step_00000004"
    assert [t.key for t in swc.inspect(manager.path(4)).tensors] == ["w"]
    state: dict[str, Any] = {"w": torch.zeros(SHAPE), "step": -1}
    assert manager.restore(state, 2) == 2
    assert torch.equal(state["w"], reference(2)) and state["step"] == 2


def _save_then_die(rank: int, world: int, root: str) -> None:
    manager = swc.CheckpointManager(root)
    layout = Layout.row_wise(SHAPE, [15, 9])
    for step in (1, 2):
        value = ShardedTensor.from_layout(layout, shard_of(reference(step), layout, rank))
        manager.save(step, {"w": value, "step": step})
    os.environ["SHARDWISE_FAILPOINT"] = "mid-data"  # every rank, this process only: SIGKILL
    value = ShardedTensor.from_layout(layout, shard_of(reference(3), layout, rank))
    manager.save(3, {"w": value, "step": 3})


def test_latest_never_returns_a_step_whose_save_was_killed(tmp_path):
    died = run_ranks(_save_then_die, 2, str(tmp_path), timeout=60, allow_dead=True)
    assert [type(d).__name__ for d in died] == ["RankFailure", "RankFailure"]
    killed = tmp_path / step_folder(3)
    left = _tree(killed)
    assert any(name.endswith(".distcp") for name in left)  # data written, never committed
    with pytest.raises(swc.IncompleteCheckpointError):
        swc.load({"w": torch.zeros(SHAPE), "step": -1}, killed)

    manager = swc.CheckpointManager(tmp_path, keep_last=1)
    assert manager.steps() == [1, 2] and manager.latest() == 2
    state: dict[str, Any] = {"w": torch.zeros(SHAPE), "step": -1}
    assert manager.restore(state) == 2
    assert torch.equal(state["w"], reference(2))
    with pytest.raises(swc.CheckpointNotFoundError, match="step 3 under .* not a committed"):
        manager.restore(state, 3)

    manager.save(4, _state(4))  # keep_last=1: 1 and 2 go; the killed 3 is nobody's to delete
    assert _folders(tmp_path) == ["step_00000003", "step_00000004"]
    assert _tree(killed) == left
    assert manager.steps() == [4] and manager.latest() == 4


# -- one process -------------------------------------------------------------------------------


class _Gate:
    """A `Stateful` whose `load_state_dict` (inside `swc.load`, so inside `restore`)
    says it was reached, then waits for `go`."""

    def __init__(self, reached: threading.Event, go: threading.Event) -> None:
        self.reached, self.go = reached, go
        self.loaded: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"x": torch.zeros(3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state["x"].clone()
        self.reached.set()
        assert self.go.wait(60), "the test never let the restore finish"


def test_retention_never_deletes_a_step_while_another_thread_restores_it(tmp_path):
    manager = swc.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, {"w": reference(1), "gate": {"x": torch.full((3,), 1.0)}})
    reached, go = threading.Event(), threading.Event()
    gate = _Gate(reached, go)
    restoring: dict[str, Any] = {"w": torch.zeros(SHAPE), "gate": gate}
    outcome: list[Any] = []

    def restore() -> None:
        try:
            outcome.append(manager.restore(restoring))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            outcome.append(e)

    reader = threading.Thread(target=restore)
    reader.start()
    try:
        assert reached.wait(60)
        # step 1 is being restored: keep_last=1 would delete it, the guard keeps it
        manager.save(2, {"w": reference(2), "gate": {"x": torch.full((3,), 2.0)}})
        assert _folders(tmp_path) == ["step_00000001", "step_00000002"]
        assert manager.steps() == [1, 2]
    finally:
        go.set()
        reader.join(60)
    assert outcome == [1]
    assert torch.equal(restoring["w"], reference(1)) and gate.loaded is not None
    assert gate.loaded.tolist() == [1.0] * 3
    # no restore holds step 1 now: the next retention deletes both older steps
    manager.save(3, {"w": reference(3), "gate": {"x": torch.full((3,), 3.0)}})
    assert _folders(tmp_path) == ["step_00000003"] and manager.steps() == [3]


def test_async_save_deletes_old_steps_only_once_committed(tmp_path):
    manager = swc.CheckpointManager(tmp_path, keep_last=2)
    seen = []
    for step in (1, 2):
        future = manager.save(step, _state(step), async_=True)
        assert isinstance(future, swc.SaveFuture)
        manager.wait_until_finished()
        seen.append(manager.steps())
    assert seen == [[1], [1, 2]]
    hold, release = threading.Event(), threading.Event()
    held = _ASYNC.executor.submit(lambda: (hold.set(), release.wait(60)))  # step 3 queues behind
    try:
        assert hold.wait(60)
        future = manager.save(3, _state(3), async_=True)
        assert not future.done()
        # step 3 not committed: not returned, and nothing deleted for it yet
        assert manager.steps() == [1, 2] and manager.latest() == 2
        # (step 3's folder is made by the background save, once it runs)
        assert set(_folders(tmp_path)) - {"step_00000003"} == {"step_00000001", "step_00000002"}
    finally:
        release.set()
        held.result(60)
    assert isinstance(future.result(60), swc.SaveInfo)
    manager.wait_until_finished()
    assert _folders(tmp_path) == ["step_00000002", "step_00000003"]
    assert manager.steps() == [2, 3] and manager.latest() == 3


def test_a_memory_root_saves_keeps_the_last_one_and_restores(memory_root):
    import fsspec

    manager = swc.CheckpointManager(memory_root, keep_last=1)
    for step in (7, 8, 9):
        manager.save(step, _state(step))
    name = memory_root[len("memory://") :]
    assert fsspec.filesystem("memory").ls(f"/{name}", detail=False) == [f"/{name}/step_00000009"]
    assert manager.steps() == [9] and manager.latest() == 9
    assert manager.path(9) == f"{memory_root}/step_00000009"
    state: dict[str, Any] = {"w": torch.zeros(SHAPE), "step": -1}
    assert manager.restore(state) == 9
    assert torch.equal(state["w"], reference(9)) and state["step"] == 9


def test_foreign_entries_under_the_root_are_never_listed_nor_deleted(tmp_path):
    # checkpoints in folders the naming does not own, other folders, and plain files
    for odd in ("step_1", "step_000000002", "step_00000003.bak"):
        swc.save(_state(0), tmp_path / odd)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    (tmp_path / "step_00000004").write_text("a file, not a step folder")
    (tmp_path / "README.txt").write_text("mine")
    foreign = _tree(tmp_path)

    manager = swc.CheckpointManager(tmp_path, keep_last=1)
    manager.save(5, _state(5))
    (tmp_path / "step_00000005" / "notes.txt").write_text("the user's, in a step folder")
    for step in (6, 7):
        manager.save(step, _state(step))
    assert manager.steps() == [7] and manager.latest() == 7
    expected = ["README.txt", "notes", "step_000000002", "step_00000003.bak", "step_00000004"]
    expected += ["step_00000005", "step_00000007", "step_1"]
    assert _folders(tmp_path) == sorted(expected)
    assert {k: v for k, v in _tree(tmp_path).items() if k in foreign} == foreign
    # step 5's checkpoint is gone; the file it did not write stays, with its folder
    assert _folders(tmp_path / "step_00000005") == ["notes.txt"]


def test_a_deletion_killed_halfway_is_skipped_by_latest_and_finished_by_the_next_save(tmp_path):
    manager = swc.CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        manager.save(step, _state(step))
    # as a retention killed after marking step 2: its records are all still there
    (tmp_path / step_folder(2) / RETIRING).write_text("deleting step 2 (retention)\n")
    assert manager.steps() == [1] and manager.latest() == 1
    manager.save(3, _state(3))
    assert _folders(tmp_path) == ["step_00000001", "step_00000003"]
    assert manager.steps() == [1, 3]


def test_restore_names_the_root_when_nothing_is_committed(tmp_path):
    manager = swc.CheckpointManager(tmp_path / "run")
    state: dict[str, Any] = {"w": torch.zeros(SHAPE)}
    with pytest.raises(swc.CheckpointNotFoundError, match="no committed checkpoint under .*run"):
        manager.restore(state)
    assert manager.restore(state, missing_ok=True) is None
    assert manager.latest() is None and manager.steps() == []
    assert torch.equal(state["w"], torch.zeros(SHAPE))


def test_a_step_saved_twice_is_refused(tmp_path):
    manager = swc.CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    with pytest.raises(swc.CheckpointExistsError):
        manager.save(1, _state(2))
    state: dict[str, Any] = {"w": torch.zeros(SHAPE), "step": -1}
    assert manager.restore(state) == 1 and torch.equal(state["w"], reference(1))


@pytest.mark.parametrize(
    "name, step",
    [
        ("step_00000100", 100),
        ("step_00000000", 0),
        ("step_123456789", 123456789),
        ("step_100", None),
        ("step_000000100", None),  # not what formatting 100 gives
        ("step_00000100.bak", None),
        ("step_-0000001", None),
        ("Step_00000100", None),
        ("step_０００００１００", None),  # non-ASCII digits
    ],
)
def test_step_folder_names_are_parsed_strictly(name, step):
    assert step_of(name) == step
    if step is not None:
        assert step_folder(step) == name


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"keep_last": 0}, swc.InvalidArgumentError),
        ({"keep_last": 2, "keep_every": 0}, swc.InvalidArgumentError),
        ({"keep_every": 10}, swc.InvalidArgumentError),
        ({"keep_last": 2.0}, TypeError),
        ({"keep_last": True}, TypeError),
    ],
    ids=["keep-last-0", "keep-every-0", "keep-every-alone", "keep-last-float", "keep-last-bool"],
)
def test_bad_arguments_are_refused(tmp_path, kwargs, error):
    with pytest.raises(error):
        swc.CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("step", [-1, True, 1.0, "1"], ids=["negative", "bool", "float", "str"])
def test_a_bad_step_is_refused_before_anything_is_written(tmp_path, step):
    manager = swc.CheckpointManager(tmp_path)
    with pytest.raises((swc.InvalidArgumentError, TypeError)):
        manager.save(step, _state(1))
    assert _folders(tmp_path) == []

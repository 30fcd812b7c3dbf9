"""`async_save` from several threads of one process: each save writes the bytes it
staged, never another's (issue 35, point 1)."""

from __future__ import annotations

import threading
from typing import Any

import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.api import _ASYNC


class _SlowState:
    """A `Stateful` whose `state_dict()` returns only once `go` is set: its save
    stages after another thread's save has staged and been submitted."""

    def __init__(self, go: threading.Event) -> None:
        self.go = go

    def state_dict(self) -> dict[str, Any]:
        assert self.go.wait(60), "the other save never staged"
        return {"t": torch.full((4,), 1.0), "big": torch.full((300_001,), 1.0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("not loaded here")


def _loaded(path: Any) -> tuple[list[float], float]:
    out = {"m": {"t": torch.zeros(4), "big": torch.zeros(300_001)}}
    swc.load(out, path)
    return out["m"]["t"].tolist(), float(out["m"]["big"].unique().item())


def test_two_threads_saving_at_once_keep_their_own_bytes(tmp_path):
    """Thread A's state is produced while thread B's save is staged and queued; B's
    background write runs only after A has staged (the writer thread is held), so
    shared buffers would make B's checkpoint hold A's values."""
    hold = threading.Event()
    go = threading.Event()
    held = _ASYNC.executor.submit(hold.wait, 60)  # B's write queues behind this
    futures: dict[str, Any] = {}
    errors: list[BaseException] = []

    def a() -> None:
        try:
            futures["a"] = swc.async_save(
                {"m": _SlowState(go)}, tmp_path / "A", staging="background"
            )
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def b() -> None:
        try:
            state = {"m": {"t": torch.full((4,), 2.0), "big": torch.full((300_001,), 2.0)}}
            futures["b"] = swc.async_save(state, tmp_path / "B", wait=True, staging="background")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            go.set()

    ta = threading.Thread(target=a)
    ta.start()
    tb = threading.Thread(target=b)
    tb.start()
    tb.join(60)
    ta.join(60)
    hold.set()
    held.result(60)
    assert errors == []
    futures["a"].result(60)
    futures["b"].result(60)
    assert _loaded(tmp_path / "A") == ([1.0] * 4, 1.0)
    assert _loaded(tmp_path / "B") == ([2.0] * 4, 2.0)


def test_a_later_async_save_reuses_the_buffers_an_earlier_one_handed_back(tmp_path):
    state = {"t": torch.full((64,), 3.0)}
    swc.async_save(state, tmp_path / "one").result(60)
    kept = _ASYNC.stager._kept
    assert kept is not None  # handed back once committed
    ptr = kept.tensors[("t",)].data_ptr()
    state["t"].fill_(4.0)
    swc.async_save(state, tmp_path / "two").result(60)
    kept = _ASYNC.stager._kept
    assert kept is not None and kept.tensors[("t",)].data_ptr() == ptr
    out = {"t": torch.zeros(64)}
    swc.load(out, tmp_path / "one")
    assert out["t"].tolist() == [3.0] * 64
    swc.load(out, tmp_path / "two")
    assert out["t"].tolist() == [4.0] * 64


def test_an_async_save_from_a_done_callback_runs_rather_than_waiting_for_itself(tmp_path):
    """The callback runs on the one save thread: queued behind it, the new save would
    wait for its own staging forever."""
    got: list[Any] = []
    called = threading.Event()

    def again(_: Any) -> None:
        try:
            got.append(swc.async_save({"t": torch.full((4,), 6.0)}, tmp_path / "two").result())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            got.append(e)
        finally:
            called.set()

    first = swc.async_save({"t": torch.full((4,), 5.0)}, tmp_path / "one")
    first.add_done_callback(again)
    assert called.wait(60), "the callback's async_save never returned"
    assert [type(g).__name__ for g in got] == ["SaveInfo"]
    out = {"t": torch.zeros(4)}
    swc.load(out, tmp_path / "two")
    assert out["t"].tolist() == [6.0] * 4


def test_host_state_is_staged_when_async_save_returns(tmp_path):
    hold = threading.Event()
    held = _ASYNC.executor.submit(hold.wait, 60)  # the save itself has not started
    try:
        fut = swc.async_save({"t": torch.ones(4)}, tmp_path / "ck", staging="background")
        assert fut.staged.done() and not fut.done()
    finally:
        hold.set()
        held.result(60)
    fut.result(60)


class ShardedObject:
    """Stands for Megatron's ShardedObject (stored under its unique key)."""

    def __init__(self, key: str, data: Any = None) -> None:
        self.key, self.unique_key, self.data, self.replica_id = key, f"{key}/shard_0", data, 0


ShardedObject.__module__ = "megatron.core.dist_checkpointing.mapping"


def test_megatron_objects_are_stored_under_the_key_save_uses(tmp_path):
    state = {"w": torch.arange(4.0), "sched": ShardedObject("sched", {"lr": 1.5})}
    swc.async_save(state, tmp_path / "async").result(60)
    swc.save(state, tmp_path / "sync")
    for name in ("async", "sync"):
        assert "sched/shard_0" in swc.inspect(tmp_path / name).objects, name
        target = {"w": torch.zeros(4), "sched": ShardedObject("sched")}
        swc.load(target, tmp_path / name)
        assert target["sched"].data == {"lr": 1.5} and target["w"].tolist() == [0, 1, 2, 3]

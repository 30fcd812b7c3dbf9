"""`async_save` from several threads of one process: each save writes the bytes it
staged, never another's (issue 35, point 1)."""

from __future__ import annotations

import threading
from typing import Any

import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.api.async_save import _ASYNC


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

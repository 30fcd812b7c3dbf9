"""How many collectives each save and load makes, per rank, pinned exactly.

Every exchange is a round trip through every rank: the number of them is part of
each entry point's contract (stated in the docstrings of `api`/`api`,
`engine.save` and `engine.load`). A counting shim wraps torch.distributed's collectives at
the `torch.distributed` module attributes (shardwise and DCP both call them as
`dist.<name>`; calls nested inside `distributed_c10d` itself are not counted) and
shardwise's `ProcessGroupCommunicator` methods, on 2 spawned gloo ranks, around one
call each. A change in the number of exchanges fails here: update the pinned
numbers, and the docstrings with them.
"""

from __future__ import annotations

import functools
import sys
import threading
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import plan as plan_cache
from shardwise.comm.communicator import ProcessGroupCommunicator
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

# Every collective torch.distributed offers that a checkpoint could call.
_DIST = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "new_group",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
)
_COMM = (
    "all_gather_object",
    "all_to_all_single",
    "all_to_all_object",
    "all_reduce_max",
    "broadcast",
)

SHAPE = (8, 6)
FULL = torch.arange(48, dtype=torch.float32).reshape(SHAPE)
ROWS = Layout.chunked(SHAPE, 0, 2)


class _Opt:
    """A `Stateful`, as an optimizer wrapper is."""

    def __init__(self, lr: float) -> None:
        self.lr, self.m = lr, torch.full((3,), lr)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "m": self.m}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.m = state["lr"], state["m"]


def _state(rank: int, scale: float = 1.0) -> dict[str, Any]:
    """A ShardedTensor, a plain tensor, an object and a Stateful."""
    return {
        "w": ShardedTensor.from_layout(ROWS, shard_of(FULL * scale, ROWS, rank), rank=rank),
        "b": torch.arange(4, dtype=torch.float32) * scale,
        "meta": {"step": int(10 * scale), "name": "run"},
        "opt": _Opt(0.5 * scale),
    }


# DCP's `_DistWrapper` helpers around one dist call, and shardwise's agreement helpers
_DCP_SENDS = {"gather_object", "scatter_object", "broadcast_object", "all_gather_object"}
_HELPERS = {"_agree", "exchange", "agree", "verdict", "route", *_COMM}


def _site() -> str:
    """Who asked for this collective: the innermost shardwise function past the
    agreement helpers, then DCP's step below it (`_DistWrapper`'s method), e.g.
    `engine.load.load_state`, or `dcp.reduce_scatter` for a call of DCP's own."""
    frames = traceback.extract_stack()[:-2]
    ours = theirs = ""
    for f in reversed(frames):
        name = f.filename.replace("\\", "/")
        if not theirs and "/torch/distributed/checkpoint/" in name and f.name not in _DCP_SENDS:
            theirs = f"dcp.{f.name}"
        if "/shardwise/" in name and f.name not in _HELPERS:
            ours = f"{Path(name).stem}.{f.name}"
            break
    if "testing" in ours:  # the test itself called DCP
        ours = ""
    return " > ".join(s for s in (ours, theirs) if s) or "?"


class _Counting:
    """While active: every collective this process makes, as ("dist." or "comm.")
    name, in order, with the site that asked for it (any thread: async saves)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append((label, _site()))
            return original(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def __enter__(self) -> _Counting:
        for name in _DIST:
            if hasattr(dist, name):
                self._wrap(dist, name, f"dist.{name}")
        for name in _COMM:
            self._wrap(ProcessGroupCommunicator, name, f"comm.{name}")
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)

    def counts(self) -> dict[str, int]:
        return dict(Counter(label for label, _ in self.calls))


def _stock(folder: str) -> str:
    return str(Path(folder) / "stock")


def _prepare(rank: int, world: int, folder: str) -> None:
    """The checkpoints the loads read: shardwise's and stock DCP's (not counted)."""
    swc.save(_state(rank), str(Path(folder) / "ckpt"))
    dcp.save(_state(rank), storage_writer=FileSystemWriter(_stock(folder)))


def _call(entry: str, rank: int, folder: str) -> None:
    root = Path(folder)
    state = _state(rank, 2.0)
    if entry == "swc.save":  # a first save: nothing planned before
        plan_cache.forget()
        swc.save(state, str(root / "saved"))
    elif entry == "swc.save(again)":  # a training loop's next save: the plan is reused
        swc.save(state, str(root / "saved again"))
    elif entry == "swc.async_save":
        swc.async_save(state, str(root / "async")).result()
    elif entry == "swc.async_save(again)":
        swc.async_save(state, str(root / "async"), overwrite=True).result()
    elif entry == "dcp.save+Writer":
        dcp.save(state, storage_writer=swc.Writer(str(root / "writer")))
    elif entry == "swc.load":
        swc.load(state, str(root / "ckpt"))
    elif entry == "swc.load(no Stateful)":
        state["opt"] = state["opt"].state_dict()  # the same values, as a plain dict
        swc.load(state, str(root / "ckpt"))
        state["opt"] = _Opt(state["opt"]["lr"])
    elif entry == "swc.load(broadcast)":
        swc.load(state, str(root / "ckpt"), broadcast_replicated=True)
    elif entry == "swc.load(stock)":
        swc.load(state, _stock(folder))
    elif entry == "dcp.load+Reader":
        dcp.load(state, storage_reader=swc.Reader(str(root / "ckpt")))
    else:
        raise AssertionError(entry)
    if "load" in entry:  # it did load
        assert torch.equal(state["b"], torch.arange(4, dtype=torch.float32)), entry
        assert state["opt"].lr == 0.5 and state["meta"]["step"] == 10, entry


def _count(rank: int, world: int, folder: str, entries: list[str]) -> dict[str, Any]:
    _prepare(rank, world, folder)
    found: dict[str, Any] = {}
    for entry in entries:
        dist.barrier()  # the previous entry is over on every rank before counting starts
        with _Counting() as counting:
            _call(entry, rank, folder)
        found[entry] = (counting.counts(), counting.calls)
    return found


# Per rank, per entry point: {collective: calls}. "comm." counts shardwise's own
# Communicator methods; each of those is also one "dist." call below it. The order
# (printed on failure, and by running this module) names each exchange.
_AGAIN = {"comm.all_reduce_max": 5, "dist.all_reduce": 5}
# No entry point of shardwise's gathers every rank's values when nothing is wrong: its
# verdicts and the values every rank must share are one fixed-size all_reduce each
# (`Agreement.agree`); only the planning routes and the reports to owners carry payloads.
PINNED: dict[str, dict[str, int]] = {
    # api.edge.agree_route (folder, route, adapted values), then saving's (engine.saving):
    # agree (all_reduce), plan by key owners (2 routes), places to owners (route), the
    # owners' record parts written (all_reduce), every rank's data durable (all_reduce),
    # the verdict (all_reduce). A route is two all_to_all_single: the sizes, then the bytes.
    "swc.save": {
        "comm.all_reduce_max": 5,
        "dist.all_reduce": 5,
        "comm.all_to_all_object": 3,
        "dist.all_to_all_single": 6,
    },
    # the same structure again: the plan is reused (engine.plan_cache), no planning route,
    # and no reports (checksums stay in the writers' files; each object's owner writes it)
    "swc.save(again)": _AGAIN,
    # api.edge.agree_route (folder, adapted values), api.save._check_target (staging,
    # objects, target), the async group (first call only), then saving's on the
    # background thread (a first save on that group)
    "swc.async_save": {
        "comm.all_reduce_max": 6,
        "dist.all_reduce": 6,
        "dist.new_group": 1,
        "comm.all_to_all_object": 3,
        "dist.all_to_all_single": 6,
    },
    "swc.async_save(again)": {**_AGAIN, "comm.all_reduce_max": 6, "dist.all_reduce": 6},
    # none of shardwise's: DCP's plan (gather + scatter) and finish (gather + broadcast)
    "dcp.save+Writer": {
        "dist.gather_object": 2,
        "dist.scatter_object_list": 1,
        "dist.broadcast_object_list": 1,
    },
    # api.edge.agree_route (folder, route, adapted values), loading's two (targets
    # fit, read verdict), then the call's agreement after the Stateful's load_state_dict
    "swc.load": {"dist.all_reduce": 4, "comm.all_reduce_max": 4},
    "swc.load(no Stateful)": {"dist.all_reduce": 3, "comm.all_reduce_max": 3},
    # the same, values every rank loads whole read once and broadcast (engine.replicated):
    # "b" and the Stateful's "m", one reader each, one broadcast each
    "swc.load(broadcast)": {
        "dist.all_reduce": 4,
        "comm.all_reduce_max": 4,
        "comm.broadcast": 2,
        "dist.broadcast": 2,
    },
    # one load path for every checkpoint: a stock one (here with a Stateful) costs what
    # a shardwise one does
    "swc.load(stock)": {"dist.all_reduce": 4, "comm.all_reduce_max": 4},
    # none of shardwise's: DCP's plan (gather + scatter) and read (all_gather)
    "dcp.load+Reader": {
        "dist.gather_object": 1,
        "dist.scatter_object_list": 1,
        "dist.all_gather_object": 1,
    },
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("counts")
    results = run_ranks(_count, 2, str(folder), list(PINNED), timeout=60)
    assert results[0].keys() == results[1].keys() == PINNED.keys()
    return dict(zip(range(2), results, strict=True))


@pytest.mark.parametrize("entry", list(PINNED))
def test_collective_count_is_pinned(counted, entry):
    for rank in (0, 1):
        counts, calls = counted[rank][entry]
        sites = "\n".join(f"  {label:28} {site}" for label, site in calls)
        assert counts == PINNED[entry], (
            f"rank {rank}, {entry}: {counts} != pinned {PINNED[entry]}; in order:\n{sites}\n"
            "a change in the number of exchanges: update PINNED and the docstrings that state "
            "it (api.save/load, checkpoint/saving.py, checkpoint/loading.py)"
        )
    # every rank makes the same collectives in the same order, or a rank would hang
    assert counted[0][entry][1] == counted[1][entry][1]


if __name__ == "__main__":  # print the table: python -m tests.checkpoint.api.test_collective_counts
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_count, 2, tmp, list(PINNED), timeout=60)
    for entry, (counts, calls) in out[0].items():
        print(entry, counts)
        for label, site in calls:
            print("   ", label, site)
    sys.exit(0)

"""`engine.load`: values every rank loads whole are read by one rank and broadcast.

Thread ranks on the in-process communicator (its `received` counts what each rank
gets over the wire, `calls` every collective), and one spawned gloo run for
torch.distributed's own broadcast. Each test checks the values bit for bit and
the exact bytes each rank read from storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine.load import Batch, Value, load_state, placed, schedule
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.engine.stored import StoredView
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.comm.agreement import Agreement
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder
from shardwise.testing import run_ranks, shard_of

from ...comm.threaded_world import ThreadedRank, ThreadedWorld

pytestmark = pytest.mark.spawned  # one test spawns gloo ranks; the module is marked whole
W = 4
SIZES = {"a": 4000, "b": 3000, "c": 2000, "d": 1000}  # bytes of four replicated values
ROWS = Layout.chunked((8, 6), 0, W)
WEIGHT = torch.arange(48.0).reshape(8, 6)


def _values(salt: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: torch.arange(n // 4, dtype=torch.float32) * salt for k, n in SIZES.items()}


def _state(rank: int, salt: float = 1.0) -> dict[str, Any]:
    """Four values every rank holds whole."""
    return _values(salt)


def _with_weight(rank: int, salt: float = 1.0) -> dict[str, Any]:
    """The same, and a row-sharded weight each rank reads its rows of."""
    sharded = ShardedTensor.from_layout(ROWS, shard_of(WEIGHT * salt, ROWS, rank), rank=rank)
    return {**_values(salt), "w": sharded}


def _saved(path: Path | str, state_of=_state) -> None:
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(state_of(comm.rank), path, Agreement(comm)))


def _load(
    world: ThreadedWorld, path: Path | str, broadcast: bool | None, state_of=None
) -> list[tuple[int, dict[str, Any]]]:
    def one(comm: ThreadedRank) -> tuple[int, dict[str, Any]]:
        target = (state_of or _state)(comm.rank, -1.0)
        read, _ = load_state(
            target,
            path,
            Agreement(comm),
            strict=True,
            verify=True,
            cast_dtype=False,
            broadcast=broadcast,
        )
        return read, target

    return world.run(one)


def _exact(target: dict[str, Any], rank: int) -> None:
    for key, value in _values().items():
        assert torch.equal(target[key], value), key
    if "w" in target:
        assert torch.equal(target["w"].local_shards()[0], shard_of(WEIGHT, ROWS, rank)[0])


# -- the schedule ---------------------------------------------------------------------------------


def _values_at(*sizes: int, file: str = "f") -> list[Value]:
    """Values of `sizes` side by side in one file, keys "k0", "k1", ..."""
    out, at = [], 0
    for i, n in enumerate(sizes):
        out.append(Value(f"k{i}", n, file, at))
        at += n
    return out


def test_readers_take_consecutive_runs_of_about_equal_bytes() -> None:
    # 100 bytes over 2 readers: middles at 10, 35, 55, 80 -> slices [0, 50) and [50, 100)
    assert schedule(_values_at(20, 30, 10, 40), 2, batch=1000) == [
        Batch(0, ("k0", "k1"), 50),
        Batch(1, ("k2", "k3"), 50),
    ]
    # one large value keeps its reader; the slice it spans leaves another reader idle
    assert schedule(_values_at(10, 70, 10, 10), 4, batch=1000) == [
        Batch(0, ("k0",), 10),
        Batch(1, ("k1",), 70),  # its middle, 45, is in the second quarter
        Batch(3, ("k2", "k3"), 20),
    ]


def test_readers_never_outnumber_values_spread_over_ranks_and_batches_are_bounded() -> None:
    # 3 values on 1,024 ranks: readers 0, 341 and 682 (spread, e.g. over hosts)
    assert schedule(_values_at(60, 60, 60), 1024) == [
        Batch(0, ("k0",), 60),
        Batch(341, ("k1",), 60),
        Batch(682, ("k2",), 60),
    ]
    assert schedule(_values_at(60, 50, 40, 500), 1, batch=100) == [
        Batch(0, ("k0",), 60),  # k0 + k1 would exceed the batch
        Batch(0, ("k1", "k2"), 90),
        Batch(0, ("k3",), 500),  # larger than a batch: alone
    ]
    assert schedule([], 8) == []


def _scheduled(path: Path | str, values: dict[str, torch.Tensor], world: int) -> list[Batch]:
    return schedule(placed(StoredView.read(open_folder(path), 0), values), world)


def _shares(batches: list[Batch], world: int) -> list[int]:
    """What each rank reads of the values: its share of the schedule."""
    reads = [0] * world
    for b in batches:
        reads[b.reader] += b.nbytes
    return reads


# -- loads on thread ranks ------------------------------------------------------------------------


def test_each_value_is_read_once_and_broadcast(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W)
    plain = _load(world, path, False)
    verdicts = list(world.received)  # the first load's traffic: its verdicts alone
    shared = _load(world, path, True)
    broadcasts = world.calls.count("broadcast")
    batches = _scheduled(path, _values(), W)
    expected = _shares(batches, W)
    for rank, (read, target) in enumerate(shared):
        _exact(target, rank)
        _exact(plain[rank][1], rank)
        assert read == expected[rank]  # its share of the values, nothing else
        assert plain[rank][0] >= sum(SIZES.values())
        # it receives the three others' values, and verdicts as the first load did
        got = world.received[rank] - 2 * verdicts[rank]
        assert got == sum(SIZES.values()) - expected[rank]
    assert sum(expected) == sum(SIZES.values()) and max(expected) < sum(SIZES.values())
    assert broadcasts == len(batches) >= 3  # 4 values, at most one reader idle


def test_scheduling_the_values_fetches_no_checksum(tmp_path: Path, monkeypatch) -> None:
    """Where each value lies is read off its index rows: the rows' checksums, which
    their writers keep (format version 5), are fetched once per group for the load,
    never once per value to schedule it (10,000 small values cost a read each)."""
    from shardwise.checkpoint.format import index as writer_checksums

    keys = [f"v{i}" for i in range(40)]
    path = tmp_path / "ck"
    world = ThreadedWorld(W)
    world.run(
        lambda comm: save_state({k: torch.full((8,), 1.0) for k in keys}, path, Agreement(comm))
    )
    fetches: list[int] = []
    real = writer_checksums.fetch_slots

    def counted(*args: Any) -> Any:
        fetches.append(len(args[-1].at))
        return real(*args)

    monkeypatch.setattr(writer_checksums, "fetch_slots", counted)

    loaded = _load(world, path, True, lambda _rank, _salt: {k: torch.zeros(8) for k in keys})
    for _read, target in loaded:
        assert all(torch.equal(v, torch.ones(8)) for v in target.values())
    assert len(fetches) == W  # one group per rank: each rank checks every value's rows
    assert fetches == [40] * W


def test_other_values_load_beside_the_broadcast_ones(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _saved(path, _with_weight)
    world = ThreadedWorld(W)
    for rank, (_read, target) in enumerate(_load(world, path, True, _with_weight)):
        _exact(target, rank)  # the weight's rows read by each rank, the values sent
    assert world.calls.count("broadcast") == len(_scheduled(path, _values(), W))


def test_one_rank_loading_a_value_otherwise_broadcasts_nothing(tmp_path: Path) -> None:
    """Every rank must name the same values: here rank 2 loads "c" by rows."""
    path = tmp_path / "ck"
    _saved(path)

    def state_of(rank: int, salt: float) -> dict[str, Any]:
        state = _state(rank, salt)
        if rank == 2:
            layout = Layout.chunked((500,), 0, W)
            state["c"] = ShardedTensor.from_layout(
                layout, shard_of(state["c"], layout, rank), rank=rank
            )
        return state

    world = ThreadedWorld(W)
    loaded = _load(world, path, True, state_of)
    assert "broadcast" not in world.calls
    for rank, (read, target) in enumerate(loaded):
        if rank == 2:
            assert torch.equal(target["c"].local_shards()[0], _values()["c"][250:375])
        else:
            _exact(target, rank)
        assert read >= (8_500 if rank == 2 else 10_000)  # each its own values, whole


def test_auto_broadcasts_from_an_object_store_not_from_a_local_folder(tmp_path: Path) -> None:
    local = tmp_path / "ck"
    _saved(local)
    world = ThreadedWorld(W)
    for _read, target in _load(world, local, None):
        assert torch.equal(target["a"], _values()["a"])
    assert "broadcast" not in world.calls  # one host, a local folder: its page cache

    remote = f"memory://replicated-{os.getpid()}-{id(tmp_path)}/ck"
    _saved(remote)
    world = ThreadedWorld(W)
    loaded = _load(world, remote, None)
    batches = _scheduled(remote, _values(), W)
    # rank 0's records (their size, then their bytes: `read_once.records`), then each batch
    assert world.calls.count("broadcast") == 2 + len(batches)
    assert world.calls[:3] == ["broadcast", "broadcast", "all_reduce"]
    for rank, (read, target) in enumerate(loaded):
        _exact(target, rank)
        assert read == _shares(batches, W)[rank]


def test_a_corrupt_value_fails_every_rank_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _saved(path)
    (chunk,) = Manifest.read(path).tensors["b"].chunks
    assert chunk.payload is not None
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + 5)
        f.write(b"\xff\xff")
    world = ThreadedWorld(W)

    def one(comm: ThreadedRank) -> str:
        with pytest.raises(CorruptCheckpointError) as caught:
            load_state(
                _state(comm.rank, -1.0),
                path,
                Agreement(comm),
                strict=True,
                verify=True,
                cast_dtype=False,
                broadcast=True,
            )
        return str(caught.value)

    messages = world.run(one)
    batches = _scheduled(path, _values(), W)
    assert world.calls.count("broadcast") == len(batches)  # every rank made every one
    (reader,) = [b.reader for b in batches if "b" in b.keys]  # the one rank that read "b"
    assert len(set(messages)) == 1
    assert messages[0].startswith(f"rank {reader}: 'b': bytes ") and chunk.file in messages[0]


# -- torch.distributed --------------------------------------------------------------------------


def _gloo_rank(rank: int, world: int, folder: str) -> tuple[int, bool]:
    values = _gloo_values()
    swc.save(values, folder)
    target = {k: torch.zeros_like(v) for k, v in values.items()}
    info = swc.load(target, folder, broadcast_replicated=True)
    return info.bytes_read, all(torch.equal(target[k], values[k]) for k in values)


def _gloo_values() -> dict[str, torch.Tensor]:
    return {f"v{i}": torch.full((1000 * (i + 1),), float(i)) for i in range(3)}


def test_gloo_ranks_read_their_share_and_receive_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    results = run_ranks(_gloo_rank, 3, str(path), timeout=60)
    shares = _shares(_scheduled(path, _gloo_values(), 3), 3)
    assert sorted(shares) == [4_000, 8_000, 12_000]  # a value each: 3 values, 3 ranks
    assert results == [(share, True) for share in shares]


def _device_rank(rank: int, world: int, folder: str) -> tuple[int, bool]:
    """Targets on this rank's CUDA device (NCCL: GPU `rank`; gloo: GPU 0)."""
    device = torch.device("cuda", torch.cuda.current_device())
    values = _gloo_values()
    swc.save(values, folder)
    target = {k: torch.zeros_like(v, device=device) for k, v in values.items()}
    info = swc.load(target, folder, broadcast_replicated=True)
    exact = all(t.device == device and torch.equal(t.cpu(), values[k]) for k, t in target.items())
    return info.bytes_read, exact


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_cuda_targets_are_read_once_where_the_group_carries_them(
    tmp_path: Path, backend: str
) -> None:
    """Over NCCL a value is read into its reader's device and broadcast device to
    device; over gloo (no CUDA backend) each rank reads its own CUDA targets."""
    if not torch.cuda.is_available() or (backend == "nccl" and torch.cuda.device_count() < 3):
        pytest.skip("needs CUDA (3 GPUs for NCCL)")
    path = tmp_path / "ck"
    results = run_ranks(_device_rank, 3, str(path), timeout=120, backend=backend)
    if backend == "nccl":
        shares = _shares(_scheduled(path, _gloo_values(), 3), 3)
        assert results == [(share, True) for share in shares]
    else:
        assert results == [(24_000, True)] * 3

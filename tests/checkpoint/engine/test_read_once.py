"""`engine.read_once`: each stored chunk several ranks need is read by one of them and
its parts sent to the others (DP replicas of TP shards, HSDP, a row-wise checkpoint
loaded column-wise).

Thread ranks on the in-process communicator (`received` counts the bytes each rank
gets over the wire, `calls` every collective) and spawned gloo ranks with DTensors
on a real DP × TP mesh. Each test checks the values bit for bit and the exact bytes
each rank read from storage.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine import read_once
from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io import chunks
from shardwise.comm.agreement import Agreement
from shardwise.comm.in_process import ThreadedRank, ThreadedWorld
from shardwise.errors import CorruptCheckpointError, InvalidArgumentError
from shardwise.storage import LocalFolder
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned  # one test spawns gloo ranks; the module is marked whole
W = 4
SHAPE = (8, 6)
FULL = {k: torch.arange(48.0).reshape(SHAPE) * (i + 1) for i, k in enumerate("abc")}
ROWS = Layout.chunked(SHAPE, 0, W)  # saved: 2 rows a rank
COLUMNS = Layout.column_wise(SHAPE, [2, 1, 2, 1])  # loaded: a band of every stored row chunk
# DP 2 x TP 2: rank r holds row half r % 2 (ranks 0 and 2 the top, 1 and 3 the bottom)
DP_TP = Layout(SHAPE, {r: [Block((4 * (r % 2), 0), (4, 6))] for r in range(W)}, W)
NBYTES = 48 * 4  # one tensor's stored bytes


@pytest.fixture(autouse=True)
def _no_gaps(monkeypatch) -> None:
    """Chunks near each other in a file are read with the gap between (`io.chunks.GAP`):
    without that, the bytes each rank reads are exactly the chunks it reads."""
    monkeypatch.setattr(chunks, "GAP", 0)


def _state(layout: Layout, rank: int, fill: bool) -> dict[str, Any]:
    out = {}
    for key, full in FULL.items():
        shards = shard_of(full if fill else torch.full(SHAPE, -1.0), layout, rank)
        out[key] = ShardedTensor.from_layout(layout, shards, rank=rank)
    return out


def _saved(path: Path, layout: Layout = ROWS) -> None:
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_state(layout, comm.rank, True), path, Agreement(comm)))


def _load_one(
    comm: ThreadedRank, target: dict[str, Any], path: Path, once: bool | None, cast: bool = False
) -> int:
    """`target` loaded on this thread rank; the bytes it read."""
    read, _ = load_state(
        target, path, Agreement(comm), strict=True, verify=True, cast_dtype=cast, broadcast=once
    )
    return read


def _failures(
    world: ThreadedWorld, path: Path, layout: Layout, kind: type[BaseException]
) -> list[BaseException | None]:
    """What each rank's forced read-once load raised of `kind` (None: it loaded)."""

    def one(comm: ThreadedRank) -> BaseException | None:
        try:
            _load_one(comm, _state(layout, comm.rank, False), path, True)
        except kind as e:
            return e
        return None

    return world.run(one)


def _load(
    world: ThreadedWorld, path: Path, layout: Layout, once: bool | None
) -> list[tuple[int, dict[str, Any]]]:
    def one(comm: ThreadedRank) -> tuple[int, dict[str, Any]]:
        target = _state(layout, comm.rank, False)
        return _load_one(comm, target, path, once), target

    out = world.run(one)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _exact(target: dict[str, Any], layout: Layout, rank: int) -> None:
    for key, full in FULL.items():
        got = target[key].local_shards()
        want = shard_of(full, layout, rank)
        assert len(got) == len(want), key
        for g, w in zip(got, want):
            assert torch.equal(g, w), (key, rank)


def _exchanged(monkeypatch) -> dict[int, int]:
    """Bytes each rank receives in the read-once exchange (`read_once.run`), filled as
    loads run."""
    got: dict[int, int] = {}
    real = read_once.run

    def counted(comm: Any, executor: Any, plan: Any) -> Any:
        before = comm.world.received[comm.rank]
        out = real(comm, executor, plan)
        got[comm.rank] = got.get(comm.rank, 0) + comm.world.received[comm.rank] - before
        return out

    monkeypatch.setattr(read_once, "run", counted)
    return got


def test_dp_replicas_read_each_stored_chunk_once(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ck"
    _saved(path, DP_TP)  # two stored chunks a tensor: the row halves
    world = ThreadedWorld(W)
    received = _exchanged(monkeypatch)
    plain = _load(world, path, DP_TP, False)
    assert received == {}  # no exchange
    once = _load(world, path, DP_TP, True)
    for rank in range(W):
        _exact(plain[rank][1], DP_TP, rank)
        _exact(once[rank][1], DP_TP, rank)
        assert plain[rank][0] == 3 * NBYTES // 2  # its half of each of the three
    reads = [r for r, _ in once]
    assert sum(reads) == 3 * NBYTES  # every stored byte read once
    # each half's two holders split its three tensors by bytes: one reads two, one reads one
    assert sorted(reads) == [NBYTES // 2, NBYTES // 2, NBYTES, NBYTES]
    # what a rank did not read it received, and nothing else
    assert received == {rank: 3 * NBYTES // 2 - reads[rank] for rank in range(W)}
    assert world.calls.count("send_recv") == 1


def test_a_row_wise_checkpoint_loads_column_wise_reading_each_row_chunk_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ck"
    _saved(path)  # four row chunks a tensor, each needed by all four column ranks
    world = ThreadedWorld(W)
    plain = _load(world, path, COLUMNS, False)
    once = _load(world, path, COLUMNS, True)
    for rank in range(W):
        _exact(once[rank][1], COLUMNS, rank)
        assert plain[rank][0] == 3 * NBYTES  # verified: every row chunk read whole, by all
    assert sum(r for r, _ in once) == 3 * NBYTES
    assert world.calls.count("send_recv") == 1  # one round: 144 bytes a rank


def test_rounds_cut_the_bytes_and_every_rank_takes_part_in_each(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W)
    monkeypatch.setattr(read_once, "BATCH", 100)  # the largest rank's targets: 192 bytes
    for rank, (_read, target) in enumerate(_load(world, path, COLUMNS, True)):
        _exact(target, COLUMNS, rank)
    assert world.calls.count("send_recv") == 2  # ceil(192 / 100)
    monkeypatch.setattr(read_once, "BATCH", 1)
    for rank, (_read, target) in enumerate(_load(world, path, COLUMNS, True)):
        _exact(target, COLUMNS, rank)
    assert world.calls.count("send_recv") == 2 + 3  # a round a key at most


def test_several_blocks_a_rank_and_replicas_of_them(tmp_path: Path, monkeypatch) -> None:
    """Ranks 0 and 3 hold columns 0 and 4 (replicas), rank 1 columns 1 and 5, rank 2
    columns 2 and 3: every stored row chunk is needed by all four, twice by three."""
    cols = [Block((0, c), (8, 1)) for c in range(6)]
    layout = Layout(SHAPE, {0: [cols[0], cols[4]], 1: [cols[1], cols[5]], 2: [cols[2], cols[3]],
                            3: [cols[0], cols[4]]}, W)  # fmt: skip
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W)
    received = _exchanged(monkeypatch)
    once = _load(world, path, layout, True)
    for rank in range(W):
        _exact(once[rank][1], layout, rank)
    reads = [r for r, _ in once]
    assert sum(reads) == 3 * NBYTES  # each row chunk once, whole (a checksum tile)
    assert reads == [3 * NBYTES // W] * W  # a row chunk of each tensor per rank
    # each rank receives its two columns of every row chunk it did not read
    assert received == {r: 3 * 2 * 8 * 4 - 3 * 2 * 2 * 4 for r in range(W)}


def test_a_block_a_rank_holds_twice_fills_both(tmp_path: Path) -> None:
    top, bottom = Block((0, 0), (4, 6)), Block((4, 0), (4, 6))
    layout = Layout(SHAPE, {0: [top, top], 1: [top], 2: [bottom], 3: [bottom]}, W)
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W)
    for rank, (_read, target) in enumerate(_load(world, path, layout, True)):
        _exact(target, layout, rank)
    assert world.calls.count("send_recv") == 1


def test_a_rank_failing_to_make_its_messages_fails_every_rank(tmp_path: Path, monkeypatch) -> None:
    """Rank 1 cannot allocate its scratch (out of memory): it still sends what the
    others wait for, and every rank raises its error, none waits for messages."""
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W, timeout=20)
    real = read_once._read_and_part

    def failing(rank: int, *args: Any) -> Any:
        if rank == 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (simulated)")
        return real(rank, *args)

    monkeypatch.setattr(read_once, "_read_and_part", failing)

    found = _failures(world, path, COLUMNS, RuntimeError)
    assert [type(e).__name__ for e in found] == ["RuntimeError"] * W, found
    assert all("rank 1" in str(e) and "can't allocate memory" in str(e) for e in found)


def test_tensors_on_a_group_no_process_group_describes_load_as_before(tmp_path: Path) -> None:
    """A ShardedTensor on a Communicator (thread ranks) has no global ranks torch knows:
    it takes no part, and the load reads as without the exchange."""
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    world = ThreadedWorld(W)

    def one(comm: ThreadedRank) -> int:
        shards = shard_of(torch.full(SHAPE, -1.0), DP_TP, comm.rank)
        target = {"a": ShardedTensor.from_layout(DP_TP, shards, group=comm, rank=comm.rank)}
        read = _load_one(comm, target, path, True)
        assert torch.equal(target["a"].local_shards()[0], shard_of(FULL["a"], DP_TP, comm.rank)[0])
        return read

    assert world.run(one) == [NBYTES // 2] * W
    assert world.calls.count("send_recv") == 0


def test_one_rank_seeing_a_shared_medium_decides_for_all(tmp_path: Path, monkeypatch) -> None:
    """Where ranks of one host see the folder through different mounts, the verdict
    carries what each sees: all exchange (or none), never some."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # no launcher says "one host"
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    world = ThreadedWorld(W)
    here = threading.local()  # this thread's rank: rank 0's mount is a network file system
    monkeypatch.setattr(
        LocalFolder, "shared_medium", property(lambda self: getattr(here, "rank", -1) == 0)
    )

    def one(comm: ThreadedRank) -> tuple[int, dict[str, Any]]:
        here.rank = comm.rank
        target = _state(DP_TP, comm.rank, False)
        read = _load_one(comm, target, path, None)
        return read, target

    out = world.run(one)
    for rank, (_read, target) in enumerate(out):
        _exact(target, DP_TP, rank)
    assert sum(r for r, _ in out) == 3 * NBYTES  # every byte once: all exchanged
    assert world.calls.count("send_recv") == 1


def test_a_chunk_only_one_rank_needs_is_read_by_it(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _saved(path)
    world = ThreadedWorld(W)
    once = _load(world, path, ROWS, True)  # the saved layout: no chunk has two holders
    for rank in range(W):
        _exact(once[rank][1], ROWS, rank)
        assert once[rank][0] == 3 * NBYTES // W


def test_auto_exchanges_on_a_shared_medium_only(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    world = ThreadedWorld(W)
    local = _load(world, path, DP_TP, None)  # one host, its own disk: each reads its own
    assert [r for r, _ in local] == [3 * NBYTES // 2] * W
    assert world.calls.count("send_recv") == 0
    monkeypatch.setattr(LocalFolder, "shared_medium", property(lambda self: True))
    shared = _load(world, path, DP_TP, None)
    assert sum(r for r, _ in shared) == 3 * NBYTES
    assert world.calls.count("send_recv") == 1
    for rank in range(W):
        _exact(shared[rank][1], DP_TP, rank)


def test_ranks_planning_from_other_facts_exchange_nothing(tmp_path: Path) -> None:
    """Rank 2 casts one tensor (its targets are float64): it cannot take the stored
    bytes as sent, so no rank exchanges anything and each reads its own."""
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    world = ThreadedWorld(W)

    def one(comm: ThreadedRank) -> int:
        target = _state(DP_TP, comm.rank, False)
        if comm.rank == 2:
            shards = [torch.zeros(4, 6, dtype=torch.float64)]
            target["b"] = ShardedTensor.from_layout(DP_TP, shards, rank=2)
        read = _load_one(comm, target, path, True, cast=True)
        if comm.rank == 2:
            assert torch.equal(target["b"].local_shards()[0], FULL["b"][:4].double())
        return read

    reads = world.run(one)
    assert reads == [3 * NBYTES // 2] * W
    assert world.calls.count("send_recv") == 0


def test_a_corrupt_chunk_is_refused_on_every_rank_naming_it(tmp_path: Path) -> None:
    """A flipped bit inside the stored bottom half of "b": its reader finds it and every
    rank raises it, naming tensor, file and byte range (its receiver among them, whose
    own reads were clean)."""
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    payload = FULL["b"][4:].contiguous().numpy().tobytes()
    _refused_by_its_reader(path, lambda raw: raw.find(payload) + 10 if payload in raw else -1)


def _refused_by_its_reader(path: Path, where: Any) -> None:
    """Flip a bit at `where(file bytes)` (-1: not this file) in the one data file that
    has it; every rank then raises a checksum mismatch naming "b" and that file, found
    by the exchange's reader."""
    flipped = []
    for p in sorted(path.glob("*.distcp")):
        raw = bytearray(p.read_bytes())
        at = where(raw)
        if at >= 0:
            raw[at] ^= 0x10
            p.write_bytes(bytes(raw))
            flipped.append(p.name)
    assert len(flipped) == 1
    world = ThreadedWorld(W)
    found = _failures(world, path, DP_TP, CorruptCheckpointError)
    assert all(isinstance(e, CorruptCheckpointError) for e in found), found
    assert all("'b'" in str(e) and flipped[0] in str(e) and "checksum" in str(e) for e in found)
    assert world.calls.count("send_recv") == 1  # found by the exchange's reader


def test_a_network_file_system_is_a_shared_medium(tmp_path: Path) -> None:
    from shardwise.storage.local import file_system_of

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "server:/export /mnt/nfs nfs4 rw 0 0\n"
        "lustre@tcp:/fs /mnt/my\\040lustre lustre rw 0 0\n"
    )
    assert file_system_of("/mnt/nfs/ckpt/step_1", str(mounts)) == "nfs4"
    assert file_system_of("/mnt/my lustre/ckpt", str(mounts)) == "lustre"
    assert file_system_of("/mnt/nfsx", str(mounts)) == "ext4"  # a prefix, not the mount
    assert file_system_of("/x", str(tmp_path / "none")) is None
    stacked = tmp_path / "stacked"  # an automounter's map, then the NFS mount over it
    stacked.write_text("/ / ext4 rw 0 0\nauto.data /data autofs rw 0 0\nsrv:/d /data nfs4 rw 0 0\n")
    assert file_system_of("/data/ck", str(stacked)) == "nfs4"  # the later one is in effect
    assert LocalFolder(tmp_path).shared_medium is False  # this machine's tmp: a local disk


def test_read_once_takes_auto_true_or_false(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="read_once='sometimes'"):
        swc.load({}, tmp_path, read_once="sometimes")


# -- gloo ranks, DTensors on a DP x TP mesh ----------------------------------------------


def _dp_tp(rank: int, world: int, path: str) -> tuple[list[int], bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    chunks.GAP = 0  # as `_no_gaps`, in this process
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = {k: torch.arange(64.0 * 6).reshape(64, 6) * (i + 1) for i, k in enumerate("xyz")}
    place = (Replicate(), Shard(0))
    swc.save({k: distribute_tensor(v, mesh, place) for k, v in full.items()}, path)
    reads = []
    ok = True
    for once in (False, True):
        targets = {k: distribute_tensor(torch.zeros(64, 6), mesh, place) for k in full}
        info = swc.load(targets, path, read_once=once)
        reads.append(info.bytes_read)
        ok &= all(torch.equal(targets[k].full_tensor(), v) for k, v in full.items())
    return reads, ok


def test_dtensor_dp_tp_on_gloo_ranks(tmp_path: Path) -> None:
    out = run_ranks(_dp_tp, W, os.fspath(tmp_path / "ck"), timeout=120)
    stored = 3 * 64 * 6 * 4
    assert all(ok for _reads, ok in out)
    assert [reads[0] for reads, _ok in out] == [stored // 2] * W  # each its TP half
    assert sum(reads[1] for reads, _ok in out) == stored  # each byte once


def _per_rank_records(rank: int, world: int, path: str, once: bool | None) -> Any:
    """Stock `dcp.save(use_collectives=False)`: each rank's own records; the DP replicas
    saved different values, so each rank must load its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    mine = FULL["a"] + 100 * rank
    if once is None:
        state = {"a": ShardedTensor.from_layout(DP_TP, shard_of(mine, DP_TP, rank), rank=rank)}
        dcp.save(state, storage_writer=FileSystemWriter(path), use_collectives=False)
        return None
    target = {"a": ShardedTensor.from_layout(DP_TP, [torch.zeros(4, 6)], rank=rank)}
    swc.load(target, path, read_once=once)
    return torch.equal(target["a"].local_shards()[0], shard_of(mine, DP_TP, rank)[0])


def test_per_rank_records_are_each_ranks_own(tmp_path: Path) -> None:
    path = os.fspath(tmp_path / "ck")
    run_ranks(_per_rank_records, W, path, None, timeout=120)
    assert run_ranks(_per_rank_records, W, path, True, timeout=120) == [True] * W


# -- the records, read once on an object store ---------------------------------------------


@pytest.fixture
def store(monkeypatch) -> Any:
    """A folder on fsspec's in-memory filesystem (shared by the thread ranks, an object
    store to shardwise), and the listings and whole-or-ranged reads made of each file
    (`calls[(method, file name)]`), counted below `FsspecFolder`."""
    import collections
    import uuid

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    calls: collections.Counter = collections.Counter()
    lock = threading.Lock()
    for method in ("ls", "cat_file"):
        real = getattr(MemoryFileSystem, method)

        def counted(self: Any, path: str, *a: Any, _real: Any = real, _m: str = method, **k: Any):
            with lock:
                calls[(_m, path.rstrip("/").rsplit("/", 1)[-1])] += 1
            return _real(self, path, *a, **k)

        monkeypatch.setattr(MemoryFileSystem, method, counted)
    root = f"/sw-once-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}/ck", calls
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _memory_load(world: ThreadedWorld, url: str, layout: Layout, once: bool | None) -> list[Any]:
    def one(comm: ThreadedRank) -> Any:
        target = _state(layout, comm.rank, False)
        load_state(target, url, Agreement(comm), strict=True, verify=True,
                   cast_dtype=False, broadcast=once)  # fmt: skip
        _exact(target, layout, comm.rank)

    return world.run(one)


def test_on_an_object_store_one_rank_lists_and_reads_the_records_for_all(store) -> None:
    url, calls = store
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_state(DP_TP, comm.rank, True), url, Agreement(comm)))
    calls.clear()
    assert _memory_load(world, url, DP_TP, False) == [None] * W
    # each rank alone: its listing, the manifest, the tail of .metadata, its index sections
    assert calls[("ls", "ck")] == W
    assert calls[("cat_file", "shardwise.json")] == W
    assert calls[("cat_file", ".metadata")] == W
    index = Manifest.read(url).index
    assert index is not None
    records = {"shardwise.json", ".metadata", index.file}
    assert calls[("cat_file", index.file)] >= W  # its sections: a read a run of them

    for once in (None, True):
        calls.clear()
        world.calls.clear()
        assert _memory_load(world, url, DP_TP, once) == [None] * W
        assert calls[("ls", "ck")] == 1  # rank 0 lists and reads them, sends them to all
        assert {n: calls[("cat_file", n)] for n in records} == dict.fromkeys(records, 1)
        assert world.calls[:2] == ["broadcast", "broadcast"]  # their size, then their bytes


def test_every_rank_raises_what_the_rank_reading_the_records_found(store) -> None:
    url, calls = store
    (alone,) = ThreadedWorld(1).run(lambda comm: _memory_load_caught(comm, url))
    assert isinstance(alone, swc.CheckpointNotFoundError), alone
    lone = dict(calls)  # what one rank's search for the records costs
    calls.clear()
    world = ThreadedWorld(W)
    got = world.run(lambda comm: _memory_load_caught(comm, url))
    assert all(isinstance(e, swc.CheckpointNotFoundError) for e in got), got
    assert all(str(e) == str(got[0]) == f"rank 0: {alone}" for e in got)
    assert dict(calls) == lone  # rank 0's alone
    assert world.calls[:1] == ["broadcast"]  # "not read": no bytes follow


def _memory_load_caught(comm: ThreadedRank, url: str) -> BaseException | None:
    try:
        load_state(_state(DP_TP, comm.rank, False), url, Agreement(comm), strict=True,
                   verify=True, cast_dtype=False, broadcast=None)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return e
    return None


class NoCredentials(Exception):
    """What botocore raises where no credential is found: not an OSError."""


def test_rank_0_failing_with_any_exception_fails_every_rank_without_a_hang(
    store, monkeypatch
) -> None:
    """A failure only rank 0 meets (a credential an object store refuses, raised as
    botocore's own exception, not an OSError) is raised on every rank by the verdict."""
    from fsspec.implementations.memory import MemoryFileSystem

    url, _calls = store
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_state(DP_TP, comm.rank, True), url, Agreement(comm)))

    def refused(self: Any, path: str, *a: Any, **k: Any) -> Any:
        raise NoCredentials("Unable to locate credentials")

    with monkeypatch.context() as patched:  # undone before the store's own cleanup
        patched.setattr(MemoryFileSystem, "ls", refused)
        got = world.run(lambda comm: _memory_load_caught(comm, url))
    assert all(isinstance(e, NoCredentials) for e in got), got
    assert all(str(e) == "rank 0: Unable to locate credentials" for e in got), got


def test_records_past_the_bound_are_read_by_every_rank_itself(store, monkeypatch) -> None:
    url, calls = store
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_state(DP_TP, comm.rank, True), url, Agreement(comm)))
    monkeypatch.setattr(read_once, "SHARED_BYTES", 100)  # the manifest alone is larger
    calls.clear()
    world.calls.clear()
    assert _memory_load(world, url, DP_TP, None) == [None] * W
    assert calls[("ls", "ck")] == W  # each rank lists and reads them, as without sharing
    assert calls[("cat_file", "shardwise.json")] == W
    assert world.calls[:2] == ["broadcast", "all_reduce"]  # "each reads them": no bytes


BIG = (256, 64)  # 32 KiB a row half: the bytes between two payloads of a file are < 10%
BIG_FULL = {k: torch.arange(256 * 64.0).reshape(BIG) + i for i, k in enumerate("wxyz")}
BIG_DP_TP = Layout(BIG, {r: [Block((128 * (r % 2), 0), (128, 64))] for r in range(W)}, W)


def _big(rank: int, fill: bool, full: dict[str, torch.Tensor] = BIG_FULL) -> dict[str, Any]:
    return {
        k: ShardedTensor.from_layout(
            BIG_DP_TP, shard_of(f if fill else torch.full(BIG, -1.0), BIG_DP_TP, rank), rank=rank
        )
        for k, f in full.items()
    }


def _big_load(
    comm: ThreadedRank, url: str, once: bool | None, fulls: dict[str, torch.Tensor] = BIG_FULL
) -> None:
    target = _big(comm.rank, False, fulls)
    load_state(target, url, Agreement(comm), strict=True, verify=True, cast_dtype=False,
               broadcast=once)  # fmt: skip
    for k, full in fulls.items():
        (got,) = target[k].local_shards()
        (want,) = shard_of(full, BIG_DP_TP, comm.rank)
        assert torch.equal(got, want), (k, comm.rank)


def test_on_an_object_store_each_data_file_is_one_request(store) -> None:
    """DP 2 x TP 2, four tensors: each replica pair's chunks lie in two files (its two
    writers'), and each file is read by one of the pair, its chunks and the checksums
    their writer keeps after them in one ranged GET. The other rank fetches neither."""
    url, calls = store
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_big(comm.rank, True), url, Agreement(comm)))
    index = Manifest.read(url).index
    assert index is not None
    records = {"shardwise.json", ".metadata", index.file}

    def data() -> dict[str, int]:
        return {n: c for (m, n), c in calls.items() if m == "cat_file" and n not in records}

    calls.clear()
    assert world.run(lambda comm: _big_load(comm, url, False)) == [None] * W
    alone = data()
    assert len(alone) == W  # one data file a writer
    # each file by both ranks of its pair: its chunks, then (planning) its checksums
    assert alone == dict.fromkeys(alone, 4)
    calls.clear()
    assert world.run(lambda comm: _big_load(comm, url, None)) == [None] * W
    assert data() == dict.fromkeys(alone, 1)
    assert {n: calls[("cat_file", n)] for n in records} == dict.fromkeys(records, 1)
    assert calls[("ls", "ck")] == 1


def test_a_corrupt_checksum_its_writer_keeps_is_found_by_the_reader(tmp_path: Path) -> None:
    """The checksum kept for the bottom half of "b", flipped in its writer's file: the
    rank reading that chunk fetches it (its receiver never does) and every rank raises
    the mismatch, naming tensor and file."""
    import crc32c

    path = tmp_path / "ck"
    _saved(path, DP_TP)
    kept = crc32c.crc32c(FULL["b"][4:].contiguous().numpy().tobytes()).to_bytes(4, "little")
    _refused_by_its_reader(path, lambda raw: raw.rfind(kept))


def test_a_files_chunks_go_to_one_reader_unless_it_is_too_large() -> None:
    members = (3, 5)
    turn = read_once.zlib.crc32(repr(members).encode()) % 2
    a, b = members[turn], members[1 - turn]
    # two files of two chunks: one reader each, not a chunk of each file to each
    assert read_once._readers(members, [4, 4, 4, 4], ["f", "f", "g", "g"]) == [a, a, b, b]
    # one file of everything: cut between the members as before, chunk by chunk
    assert read_once._readers(members, [4, 4, 4, 4], ["f"] * 4) == [a, a, b, b]
    # a file of 6 of 8 bytes (past 5/4 of a share of 4): g whole to the first, then
    # f's chunks fill the first up to its share and the rest go to the other
    assert read_once._readers(members, [2, 2, 2, 2], ["f", "f", "f", "g"]) == [a, b, b, a]
    # 5 of 8 (5/4 of a share): whole to one reader, the rest to the other
    assert read_once._readers(members, [3, 2, 3], ["f", "f", "g"]) == [a, a, b]


def test_a_few_files_more_than_readers_leave_no_reader_far_past_its_share() -> None:
    """17 files of 4 equal chunks for 16 readers: 16 whole files, one to each, and the
    last cut by chunks among the first four (the slowest reader sets the time)."""
    files = [f"f{i}" for i in range(17) for _ in range(4)]
    got = read_once._readers(tuple(range(16)), [1] * len(files), files)
    per = [got.count(r) for r in range(16)]
    assert sum(per) == 68 and max(per) == 5 and min(per) == 4  # shares of 4.25 chunks
    whole = {name for name in set(files) if len({g for g, f in zip(got, files) if f == name}) == 1}
    assert whole == {f"f{i}" for i in range(16)}
    assert sorted(got[-4:]) == sorted(got[0:16:4])  # f16's chunks: f0's to f3's readers


def test_kept_checksums_past_a_files_end_are_refused_unverified_too(tmp_path: Path) -> None:
    """Each data file cut short by its last checksum: every rank refuses it at planning,
    `verify=False` or not, exchange or not (the rank that would fetch a checksum is not
    the only one that checks where it lies)."""
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    index = Manifest.read(path).index
    assert index is not None
    for p in path.glob("*.distcp"):
        if p.name != index.file:
            p.write_bytes(p.read_bytes()[:-4])
    world = ThreadedWorld(W)
    for once in (False, True):

        def one(comm: ThreadedRank, once: bool = once) -> BaseException | None:
            try:
                load_state(_state(DP_TP, comm.rank, False), path, Agreement(comm), strict=True,
                           verify=False, cast_dtype=False, broadcast=once)  # fmt: skip
            except CorruptCheckpointError as refused:
                return refused
            return None

        world.calls.clear()
        got = world.run(one)
        assert all(isinstance(e, CorruptCheckpointError) for e in got), (once, got)
        assert all("chunk checksums" in str(e) and "lie past its end" in str(e) for e in got)
        assert "send_recv" not in world.calls  # refused before any read


def test_rounds_fetch_each_files_checksums_once(store, monkeypatch) -> None:
    """Eight rounds (a key each; each data file holds 4 of the 8 keys' chunks): a
    reader fetches the checksums of all its rounds' chunks in the first, one request
    per file, not one per round; each round's chunk is a request of its own."""
    url, calls = store
    fulls = {f"k{i}": torch.arange(256 * 64.0).reshape(BIG) + i for i in range(8)}
    world = ThreadedWorld(W)
    world.run(lambda comm: save_state(_big(comm.rank, True, fulls), url, Agreement(comm)))
    index = Manifest.read(url).index
    assert index is not None
    records = {"shardwise.json", ".metadata", index.file}
    monkeypatch.setattr(read_once, "BATCH", 32 << 10)  # a rank holds 8 x 32 KiB: 8 rounds
    calls.clear()
    world.calls.clear()
    assert world.run(lambda comm: _big_load(comm, url, None, fulls)) == [None] * W
    assert world.calls.count("send_recv") == 8
    data = {n: c for (m, n), c in calls.items() if m == "cat_file" and n not in records}
    assert len(data) == W
    # each file: its 4 chunks, one a round, and one request for their 4 checksums (the
    # first round's chunk lies far from them; per round they were 3 requests more)
    assert data == dict.fromkeys(data, 5)


def test_no_section_is_held_while_the_exchange_runs(tmp_path: Path, monkeypatch) -> None:
    """What a rank keeps of a chunk it plans without its checksums is the chunk's entry
    and where they lie, not its section: sections are let go group by group as the
    load plans (`engine.stored.GROUP`), whatever the rounds after."""
    import gc

    from shardwise.checkpoint.format.table import ChunkTable

    path = tmp_path / "ck"
    _saved(path, ROWS)
    alive: list[int] = []
    real = read_once.run

    def counted(comm: Any, executor: Any, plan: Any) -> Any:
        gc.collect()
        alive.append(sum(isinstance(o, ChunkTable) for o in gc.get_objects()))
        return real(comm, executor, plan)

    monkeypatch.setattr(read_once, "run", counted)
    for rank, (_read, target) in enumerate(_load(ThreadedWorld(W), path, COLUMNS, True)):
        _exact(target, COLUMNS, rank)
    assert alive == [0] * W


def test_a_chunk_two_pieces_of_a_rank_take_part_of_is_checked_once(tmp_path: Path) -> None:
    """Rank 0 holds its stored two rows as two one-row blocks: the chunk is planned for
    each piece, its kept checksums fetched once and checked for both (two fetches of
    one slot would look like two chunks' checksums overlapping)."""
    path = tmp_path / "ck"
    _saved(path, ROWS)
    split = {r: [Block((2 * r, 0), (2, 6))] for r in range(W)}
    split[0] = [Block((0, 0), (1, 6)), Block((1, 0), (1, 6))]
    layout = Layout(SHAPE, split, W)
    for verify in (True, False):

        def one(comm: ThreadedRank, verify: bool = verify) -> dict[str, Any]:
            target = _state(layout, comm.rank, False)
            load_state(target, path, Agreement(comm), strict=True, verify=verify,
                       cast_dtype=False, broadcast=True)  # fmt: skip
            return target

        for rank, target in enumerate(ThreadedWorld(W).run(one)):
            assert not isinstance(target, BaseException), target
            _exact(target, layout, rank)


def _state_on(layout: Layout, rank: int, device: str) -> dict[str, Any]:
    """Empty targets (-1) of `layout` on `device`."""
    out = {}
    for key in FULL:
        shards = [s.to(device) for s in shard_of(torch.full(SHAPE, -1.0), layout, rank)]
        out[key] = ShardedTensor.from_layout(layout, shards, rank=rank)
    return out


def _exact_on(target: dict[str, Any], layout: Layout, rank: int, device: str) -> None:
    for key, full in FULL.items():
        got = target[key].local_shards()
        want = shard_of(full, layout, rank)
        assert [g.device.type for g in got] == [device] * len(want), key
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), (key, rank)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["dp-tp", "rows-to-columns"])
def test_targets_on_each_device_are_read_once(
    tmp_path: Path, monkeypatch, device: str, name: str
) -> None:
    """CUDA targets take part: the bytes read for others travel in host memory and
    each rank copies its own to its device once (the same bytes read, sent and
    received as CPU targets)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    saved, loaded = (DP_TP, DP_TP) if name == "dp-tp" else (ROWS, COLUMNS)
    path = tmp_path / "ck"
    _saved(path, saved)
    world = ThreadedWorld(W)
    received = _exchanged(monkeypatch)

    def one(comm: ThreadedRank) -> tuple[int, dict[str, Any]]:
        target = _state_on(loaded, comm.rank, device)
        return _load_one(comm, target, path, True), target

    out = world.run(one)
    for rank, (_read, target) in enumerate(out):
        _exact_on(target, loaded, rank, device)
    assert sum(read for read, _t in out) == 3 * NBYTES  # every stored byte read once
    held = [sum(s.numel() * 4 for s in shard_of(FULL["a"], loaded, r)) * 3 for r in range(W)]
    if name == "dp-tp":  # what a rank did not read it received
        assert received == {r: held[r] - out[r][0] for r in range(W)}
    else:  # a rank reads whole row chunks: it receives its band of the three others
        assert received == {r: held[r] * 3 // 4 for r in range(W)}
    assert world.calls.count("send_recv") == 1


def test_targets_that_cannot_take_bytes_in_place_are_filled_through_scratch(
    tmp_path: Path, monkeypatch
) -> None:
    """Every target staged as a CUDA target is (`_staged`: received into scratch, then
    copied; the reader's own part copied from its read): the same values and bytes."""
    monkeypatch.setattr(read_once, "_staged", lambda t: True)
    staged: list[tuple[int, ...]] = []
    real = read_once._scratch

    def counted(shape: Any, dtype: torch.dtype, device_bound: bool) -> torch.Tensor:
        staged.append(tuple(torch.Size(shape if not isinstance(shape, int) else [shape])))
        return real(shape, dtype, device_bound)

    monkeypatch.setattr(read_once, "_scratch", counted)
    path = tmp_path / "ck"
    _saved(path, DP_TP)
    world = ThreadedWorld(W)
    once = _load(world, path, DP_TP, True)
    for rank in range(W):
        _exact(once[rank][1], DP_TP, rank)
    assert sum(r for r, _ in once) == 3 * NBYTES
    # each of the 6 stored halves: its reader reads it straight into its own target (a
    # CPU target), its other holder receives it into a (4, 6) scratch
    assert sorted(staged) == [(4, 6)] * 6

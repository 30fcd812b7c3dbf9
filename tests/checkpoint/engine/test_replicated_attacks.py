"""Attacks on `engine.load` (issue 22): loads where ranks could call different
collectives (a hang), broadcast different sizes, or end with wrong values silently.

Thread ranks time out after `T` seconds, so a hang fails fast (`BrokenBarrierError`);
one spawned gloo run checks torch.distributed's broadcast on subgroups. Values are
checked bit for bit, against what the same load without broadcasts gives.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint import api as edge
from shardwise.checkpoint.engine.load import Batch, load_state, placed, schedule
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.engine.stored import StoredView
from shardwise.checkpoint.format.manifest import Manifest, seal
from shardwise.checkpoint.format.table import encode_section
from shardwise.comm.agreement import Agreement
from shardwise.errors import ArgumentMismatchError, CorruptCheckpointError
from shardwise.storage import open_folder
from shardwise.testing import run_ranks, shard_of

from ...comm.threaded_world import ThreadedRank, ThreadedWorld

pytestmark = pytest.mark.spawned  # one test spawns gloo ranks; the module is marked whole
T = 5.0  # seconds a thread rank waits for the others: a hang fails fast


def _save(path: Path, state_of: Any, world: int) -> None:
    results = ThreadedWorld(world, T).run(
        lambda comm: save_state(state_of(comm.rank), path, Agreement(comm))
    )
    assert not any(isinstance(r, Exception) for r in results), results


def _load(
    path: Path, target_of: Any, world: int, broadcast: bool | None, **kw: Any
) -> tuple[ThreadedWorld, list[Any]]:
    """Each rank's (bytes read, targets), or the exception it raised."""
    tw = ThreadedWorld(world, T)

    def one(comm: ThreadedRank) -> tuple[int, dict[str, Any]]:
        target = target_of(comm.rank)
        options = {"strict": True, "cast_dtype": False, **kw}
        read, _ = load_state(
            target, path, Agreement(comm), verify=True, broadcast=broadcast, **options
        )
        return read, target

    return tw, tw.run(one)


def _outcome(result: Any) -> tuple[str, str]:
    """An exception as (type name, message); `BrokenBarrierError` is a hang."""
    assert isinstance(result, Exception), result
    return type(result).__name__, str(result)


def _batches(path: Path, values: dict[str, torch.Tensor], world: int) -> list[Batch]:
    return schedule(placed(StoredView.read(open_folder(path), 0), values), world)


def _one_error(results: list[Any]) -> tuple[str, str]:
    """The error every rank raised, the same on all (a rank left waiting in a
    collective raises `BrokenBarrierError`: a hang)."""
    outcomes = [_outcome(r) for r in results]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert outcomes[0][0] != "BrokenBarrierError", outcomes
    return outcomes[0]


def _shares(path: Path, values: dict[str, torch.Tensor], world: int) -> list[int]:
    """What each rank reads of `values`: its share of the schedule."""
    reads = [0] * world
    for b in _batches(path, values, world):
        reads[b.reader] += b.nbytes
    return reads


def _reads_its_share(read: int, share: int) -> bool:
    """A reader reads its values' records (their bytes, with the padding between small
    records read with them); a rank with no share reads nothing."""
    return read >= share if share else read == 0


# -- hangs: a rank whose targets differ in a way the agreed hash does not see ------------------


def _odd_target(kind: str) -> torch.Tensor:
    if kind == "conjugate view":
        return torch.zeros(6, dtype=torch.complex64).conj()  # is_conj(): no byte view
    return torch.zeros(6).to_mkldnn()  # an opaque layout, on the CPU, "contiguous"


@pytest.mark.parametrize("kind", ["conjugate view", "mkldnn"])
def test_an_odd_target_on_one_rank_fails_every_rank_as_without_broadcast(
    tmp_path: Path, kind: str
) -> None:
    """Rank 1's target has the key's shape, dtype and device, "contiguous", but no
    byte view: the load must fail on every rank as it does without broadcasts (the
    read verdict names rank 1), never leave rank 0 waiting in a broadcast."""
    if kind == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")
    path = tmp_path / "ck"
    dtype = torch.complex64 if kind == "conjugate view" else torch.float32
    saved = (torch.arange(6.0) * 3).to(dtype)
    _save(path, lambda r: {"z": saved.clone()}, 2)

    def target_of(rank: int) -> dict[str, Any]:
        return {"z": _odd_target(kind) if rank == 1 else torch.zeros(6, dtype=dtype)}

    _, without = _load(path, target_of, 2, False)
    assert _one_error(without)[1].startswith("rank 1: ")
    _, got = _load(path, target_of, 2, True)
    assert _one_error(got)[1].startswith("rank 1: ")  # not rank 0 left in a broadcast


def test_a_conjugate_view_on_every_rank_fails_as_without_broadcast(tmp_path: Path) -> None:
    """Every rank's target a conjugate view: the same error as without broadcasts (the
    read verdict's, naming every rank), not a bare RuntimeError out of `send`."""
    path = tmp_path / "ck"
    z = torch.arange(6.0).to(torch.complex64) * (1 + 2j)
    _save(path, lambda r: {"z": z.clone()}, 2)

    def target_of(rank: int) -> dict[str, Any]:
        return {"z": torch.zeros(6, dtype=torch.complex64).conj()}

    _, without = _load(path, target_of, 2, False)
    kind, message = _one_error(without)
    assert message.startswith("rank 0: ") and "; rank 1: " in message
    _, got = _load(path, target_of, 2, True)
    kind, message = _one_error(got)  # not a bare RuntimeError
    assert message.startswith("rank 0: ") and "; rank 1: " in message


def test_tied_targets_on_one_rank_fail_every_rank_as_without_broadcast(tmp_path: Path) -> None:
    """The reader of "t1" and "t2" (one packed batch) holds them as one tensor (tied);
    the other rank holds two. Stored apart, "t1" and "t2" differ: the tied rank's reads
    fail their checksums (each lands on the other), and every rank raises that, as
    without broadcasts: the untied rank is never left with one's values in the other."""
    path = tmp_path / "ck"
    saved = {"a": torch.arange(1000.0), "t1": torch.arange(4.0), "t2": torch.arange(50.0, 54.0)}
    _save(path, lambda r: {k: v.clone() for k, v in saved.items()}, 1)
    (packed,) = [b for b in _batches(path, saved, 2) if {"t1", "t2"} <= set(b.keys)]

    def target_of(rank: int) -> dict[str, Any]:
        t1 = torch.zeros(4)
        t2 = t1 if rank == packed.reader else torch.zeros(4)
        return {"a": torch.zeros(1000), "t1": t1, "t2": t2}

    _, alone = _load(path, target_of, 2, False)
    kind, message = _one_error(alone)
    assert kind == "CorruptCheckpointError" and message.startswith(f"rank {packed.reader}: ")
    assert message.endswith("fail their checksum")
    tw, got = _load(path, target_of, 2, True)
    kind, message = _one_error(got)  # which of the two fails first is the executor's order
    assert kind == "CorruptCheckpointError" and message.startswith(f"rank {packed.reader}: ")
    assert message.endswith("fail their checksum") and "broadcast" in tw.calls


# -- untrusted input: a crafted index ---------------------------------------------------------

YS = torch.arange(12.0).reshape(2, 6) + 100
YROWS = Layout.chunked((2, 6), 0, 2)


def _x_and_y_rows(rank: int, x: torch.Tensor | None = None, y: torch.Tensor = YS) -> Any:
    """ "x" whole on every rank, "y" by rows: rank r holds row r."""
    x = torch.arange(6.0) if x is None else x
    return {"x": x, "y": ShardedTensor.from_layout(YROWS, shard_of(y, YROWS, rank), rank=rank)}


def test_a_crafted_index_refused_without_broadcast_is_refused_with_it(tmp_path: Path) -> None:
    """The index says "x"'s chunk is the bytes of "y"'s row 1 (sealed, checksums right).
    A load refuses two rows naming the same bytes among those a rank reads: without
    broadcasts rank 1 reads both and every rank refuses. With them rank 0 reads "x"
    and sends it to rank 1, which must still check x's row with the rows it reads,
    and refuse: never "x" loaded from "y"'s row 1."""
    path = tmp_path / "ck"
    _save(path, _x_and_y_rows, 2)
    folder = open_folder(path)
    full, head = Manifest.read(folder), Manifest.read_head(folder)
    assert head.index is not None and head.index.blocks[0] == 0
    (x,) = full.tensors["x"].chunks
    (row1,) = [c for c in full.tensors["y"].chunks if c.offsets == (1, 0)]
    crafted = dataclasses.replace(
        x,
        file=row1.file,
        record=row1.record,
        payload=row1.payload,
        crcs=row1.crcs,
        frame=row1.frame,
    )
    section = encode_section([crafted], 1, list(head.tensors["x"].transforms))
    index = folder.read(head.index.file)
    folder.write_durably(head.index.file, index + section)
    doc = json.loads(folder.read("shardwise.json"))
    doc["tensors"]["x"]["section"] = [0, len(index), len(section), 1, crc32c.crc32c(section)]
    doc["crc32c"] = 0
    folder.write_durably("shardwise.json", seal(json.dumps(doc, separators=(",", ":"))).encode())

    def target_of(rank: int) -> dict[str, Any]:
        return _x_and_y_rows(rank, torch.zeros(6), torch.zeros(2, 6))

    _, without = _load(path, target_of, 2, False)
    kind, message = _one_error(without)
    assert kind == "CorruptCheckpointError" and "'y' and 'x' claim overlapping bytes" in message
    _, got = _load(path, target_of, 2, True)
    loaded = [r[1]["x"].tolist() for r in got if not isinstance(r, Exception)]
    assert loaded == [], f"loaded 'x' from 'y''s bytes: {loaded}"
    kind, message = _one_error(got)
    assert kind == "CorruptCheckpointError" and "claim overlapping bytes" in message


# -- the in-process broadcast, as a process group's ------------------------------------------


@pytest.mark.parametrize(
    "received",
    [torch.zeros(4, dtype=torch.uint8), torch.zeros(1, dtype=torch.float32)],
    ids=["more bytes", "another dtype"],
)
def test_threaded_broadcast_refuses_a_tensor_unlike_the_senders(received: torch.Tensor) -> None:
    """A broadcast of different sizes or dtypes is a bug a process group would hang or
    garble on: the test double must not hide it (`copy_` broadcasts and converts)."""
    tw = ThreadedWorld(2, 2.0)

    def one(comm: ThreadedRank) -> list[float]:
        tensor = torch.tensor([7], dtype=torch.uint8) if comm.rank == 0 else received.clone()
        comm.broadcast(tensor, 0)
        return tensor.tolist()

    sent, got = tw.run(one)
    assert isinstance(got, Exception), f"rank 1 received {got} silently"


def test_threaded_broadcast_copies_before_the_sender_goes_on() -> None:
    """The sender changes its tensor right after the call: every rank has the value sent."""
    tw = ThreadedWorld(4, T)
    gate = threading.Barrier(4, timeout=T)

    def one(comm: ThreadedRank) -> list[int]:
        tensor = torch.full((3,), comm.rank, dtype=torch.int64)
        comm.broadcast(tensor, 2)
        if comm.rank == 2:
            tensor.fill_(-1)  # reuses its buffer at once
        gate.wait()
        return tensor.tolist()

    assert tw.run(one) == [[2, 2, 2], [2, 2, 2], [-1, -1, -1], [2, 2, 2]]
    assert tw.calls == ["broadcast"] and tw.received == [24, 24, 0, 24]


# -- values: exact, bit for bit, however they are held ---------------------------------------

ODD = {
    "bool": torch.tensor([True, False, True, True, False]),
    "c64": torch.arange(5.0).to(torch.complex64) * (1 - 3j),
    "f8": torch.linspace(-2, 2, 7).to(torch.float8_e4m3fn),
    "u16": torch.tensor([0, 1, 65535, 40000], dtype=torch.uint16),
    "bf16": torch.linspace(-1, 1, 9).to(torch.bfloat16),
    "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "scalar": torch.tensor(3.25, dtype=torch.float64),
    "big": torch.arange(3000, dtype=torch.int32),
}


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).view(torch.uint8).tolist())


def test_every_dtype_and_a_scalar_arrive_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _save(path, lambda r: {k: v.clone() for k, v in ODD.items()}, 3)
    tw, got = _load(path, lambda r: {k: torch.zeros_like(v) for k, v in ODD.items()}, 3, True)
    shares = _shares(path, dict(ODD), 3)
    assert tw.calls.count("broadcast") >= 2  # several readers, packed batches among them
    for rank, (read, target) in enumerate(got):
        assert {k: _bits(v) for k, v in target.items()} == {k: _bits(v) for k, v in ODD.items()}
        assert {k: v.shape for k, v in target.items()} == {k: v.shape for k, v in ODD.items()}
        assert _reads_its_share(read, shares[rank])


def test_saved_sharded_loaded_whole_is_broadcast_from_its_chunks(tmp_path: Path) -> None:
    """Saved by rows over 4 ranks (4 chunks), loaded whole by each: one reader reads the
    4 chunks, the others receive them."""
    path = tmp_path / "ck"
    full = torch.arange(96.0).reshape(16, 6)
    rows = Layout.chunked((16, 6), 0, 4)
    extra = torch.arange(10.0)

    def state_of(rank: int) -> dict[str, Any]:
        sharded = ShardedTensor.from_layout(rows, shard_of(full, rows, rank), rank=rank)
        return {"w": sharded, "x": extra.clone()}

    _save(path, state_of, 4)
    assert len(Manifest.read(path).tensors["w"].chunks) == 4
    tw, got = _load(path, lambda r: {"w": torch.zeros(16, 6), "x": torch.zeros(10)}, 4, True)
    shares = _shares(path, {"w": full, "x": extra}, 4)
    assert sorted(shares) == [0, 0, 40, 384]
    assert tw.calls.count("broadcast") == 2
    for rank, (read, target) in enumerate(got):
        assert torch.equal(target["w"], full) and torch.equal(target["x"], extra)
        assert _reads_its_share(read, shares[rank])


def test_parameters_views_of_one_buffer_and_tied_keys(tmp_path: Path) -> None:
    """Parameters stay leaves needing grad; views into one flat buffer (FSDP-style) fill
    their own bytes only; one tensor under two keys (tied weights) holds its value."""
    path = tmp_path / "ck"
    a, b, tied = torch.arange(5.0), torch.arange(10.0, 17.0), torch.arange(-4.0, 0.0)

    def state_of(rank: int) -> dict[str, Any]:
        return {
            "p": torch.nn.Parameter(a.clone()),
            "va": a + 100,
            "vb": b.clone(),
            "t1": tied.clone(),
            "t2": tied.clone(),
        }

    _save(path, state_of, 3)
    holders: list[dict[str, Any]] = []

    def target_of(rank: int) -> dict[str, Any]:
        buffer = torch.full((20,), -7.0)
        same = torch.zeros(4)
        held = {
            "p": torch.nn.Parameter(torch.zeros(5)),
            "va": buffer[1:6],
            "vb": buffer[8:15],
            "t1": same,
            "t2": same,
            "buffer": buffer,
        }
        holders.append(held)
        return {k: v for k, v in held.items() if k != "buffer"}

    tw, got = _load(path, target_of, 3, True)
    assert all(not isinstance(r, Exception) for r in got), got
    assert "broadcast" in tw.calls
    for held in holders:
        p = held["p"]
        assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf and p.grad is None
        assert torch.equal(p.detach(), a)
        gaps = torch.full((20,), -7.0)
        gaps[1:6], gaps[8:15] = a + 100, b
        assert torch.equal(held["buffer"], gaps)
        assert torch.equal(held["t1"], tied) and held["t1"] is held["t2"]


def _four(rank: int) -> dict[str, Any]:
    return {k: torch.arange(n, dtype=torch.float32) + 10 * i for i, (k, n) in enumerate(FOUR)}


FOUR = [("a", 300), ("b", 200), ("c", 100), ("d", 50)]


def test_a_rank_casting_one_value_broadcasts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _save(path, _four, 3)

    def target_of(rank: int) -> dict[str, Any]:
        t = {k: torch.zeros_like(v) for k, v in _four(rank).items()}
        if rank == 1:
            t["b"] = torch.zeros(200, dtype=torch.float64)
        return t

    tw, got = _load(path, target_of, 3, True, cast_dtype=True)
    assert "broadcast" not in tw.calls
    for _read, target in got:
        for k, v in _four(0).items():
            assert torch.equal(target[k].to(torch.float32), v), k


def test_not_strict_a_key_only_some_ranks_hold(tmp_path: Path) -> None:
    """Rank 2 leaves "c" out: nothing is broadcast. A key absent from the checkpoint on
    rank 0 only: the shared values are still broadcast, that target left as it was."""
    path = tmp_path / "ck"
    _save(path, _four, 3)
    zeros = {k: torch.zeros_like(v) for k, v in _four(0).items()}

    def without_c(rank: int) -> dict[str, Any]:
        return {k: v.clone() for k, v in zeros.items() if rank != 2 or k != "c"}

    tw, got = _load(path, without_c, 3, True, strict=False)
    assert "broadcast" not in tw.calls
    for rank, (_read, target) in enumerate(got):
        assert sorted(target) == (["a", "b", "d"] if rank == 2 else ["a", "b", "c", "d"])
        assert all(torch.equal(v, _four(0)[k]) for k, v in target.items())

    def extra(rank: int) -> dict[str, Any]:
        t = {k: v.clone() for k, v in zeros.items()}
        if rank == 0:
            t["new"] = torch.full((3,), 5.0)
        return t

    tw, got = _load(path, extra, 3, True, strict=False)
    assert tw.calls.count("broadcast") == len(_batches(path, _four(0), 3)) >= 2
    for rank, (read, target) in enumerate(got):
        assert all(torch.equal(target[k], v) for k, v in _four(0).items())
        assert _reads_its_share(read, _shares(path, _four(0), 3)[rank])
    assert torch.equal(got[0][1]["new"], torch.full((3,), 5.0))


def test_one_rank_broadcasts_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _save(path, _four, 1)
    tw, got = _load(path, lambda r: {k: torch.zeros_like(v) for k, v in _four(0).items()}, 1, True)
    assert tw.calls == []  # alone: no exchange at all
    ((read, target),) = got
    assert read >= 4 * 650 and all(torch.equal(target[k], v) for k, v in _four(0).items())


def _four_with_b_damaged(path: Path) -> Any:
    """`_four` saved on 2 ranks at `path`, two bytes of "b"'s payload flipped; its chunk."""
    _save(path, _four, 2)
    (chunk,) = Manifest.read(path).tensors["b"].chunks
    assert chunk.payload is not None
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + 9)
        f.write(b"\x13\x37")
    return chunk


def test_a_corrupt_value_packed_with_others_fails_every_rank(tmp_path: Path) -> None:
    """Two ranks, four values: each reader packs several into one broadcast; "b" is
    damaged. Every rank raises the same CorruptCheckpointError naming 'b' and its file."""
    path = tmp_path / "ck"
    chunk = _four_with_b_damaged(path)
    tw, got = _load(path, lambda r: {k: torch.zeros_like(v) for k, v in _four(0).items()}, 2, True)
    outcomes = [_outcome(r) for r in got]
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == "CorruptCheckpointError"
    assert "'b'" in outcomes[0][1] and chunk.file in outcomes[0][1]
    assert all(isinstance(r, CorruptCheckpointError) for r in got)
    assert tw.calls.count("broadcast") == 2  # one packed batch per reader


def test_a_rank_that_verifies_is_never_sent_unverified_bytes(tmp_path: Path) -> None:
    """`verify` is each rank's own (`swc.load` does not agree on it): the reader of a
    damaged "b" skips checksums, the other rank verifies. Without broadcasts the
    verifying rank refuses "b" and the read verdict raises it on both; a broadcast
    must not hand it the damaged bytes as loaded, silently."""
    path = tmp_path / "ck"
    chunk = _four_with_b_damaged(path)
    (reader,) = [b.reader for b in _batches(path, _four(0), 2) if "b" in b.keys]

    def load(broadcast: bool) -> list[Any]:
        tw = ThreadedWorld(2, T)

        def one(comm: ThreadedRank) -> dict[str, Any]:
            target = {k: torch.zeros_like(v) for k, v in _four(0).items()}
            verify = comm.rank != reader  # the reader of "b" alone skips checksums
            load_state(
                target,
                path,
                Agreement(comm),
                strict=True,
                verify=verify,
                cast_dtype=False,
                broadcast=broadcast,
            )
            return target

        return tw.run(one)

    kind, message = _one_error(load(False))
    assert kind == "CorruptCheckpointError" and "'b'" in message and chunk.file in message
    got = load(True)
    damaged = [r["b"].tolist() != _four(0)["b"].tolist() for r in got if isinstance(r, dict)]
    assert damaged == [], f"ranks loaded a damaged 'b' without an error: {damaged}"
    assert _one_error(got) == (kind, message)


def test_swc_load_ranks_passing_different_broadcast_options_all_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edge, "_distributed", lambda group: True)  # thread ranks as a group
    path = tmp_path / "ck"
    _save(path, _four, 2)
    tw = ThreadedWorld(2, T)

    def one(comm: ThreadedRank) -> None:
        target = {k: torch.zeros_like(v) for k, v in _four(0).items()}
        swc.load(target, str(path), process_group=comm, broadcast_replicated=comm.rank == 0)

    got = tw.run(one)
    assert all(isinstance(r, ArgumentMismatchError) for r in got), got
    assert str(got[0]) == str(got[1]) and "broadcast_replicated" in str(got[0])
    assert "broadcast" not in tw.calls


# -- torch.distributed: a subgroup whose group ranks are not its global ranks ---------------


def _values(offset: float) -> dict[str, torch.Tensor]:
    return {f"v{i}": torch.full((100 * (i + 1),), offset + i) for i in range(3)}


def _subgroup_rank(rank: int, world: int, root: str) -> tuple[int, int, int, bool]:
    import torch.distributed as dist

    # group ranks 0, 1 are global 3, 1 (unsorted), and 0, 2
    odd = dist.new_group([3, 1], sort_ranks=False)
    even = dist.new_group([0, 2])
    group, name = (odd, "odd") if rank % 2 else (even, "even")
    values = _values(10.0 * (rank % 2))
    swc.save(values, f"{root}/{name}", process_group=group)
    reads, exact = [], True
    for broadcast in (True, False):
        target = {k: torch.zeros_like(v) for k, v in values.items()}
        info = swc.load(
            target, f"{root}/{name}", process_group=group, broadcast_replicated=broadcast
        )
        exact = exact and all(torch.equal(target[k], v) for k, v in values.items())
        reads.append(info.bytes_read)
    return dist.get_rank(group), reads[0], reads[1], exact


def test_gloo_subgroups_broadcast_from_group_ranks(tmp_path: Path) -> None:
    results = run_ranks(_subgroup_rank, 4, str(tmp_path), timeout=90)
    assert [r[0] for r in results] == [0, 1, 1, 0]  # global 3 is group rank 0 of "odd"
    for name, members in (("even", (0, 2)), ("odd", (3, 1))):
        shares = _shares(tmp_path / name, _values(0.0), 2)
        assert sum(shares) == 2400 and 0 not in shares  # 3 values: each group rank reads
        for global_rank in members:
            group_rank, read, alone, exact = results[global_rank]
            assert exact and shares[group_rank] <= read < alone, (name, global_rank)

"""The save/load engine (`engine.plan`, `engine.save`, `engine.load`) with ranks as threads.

The plan is a pure function of the exchanged inventories, so its decisions
(who writes what, where every record lands, what is refused) are checked
exactly; the engine then runs over ThreadedWorld's in-memory communicator
and stock `dcp.load` reads what it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise import Block, Layout, ShardedTensor, ShardMismatchError
from shardwise.checkpoint.engine.inventory import describe, serialize_objects
from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.plan import place_archives, plan_save
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.archive import archive_frame
from shardwise.checkpoint.format.checksums import checksum_payload
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.comm.agreement import Agreement
from shardwise.testing import shard_of

from ...comm.threaded_world import ThreadedRank, ThreadedWorld

FULL = torch.arange(48, dtype=torch.float32).reshape(6, 8)
ROWS = Layout.row_wise((6, 8), [4, 2])
COLS = Layout.column_wise((6, 8), [3, 5])
ARGS = ("save path", ("p",))


def _entries(state: dict, objects: dict | None = None) -> list:
    return describe(state, {k: (k,) for k in state}, objects or {})[0]


def _sharded(rank: int, layout: Layout = ROWS, full: torch.Tensor = FULL) -> ShardedTensor:
    return ShardedTensor.from_layout(layout, shard_of(full, layout, rank), rank=rank)


def test_replicated_tensors_are_spread_largest_first_and_written_once() -> None:
    # both ranks hold three plain tensors: 400, 200 and 100 bytes
    state = {"a": torch.zeros(25), "b": torch.zeros(100), "c": torch.zeros(50)}
    plan = plan_save([_entries(state), _entries(state)])
    assert plan.problems == []
    writers = {k: [c[2] for c in t.chunks] for k, t in plan.tensors.items()}
    # "b" (400 B) to rank 0, "c" (200 B) to rank 1, "a" (100 B) to the lighter rank 1
    assert writers == {"a": [1], "b": [0], "c": [1]}
    assert plan.writes == [[("b", 0)], [("a", 0), ("c", 0)]]  # each rank in its own order


def test_sharded_chunks_stay_with_their_holder_and_count_toward_its_load() -> None:
    big = torch.zeros(4, 64)  # 1 KiB, replicated
    inventories = [
        _entries({"emb": _sharded(r), "big": big, "step": 3}, {"step": b"x" * (5 + r)})
        for r in range(2)
    ]
    plan = plan_save(inventories)
    # rank 0 holds 4 rows (128 B), rank 1 2 rows (64 B): the 1 KiB replica goes to rank 1
    assert [(c[0], c[1], c[2]) for c in plan.tensors["emb"].chunks] == [
        ((0, 0), (4, 8), 0),
        ((4, 0), (2, 8), 1),
    ]
    assert plan.tensors["big"].chunks[0][2] == 1
    assert plan.objects == {"step": (0, 1)}  # the lowest rank holding it, its 2nd record
    assert plan.mappings == {}  # every path is (key,): a flat state's


def test_record_placement_follows_record_lengths() -> None:
    entries = _entries({"x": torch.zeros(3, 5), "y": torch.zeros(7, dtype=torch.bfloat16)})
    plan = plan_save([entries])
    places = place_archives(plan.writes[0], entries, "0" * 40)
    hx, tx = archive_frame(torch.float32, (3, 5))
    hy, ty = archive_frame(torch.bfloat16, (7,))
    x_len = len(hx) + 60 + len(tx)
    assert places.rows[:, :3].tolist() == [
        [0, x_len, len(hx)],
        [x_len, len(hy) + 14 + len(ty), x_len + len(hy)],
    ]


def test_disagreements_and_bad_chunks_are_all_listed() -> None:
    overlap = ShardedTensor.from_layout(
        Layout.row_wise((6, 8), [6]), [FULL], rank=0
    )  # rank 0 claims every row, rank 1 rows 4..5 too
    inventories = [
        _entries({"w": torch.zeros(2), "s": overlap, "o": 1}, {"o": b"1"}),
        _entries({"w": torch.zeros(3), "s": _sharded(1), "o": torch.zeros(1)}),
    ]
    problems = plan_save(inventories).problems
    assert problems == [
        "'w': rank 0 holds a tensor of dtype float32, shape (2,) but rank 1 holds a tensor "
        "of dtype float32, shape (3,)",
        "'o': rank 0 holds a Python object but rank 1 holds a tensor of dtype float32, shape (1,)",
        "'s': the block [0:6, 0:8] held by rank 0 and the block [4:6, 0:8] held by rank 1 "
        "partly overlap; ranks holding copies of a part (replicas, such as the data-parallel "
        "copies of a tensor-parallel weight) must hold identical blocks: give every copy the "
        "same layout",
    ]


def test_chunks_not_covering_the_tensor_are_refused_even_in_one_process() -> None:
    part = ShardedTensor.from_layout(
        Layout((6, 8), [[Block((0, 0), (4, 8))], []], allow_holes=True), [FULL[:4]], rank=0
    )
    hole = (
        "'h': elements [4:6, 0:8] are held by no rank (the chunks saved cover 32 of its 48 "
        "elements); every element must be saved: give the layout blocks that cover the tensor"
    )
    # one process: stock DCP would store the holes, to be read back as uninitialised memory
    assert plan_save([_entries({"h": part})]).problems == [hole]
    empty = ShardedTensor.from_layout(part.layout_spec, [], rank=1, dtype=torch.float32)
    both = plan_save([_entries({"h": part}), _entries({"h": empty})])
    assert both.problems == [hole]


def test_unpicklable_object_is_named() -> None:
    _, problem = serialize_objects({"fine": 1, "lock": __import__("threading").Lock()})
    assert isinstance(problem, TypeError)
    assert str(problem).startswith("object 'lock' cannot be pickled")


def _save_two_ranks(path: Path, state_of) -> list:
    world = ThreadedWorld(2)
    return world.run(lambda comm: save_state(state_of(comm.rank), path, Agreement(comm, ARGS)))


def test_two_thread_ranks_save_what_stock_dcp_loads(tmp_path: Path) -> None:
    path = tmp_path / "ck"

    def state(rank: int) -> dict:
        return {
            "model": {"emb": _sharded(rank), "bias": torch.arange(5.0)},
            "step": 12,
            "opt": {"lr": [0.1, 0.01]},
        }

    assert _save_two_ranks(path, state) == [None, None]
    names = sorted(os.listdir(path))
    manifest = Manifest.read(path)
    assert manifest.index is not None
    index = manifest.index.file
    data = [n for n in names if n.endswith(".distcp") and n != index]
    assert len(data) == 2
    assert names == sorted([".metadata", ".shardwise", "shardwise.json", index, *data])
    target = {"model": {"emb": torch.zeros(6, 8), "bias": torch.zeros(5)}, "step": 0, "opt": {}}
    target["opt"] = {"lr": [0.0, 0.0]}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["model"]["emb"], FULL)
    assert torch.equal(target["model"]["bias"], torch.arange(5.0))
    assert target["step"] == 12 and target["opt"]["lr"] == [0.1, 0.01]
    assert manifest.world_size == 2
    assert [c.offsets for c in manifest.tensors["model.emb"].chunks] == [(0, 0), (4, 0)]


def test_two_thread_ranks_load_into_another_layout(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    assert _save_two_ranks(path, lambda r: {"emb": _sharded(r), "n": r + 7}) == [None, None]

    def load(comm: ThreadedRank) -> tuple:
        target = {"emb": ShardedTensor.zeros(COLS, rank=comm.rank), "n": 0}
        read = load_state(
            target, path, Agreement(comm, ARGS), strict=True, verify=True, cast_dtype=False
        )
        return read, target

    results = ThreadedWorld(2).run(load)
    for rank, ((read, manifest), target) in enumerate(results):
        (block,) = COLS.blocks_of(rank)
        assert torch.equal(target["emb"].local_shards()[0], FULL[block.slices()])
        assert target["n"] == 7  # rank 0's object
        # each stored chunk is one checksum tile: a verified column band reads both whole
        assert read == 4 * 8 * 4 + 2 * 8 * 4 + manifest.objects["n"].length


def test_a_rank_whose_target_mismatches_fails_every_rank_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    assert _save_two_ranks(path, lambda r: {"emb": _sharded(r)}) == [None, None]

    def load(comm: ThreadedRank) -> object:
        shape = (6, 8) if comm.rank == 0 else (6, 9)
        target = {"emb": torch.full(shape, -1.0)}
        load_state(target, path, Agreement(comm, ARGS), strict=True, verify=True, cast_dtype=False)
        return target["emb"]

    results = ThreadedWorld(2).run(load)
    for result in results:
        assert isinstance(result, ValueError)
        assert str(result) == (f"rank 1: {path}: 'emb' shape (6, 9) here, (6, 8) in the checkpoint")


def test_disagreeing_ranks_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    results = _save_two_ranks(path, lambda r: {"w": torch.zeros(2 + r)})
    assert all(isinstance(r, ShardMismatchError) for r in results)
    assert not path.exists()


def test_corruption_found_by_one_rank_fails_both(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    assert _save_two_ranks(path, lambda r: {"emb": _sharded(r)}) == [None, None]
    chunk = Manifest.read(path).tensors["emb"].chunks[1]
    assert chunk.payload is not None
    with open(path / chunk.file, "r+b") as f:  # rank 1's rows
        f.seek(chunk.payload[0] + 3)
        byte = f.read(1)
        f.seek(chunk.payload[0] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))

    def load(comm: ThreadedRank) -> object:
        target = {"emb": _sharded(comm.rank)}
        return load_state(
            target, path, Agreement(comm, ARGS), strict=True, verify=True, cast_dtype=False
        )

    results = ThreadedWorld(2).run(load)
    for result in results:
        assert type(result).__name__ == "CorruptCheckpointError"
        assert "rank 1: 'emb': bytes" in str(result) and chunk.file in str(result)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.int8, torch.complex64])
def test_dtypes_round_trip_through_the_engine(tmp_path: Path, dtype: torch.dtype) -> None:
    value = (torch.arange(40) - 20).to(dtype).reshape(5, 8)
    path = tmp_path / "ck"
    assert _save_two_ranks(path, lambda r: {"v": value}) == [None, None]
    target = {"v": torch.zeros(5, 8, dtype=dtype)}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    assert torch.equal(target["v"], value)


def test_manifest_with_late_checksums_is_canonical(tmp_path: Path) -> None:
    """Rank 0 builds the manifest's entries before the checksums arrive and fills them
    in: the result must be exactly what encoding the finished manifest gives."""
    big = torch.arange(4 * 32768, dtype=torch.float32).reshape(4, 32768)  # 512 KiB: 8 tiles
    path = tmp_path / "ck"

    def state(rank: int) -> dict:
        return {"emb": _sharded(rank), "big": big, "scalar": torch.tensor(2.5), "note": "hi"}

    assert _save_two_ranks(path, state) == [None, None]
    text = (path / "shardwise.json").read_text()
    manifest = Manifest.read(path)
    assert manifest.to_json() == text
    (chunk,) = manifest.tensors["big"].chunks
    tile, crcs = checksum_payload(big.numpy().data.cast("B"), (4, 32768), 4)
    assert (chunk.tile, chunk.crcs) == (tile, crcs) and tile == (1, 16384) and len(crcs) == 8
    assert manifest.tensors["scalar"].chunks[0].tile == ()
    assert manifest.metadata_crc32c == crc32c.crc32c((path / ".metadata").read_bytes())
    note = manifest.objects["note"]
    with open(path / note.file, "rb") as f:
        f.seek(note.offset)
        assert crc32c.crc32c(f.read(note.length)) == note.crc32c

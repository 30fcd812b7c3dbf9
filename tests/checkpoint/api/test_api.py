"""swc.save / swc.load on real ranks: resharding, stock compatibility, ranged reads, errors."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import ChunkEntry, Manifest, seal
from shardwise.storage import open_folder
from shardwise.testing import run_ranks, shard_of
from tests.inline_manifest import inline_manifest

pytestmark = pytest.mark.spawned

SHAPE = (64, 32)


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "emb": torch.randn(SHAPE, generator=g),
        "grid": torch.randn(12, 10, 3, generator=g),
        "bias": torch.randn(32, generator=g),
        "half": torch.randn(6, 4, generator=g).bfloat16(),
    }


def save_state(rank: int, world: int) -> dict:
    full = reference()
    layouts = {
        "emb": Layout.row_wise(SHAPE, [40, 24]),
        "grid": Layout.grid((12, 10, 3), (1, 2, 1)),
        "half": Layout.table_wise((6, 4), 1, 2),  # rank 0 holds nothing
    }
    state = {
        k: ShardedTensor.from_layout(lay, shard_of(full[k], lay, rank), dtype=full[k].dtype)
        for k, lay in layouts.items()
    }
    state["bias"] = full["bias"].clone()  # plain tensor: replicated, written once
    state["extra"] = {"step": 100, "names": ["a", "b"]}
    return state


def load_state(rank: int, world: int) -> dict:
    full = reference()
    layouts = {
        "emb": Layout.chunked(SHAPE, 1, world),  # row-wise -> column-wise
        "grid": Layout.chunked((12, 10, 3), 0, world),
        "half": Layout.replicated((6, 4), world),
    }
    state = {k: ShardedTensor.full(lay, 0, dtype=full[k].dtype) for k, lay in layouts.items()}
    state["bias"] = torch.zeros(32)
    state["extra"] = {"step": 0, "names": []}
    return state


def _check(state: dict) -> list[str]:
    full, bad = reference(), []
    for k, v in state.items():
        if k == "extra":
            if v != {"step": 100, "names": ["a", "b"]}:
                bad.append(f"extra {v}")
        elif isinstance(v, ShardedTensor):
            for shard, block in zip(v.local_shards(), v.local_blocks):
                if not torch.equal(shard, full[k][block.slices()]):
                    bad.append(f"rank {v.rank} {k} {block}")
        elif not torch.equal(v, full[k]):
            bad.append(k)
    return bad


def _save(rank: int, world: int, path: str) -> None:
    swc.save(save_state(rank, world), path)


def _load(rank: int, world: int, path: str, verify: bool) -> tuple[list[str], int, int]:
    state = load_state(rank, world)
    reader = swc.load(state, path, verify=verify)
    needed = (
        sum(
            sum(s.numel() * s.element_size() for s in v.local_shards())
            for k, v in state.items()
            if isinstance(v, ShardedTensor)
        )
        + 32 * 4
    )
    needed += sum(o.length for o in reader.manifest.objects.values())  # pickled objects, read whole
    return _check(state), reader.bytes_read, needed


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("swc") / "step_100")
    run_ranks(_save, 2, path, timeout=90)
    return path


@pytest.mark.parametrize("world", [1, 3, 4])
def test_save_on_2_load_on_other_world_sizes(saved, world):
    results = run_ranks(_load, world, saved, True, timeout=90)
    assert [bad for bad, _, _ in results] == [[]] * world


WIDE = (64, 65536)  # float32 rows of 256 KiB: checksum tiles of 1 x 16384 (64 KiB)


def _wide_save(rank: int, world: int, path: str) -> None:
    full = torch.arange(WIDE[0] * WIDE[1], dtype=torch.float32).reshape(WIDE)
    layout = Layout.row_wise(WIDE, [40, 24])
    swc.save({"w": ShardedTensor.from_layout(layout, shard_of(full, layout, rank))}, path)


def _wide_load(rank: int, world: int, path: str, verify: bool, via: str) -> tuple[bool, int, int]:
    full = torch.arange(WIDE[0] * WIDE[1], dtype=torch.float32).reshape(WIDE)
    target = ShardedTensor.zeros(Layout.chunked(WIDE, 1, world))
    if via == "swc.load":
        reader = swc.load({"w": target}, path, verify=verify)
    else:  # the DCP storage reader, through stock dcp.load, each rank reading its own
        reader = swc.Reader(path, verify=verify, read_once=False)
        dcp.load({"w": target}, storage_reader=reader)
    (shard,) = target.local_shards()
    return (
        torch.equal(shard, full[target.local_blocks[0].slices()]),
        reader.bytes_read,
        shard.nbytes,
    )


@pytest.mark.parametrize("via", ["swc.load", "dcp.load+Reader"])
def test_ranged_reads_row_wise_to_column_wise(tmp_path, via):
    """A rank reads only the byte runs its column band needs; verifying, the checksum
    tiles that cover them (64 KiB of each 256 KiB row here): at most 1.1x either way."""
    path = str(tmp_path / "wide")
    run_ranks(_wide_save, 2, path, timeout=90)
    for verify in (False, True):
        for ok, read, needed in run_ranks(_wide_load, 4, path, verify, via, timeout=90):
            assert ok and needed <= read <= 1.1 * needed, (verify, read, needed)


def test_narrow_rows_are_read_in_whole_pages(saved):
    """Runs closer than an OS page are read together: never more than the stored chunks."""
    for bad, read, needed in run_ranks(_load, 4, saved, False, timeout=90):
        stored = sum(t.nbytes for t in reference().values()) + 32 * 4
        assert bad == [] and read <= stored + 4096, (read, needed)


def test_manifest_and_stock_reader(saved):
    manifest = json.loads((Path(saved) / "shardwise.json").read_text())
    assert manifest["format"] == "shardwise.checkpoint" and manifest["world_size"] == 2
    assert manifest["tensors"]["emb"]["shape"] == [64, 32]
    assert len(Manifest.read(saved).tensors["bias"].chunks) == 1  # replicated: written once
    assert "extra.step" in manifest["objects"]
    full = reference()
    plain = {k: torch.zeros_like(v) for k, v in full.items()}
    plain["extra"] = {"step": 0, "names": []}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(saved))  # stock, no shardwise code
    assert all(torch.equal(plain[k], full[k]) for k in full) and plain["extra"]["step"] == 100


def test_read_tensor_offline(saved):
    full = reference()
    region = Block((10, 5), (40, 7))  # crosses the row-wise boundary at 40
    assert torch.equal(swc.read_tensor(saved, "emb", region), full["emb"][10:50, 5:12])
    assert torch.equal(swc.read_tensor(saved, "half"), full["half"])
    with pytest.raises(ValueError, match="out of bounds"):
        swc.read_tensor(saved, "emb", Block((60, 0), (5, 32)))
    with pytest.raises(KeyError):
        swc.read_tensor(saved, "nope")


def _stock_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    full = reference()
    mesh = init_device_mesh("cpu", (world,))
    layout = Layout.column_wise(SHAPE, [8, 8, 8, 8], ranks=[0, 1, 0, 1])
    blocks = layout.blocks_of(rank)
    lsw = LocalShardsWrapper(
        [full["emb"][b.slices()].clone() for b in blocks], [b.offsets for b in blocks]
    )
    state = {
        "emb": DTensor.from_local(
            lsw, mesh, (Shard(1),), run_check=False, shape=torch.Size(SHAPE), stride=(32, 1)
        ),
        "grid": distribute_tensor(full["grid"], mesh, (Shard(0),)),
        "bias": full["bias"].clone(),
        "half": full["half"].clone(),
    }
    dcp.save(state, checkpoint_id=path)


def _load_stock(rank: int, world: int, path: str) -> tuple[list[str], int, int]:
    state = load_state(rank, world)
    del state["extra"]
    reader = swc.load(state, path)
    needed = sum(
        sum(s.nbytes for s in v.local_shards())
        for v in state.values()
        if isinstance(v, ShardedTensor)
    )
    return _check(state), reader.bytes_read, needed


def test_load_a_stock_checkpoint_with_ranged_reads(tmp_path):
    path = str(tmp_path / "stock")
    run_ranks(_stock_save, 2, path, timeout=90)
    for bad, read, needed in run_ranks(_load_stock, 3, path, timeout=90):
        # stock chunks are torch.save records: we read a few KiB of zip header per chunk
        assert bad == [] and read <= 1.1 * (needed + 32 * 4) + 8 * 4096, (read, needed)


def _mismatch(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    state = load_state(rank, world)
    if rank == 1:
        state["emb"] = ShardedTensor.zeros(
            Layout.chunked((64, 31), 1, world)
        )  # shape, one rank only
    state["half"] = ShardedTensor.zeros(Layout.replicated((6, 4), world), dtype=torch.float32)
    state["missing"] = torch.zeros(2)
    try:
        swc.load(state, path)
    except Exception as e:
        untouched = all(bool((s == 0).all()) for s in state["grid"].local_shards())
        return type(e).__name__, str(e), untouched
    return "no error", "", False


def test_mismatches_listed_on_every_rank_before_any_write(saved):
    results = run_ranks(_mismatch, 2, saved, timeout=60)
    for name, message, untouched in results:
        assert name == "CheckpointMismatchError" and untouched
        for word in ("rank 1", "'emb' shape", "'half' dtype", "'missing' is missing"):
            assert word in message, (word, message)
    assert results[0][:2] == results[1][:2]


def _exists(rank: int, world: int, path: str) -> str:
    try:
        swc.save(save_state(rank, world), path)
    except FileExistsError as e:
        return str(e)
    return "saved"


def test_existing_checkpoint_refused_then_replaced(saved, tmp_path):
    assert all("overwrite=True" in r for r in run_ranks(_exists, 2, saved, timeout=60))
    copy = tmp_path / "copy"
    run_ranks(_save, 2, str(copy), timeout=60)
    before = (copy / "shardwise.json").stat().st_mtime_ns
    run_ranks(_overwrite, 2, str(copy), timeout=60)
    assert (copy / "shardwise.json").stat().st_mtime_ns != before
    assert not list(tmp_path.glob(".copy.shardwise-*"))


def _overwrite(rank: int, world: int, path: str) -> None:
    swc.save(save_state(rank, world), path, overwrite=True)


# -- damage: corruption, truncation, incomplete saves, malicious metadata ----------------


def _copy(src: str, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _full_targets() -> dict:
    state = {k: torch.zeros_like(v) for k, v in reference().items()}
    state["extra"] = {"step": 0, "names": []}
    return state


def test_flipped_byte_is_caught_naming_tensor_file_and_range(saved, tmp_path):
    bad = _copy(saved, tmp_path / "bad")
    chunk = Manifest.read(bad).tensors["emb"].chunks[0]
    assert chunk.payload is not None
    with open(bad / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.load(_full_targets(), bad)
    assert (
        "'emb'" in str(info.value) and chunk.file in str(info.value) and "bytes" in str(info.value)
    )
    state = _full_targets()
    swc.load(state, bad, verify=False)  # the caller can opt out


def test_truncated_file_is_caught(saved, tmp_path):
    bad = _copy(saved, tmp_path / "trunc")
    data = bad / Manifest.read(bad).tensors["emb"].chunks[0].file
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(swc.CorruptCheckpointError, match="truncated"):
        swc.load(_full_targets(), bad)


def test_incomplete_checkpoints(saved, tmp_path):
    no_manifest = _copy(saved, tmp_path / "nomanifest")
    (no_manifest / "shardwise.json").unlink()
    with pytest.raises(swc.IncompleteCheckpointError):
        swc.load(_full_targets(), no_manifest)
    (tmp_path / "ghost").mkdir()  # a first save that died before its commit leaves only data
    (tmp_path / "ghost" / "__0_0.sw0123456789ab.distcp").write_bytes(b"partial")
    with pytest.raises(swc.IncompleteCheckpointError, match="never committed"):
        swc.load(_full_targets(), tmp_path / "ghost")
    with pytest.raises(FileNotFoundError):
        swc.load(_full_targets(), tmp_path / "nothing")


def _flip(folder: Path, chunk: ChunkEntry, at: int) -> None:
    assert chunk.payload is not None
    with open(folder / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_raises_listing_every_problem(saved, tmp_path):
    assert swc.verify(saved) == [] and swc.verify(saved, raise_on_error=False) == []
    bad = _copy(saved, tmp_path / "two")
    tensors = Manifest.read(bad).tensors
    damaged = [("emb", tensors["emb"].chunks[0]), ("grid", tensors["grid"].chunks[1])]
    for _, chunk in damaged:
        _flip(bad, chunk, 4)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.verify(bad)
    problems = info.value.problems
    assert sorted(p.split(":")[0] for p in problems) == [
        f"'{k}' chunk at {c.offsets}" for k, c in damaged
    ]
    assert all(p in str(info.value) for p in problems) and "2 problems" in str(info.value)
    assert (
        swc.verify(bad, raise_on_error=False) == problems
    )  # the reporting form returns the same list


def test_verify_names_incomplete_and_absent_checkpoints(saved, tmp_path):
    no_manifest = _copy(saved, tmp_path / "nomanifest")
    (no_manifest / "shardwise.json").unlink()
    with pytest.raises(swc.IncompleteCheckpointError, match="did not commit") as info:
        swc.verify(no_manifest)
    assert (
        len(info.value.problems) == 1
        and swc.verify(no_manifest, raise_on_error=False) == info.value.problems
    )
    for raise_on_error in (True, False):
        with pytest.raises(FileNotFoundError):
            swc.verify(tmp_path / "nothing", raise_on_error=raise_on_error)


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_malicious_stock_metadata_runs_nothing(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    victim = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Touch(str(victim))))
    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        swc.load({"x": torch.zeros(1)}, folder)
    assert not victim.exists()


@pytest.mark.parametrize(
    "field, value, refusal",
    [
        ("file", "../../etc/passwd", r"chunks\[0\]\.file: expected a file name \(no `/`"),
        ("payload", [-1, 4], r"chunks\[0\]\.payload: expected \[offset, length\]"),
        ("sizes", [10**12, 32], r"chunk at offsets \(0, 0\) of 'emb' has inconsistent sizes"),
    ],
    ids=["path-traversal", "negative-offset", "absurd-size"],
)
def test_hostile_manifest_fields(saved, tmp_path, field, value, refusal):
    bad = _copy(saved, tmp_path / field)
    inline_manifest(bad)  # version 3: chunks listed in the manifest
    manifest = json.loads((bad / "shardwise.json").read_text())
    manifest["tensors"]["emb"]["chunks"][0][field] = value
    manifest["crc32c"] = 0  # sealed again: the field itself is what is refused
    (bad / "shardwise.json").write_text(seal(json.dumps(manifest, separators=(",", ":"))))
    with pytest.raises(swc.CorruptCheckpointError, match=refusal):
        swc.load(_full_targets(), bad)


def _section(folder: Path, key: str) -> tuple[Manifest, int, int]:
    """The manifest (as loads read it: no chunks) of the checkpoint in `folder`, and
    where `key`'s chunk section lies in its index file: first byte, length."""
    head = Manifest.read_head(open_folder(folder))
    assert head.index is not None and head.tensors[key].section is not None
    block, offset, length, _, _ = head.tensors[key].section
    return head, head.index.blocks[block] + offset, length


def test_a_damaged_section_is_refused_and_read_only_by_loads_of_its_tensor(saved, tmp_path):
    bad = _copy(saved, tmp_path / "section")
    head, start, length = _section(bad, "grid")
    assert head.index is not None
    with open(bad / head.index.file, "r+b") as f:
        f.seek(start + length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(
        swc.CorruptCheckpointError,
        match=f"{head.index.file}: the section of 'grid' does not match its checksum",
    ):
        swc.load(_full_targets(), bad)
    others = {k: v for k, v in _full_targets().items() if k != "grid"}
    swc.load(others, bad)  # the other tensors' sections are whole
    full = reference()
    assert all(torch.equal(others[k], full[k]) for k in ("emb", "bias", "half"))


@pytest.mark.parametrize(
    "column, value, refusal",
    [
        (2, 10**12, r"chunk at offsets \(0, 0\) has inconsistent sizes or byte ranges"),
        (6, 7, r"'emb': data file .*__7_0\.sw[0-9a-f]{12}\.distcp is missing"),
        (8, -5, "a chunk row holds an impossible value"),
    ],
    ids=["absurd-size", "missing-file", "negative"],
)
def test_hostile_section_rows(saved, tmp_path, column, value, refusal):
    """A section's row, its checksums made to match: refused by what it holds.
    Columns of a 2-d tensor: offsets 0-1, sizes 2-3, tile 4-5, rank 6, k 7, token 8."""
    bad = _copy(saved, tmp_path / f"row{column}")
    head, start, length = _section(bad, "emb")
    assert head.index is not None
    index = bytearray((bad / head.index.file).read_bytes())
    struct.pack_into("<q", index, start + 8 * column, value)  # the first row
    (bad / head.index.file).write_bytes(index)
    entry = head.tensors["emb"]
    assert entry.section is not None
    block, offset, _, rows, _ = entry.section
    entry.section = (block, offset, length, rows, crc32c.crc32c(index[start : start + length]))
    (bad / "shardwise.json").write_text(head.to_json())
    with pytest.raises(swc.CorruptCheckpointError, match=refusal):
        swc.load(_full_targets(), bad)


def _load_corrupt(rank: int, world: int, path: str) -> tuple[str, list]:
    """Load with emb split by rows (rank 0: rows 0..32, rank 1: rows 32..64); return the
    error and every (file, start, end) byte range this rank read."""
    from tests.reliability.reads import data_reads

    state = load_state(rank, world)
    state["emb"] = ShardedTensor.zeros(Layout.chunked(SHAPE, 0, world))
    with data_reads() as reads:
        try:
            swc.load(state, path)
        except Exception as e:
            return type(e).__name__, reads
    return "no error", reads


def test_corruption_found_by_one_rank_raises_on_every_rank(saved, tmp_path):
    from tests.reliability.reads import touches

    bad = _copy(saved, tmp_path / "bad2")
    # emb was saved as rows 0..40 | 40..64: corrupt the second chunk. Row-split targets
    # (rows 0..32 | 32..64) make rank 1 alone need it (column-wise ones would make both).
    chunk = next(c for c in Manifest.read(bad).tensors["emb"].chunks if c.offsets == (40, 0))
    assert chunk.payload is not None
    with open(bad / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + 8)
        f.write(b"\x00\x01\x02\x03")
    results = run_ranks(_load_corrupt, 2, str(bad), timeout=60)
    assert [kind for kind, _ in results] == ["CorruptCheckpointError"] * 2, results
    readers = [
        r for r, (_, reads) in enumerate(results) if touches(reads, chunk.file, *chunk.record)
    ]
    assert readers == [1], (chunk, results)  # only rank 1 read any byte of that chunk


def _async(rank: int, world: int, folder: str) -> list[str]:
    from shardwise.checkpoint.api import _ASYNC

    bad = []
    state = save_state(rank, world)
    fut = swc.async_save(state, f"{folder}/a")
    for v in state.values():  # modifying right away must not change what is saved
        if isinstance(v, torch.Tensor):
            for s in v.local_shards() if isinstance(v, ShardedTensor) else [v]:
                s.fill_(-1)
    state["extra"]["step"] = -1
    fut.result()
    kept = _ASYNC.stager._kept
    assert kept is not None  # handed back by the committed save
    buffers = {k: b.data_ptr() for k, b in kept.tensors.items()}
    second = swc.async_save(save_state(rank, world), f"{folder}/b")
    second.result()
    kept = _ASYNC.stager._kept
    if kept is None or {k: b.data_ptr() for k, b in kept.tensors.items()} != buffers:
        bad.append("staging buffers were reallocated on the second save")
    for name in ("a", "b"):
        target = load_state(rank, world)
        swc.load(target, f"{folder}/{name}")
        bad += [f"{name}: {b}" for b in _check(target)]
    dist.barrier()
    return bad


def test_async_save_stages_then_commits_in_background(tmp_path):
    assert run_ranks(_async, 2, str(tmp_path), timeout=90) == [[], []]


def _kinds(rank: int, world: int, folder: str) -> list[str]:
    """DTensor, legacy ShardedTensor and an optimizer state dict through swc.save/load."""
    import warnings

    from torch.distributed._shard.sharded_tensor import Shard as LegacyShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    full = reference()["emb"]
    mesh = init_device_mesh("cpu", (world,))
    layout = Layout.row_wise(SHAPE, [40, 24])
    (block,) = layout.blocks_of(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = init_from_local_shards(
            [
                LegacyShard.from_tensor_and_offsets(
                    full[block.slices()].clone(), list(block.offsets), rank
                )
            ],
            *SHAPE,
        )
    param = torch.nn.Parameter(ShardedTensor.from_layout(layout, shard_of(full, layout, rank)))
    opt = torch.optim.Adam([param], lr=0.1, foreach=False)
    param.grad = ShardedTensor.from_layout(layout, shard_of(full * 0.5, layout, rank))
    opt.step()
    state = {
        "dt": distribute_tensor(full, mesh, (Shard(1),)),
        "legacy": legacy,
        "model": {"w": param},
        "optim": opt.state_dict(),
    }
    swc.save(state, f"{folder}/kinds")
    cols = Layout.chunked(SHAPE, 1, world)
    target_param = torch.nn.Parameter(ShardedTensor.zeros(cols))
    target_opt = torch.optim.Adam([target_param], lr=0.1, foreach=False)
    target_param.grad = ShardedTensor.zeros(cols)
    target_opt.step()  # creates the state entries to load into
    target = {
        "dt": ShardedTensor.zeros(cols),
        "legacy": ShardedTensor.zeros(cols),
        "model": {"w": target_param},
        "optim": target_opt.state_dict(),
    }
    swc.load(target, f"{folder}/kinds")
    bad = []
    for key in ("dt", "legacy"):
        if not all(
            torch.equal(s, full[b.slices()])
            for s, b in zip(target[key].local_shards(), target[key].local_blocks)
        ):
            bad.append(key)
    expected = param.detach().full_tensor()
    got = target_param.detach()
    if not all(
        torch.equal(s, expected[b.slices()]) for s, b in zip(got.local_shards(), got.local_blocks)
    ):
        bad.append("param")
    moments = opt.state[param]["exp_avg"].full_tensor()
    loaded = target_opt.state_dict()["state"][0]["exp_avg"]
    if not all(
        torch.equal(s, moments[b.slices()])
        for s, b in zip(loaded.local_shards(), loaded.local_blocks)
    ):
        bad.append("exp_avg")
    if float(target_opt.state_dict()["state"][0]["step"]) != 1.0:
        bad.append("step")
    return bad


def test_dtensor_legacy_and_optimizer_state(tmp_path):
    assert run_ranks(_kinds, 2, str(tmp_path), timeout=90) == [[], []]

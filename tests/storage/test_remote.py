"""Checkpoints under an fsspec URL, in one process, on fsspec's in-memory filesystem:
what is fetched (ranged reads, counted), how records are committed, what is collected."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardwise.checkpoint as swc
from shardwise import Block
from shardwise.checkpoint.format.manifest import TAIL, Manifest
from shardwise.checkpoint.io.commit import referenced_files
from shardwise.storage import FsspecFolder, SharedReads, open_folder
from shardwise.storage.remote import PART, WASTE, _parts, coalesce


@pytest.fixture
def url():
    root = f"/sw-remote-{uuid.uuid4().hex[:8]}"
    yield f"memory://{root}/ckpt"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _ls(url: str) -> list[str]:
    folder = open_folder(url)
    return folder.names()


def _files(url: str) -> tuple[str, str]:
    """The save's one data file and its index file (version 4: one more data file)."""
    m = Manifest.read(url)
    assert m.index is not None
    (data,) = m.files() - {m.index.file}
    return data, m.index.file


def _opening_bytes(url: str, *keys: str) -> int:
    """What a load reads before any tile: the last `TAIL` bytes of `.metadata` (its
    size checked), the index sections of `keys` and their chunks' checksums, which
    `swc.save`'s writers keep in their data files (the frame and one per tile)."""
    folder = open_folder(url)
    m = Manifest.read_head(folder)
    lengths = []
    for k in keys:
        section = m.tensors[k].section
        assert section is not None
        lengths.append(section[2])  # (block, offset, length, rows, crc32c)
    kept = sum(4 * (1 + len(c.crcs)) for k in keys for c in Manifest.read(folder).tensors[k].chunks)
    return min(folder.sizes()[".metadata"], TAIL) + sum(lengths) + kept


# -- coalescing -----------------------------------------------------------------------------


def test_coalesce_joins_overlaps_and_close_neighbours_only():
    assert coalesce([(0, 100), (50, 120)]) == [(0, 120)]
    assert coalesce([(0, 100), (110, 200)]) == [(0, 200)]  # 10 gap bytes for 190 wanted
    assert coalesce([(0, 100), (130, 200)]) == [(0, 100), (130, 200)]  # 30 for 170: too many
    assert coalesce([(300, 400), (0, 100)]) == [(0, 100), (300, 400)]
    assert coalesce([(5, 5), (0, 0)]) == []


@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 500)), max_size=60))
def test_coalesced_ranges_cover_every_byte_wanted_at_most_one_tenth_more(pairs):
    wanted = [(s, s + n) for s, n in pairs]
    merged = coalesce(wanted)
    covered = set().union(*(range(s, e) for s, e in wanted)) if wanted else set()
    fetched = sum(e - s for s, e in merged)
    assert all(any(s <= b < e for s, e in merged) for b in covered)
    assert fetched <= (1 + WASTE) * len(covered)
    assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))  # disjoint, sorted


def test_long_ranges_are_fetched_as_parts():
    q = PART // 4
    assert _parts([(0, 2 * PART + q)]) == [(0, PART), (PART, 2 * PART), (2 * PART, 2 * PART + q)]
    # a last part under a quarter joins the one before: no request for a few bytes
    assert _parts([(0, 2 * PART + q - 1)]) == [(0, PART), (PART, 2 * PART + q - 1)]
    assert _parts([(7, 7 + PART + 5), (10 * PART, 10 * PART + 3)]) == [
        (7, 7 + PART + 5),
        (10 * PART, 10 * PART + 3),
    ]
    assert _parts([(0, PART)]) == [(0, PART)]


# -- saving and loading ---------------------------------------------------------------------


def test_a_save_writes_the_records_last_and_loads_back_bit_for_bit(url):
    w = torch.randn(256, 512)
    swc.save({"w": w, "step": 3}, url)
    assert _ls(url) == [".metadata", ".shardwise", *sorted(_files(url)), "shardwise.json"]
    out = {"w": torch.zeros(256, 512), "step": 0}
    swc.load(out, url)
    assert out["step"] == 3 and torch.equal(out["w"], w)


def test_a_column_band_fetches_only_its_tiles(url):
    """Rows of 512 KiB (float32 x 131072): tiles 64 KiB wide. A band of two tiles'
    width fetches those two tiles of every row, no more (plus nothing else)."""
    w = torch.randn(64, 131072)
    swc.save({"w": w}, url)
    folder = open_folder(url)
    assert isinstance(folder, FsspecFolder)
    ckpt = swc.open_checkpoint(folder)
    before = folder.range_bytes
    band = ckpt.read("w", Block((0, 16384), (64, 32768)))
    assert torch.equal(band, w[:, 16384:49152])
    needed = 64 * 32768 * 4
    assert folder.range_bytes - before == needed  # tile-aligned: exactly the band
    assert ckpt.bytes_read == needed


def test_an_unaligned_band_costs_at_most_its_enclosing_tiles(url):
    w = torch.randn(32, 131072)
    swc.save({"w": w}, url)
    folder = open_folder(url)
    ckpt = swc.open_checkpoint(folder)
    band = ckpt.read("w", Block((0, 1000), (32, 20000)))
    assert torch.equal(band, w[:, 1000:21000])
    # two 64 KiB tiles per row, after the tail of `.metadata` and the section of 'w'
    assert folder.range_bytes == _opening_bytes(url, "w") + 32 * 2 * 65536
    unverified = swc.open_checkpoint(url, verify=False)
    before = unverified.folder.range_bytes
    unverified.read("w", Block((0, 1000), (32, 20000)))
    fetched = unverified.folder.range_bytes - before
    assert 32 * 20000 * 4 <= fetched <= 1.1 * 32 * 20000 * 4


def test_a_resharding_load_fetches_at_most_1_1x_the_bytes_its_targets_need(url):
    """Saved row-wise on 4 (simulated) ranks, loaded column-wise: each target column
    block needs one band of every stored chunk."""
    from shardwise import Layout, ShardedTensor
    from shardwise.testing import shard_of

    full = torch.randn(256, 65536)  # 256 KiB rows: 4 column tiles each
    rows = Layout.row_wise(full.shape, [64, 64, 64, 64])
    state = {
        "w": ShardedTensor.from_layout(
            Layout(full.shape, {0: [b for r in range(4) for b in rows.blocks_of(r)]}),
            [s for r in range(4) for s in shard_of(full, rows, r)],
        )
    }
    swc.save(state, url)
    cols = Layout.column_wise(full.shape, [16384, 16384, 16384, 16384])
    for rank in range(4):
        target = ShardedTensor.empty(cols, dtype=torch.float32, device="cpu")
        target = ShardedTensor.from_layout(
            cols, [torch.zeros(b.sizes) for b in cols.blocks_of(rank)], rank=rank
        )
        folder = open_folder(url)
        reader = swc.load({"w": target}, folder)
        needed = 256 * 16384 * 4
        assert torch.equal(target.local_shards()[0], full[:, rank * 16384 : (rank + 1) * 16384])
        assert reader.bytes_read == needed
        assert needed <= folder.range_bytes <= 1.1 * needed
        assert folder.whole_bytes < 64 << 10  # the manifest: metadata only


def test_an_overwrite_keeps_foreign_objects_and_collects_the_old_data(url):
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/notes.txt", b"mine")
    fs.pipe_file(f"{root}/__9_9.distcp", b"not ours")
    swc.save({"w": torch.ones(8)}, url)
    first = referenced_files(url)
    assert first == set(_files(url))
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        swc.save({"w": torch.zeros(8)}, url)
    swc.save({"w": torch.full((8,), 2.0)}, url, overwrite=True)
    second = referenced_files(url)
    assert first.isdisjoint(second) and second == set(_files(url))  # data and index
    assert (
        set(_ls(url))
        == {"notes.txt", "__9_9.distcp", ".metadata", ".shardwise", "shardwise.json"} | second
    )
    assert fs.cat_file(f"{root}/notes.txt") == b"mine"
    assert torch.equal(swc.read_tensor(url, "w"), torch.full((8,), 2.0))


def test_leftovers_of_an_interrupted_save_are_collected_by_the_next(url):
    folder = open_folder(url)
    folder.make()
    folder.write_durably("__0_0.sw0123456789ab.distcp", b"half a save")
    folder.write_durably(".metadata.swabcdef012345.tmp", b"half a record")
    with pytest.raises(swc.IncompleteCheckpointError, match="started but never committed"):
        swc.load({"w": torch.zeros(8)}, url)
    swc.save({"w": torch.zeros(8)}, url)
    names = set(_ls(url))
    assert (
        "__0_0.sw0123456789ab.distcp" not in names and ".metadata.swabcdef012345.tmp" not in names
    )
    assert {n for n in names if n.endswith(".distcp")} == set(_files(url))


def test_a_failed_upload_leaves_no_object(url):
    folder = open_folder(url)
    folder.make()
    with pytest.raises(RuntimeError, match="boom"):
        with folder.create("__0_0.sw0123456789ab.distcp") as sink:
            sink.write([b"x" * 100])
            raise RuntimeError("boom")
    assert _ls(url) == []


def test_marker_without_manifest_reads_as_incomplete(url):
    swc.save({"w": torch.ones(8)}, url)
    open_folder(url).remove("shardwise.json")
    with pytest.raises(swc.IncompleteCheckpointError, match="without its shardwise.json"):
        swc.load({"w": torch.zeros(8)}, url)


def test_corruption_is_found_on_a_remote_folder(url):
    swc.save({"w": torch.arange(100000.0)}, url)
    folder = open_folder(url)
    data, _ = _files(url)
    raw = bytearray(folder.read(data))
    raw[len(raw) // 2] ^= 0x10
    folder.write_durably(data, bytes(raw))
    with pytest.raises(swc.CorruptCheckpointError, match=rf"'w': bytes \d+\.\.\d+ of {url}/{data}"):
        swc.load({"w": torch.zeros(100000)}, url)
    with pytest.raises(swc.CorruptCheckpointError, match=data):
        swc.verify(url)


def test_offline_tools_take_urls(url, tmp_path):
    w = torch.randn(40, 30)
    swc.save({"w": w, "b": torch.ones(3)}, url)
    assert [t.key for t in swc.inspect(url).tensors] == ["b", "w"]
    assert swc.verify(url, raise_on_error=False) == []
    out = url.rsplit("/", 1)[0] + "/resharded"
    assert swc.reshard(url, out, 3) == out
    assert torch.equal(swc.read_tensor(out, "w"), w)
    target = url.rsplit("/", 1)[0] + "/export/model.safetensors"
    assert swc.convert(url, target) == [target]
    local = tmp_path / "model.safetensors"
    local.write_bytes(fsspec.filesystem("memory").cat_file(target.removeprefix("memory://")))
    from safetensors.torch import load_file

    assert torch.equal(load_file(local)["w"], w)


def test_one_ranks_reads_of_the_records_serve_another_without_a_request(url) -> None:
    """`FsspecFolder.record` keeps the listing and every read; another folder that
    `know`s them (sent as `SharedReads.encode` bytes) lists and reads nothing from the
    store, refuses a record over its limit as the store's would be, and reads the store
    for what was not recorded."""
    swc.save({"w": torch.arange(12.0)}, url)
    reader = open_folder(url)
    assert isinstance(reader, FsspecFolder)
    reader.record()
    listing = reader.sizes()
    manifest = reader.read("shardwise.json", limit=1 << 20)
    data = next(n for n in listing if n.endswith(".distcp"))
    head = reader.open(data).pread(8, 4)
    reads = reader.recorded()
    first = reader.open(data).pread(4, 0)  # not recorded
    assert reads.listing == listing
    assert reader.sizes() == listing and reader.recorded().spans == {}  # recording stopped

    other = open_folder(url)
    assert isinstance(other, FsspecFolder)
    other.know(SharedReads.decode(reads.encode()))
    fs = other.fs
    calls: list[str] = []
    real_ls, real_cat = fs.ls, fs.cat_file
    fs.ls = lambda *a, **k: calls.append("ls") or real_ls(*a, **k)
    fs.cat_file = lambda *a, **k: calls.append("cat") or real_cat(*a, **k)
    try:
        assert other.sizes() == listing
        assert other.read("shardwise.json", limit=1 << 20) == manifest
        assert other.open(data).pread(8, 4) == head
        assert other.open(data).pread(4, 6) == head[2:6]  # inside a recorded range
        assert calls == []
        with pytest.raises(swc.CorruptCheckpointError, match="shardwise.json"):
            other.read("shardwise.json", limit=len(manifest) - 1)
        assert other.open(data).pread(4, 0) == first  # not recorded: from the store
        assert calls == ["cat"]
        other.know(None)
        other.sizes()
        assert calls == ["cat", "ls"]
    finally:
        fs.ls, fs.cat_file = real_ls, real_cat


def test_a_record_is_served_as_the_rank_that_read_it_got_it(url) -> None:
    """A whole read is served exactly as it returned, whatever the listing said: a
    record replaced between rank 0's listing and its read (longer now) reaches every
    rank as rank 0 parsed it, never cut to the listed size."""
    swc.save({"w": torch.arange(12.0)}, url)
    read = open_folder(url).read("shardwise.json")
    reads = SharedReads({"shardwise.json": len(read) - 4}, {"shardwise.json": read})
    other = open_folder(url)
    assert isinstance(other, FsspecFolder)
    other.know(SharedReads.decode(reads.encode()))
    assert other.read("shardwise.json") == read
    assert other.read("shardwise.json", limit=len(read)) == read

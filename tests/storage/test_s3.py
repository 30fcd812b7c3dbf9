"""Checkpoints on a real S3 API (moto's server on 127.0.0.1, through s3fs): saved on N
ranks, loaded on M in other layouts bit for bit, read by stock DCP's fsspec reader and
reading what its fsspec writer wrote, with the bytes fetched counted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise.checkpoint.engine.load import placed, schedule
from shardwise.checkpoint.engine.stored import StoredView
from shardwise.checkpoint.format.manifest import TAIL, Manifest
from shardwise.storage import open_folder
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPES = {"emb": (60, 96), "col": (24, 40), "bias": (7,)}


def _full(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _layouts(world: int) -> dict[str, Any]:
    from shardwise import Layout

    if world == 2:  # row-wise uneven; column-wise with two blocks per rank
        return {
            "emb": Layout.row_wise(SHAPES["emb"], [45, 15]),
            "col": Layout(
                SHAPES["col"],
                {
                    0: [
                        Layout.column_wise(SHAPES["col"], [10] * 4).blocks_of(r)[0] for r in (0, 2)
                    ],
                    1: [
                        Layout.column_wise(SHAPES["col"], [10] * 4).blocks_of(r)[0] for r in (1, 3)
                    ],
                },
            ),
        }
    # three ranks: column-wise for emb (rank 2 holds nothing), a grid for col
    return {
        "emb": Layout.column_wise(SHAPES["emb"], [50, 46, 0]),
        "col": Layout.grid(SHAPES["col"], (3, 1)),
    }


def _state(rank: int, world: int, seed: int) -> dict[str, Any]:
    from shardwise import ShardedTensor
    from shardwise.testing import shard_of

    full = _full(seed)
    state: dict[str, Any] = {
        k: ShardedTensor.from_layout(lay, shard_of(full[k], lay, rank), dtype=torch.float32)
        for k, lay in _layouts(world).items()
    }
    state["bias"] = full["bias"].clone()
    state["step"] = {"seed": seed}
    return state


def _exact(target: dict[str, Any], rank: int) -> bool:
    """Whether `target` (`_state` in other layouts) holds the values saved with seed 0."""
    full = _full(0)
    exact = target["step"] == {"seed": 0} and torch.equal(target["bias"], full["bias"])
    for key in ("emb", "col"):
        st = target[key]
        for block, shard in zip(st.layout_spec.blocks_of(rank), st.local_shards()):
            region = tuple(slice(o, o + n) for o, n in zip(block.offsets, block.sizes))
            exact = exact and torch.equal(shard, full[key][region])
    return exact


def _save(rank: int, world: int, url: str, options: dict) -> str:
    import shardwise.checkpoint as swc

    return str(swc.save(_state(rank, world, 0), url, storage_options=options).path)


def _load(rank: int, world: int, url: str, options: dict) -> tuple[bool, int, int, int]:
    """Load into other layouts: (bit exact, bytes read, ranged bytes fetched, whole bytes)."""
    import shardwise.checkpoint as swc
    from shardwise.storage import open_folder

    target = _state(rank, world, 99)  # other values, to be overwritten
    folder = open_folder(url, options)
    # every rank reads the bias itself: its ranges are counted below (broadcasts: further down)
    reader = swc.load(target, folder, broadcast_replicated=False)
    exact = _exact(target, rank)
    return exact, reader.bytes_read, folder.range_bytes, folder.whole_bytes


def test_saved_on_two_ranks_loads_on_three_in_other_layouts_bit_for_bit(s3_bucket):
    url, options = s3_bucket
    url += "/ckpt/step_10"
    assert run_ranks(_save, 2, url, options, timeout=120) == [url, url]
    results = run_ranks(_load, 3, url, options, timeout=120)
    assert [r[0] for r in results] == [True, True, True]
    folder = open_folder(url, options)
    index = Manifest.read_head(folder).index
    assert index is not None
    sizes = folder.sizes()
    # before any chunk: the last `TAIL` bytes of `.metadata`, and the sections of the
    # tensors loaded, adjacent in the index: one read of all of it on every rank
    opening = min(sizes[".metadata"], TAIL) + sizes[index.file]
    for _exact, read, fetched, whole in results:
        # every byte read was fetched once, plus the gaps of ranges merged into one GET
        # (at most a tenth); the manifest is the only whole object read
        assert read <= fetched - opening <= 1.1 * read
        assert whole < 16 << 10


def _records_once(rank: int, world: int, url: str, options: dict) -> tuple[bool, int, int]:
    """Load into other layouts, `read_once` as by default: (bit exact, listings made,
    bytes of whole objects read)."""
    import shardwise.checkpoint as swc
    from shardwise.storage import open_folder

    target = _state(rank, world, 99)
    folder = open_folder(url, options)
    listings = []
    real = folder.fs.ls
    folder.fs.ls = lambda *a, **k: listings.append(a) or real(*a, **k)
    swc.load(target, folder)
    exact = _exact(target, rank)
    return exact, len(listings), folder.whole_bytes


def test_rank_0_lists_and_reads_the_records_for_every_rank(s3_bucket):
    """On an object store one rank lists the folder and reads `shardwise.json`, the
    tail of `.metadata` and the index, and broadcasts them (`engine.read_once.records`):
    the other ranks make none of those requests."""
    url, options = s3_bucket
    url += "/ckpt/records"
    run_ranks(_save, 2, url, options, timeout=120)
    results = run_ranks(_records_once, 3, url, options, timeout=120)
    manifest = open_folder(url, options).sizes()["shardwise.json"]
    assert results == [(True, 1, manifest), (True, 0, 0), (True, 0, 0)]


def _replicated(rank: int, world: int, url: str, options: dict) -> tuple[int, bool]:
    import shardwise.checkpoint as swc

    state = {f"v{i}": torch.full((1000 * (i + 1),), float(i)) for i in range(3)}
    if world == 2:
        swc.save(state, url, storage_options=options)
        return 0, True
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    info = swc.load(target, url, storage_options=options)  # from S3: broadcast by default
    return info.bytes_read, all(torch.equal(target[k], state[k]) for k in state)


def test_values_every_rank_loads_are_fetched_once_and_broadcast(s3_bucket):
    url, options = s3_bucket
    url += "/ckpt/replicated"
    run_ranks(_replicated, 2, url, options, timeout=120)
    results = run_ranks(_replicated, 3, url, options, timeout=120)
    view = StoredView.read(open_folder(url, options), 0)
    values = {f"v{i}": torch.zeros(1000 * (i + 1)) for i in range(3)}
    shares = [0, 0, 0]
    for batch in schedule(placed(view, values), 3):
        shares[batch.reader] += batch.nbytes
    assert sorted(shares) == [4_000, 8_000, 12_000]  # each value fetched by one rank alone
    assert results == [(share, True) for share in shares]


def _unknown_scheme(rank: int, world: int) -> str:
    import shardwise.checkpoint as swc

    try:
        swc.save({"w": torch.ones(2)}, "nosuch://bucket/ckpt")
    except swc.UnsupportedStorageError as e:
        return str(e)
    return "saved"


def test_an_unknown_scheme_is_refused_on_every_rank():
    messages = run_ranks(_unknown_scheme, 2, timeout=60)
    assert all("no fsspec backend serves 'nosuch://'" in m for m in messages), messages


def _stock_roundtrip(rank: int, world: int, url: str, options: dict) -> tuple[bool, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import shardwise.checkpoint as swc

    full = _full(0)
    # stock FsspecReader reads shardwise's checkpoint (saved row-wise on 2 ranks)
    plain = {k: torch.zeros(s) for k, s in SHAPES.items()} | {"step": {"seed": -1}}
    dcp.load(plain, storage_reader=FsspecReader(f"{url}/ours", **options))
    stock_reads_ours = plain["step"] == {"seed": 0} and all(
        torch.equal(plain[k], full[k]) for k in SHAPES
    )
    # shardwise reads what stock FsspecWriter wrote
    dcp.save(_state(rank, world, 5), storage_writer=FsspecWriter(f"{url}/stock", **options))
    target = _state(rank, world, 99)
    swc.load(target, f"{url}/stock", storage_options=options)
    full5 = _full(5)
    ours_reads_stock = target["step"] == {"seed": 5} and all(
        torch.equal(s, full5[k][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))])
        for k in ("emb", "col")
        for b, s in zip(target[k].layout_spec.blocks_of(rank), target[k].local_shards())
    )
    return stock_reads_ours, ours_reads_stock


def test_stock_fsspec_reader_and_writer_interoperate_on_s3(s3_bucket):
    url, options = s3_bucket
    run_ranks(_save, 2, f"{url}/ours", options, timeout=120)
    assert run_ranks(_stock_roundtrip, 2, url, options, timeout=120) == [(True, True)] * 2


def _reshard_row_to_col(rank: int, world: int, url: str, options: dict) -> tuple[bool, int, int]:
    import shardwise.checkpoint as swc
    from shardwise import Layout, ShardedTensor
    from shardwise.storage import open_folder
    from shardwise.testing import shard_of

    full = torch.arange(128 * 65536, dtype=torch.float32).reshape(128, 65536)
    rows = Layout.row_wise(full.shape, [64, 64])
    swc.save(
        {"w": ShardedTensor.from_layout(rows, shard_of(full, rows, rank))},
        url,
        storage_options=options,
    )
    cols = Layout.column_wise(full.shape, [32768, 32768])
    target = ShardedTensor.from_layout(cols, [torch.zeros(b.sizes) for b in cols.blocks_of(rank)])
    folder = open_folder(url, options)
    swc.load({"w": target}, folder)
    lo = rank * 32768
    return torch.equal(target.local_shards()[0], full[:, lo : lo + 32768]), folder.range_bytes, 0


def test_a_row_to_column_reshard_fetches_at_most_1_1x_what_each_rank_needs(s3_bucket):
    url, options = s3_bucket
    results = run_ranks(_reshard_row_to_col, 2, f"{url}/wide", options, timeout=120)
    needed = 128 * 32768 * 4  # each rank: half the columns of every row
    for exact, fetched, _ in results:
        assert exact
        assert needed <= fetched <= 1.1 * needed

"""`batch_boxes` (every piece at once) accepts exactly the pieces `one_tile_boxes` (one
piece at a time) accepts cut along one dimension, with the same parts."""

from __future__ import annotations

import random
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine.stored import StoredView
from shardwise.checkpoint.format.table import Boxes, batch_boxes, file_of, one_tile_boxes
from shardwise.storage import open_folder

LAYOUTS = {  # 20 chunks each: sections decoded as arrays
    "rows": Layout.row_wise((40, 8), [2] * 20),
    "grid": Layout.grid((20, 8), (5, 4)),
    "cols": Layout.column_wise((8, 40), [1, 3] * 10),
    "cube": Layout.row_wise((20, 4, 6), [1] * 20),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("batches") / "ck")
    state = {}
    for key, layout in LAYOUTS.items():
        blocks = [b for r in range(layout.world_size) for b in layout.blocks_of(r)]
        mine = Layout(layout.global_shape, {0: blocks})
        shards = [torch.randn(b.sizes) for b in blocks]
        state[key] = ShardedTensor.from_layout(mine, shards)
    swc.save(state, path)
    return path


@pytest.fixture(scope="module")
def chunks(saved):
    """Each tensor's `TensorChunks`, as a load reads them."""
    view = StoredView.read(open_folder(saved), 0)
    return {key: s.sectioned for key, s in view.stored_chunks(list(LAYOUTS), [])}


def _pieces(shape: tuple[int, ...], count: int, rng: random.Random) -> list:
    out = []
    for _ in range(count):
        lo = [rng.randrange(n) for n in shape]
        out.append((tuple(lo), tuple(rng.randint(1, n - a) for a, n in zip(lo, shape))))
    return out


def _cuts(boxes: Boxes, sizes: tuple[int, ...]) -> int:
    return int((boxes.lengths != np.asarray(sizes)).any(axis=0).sum())


def _rows(boxes: Boxes) -> list[tuple]:
    fields = (boxes.file, boxes.record, boxes.payload, boxes.crc[:, None], boxes.sizes)
    more = (boxes.inner, boxes.lengths, boxes.dest)
    return sorted(map(tuple, np.hstack([*fields, *more]).tolist()))


def test_every_piece_at_once_as_one_at_a_time(chunks):
    rng = random.Random(7)
    items = []
    for key, layout in LAYOUTS.items():
        items += [(chunks[key], lo, n) for lo, n in _pieces(layout.global_shape, 300, rng)]
    items += [(chunks["rows"], (0, 0), (40, 8)), (chunks["rows"], (4, 0), (2, 8))]  # all; one
    items = [(c, lo, n, c.table.overlapping(lo, n)) for c, lo, n in items]
    rng.shuffle(items)
    batch = batch_boxes(items)
    accepted = 0
    for (c, lo, n, found), got in zip(items, batch, strict=True):
        alone = one_tile_boxes(c, lo, n, found) if len(found) > 1 else None
        if alone is None or _cuts(alone, n) != 1:
            assert got is None, (c.key, lo, n)
            continue
        assert got is not None, (c.key, lo, n)
        assert _rows(got) == _rows(alone)
        accepted += 1
    assert accepted == sum(b is not None for b in batch) == 924


def test_pieces_tested_a_few_at_a_time_give_the_same_parts(chunks, monkeypatch):
    """Batches of at most PAIRS (piece, row) pairs: each piece's parts as in one batch."""
    items = [
        (chunks["rows"], (0, 1), (40, 3)),
        (chunks["cols"], (2, 1), (5, 39)),
        (chunks["cube"], (0, 1, 0), (20, 2, 6)),
        (chunks["rows"], (3, 1), (7, 7)),
    ]
    items = [(c, lo, n, c.table.overlapping(lo, n)) for c, lo, n in items]
    whole = batch_boxes(items)
    monkeypatch.setattr("shardwise.checkpoint.format.table.PAIRS", 1)
    apart = batch_boxes(items)
    assert [b is not None for b in whole] == [True, True, True, True]
    assert [_rows(a) for a in apart] == [_rows(b) for b in whole]  # type: ignore[arg-type]


def test_each_parts_checksum_is_its_payloads_kept_by_its_writer(saved, chunks):
    """The rows keep their checksums in the data file (format 5): each part's is fetched
    from there, the crc32c of its chunk's payload."""
    c = chunks["rows"]
    assert (c.table.crc_at >= 0).all() and len(c.table.crcs) == 0  # none in the section
    (boxes,) = batch_boxes([(c, (0, 1), (40, 3), c.table.overlapping((0, 1), (40, 3)))])
    assert boxes is not None and len(boxes.crc) == 20
    for file, (at, n), crc in zip(boxes.file.tolist(), boxes.payload.tolist(), boxes.crc.tolist()):
        data = (Path(saved) / file_of(*file)).read_bytes()
        assert crc == crc32c.crc32c(data[at : at + n])

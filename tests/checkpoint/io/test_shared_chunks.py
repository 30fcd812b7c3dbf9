"""Parts of one-tile chunks, verifying: each chunk read once, whole, for all its parts."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest

FULL = torch.arange(64.0).reshape(8, 8)


def _saved(tmp_path) -> str:
    """`FULL` in two row chunks of 4 x 8 float32 (128 bytes: one tile each)."""
    path = str(tmp_path / "ck")
    rows = Layout.row_wise((8, 8), [4, 4])
    layout = Layout((8, 8), {0: [b for r in range(2) for b in rows.blocks_of(r)]})
    swc.save({"w": ShardedTensor.from_layout(layout, [FULL[:4], FULL[4:]])}, path)
    return path


def _columns() -> ShardedTensor:
    """Four column bands of two, all on this rank: each overlaps both stored chunks."""
    cols = Layout.column_wise((8, 8), [2, 2, 2, 2])
    layout = Layout((8, 8), {0: [b for r in range(4) for b in cols.blocks_of(r)]})
    return ShardedTensor.from_layout(layout, [torch.full((8, 2), -1.0) for _ in range(4)])


@pytest.mark.parametrize("verify", [True, False])
def test_each_one_tile_chunk_is_read_once_for_all_its_parts(tmp_path, verify):
    path = _saved(tmp_path)
    target = _columns()
    reader = swc.load({"w": target}, path, verify=verify)
    for i, shard in enumerate(target.local_shards()):
        assert torch.equal(shard, FULL[:, 2 * i : 2 * i + 2])
    # verifying: the two 128-byte payloads once each, by one read from the first to the
    # last (a part alone reads its whole chunk: 8 parts, 1,024 bytes); not verifying,
    # each of the 8 parts reads its 4 runs of 2 floats as one span (gaps of a row under
    # a page are read through): 3 rows of 8 floats and 2 floats
    first, second = Manifest.read(path).tensors["w"].chunks
    assert first.file == second.file and first.payload and second.payload
    span = second.payload[0] + 128 - first.payload[0]
    assert reader.bytes_read == (span if verify else 8 * (3 * 8 * 4 + 2 * 4))


def test_a_damaged_shared_chunk_is_refused_and_no_part_of_it_kept(tmp_path):
    path = _saved(tmp_path)
    m = Manifest.read(path)
    second = m.tensors["w"].chunks[1]
    data = tmp_path / "ck" / second.file
    raw = bytearray(data.read_bytes())
    raw[second.payload[0] + 5] ^= 1
    data.write_bytes(bytes(raw))
    target = _columns()
    with pytest.raises(swc.CorruptCheckpointError, match=r"'w'.*fail"):
        swc.load({"w": target}, path)
    rows = [s[4:] for s in target.local_shards()]  # the damaged chunk's rows
    assert all(torch.equal(r, torch.full((4, 2), -1.0)) for r in rows)

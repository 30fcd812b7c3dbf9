"""`io.device` and `io.read`: a load's bytes for device targets, on CPU.

`HostCopier` stands for the side stream, so the slab bookkeeping (stand-ins
carved in order, a slab reused only once all its stand-ins were sent, the
budget never exceeded) and the piecewise verified read run anywhere; the CUDA
form is tests/checkpoint/api/test_gpu_save_load.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise import CorruptCheckpointError
from shardwise.checkpoint.format.archive import ArchiveLayout
from shardwise.checkpoint.format.manifest import StoredChunk
from shardwise.checkpoint.io.device import DeviceLanding, HostCopier
from shardwise.checkpoint.io.read import can_stream, read_streamed
from shardwise.checkpoint.io.write import DataFile
from shardwise.storage import open_folder

MIB = 1 << 20


def test_stand_ins_fill_slabs_in_order_and_reuse_them_once_sent() -> None:
    landing = DeviceLanding(2 * MIB, HostCopier)  # two 1 MiB slabs
    targets = [torch.zeros(200_000) for _ in range(5)]  # 800 KB each: one per slab
    sent = []
    for k, target in enumerate(targets):
        host = landing.stand_in((200_000,), torch.float32)
        assert host is not None
        host.fill_(k)
        sent.append(host.data_ptr())
        landing.send(target, host)
    landing.finish()
    assert [int(t[0]) for t in targets] == [0, 1, 2, 3, 4]
    assert all(torch.equal(t, torch.full((200_000,), float(k))) for k, t in enumerate(targets))
    assert len(set(sent)) == 2  # two slabs, reused: never a third buffer
    assert landing.stand_in((MIB // 4 + 1,), torch.float32) is None  # larger than a slab
    landing.finish()


def test_a_slab_with_a_stand_in_not_yet_sent_is_not_reused() -> None:
    landing = DeviceLanding(2 * MIB, HostCopier)
    a = landing.stand_in((600_000,), torch.uint8)  # slab 0
    b = landing.stand_in((600_000,), torch.uint8)  # slab 1 (slab 0 closed, `a` still out)
    assert a is not None and b is not None
    assert landing.stand_in((600_000,), torch.uint8) is None  # nothing free, nothing retired
    landing.drop(a)
    c = landing.stand_in((600_000,), torch.uint8)  # slab 0 again, now that `a` is done
    assert c is not None and c.data_ptr() == a.data_ptr()
    landing.finish()


def _chunk(tmp_path: Path, tensor: torch.Tensor) -> tuple[StoredChunk, ArchiveLayout]:
    with DataFile(tmp_path, "f") as f:
        written = f.write_tensor(tensor)
        f.finish()
    chunk = StoredChunk.of(written.chunk_entry((0,) * tensor.dim(), tuple(tensor.shape)), "float32")
    assert written.payload is not None
    at, n = written.payload
    return chunk, ArchiveLayout(at, n, tensor.dtype, tuple(tensor.shape), True)


def test_a_chunk_larger_than_a_slab_is_read_piecewise_and_verified(tmp_path: Path) -> None:
    full = torch.randn(1000, 700)  # 2.8 MB through 1 MiB slabs
    chunk, layout = _chunk(tmp_path, full)
    target = torch.zeros(1000, 700)
    assert can_stream(chunk, layout, target, verify=True)
    file = open_folder(tmp_path).open("f")
    landing = DeviceLanding(2 * MIB, HostCopier)
    n = read_streamed(file, "f", "w", chunk, layout, target, landing, verify=True)
    landing.finish()
    assert n == full.nbytes and torch.equal(target, full)

    data = bytearray((tmp_path / "f").read_bytes())
    data[layout.payload_offset + 1_500_000] ^= 1
    (tmp_path / "f").write_bytes(bytes(data))
    file = open_folder(tmp_path).open("f")
    with pytest.raises(
        CorruptCheckpointError, match=r"'w': bytes \d+\.\.\d+ of f fail their checksum"
    ):
        read_streamed(file, "f", "w", chunk, layout, torch.zeros(1000, 700), landing, verify=True)
    landing.finish()
    assert not can_stream(chunk, layout, torch.zeros(700, 1000).t(), verify=True)  # strided target

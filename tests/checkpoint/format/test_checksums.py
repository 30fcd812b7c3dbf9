"""Page checksums, frames and byte views (`checksums`): the byte-level rules writers,
readers and verifiers share; checkpoints of format versions 1 and 2 (pages of 1 MiB), and
chunks stored through a transform (one checksum over the record), verified."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise import Block
from shardwise.checkpoint.format.checksums import bad_page, byte_view, frame_crc, pages_of
from shardwise.checkpoint.format.manifest import Manifest

from .tile_data import WIDE, flip_byte

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_verify_checks_compressed_chunks(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        pytest.skip("zstandard is not installed")
    folder = tmp_path / "zstd"
    dcp.save(
        {"x": torch.arange(10000.0)}, storage_writer=swc.Writer(folder, _extensions=[ZStandard()])
    )
    assert swc.verify(folder, raise_on_error=False) == []
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(swc.CorruptCheckpointError, match="'x'") as e:
        swc.verify(folder)
    assert len(e.value.problems) == 1


def test_pages_of_an_empty_payload_is_one_empty_page():
    assert pages_of(memoryview(b"")) == [crc32c.crc32c(b"")]


def test_pages_of_slices_the_payload_the_last_page_short():
    data = bytes(range(10))
    assert pages_of(memoryview(data), 4) == [
        crc32c.crc32c(data[0:4]),
        crc32c.crc32c(data[4:8]),
        crc32c.crc32c(data[8:10]),
    ]


def test_bad_page_names_the_first_damaged_page_exactly():
    payload = bytes(range(100, 110))
    pages = pages_of(memoryview(payload), 4)
    assert bad_page(payload, 0, 4, pages) is None
    damaged = bytearray(payload)
    damaged[9] ^= 1  # page 2, the short one
    damaged[5] ^= 1  # page 1: the first that fails
    assert bad_page(damaged, 0, 4, pages) == 4
    # a read of whole pages from page 1 on: offsets are relative to what was read
    assert bad_page(damaged[4:], 4, 4, pages) == 0
    assert bad_page(damaged[8:], 8, 4, pages) == 0
    assert bad_page(payload[4:], 4, 4, pages) is None


def test_bad_page_of_an_empty_payload_checks_its_one_empty_page():
    assert bad_page(b"", 0, 4, [crc32c.crc32c(b"")]) is None
    assert bad_page(b"", 0, 4, [crc32c.crc32c(b"x")]) == 0


def test_frame_crc_is_one_stream_over_head_then_tail():
    head, tail = b"PK\x03\x04 header", b"central directory"
    assert frame_crc(head, tail) == crc32c.crc32c(head + tail)
    assert frame_crc(memoryview(head), memoryview(tail)) == crc32c.crc32c(head + tail)
    assert frame_crc(tail, head) != frame_crc(head, tail)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16),  # no numpy dtype: through uint8
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),  # 0-d
        torch.empty(0, 4),
    ],
    ids=["float32", "bfloat16", "bool", "0-d", "empty"],
)
def test_byte_view_is_the_c_order_bytes_without_a_copy(t):
    view = byte_view(t)
    expected = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert view.format == "B" and len(view) == t.nbytes and bytes(view) == expected
    if t.numel():
        t.reshape(-1).view(torch.uint8)[0] ^= 0xFF  # a view: the change shows
        assert view[0] == expected[0] ^ 0xFF


def _as_version(path: Path, version: int) -> None:
    """Rewrite a checkpoint's manifest in format `version` (pages of 1 MiB), as an older
    shardwise wrote it: the data files are the same."""
    m = Manifest.read(path)
    m.version = version
    for t in m.tensors.values():
        for c in t.chunks:
            assert c.payload is not None
            with open(path / c.file, "rb") as f:
                f.seek(c.payload[0])
                c.crcs, c.tile = pages_of(memoryview(f.read(c.payload[1]))), None
    (path / "shardwise.json").write_text(m.to_json())


@pytest.mark.parametrize("version", [1, 2])
def test_checkpoints_of_version_1_and_2_still_load_and_verify(wide, tmp_path, version):
    import shutil

    path, full = wide
    old = tmp_path / "old"
    shutil.copytree(path, old)
    _as_version(old, version)
    doc = json.loads((old / "shardwise.json").read_text())
    chunk = doc["tensors"]["w"]["chunks"][0]
    assert (doc["version"], doc["page_size"], len(chunk["pages"])) == (version, 1 << 20, 10)
    assert "tile" not in chunk and "tiles" not in chunk
    assert swc.verify(old) == []
    band = Block((0, 16384), (64, 16384))
    ckpt = swc.open_checkpoint(old)
    assert torch.equal(ckpt.read("w", band), full[band.slices()])
    assert ckpt.bytes_read == full.nbytes  # 1 MiB pages: a column band reads every page
    loaded = {"w": torch.zeros(WIDE)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, storage_reader=swc.Reader(old))
    assert torch.equal(loaded["w"], full)
    loaded = {"w": torch.zeros(WIDE)}
    swc.load(loaded, old)
    assert torch.equal(loaded["w"], full)
    flip_byte(old / chunk["file"], chunk["payload"][0] + (1 << 20) + 5)  # page 1
    problems = swc.verify(old, raise_on_error=False)
    lo = chunk["payload"][0] + (1 << 20)
    assert len(problems) == 1 and f"bytes {lo}..{lo + (1 << 20)} " in problems[0]
    with pytest.raises(swc.CorruptCheckpointError, match=rf"'w': bytes {lo}\.\.{lo + (1 << 20)} "):
        swc.read_tensor(old, "w", Block((4, 0), (1, 10)))  # row 4 lies in page 1
    assert torch.equal(swc.read_tensor(old, "w", Block((0, 0), (1, 10))), full[:1, :10])

"""`io.write.DataFile`: the one writer of chunk and object bytes.

Records are framed exactly as `torch.save` frames them, batched many per write
(host copies bounded), and the crash tests' failpoints fire where they expect:
"mid-data" after the file's first write, "after-data" once it is closed.
"""

from __future__ import annotations

import io
from pathlib import Path

import crc32c
import pytest
import torch

from shardwise.checkpoint.format.archive import tensor_archive
from shardwise.checkpoint.io import write as chunk_writer
from shardwise.checkpoint.io.write import DataFile


def _saved(t: torch.Tensor, serialization_id: str = "0" * 40) -> bytes:
    head, payload, tail = tensor_archive(t, serialization_id)
    return head + bytes(payload) + tail


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """("write", buffers) per sink write and ("failpoint", name) per failpoint, in order."""
    events: list = []
    monkeypatch.setattr(chunk_writer, "failpoint", lambda name: events.append(("failpoint", name)))
    real = chunk_writer.open_folder

    def open_folder(folder):
        f = real(folder)
        create = f.create

        def spy_create(name):
            sink = create(name)
            write, write_at = sink.write, sink.write_at
            sink.write = lambda buffers: (events.append(("write", len(buffers))), write(buffers))
            sink.write_at = lambda buffers, at: (
                events.append(("write", len(buffers))),
                write_at(buffers, at),
            )
            return sink

        f.create = spy_create
        return f

    monkeypatch.setattr(chunk_writer, "open_folder", open_folder)
    return events


def test_records_are_batched_and_framed_as_torch_save(tmp_path: Path, spied: list) -> None:
    tensors = [torch.arange(n, dtype=torch.float32) for n in range(1, 40)]
    with DataFile(tmp_path, "f.distcp") as f:
        obj = f.write_object(b"pickled")
        written = [f.write_tensor(t, "1" * 40) for t in tensors]
        f.finish()
    data = (tmp_path / "f.distcp").read_bytes()
    assert data == b"pickled" + b"".join(_saved(t, "1" * 40) for t in tensors)
    assert obj.crcs == [crc32c.crc32c(b"pickled")]
    for w, t in zip(written, tensors):
        assert data[w.offset : w.offset + w.length] == _saved(t, "1" * 40)
        assert w.payload is not None
        assert data[w.payload[0] : sum(w.payload)] == t.numpy().tobytes()
    # one write for all 118 buffers, then the failpoints in the crash tests' order
    assert spied == [("write", 118), ("failpoint", "mid-data"), ("failpoint", "after-data")]


def test_a_write_per_batch_when_buffers_or_copies_fill_it(
    tmp_path: Path, spied: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk_writer, "_BATCH_BUFFERS", 6)
    with DataFile(tmp_path, "f.distcp") as f:
        for _ in range(4):  # 3 buffers each: a write after every second tensor
            f.write_tensor(torch.ones(4))
        f.finish(sync=False)
    writes = [e for e in spied if e[0] == "write"]
    assert writes == [("write", 6), ("write", 6)]  # nothing left for `finish`
    assert spied.index(("failpoint", "mid-data")) == 1  # after the first write only

    spied.clear()
    monkeypatch.setattr(chunk_writer, "_BATCH_BYTES", 64)
    wide = torch.ones(8, 4).t()  # not contiguous: a 128-byte host copy, written at once
    with DataFile(tmp_path, "g.distcp") as f:
        w = f.write_tensor(wide)
        f.write_tensor(torch.ones(2))  # in place: no copy, waits for the next write
        f.finish()
    assert [e for e in spied if e[0] == "write"] == [("write", 3), ("write", 3)]
    data = (tmp_path / "g.distcp").read_bytes()
    assert data[: w.length] == _saved(wide.contiguous())


def test_an_encoded_record_is_stored_as_is_with_one_checksum(tmp_path: Path) -> None:
    with DataFile(tmp_path, "f.distcp") as f:
        f.write_object(b"x" * 5)
        w = f.write_archive(io.BytesIO(b"compressed").getbuffer())
        f.finish()
    assert (w.offset, w.length, w.crcs, w.payload, w.tile) == (
        5,
        10,
        [crc32c.crc32c(b"compressed")],
        None,
        None,
    )
    assert (tmp_path / "f.distcp").read_bytes() == b"xxxxxcompressed"


def test_a_failure_inside_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(KeyError), DataFile(tmp_path, "f.distcp") as f:
        f.write_tensor(torch.ones(3))
        raise KeyError("boom")
    assert not (tmp_path / "f.distcp").exists()

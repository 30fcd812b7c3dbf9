"""`storage.local`: positional writes that the kernel takes in pieces still land whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.storage import local


def test_write_at_finishes_short_writes_at_their_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwritev
    calls = []

    def at_most_7(fd, views, offset):  # a kernel taking 7 bytes per call
        calls.append(offset)
        first = bytes(views[0])[:7]
        return real(fd, [first], offset)

    monkeypatch.setattr(local.os, "pwritev", at_most_7)
    sink = local.LocalSink(tmp_path / "f")
    buffers = [b"abcdefghij", memoryview(b"KLMNOPQ"), b"", bytearray(b"rstuvwxyz0123")]
    sink.write_at([b"", memoryview(b"")], 100)  # nothing to write: no call
    sink.write_at(buffers, 3)
    sink.close(sync=False)
    data = (tmp_path / "f").read_bytes()
    assert data == b"\0" * 3 + b"abcdefghijKLMNOPQrstuvwxyz0123"
    assert calls == [3, 10, 13, 20, 27]

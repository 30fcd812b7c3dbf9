"""`format.index.section_bytes`: a load's sections read window by window into one buffer;
where a head points past any file (past int64 too) it is refused, nothing misread."""

from __future__ import annotations

import json

import pytest

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.index import read_sections, section_bytes
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.storage import open_folder

from .golden_manifest import checksummed, compact, golden_folder, golden_text


@pytest.mark.parametrize("field", [1, 2])  # its offset, its length
def test_a_section_past_int64_is_refused_as_truncated(tmp_path, field):
    """A section offset or length past any file (past int64 too): the window would end
    past the index's end, refused as truncated before anything is read."""
    doc = json.loads(golden_text())
    doc["tensors"]["model.w"]["section"][field] = 1 << 70
    f = open_folder(golden_folder(tmp_path, compact(checksummed(doc))))
    head = Manifest.read_head(f)
    assert head.index is not None and head.tensors["model.w"].section[field] == 1 << 70
    wanted = [("model.w", head.tensors["model.w"])]
    with pytest.raises(swc.CorruptCheckpointError, match=r"\(\d+ bytes\): truncated"):
        list(read_sections(f, head.index, wanted, "src"))


def test_sections_of_many_windows_are_each_their_own_bytes(tmp_path, monkeypatch):
    """Windows of one section each (the buffer reused): every section's bytes its own."""
    monkeypatch.setattr("shardwise.checkpoint.format.index.WINDOW", 1)
    f = open_folder(golden_folder(tmp_path))
    head = Manifest.read_head(f)
    assert head.index is not None
    keys = list(head.tensors)
    got = list(section_bytes(f, head.index, keys, head.tensors, "src", f.sizes()))
    index = f.read(head.index.file)
    starts = {k: head.index.blocks[t.section[0]] + t.section[1] for k, t in head.tensors.items()}
    assert [k for k, *_ in got] == sorted(keys, key=starts.__getitem__)
    for key, t, data, name in got:
        assert data == index[starts[key] : starts[key] + t.section[2]] and name.endswith(f"'{key}'")

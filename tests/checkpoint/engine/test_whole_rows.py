"""`engine.stored`: pieces that are whole stored chunks, planned as arrays a group of
sections at a time and read a batch of requests at a time. Groups and batches are made
tiny here (12 tensors: sections in groups of 5, checksums fetched every 3 rows, requests
2 at a time), so that boundaries fall between neighbouring tensors: a load across them is
bit-exact, and a crafted row on either side of a boundary is refused with the very error
the one-piece path (`ChunkTable`, `TensorChunks.covering`) gives, before any target is
written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.engine import load as loading
from shardwise.checkpoint.engine import stored as stored_view
from shardwise.checkpoint.engine import stored as whole_rows
from shardwise.checkpoint.format.table import file_of

from ..format.crafted_sections import resection, section_rows

N = 12
VALUES = {f"t{i:02d}": torch.arange(12.0).reshape(4, 3) + 100 * i for i in range(N)}
# a 2-d row: offsets sizes tile rank k token record(2) payload(2) frame count transform crc_at
SIZES, RECORD, PAYLOAD, COUNT, CRC_AT = 2, 9, 11, 14, 16


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tiny groups and batches; how many pieces the array path took, and requests ran."""
    monkeypatch.setattr(stored_view, "GROUP_SECTIONS", 5)
    monkeypatch.setattr(whole_rows, "SLOTS", 3)
    monkeypatch.setattr(whole_rows, "BATCH", 2)
    seen = {"taken": 0, "batches": 0, "takes": 0}
    take, reads = whole_rows.WholeRows._take, whole_rows.WholeRows.reads

    def counted_take(self: Any, part: Any, d: int) -> Any:
        before = self.taken
        seen["takes"] += 1
        rest = take(self, part, d)
        seen["taken"] += self.taken - before
        return rest

    def counted_reads(self: Any, page_size: int) -> Any:
        for batch in reads(self, page_size):
            seen["batches"] += 1
            yield batch

    monkeypatch.setattr(whole_rows.WholeRows, "_take", counted_take)
    monkeypatch.setattr(whole_rows.WholeRows, "reads", counted_reads)
    return seen


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    swc.save(dict(VALUES), path)
    return path


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros(4, 3) for k in VALUES}


def test_a_load_across_group_and_batch_boundaries_is_bit_exact(tmp_path, small) -> None:
    path = _saved(tmp_path)
    target = _zeros()
    swc.load(target, path)
    assert all(torch.equal(target[k], v) for k, v in VALUES.items())
    # sections in groups of 5, 5, 2; requests 2 a batch
    assert small == {"taken": N, "batches": 3 + 3 + 1, "takes": 3}


def _refused(path: Path, monkeypatch: pytest.MonkeyPatch, arrays: bool) -> str:
    """The error a load of `path` raises (arrays: through `engine.stored`, else one piece at a
    time); no target written."""
    with monkeypatch.context() as m:
        if not arrays:
            m.setattr(whole_rows.WholeRows, "take", lambda self, group: group)
        target = _zeros()
        with pytest.raises(swc.CorruptCheckpointError) as e:
            swc.load(target, path)
        assert all(not t.any() for t in target.values())
    return str(e.value)


def _crafted(path: Path, key: str, change: Any) -> None:
    rows, crcs = section_rows(path, key)
    change(rows[0], path)
    resection(path, key, rows, crcs)


def _claims_next(row: list[int], path: Path) -> None:
    """Its record and payload those of the next tensor's chunk: the same bytes twice."""
    (other,), _ = section_rows(path, "t05")
    row[RECORD : RECORD + 4] = other[RECORD : RECORD + 4]


def _wider(row: list[int], _path: Path) -> None:
    row[SIZES] = 5  # past the tensor's 4 rows


def _slot_past_end(row: list[int], path: Path) -> None:
    row[CRC_AT] = (path / file_of(*row[6:9])).stat().st_size - 4


def _two_counts(row: list[int], _path: Path) -> None:
    row[COUNT] = 2  # two checksums for one tile: never fetched, its chunk refused


WHAT = {
    _claims_next: "'%s' claim overlapping bytes",  # 't05' and 't04', 't06' and 't05'
    _wider: "'%s': chunk at offsets (0, 0) has inconsistent sizes",
    _slot_past_end: "'%s': chunk checksums at bytes",
    _two_counts: "'%s': chunk at offsets (0, 0) has inconsistent sizes",
}


@pytest.mark.parametrize("key", ["t04", "t06"])  # the last of a group, the second of the next
@pytest.mark.parametrize("change", [_claims_next, _wider, _slot_past_end, _two_counts])
def test_a_crafted_row_beside_a_boundary_is_refused_as_one_piece_refuses_it(
    tmp_path, monkeypatch, small, key, change
) -> None:
    path = _saved(tmp_path)
    _crafted(path, key, change)
    expected = _refused(path, monkeypatch, arrays=False)
    assert _refused(path, monkeypatch, arrays=True) == expected
    assert WHAT[change] % (min(key, "t05") if change is _claims_next else key) in expected


def test_the_array_path_takes_no_piece_of_a_crafted_section(tmp_path, monkeypatch, small) -> None:
    """The crafted section goes the one-piece way; every other tensor the array way."""
    path = _saved(tmp_path)
    _crafted(path, "t04", _wider)
    _refused(path, monkeypatch, arrays=True)
    assert small["taken"] == N - 1 and small["batches"] == 0  # refused before any read


def test_a_flat_state_dict_is_not_copied_and_a_nested_one_is(monkeypatch) -> None:
    flat = {"a": torch.zeros(1), "b": 3}
    assert loading._flatten(flat) == (flat, {}) and loading._flatten(flat)[0] is flat
    nested = {"a": {"b": torch.zeros(1)}, "c": [torch.zeros(1)]}
    got, mappings = loading._flatten(nested)
    assert list(got) == ["a.b", "c.0"] and mappings == {"a.b": ("a", "b"), "c.0": ("c", 0)}


@pytest.mark.parametrize(("pairs", "taken", "takes"), [(3, N, 2 + 2 + 1), (0, 0, 0)])
def test_pairs_compared_at_once_are_bounded(
    tmp_path, monkeypatch, small, pairs, taken, takes
) -> None:
    """Sections taken a few (piece, row) pairs at a time; one past the bound alone is
    planned the one-piece way: bit-exact either way."""
    monkeypatch.setattr(whole_rows, "PAIRS", pairs)
    path = _saved(tmp_path)
    target = _zeros()
    swc.load(target, path)
    assert all(torch.equal(target[k], v) for k, v in VALUES.items())
    assert small["taken"] == taken and small["takes"] == takes

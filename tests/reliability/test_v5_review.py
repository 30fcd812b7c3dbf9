"""Review of format version 5 and the join off the critical path (commits 9b5713c, d3b0123,
1d38cda), as an attacker: crafted kept-checksum slots, failed saves around the join, and
repeated saves reusing their cached places."""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
import shardwise.checkpoint.engine.records as joining
import shardwise.checkpoint.engine.save as saving
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.plan import owner_of
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.format.table import file_of
from shardwise.comm.agreement import Agreement
from shardwise.testing import shard_of

from ..checkpoint.format.crafted_sections import resection, section_rows
from ..checkpoint.format.golden_manifest import save_golden
from ..comm.threaded_world import ThreadedWorld

# -- crafted crc_at slots ---------------------------------------------------------------------

HUGE = 1 << 61  # a tile count whose slot end, at + 4 * (1 + count), wraps around int64


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    save_golden(path := tmp_path_factory.mktemp("golden5") / "ck")
    return path


def _huge_count_last(golden: Path, tmp_path: Path, count: int = HUGE) -> Path:
    """model.w's row 0 claims (count, 1) elements in (1, 1) tiles, so `count` checksums,
    kept at the very end of its data file (after every other slot: none to overlap)."""
    path = Path(shutil.copytree(golden, tmp_path / "ck"))
    rows, crcs = section_rows(path, "model.w")
    rows[0][2:6] = [count, 1, 1, 1]
    rows[0][14], rows[0][16] = count, next(path.glob("__0_0.*")).stat().st_size
    resection(path, "model.w", rows, crcs)
    return path


@pytest.mark.parametrize("how", ["manifest", "load"])
def test_a_slot_count_wrapping_int64_is_a_corrupt_checkpoint(golden, tmp_path, how):
    path = _huge_count_last(golden, tmp_path)
    with pytest.raises(swc.CorruptCheckpointError):
        if how == "manifest":
            Manifest.read(path)
        else:
            swc.load({"model": {"w": torch.zeros(6, 4)}}, path)


def test_verify_names_the_tensor_of_a_wrapping_slot_count(golden, tmp_path):
    path = _huge_count_last(golden, tmp_path)
    (problem,) = swc.verify(path, raise_on_error=False)
    assert "model.w" in problem and "Errno" not in problem


def test_a_slot_count_past_its_tensor_is_never_fetched(golden, tmp_path):
    """A row reaching past its tensor has no checksums fetched: its count is never
    trusted, and the row is refused as the chunk checks refuse it."""
    path = _huge_count_last(golden, tmp_path, HUGE // 2)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.read(path)
    message = str(info.value)
    assert "chunk at offsets (0, 0) of 'model.w' has inconsistent sizes" in message
    assert "(file __0_0.sw" in message


# -- failed saves around the join ---------------------------------------------------------------

W = 2
LAYOUT = Layout.row_wise((8, 6), [3, 5])
ARGS = ("save path", ("p",))


def _state(rank: int, base: float, step: Any) -> dict[str, Any]:
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) + base
    w = ShardedTensor.from_layout(LAYOUT, shard_of(full, LAYOUT, rank), rank=rank)
    return {"w": w, "bias": torch.arange(5.0) + base, "step": step}


def _save(world: ThreadedWorld, path: Path, base: float, step: Any = 7) -> list[Any]:
    return world.run(lambda c: save_state(_state(c.rank, base, step), path, Agreement(c, ARGS)))


def _old_kept_then_next_save_collects(
    world: ThreadedWorld, path: Path, monkeypatch: pytest.MonkeyPatch, leftovers: set[str]
) -> None:
    """After a failed save: the last checkpoint loads its values; once the fault is gone
    the next save commits, removes `leftovers` and loads its own."""
    assert _loaded(world, path) == _expected(0.0, 7)
    monkeypatch.undo()
    assert _save(world, path, 200.0, 9) == [None] * W
    assert not leftovers & set(_digests(path))
    assert _loaded(world, path) == _expected(200.0, 9)


def _loaded(world: ThreadedWorld, path: Path) -> list[tuple[list[float], list[float], Any]]:
    def one(c: Any) -> tuple[list[float], list[float], Any]:
        target = _state(c.rank, -1000.0, None)
        agreement = Agreement(c, ("load path", ("p",)))
        load_state(target, path, agreement, strict=True, verify=True, cast_dtype=False)
        return _flat(target["w"].local_shards()), target["bias"].tolist(), target["step"]

    return world.run(one)


def _expected(base: float, step: Any) -> list[tuple[list[float], list[float], Any]]:
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) + base
    bias = (torch.arange(5.0) + base).tolist()
    return [(_flat(shard_of(full, LAYOUT, r)), bias, step) for r in range(W)]


def _flat(shards: list[torch.Tensor]) -> list[float]:
    return [v for t in shards for v in t.flatten().tolist()]


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


def _fails_keeping(
    world: ThreadedWorld, path: Path, before: dict[str, str]
) -> tuple[list[Any], set[str]]:
    """A save with a fault in place: `OSError` on every rank, every file of the last
    checkpoint (`before`) byte for byte as it was; the errors, and what the save left."""
    out = _save(world, path, 100.0, 8)
    assert [type(e) for e in out] == [OSError] * W
    after = _digests(path)
    assert {n: after[n] for n in before} == before
    return out, set(after) - set(before)


DATA = re.compile(r"__(\d+)_(\d+)\.sw([0-9a-f]{12})\.distcp")


def _failing_write(rank: int) -> Any:
    real = saving.write_rank_file

    def write(folder: Any, names: list[str], *rest: Any) -> None:
        if names[0].startswith(f"__{rank}_"):
            raise OSError(f"disk full on rank {rank}")
        real(folder, names, *rest)

    return write


@pytest.mark.parametrize("rank", [0, 1])
def test_a_data_write_failing_on_one_rank_keeps_the_last_checkpoint(tmp_path, monkeypatch, rank):
    """Raised on every rank; the committed checkpoint untouched; the failed save's parts
    and index gone (only the other rank's finished data file stays, a token-named
    leftover); the next save commits and collects it."""
    world, path = ThreadedWorld(W), tmp_path / "ck"
    assert _save(world, path, 0.0) == [None] * W
    before = _digests(path)
    monkeypatch.setattr(saving, "write_rank_file", _failing_write(rank))
    out, left = _fails_keeping(world, path, before)
    assert all(f"disk full on rank {rank}" in str(e) for e in out)
    extra = sorted(left)
    assert [DATA.fullmatch(n).group(1, 2) for n in extra] == [(str(1 - rank), "0")]  # type: ignore[union-attr]
    _old_kept_then_next_save_collects(world, path, monkeypatch, set(extra))


def test_a_commit_failing_before_its_renames_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """The commit raises before renaming: every rank raises, the committed checkpoint
    stays whole and loads; the leftovers (data, the joined index and records, which
    `discard` keeps once the commit began) are collected by the next save."""
    world, path = ThreadedWorld(W), tmp_path / "ck"
    assert _save(world, path, 0.0) == [None] * W
    before = _digests(path)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("rename refused")

    monkeypatch.setattr(joining, "commit", broken)
    _, leftovers = _fails_keeping(world, path, before)
    shapes = sorted(re.sub(r"\.sw[0-9a-f]{12}\.", ".sw*.", n) for n in leftovers)
    assert shapes == [  # both ranks' data, rank 0's index, the joined records
        ".metadata.sw*.tmp",
        "__0_0.sw*.distcp",
        "__0_1.sw*.distcp",
        "__1_0.sw*.distcp",
        "shardwise.json.sw*.tmp",
    ]
    _old_kept_then_next_save_collects(world, path, monkeypatch, leftovers)


# -- repeated saves reusing cached places ----------------------------------------------------


def test_a_repeated_save_reusing_its_places_loads_the_new_values(tmp_path):
    """The plan and places are reused: an object of the same length (new bytes, new
    crc32c), a strided tensor of the same shape, another folder."""
    world, path, other = ThreadedWorld(W), tmp_path / "ck", tmp_path / "other"
    assert _save(world, path, 0.0, "aaaa") == [None] * W
    strided = (torch.arange(10.0) + 5.0)[::2]

    def save_strided(c: Any) -> None:
        state = _state(c.rank, 1.0, "bbbb") | {"bias": strided}
        save_state(state, path, Agreement(c, ARGS))

    assert world.run(save_strided) == [None] * W
    assert _save(world, other, 2.0, "cccc") == [None] * W
    assert _loaded(world, path) == [(w, strided.tolist(), s) for w, _b, s in _expected(1.0, "bbbb")]
    assert _loaded(world, other) == _expected(2.0, "cccc")
    assert swc.verify(path, raise_on_error=False) == swc.verify(other, raise_on_error=False) == []


def _only_on(rank: int) -> str:
    """A key whose owner (`engine.plan.owner_of`) is not `rank`: held there only, its
    object is written by a rank that does not own it (its crc32c routed at every save)."""
    return next(k for k in (f"extra{i}" for i in range(100)) if owner_of(k, W) != rank)


def test_a_repeated_save_of_an_object_held_off_its_owner_loads_its_new_value(tmp_path):
    world, path, key = ThreadedWorld(W), tmp_path / "ck", _only_on(1)

    def save_with(value: str) -> list[Any]:
        def one(c: Any) -> None:
            state = _state(c.rank, 0.0, 7) | ({key: value} if c.rank == 1 else {})
            save_state(state, path, Agreement(c, ARGS))

        return world.run(one)

    assert save_with("aaaa") == [None] * W
    assert save_with("bbbb") == [None] * W
    assert swc.verify(path, raise_on_error=False) == []

    def load(c: Any) -> Any:
        target: dict[str, Any] = {key: None}
        agreement = Agreement(c, ("l", ("p",)))
        load_state(target, path, agreement, strict=False, verify=True, cast_dtype=False)
        return target[key]

    assert world.run(load) == ["bbbb"] * W


def test_a_part_failing_on_one_rank_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Rank 1's part cannot be written (before any data): every rank raises; only rank
    0's part is left, a temporary of the records, which the next save collects."""
    world, path = ThreadedWorld(W), tmp_path / "ck"
    assert _save(world, path, 0.0) == [None] * W
    before = _digests(path)
    real = saving.write_part

    def write_part(folder: Any, token: str, rank: int, data: list[bytes]) -> None:
        if rank == 1:
            raise OSError("quota exceeded")
        real(folder, token, rank, data)

    monkeypatch.setattr(saving, "write_part", write_part)
    _, left = _fails_keeping(world, path, before)
    assert [re.fullmatch(r"shardwise\.json\.sw[0-9a-f]{12}\.tmp", n) is not None for n in left] == [
        True
    ]
    _old_kept_then_next_save_collects(world, path, monkeypatch, left)


def test_a_crafted_count_sizes_no_allocation_past_its_tensor(tmp_path):
    """'w' (4x4) claims (n, 1) elements in (1, 1) tiles, its n checksums filling the data
    file before the other slots: refused, holding no more than the data file's size."""
    path = tmp_path / "ck"
    swc.save({"w": torch.arange(16.0).reshape(4, 4), "big": torch.randn(1 << 18)}, str(path))
    rows, crcs = section_rows(path, "w")
    big, _ = section_rows(path, "big")
    data = path / file_of(*rows[0][6:9])
    size = data.stat().st_size
    n = min(big[0][-1], rows[0][-1]) // 4 - 1  # ends where the first real slot begins
    rows[0][2:6] = [n, 1, 1, 1]
    rows[0][14], rows[0][16] = n, 0
    resection(path, "w", rows, crcs)
    tracemalloc.start()
    try:
        with pytest.raises(swc.CorruptCheckpointError) as info:
            Manifest.read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "'w'" in str(info.value)
    assert peak < size


def test_a_placement_failing_on_one_rank_fails_every_rank_at_the_route(tmp_path, monkeypatch):
    """A first save's places are reported before any data: a rank whose placing failed
    sends nothing and the route raises its problem on every rank (none waits in it)."""
    from shardwise.checkpoint.engine import plan as plan_cache

    plan_cache.forget()
    original, local = saving.place_archives, threading.local()

    def place(*args: Any) -> Any:
        if local.rank == 1:
            raise OSError("no room to place on rank 1")
        return original(*args)

    monkeypatch.setattr(saving, "place_archives", place)

    def run(c: Any) -> None:
        local.rank = c.rank
        save_state(_state(c.rank, 1.0, 7), tmp_path / "ck", Agreement(c, ARGS))

    results = ThreadedWorld(W, 10.0).run(run)
    assert [type(r).__name__ for r in results] == ["OSError", "OSError"]
    assert all("no room to place on rank 1" in str(r) for r in results)
    assert not list((tmp_path / "ck").glob("*.distcp"))  # no data written by any rank

"""An owner builds and encodes its part a batch of keys at a time (`engine.plan.owned_part`).

With batches of 3 keys, each owner's tensors and objects span several batches;
the joined records must be exactly those one batch makes (but for the names
each save gives its files), and the checkpoint must read back bit for bit
through shardwise, its tools and stock DCP.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import plan as key_owners
from shardwise.checkpoint.engine import plan as plan_cache
from shardwise.checkpoint.engine.load import load_state
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.offline.verification import verify
from shardwise.comm.agreement import Agreement
from shardwise.testing import shard_of

from ...comm.threaded_world import ThreadedWorld

ROWS = Layout.row_wise((6, 4), [2, 4])
COUNT = 8  # of each kind: sharded tensors, plain tensors, objects


def _full(i: int) -> torch.Tensor:
    return torch.arange(24.0).reshape(6, 4) + i


def _state(rank: int, fill: bool = True) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for i in range(COUNT):
        full = _full(i) if fill else torch.zeros(6, 4)
        model[f"w{i}"] = ShardedTensor.from_layout(ROWS, shard_of(full, ROWS, rank), rank=rank)
        model[f"b{i}"] = torch.full((3,), float(i) if fill else -1.0)
    notes = {f"note{i}": f"n{i}" if fill else "" for i in range(COUNT)}
    return {"model": model, **notes}


def _save(path: Path) -> None:
    plan_cache.forget()
    world = ThreadedWorld(2)
    results = world.run(lambda comm: save_state(_state(comm.rank), path, Agreement(comm)))
    assert results == [None, None]


def _untokened(text: str) -> str:
    return re.sub(r"\.sw[0-9a-f]{12}\.", ".sw.", text)


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`BATCH` = 3; the number of keys in each batch an owner encoded, in call order."""
    monkeypatch.setattr(key_owners, "BATCH", 3)
    sizes: list[int] = []
    real = key_owners.plan_records

    def counted(plan: Any, *args: Any) -> Any:
        sizes.append(len(plan.tensors) + len(plan.objects))
        return real(plan, *args)

    monkeypatch.setattr(key_owners, "plan_records", counted)
    return sizes


def test_batched_parts_join_into_the_records_one_batch_makes(
    tmp_path: Path, batches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "batched")
    owned = [[0, 0], [0, 0]]  # per owner: tensor keys, object keys
    for key in [f"model.{k}{i}" for k in "wb" for i in range(COUNT)]:
        owned[key_owners.owner_of(key, 2)][0] += 1
    for key in [f"note{i}" for i in range(COUNT)]:
        owned[key_owners.owner_of(key, 2)][1] += 1
    want = sorted(min(3, n - start) for pair in owned for n in pair for start in range(0, n, 3))
    assert sorted(batches) == want
    assert sum(math.ceil(n / 3) for pair in owned for n in pair) > 4  # several per owner

    monkeypatch.setattr(key_owners, "BATCH", 1 << 20)
    del batches[:]
    _save(tmp_path / "whole")
    assert len(batches) == sum(1 for pair in owned for n in pair if n)

    batched, whole = (
        pickle.loads((tmp_path / n / ".metadata").read_bytes()) for n in ("batched", "whole")
    )
    assert batched.state_dict_metadata == whole.state_dict_metadata
    assert (
        batched.planner_data
        == whole.planner_data
        == {
            **{f"model.{k}{i}": ("model", f"{k}{i}") for k in "wb" for i in range(COUNT)},
            **{f"note{i}": (f"note{i}",) for i in range(COUNT)},
        }
    )
    assert {(i.fqn, i.index): _untokened(str(s)) for i, s in batched.storage_data.items()} == {
        (i.fqn, i.index): _untokened(str(s)) for i, s in whole.storage_data.items()
    }
    a, b = (Manifest.read(tmp_path / n) for n in ("batched", "whole"))  # every chunk checked
    assert _placed(a) == _placed(b)
    assert {
        k: (_untokened(o.file), o.offset, o.length, o.crc32c) for k, o in a.objects.items()
    } == {k: (_untokened(o.file), o.offset, o.length, o.crc32c) for k, o in b.objects.items()}


def _placed(manifest: Manifest) -> dict[str, Any]:
    """Each tensor's chunks and index section, but for what names the save (its token,
    and the frames and section checksums that hold its serialization id)."""
    out = {}
    for key, t in manifest.tensors.items():
        assert t.section is not None
        chunks = [
            (c.offsets, c.sizes, _untokened(c.file), c.record, c.payload, c.crcs, c.tile)
            for c in t.chunks
        ]
        out[key] = (t.dtype, t.shape, t.section[:4], chunks)
    return out


def test_a_batched_part_reads_back_everywhere(tmp_path: Path, batches: list[int]) -> None:
    path = tmp_path / "ckpt"
    _save(path)
    assert len(batches) > 4
    assert verify(path) == []

    world = ThreadedWorld(2)

    def load(comm: Any) -> dict[str, Any]:
        target = _state(comm.rank, fill=False)
        load_state(target, path, Agreement(comm), strict=True, verify=True, cast_dtype=False)
        return target

    for rank, got in enumerate(world.run(load)):
        want = _state(rank)
        for i in range(COUNT):
            for g, w in zip(
                got["model"][f"w{i}"].local_shards(), want["model"][f"w{i}"].local_shards()
            ):
                assert torch.equal(g, w)
            assert torch.equal(got["model"][f"b{i}"], want["model"][f"b{i}"])
            assert got[f"note{i}"] == f"n{i}"

    stock = {"model": {f"w{i}": torch.zeros(6, 4) for i in range(COUNT)}}
    dcp.load(stock, checkpoint_id=str(path), no_dist=True)
    assert all(torch.equal(stock["model"][f"w{i}"], _full(i)) for i in range(COUNT))


def test_each_owner_removes_its_part_and_a_dead_ranks_part_is_collected(tmp_path: Path) -> None:
    """After the verdict each rank removes its own part (rank 0 removing all W would
    cost it O(W)); a part left by a rank that died there goes at the next commit."""
    path = tmp_path / "ckpt"
    _save(path)
    names = sorted(p.name for p in path.iterdir())
    assert [n for n in names if n.endswith(".tmp")] == []
    assert {".metadata", "shardwise.json", ".shardwise"} <= set(names)
    assert len([n for n in names if n.endswith(".distcp")]) == 3  # two ranks' data, the index
    dead = path / "shardwise.json.sw0123456789ab.tmp"
    dead.write_bytes(b"a part of a save whose rank died after the verdict")
    _save(path)
    assert not dead.exists()
    assert [p.name for p in path.iterdir() if p.name.endswith(".tmp")] == []

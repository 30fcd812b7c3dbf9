"""ShardedTensors on process subgroups, replicated across the other mesh dimension
(the data-parallel copies of a tensor-parallel weight), through `swc.save`,
`swc.async_save`, `swc.load` and stock `dcp.save` / `dcp.load` with the hooks.

Saved on 4 ranks as DP 2 x TP 2 (TP groups {0, 1} and {2, 3}, DP groups {0, 2} and
{1, 3}); loaded into the same split, DP 1 x TP 4, DP 4 x TP 1, 2 ranks, world-group
ShardedTensors and plain tensors, each value compared bit for bit with the reference.
Replicas are stored once: every checkpoint holds exactly the bytes of a one-process
save of the distinct blocks alone. Replicas that disagree fail on every rank, naming
the key and the ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((10, 6), torch.float32),  # TP rows 7 + 3
    "v": ((6, 4), torch.bfloat16),  # TP rank 0: two column blocks, TP rank 1: nothing
    "g": ((4, 6, 3), torch.float64),  # TP grid along dim 1
    "z": ((5, 4), torch.float32),  # DP rows 3 + 2 (ZeRO-like), replicated across TP
    "e": ((9, 3), torch.float32),  # world rows 4 + 0 + 3 + 2
    "b": ((7,), torch.float32),  # a plain tensor
}
OBJECTS = {"step": 7, "cfg": {"lr": 0.5, "names": ["a", "b"]}}
FORMATS = ("swc", "async", "dcp", "writer")  # how the DP 2 x TP 2 state was saved


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(38)
    return {k: torch.randn(shape, generator=g).to(dtype) for k, (shape, dtype) in SPECS.items()}


def saved_layouts() -> dict[str, Layout]:
    """The layouts of the DP 2 x TP 2 save: "w", "v", "g" over a TP group, "z" over a
    DP group, "e" over the world."""
    return {
        "w": Layout.row_wise((10, 6), [7, 3]),
        "v": Layout((6, 4), {0: [Block((0, 0), (6, 2)), Block((0, 2), (6, 2))], 1: []}),
        "g": Layout.grid((4, 6, 3), (1, 2, 1)),
        "z": Layout.row_wise((5, 4), [3, 2]),
        "e": Layout.row_wise((9, 3), [4, 0, 3, 2]),
    }


def mesh(rank: int, dp: int, tp: int) -> tuple[Any, Any]:
    """(TP group, DP group) of `rank` in a dp x tp grid (rank = row * tp + column).
    Every rank makes every group, in the same order, as `dist.new_group` requires."""
    tps = [dist.new_group([row * tp + c for c in range(tp)]) for row in range(dp)]
    dps = [dist.new_group([row * tp + c for row in range(dp)]) for c in range(tp)]
    return tps[rank // tp], dps[rank % tp]


def _sharded(full: torch.Tensor, layout: Layout, group: Any, fill: float | None) -> ShardedTensor:
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    shards = shard_of(full, layout, rank)
    if fill is not None:
        shards = [torch.full_like(s, fill) for s in shards]
    return ShardedTensor.from_layout(layout, shards, dtype=full.dtype, group=group)


def saved_state(rank: int) -> dict[str, Any]:
    tp, dp = mesh(rank, 2, 2)
    full, layouts = reference(), saved_layouts()
    groups = {"w": tp, "v": tp, "g": tp, "z": dp, "e": None}
    state: dict[str, Any] = {k: _sharded(full[k], layouts[k], groups[k], None) for k in layouts}
    state["b"] = full["b"].clone()
    state.update({"step": 7, "cfg": {"lr": 0.5, "names": ["a", "b"]}})
    return state


TP_COLUMNS = {1: [6], 2: [2, 4], 4: [1, 0, 3, 2]}  # "w" targets: column bands, one empty


def target_state(rank: int, world: int, dp: int, tp: int, kind: str) -> dict[str, Any]:
    """Targets filled with -7: "mesh" (subgroup tensors of a dp x tp split, other
    layouts than saved), "world" (world-group ShardedTensors) or "plain" tensors."""
    full = reference()
    state: dict[str, Any]
    if kind == "plain":
        state = {k: torch.full_like(v, -7) for k, v in full.items()}
    elif kind == "world":
        state = {
            k: _sharded(full[k], Layout.chunked(v.shape, 0, world), None, -7)
            for k, v in full.items()
            if k != "b"
        }
        state["b"] = torch.full_like(full["b"], -7)
    else:
        tp_group, dp_group = mesh(rank, dp, tp)
        layouts = {
            "w": (Layout.column_wise((10, 6), TP_COLUMNS[tp]), tp_group),
            "v": (Layout.chunked((6, 4), 0, tp), tp_group),
            "g": (Layout.chunked((4, 6, 3), 2, tp), tp_group),
            "z": (Layout.chunked((5, 4), 0, dp), dp_group),
            "e": (Layout.chunked((9, 3), 1, world), None),
        }
        state = {k: _sharded(full[k], lay, group, -7) for k, (lay, group) in layouts.items()}
        state["b"] = torch.full_like(full["b"], -7)
    state["step"] = 0
    state["cfg"] = {"lr": 0.0, "names": []}
    return state


def wrong(state: dict[str, Any]) -> list[str]:
    """What differs from the reference, bit for bit (empty: all loaded)."""
    full, bad = reference(), []
    for k, v in state.items():
        if k in OBJECTS:
            if v != OBJECTS[k]:
                bad.append(f"{k}={v!r}")
        elif isinstance(v, ShardedTensor):
            for shard, block in zip(v.local_shards(), v.local_blocks):
                if not torch.equal(shard, full[k][block.slices()]):
                    bad.append(f"{k} {block} (group rank {v.rank})")
        elif not torch.equal(v, full[k]):
            bad.append(k)
    return bad


def _save_all(rank: int, world: int, root: str) -> list[str]:
    """Save the DP 2 x TP 2 state four ways, then load each back into the same split."""
    swc.save(saved_state(rank), os.path.join(root, "swc"))
    swc.async_save(saved_state(rank), os.path.join(root, "async")).result(60)
    dcp.save(saved_state(rank), checkpoint_id=os.path.join(root, "dcp"))
    dcp.save(saved_state(rank), storage_writer=swc.Writer(os.path.join(root, "writer")))
    return _load_all(rank, world, root, 2, 2, "mesh")


def _load_all(rank: int, world: int, root: str, dp: int, tp: int, kind: str) -> list[str]:
    """Every checkpoint through `swc.load`, and two through stock `dcp.load`."""
    bad = []
    for fmt in FORMATS:
        state = target_state(rank, world, dp, tp, kind)
        swc.load(state, os.path.join(root, fmt))
        bad += [f"swc.load {fmt}: {b}" for b in wrong(state)]
    for fmt in ("swc", "dcp"):
        state = target_state(rank, world, dp, tp, kind)
        dcp.load(state, checkpoint_id=os.path.join(root, fmt))
        bad += [f"dcp.load {fmt}: {b}" for b in wrong(state)]
    return bad


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    root = tmp_path_factory.mktemp("subgroup")
    return root, run_ranks(_save_all, 4, str(root), timeout=150)


def test_a_dp_x_tp_state_saved_four_ways_loads_back_into_the_same_split(saved) -> None:
    _root, bad = saved
    assert bad == [[]] * 4


def _distinct_blocks() -> dict[str, list[Block]]:
    """Every distinct block of each tensor of the DP 2 x TP 2 save, once."""
    out = {}
    for k, layout in saved_layouts().items():
        seen: list[Block] = []
        for r in range(layout.world_size):
            seen.extend(b for b in layout.blocks_of(r) if b not in seen)
        out[k] = sorted(seen, key=lambda b: (b.offsets, b.sizes))
    return out


def _one_process_state() -> dict[str, Any]:
    """The same values with every distinct block on one rank (no replica anywhere)."""
    full = reference()
    state: dict[str, Any] = {}
    for k, blocks in _distinct_blocks().items():
        layout = Layout(full[k].shape, {0: blocks})
        state[k] = ShardedTensor.from_layout(layout, shard_of(full[k], layout, 0), rank=0)
    state["b"] = full["b"].clone()
    state.update({"step": 7, "cfg": {"lr": 0.5, "names": ["a", "b"]}})
    return state


def _data_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


def _save_one_process(fmt: str, folder: Path) -> None:
    if fmt in ("swc", "async"):
        swc.save(_one_process_state(), folder)
    elif fmt == "dcp":
        dcp.save(_one_process_state(), checkpoint_id=folder, no_dist=True)
    else:
        dcp.save(_one_process_state(), storage_writer=swc.Writer(folder), no_dist=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_replicas_are_stored_once(saved, fmt: str, tmp_path: Path) -> None:
    """Each tensor's chunks are its distinct blocks, each once, their payload exactly the
    tensor's bytes; the data files hold exactly what a one-process save of the distinct
    blocks holds, in number of bytes (the copies of "w", "v", "g" and "z" written twice
    would add 944 B of payload and their archives)."""
    root, _bad = saved
    metadata = FileSystemReader(str(root / fmt)).read_metadata()
    manifest = Manifest.read(root / fmt) if fmt != "dcp" else None
    full = reference()
    for k, blocks in _distinct_blocks().items():
        md = metadata.state_dict_metadata[k]
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        assert chunks == [(b.offsets, b.sizes) for b in blocks], k
        nbytes = full[k].numel() * full[k].element_size()
        assert sum(b.numel for b in blocks) * full[k].element_size() == nbytes, k
        if manifest is not None:  # the payload bytes the checkpoint stores
            assert sum(c.payload[1] for c in manifest.tensors[k].chunks) == nbytes, k
    assert [tuple(c.sizes) for c in metadata.state_dict_metadata["b"].chunks] == [(7,)]
    _save_one_process(fmt, tmp_path / "one")
    assert _data_bytes(root / fmt) == _data_bytes(tmp_path / "one")
    if fmt == "dcp":  # stock files are the records back to back: nothing unlisted
        listed = sum(info.length for info in metadata.storage_data.values())
        assert _data_bytes(root / fmt) == listed


SPLITS = {
    "dp1_tp4": (4, 1, 4, "mesh"),
    "dp4_tp1": (4, 4, 1, "mesh"),
    "2_ranks_dp1_tp2": (2, 1, 2, "mesh"),
    "2_ranks_dp2_tp1": (2, 2, 1, "mesh"),
    "3_ranks_world_group": (3, 1, 3, "world"),
    "2_ranks_plain_tensors": (2, 1, 2, "plain"),
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_loads_into_another_split(saved, split: str) -> None:
    root, _bad = saved
    world, dp, tp, kind = SPLITS[split]
    assert run_ranks(_load_all, world, str(root), dp, tp, kind, timeout=150) == [[]] * world


# -- replicas that disagree ------------------------------------------------------------------


def _disagreeing(rank: int, world: int, root: str) -> list[tuple[str, str, bool]]:
    """Three saves whose DP row 1 (ranks 2, 3) holds "w" otherwise than row 0, one whose
    TP column 1 (ranks 1, 3) holds "z" otherwise: each fails on every rank, writing no data."""
    out = []
    for kind in ("shape", "dtype", "layout", "dp layout"):
        tp, dp = mesh(rank, 2, 2)
        shape, dtype, rows, z_rows = (10, 6), torch.float32, [7, 3], [3, 2]
        if rank >= 2 and kind == "shape":
            shape = (10, 7)
        if rank >= 2 and kind == "dtype":
            dtype = torch.float64
        if rank >= 2 and kind == "layout":
            rows = [5, 5]
        if rank % 2 and kind == "dp layout":
            z_rows = [2, 3]
        w_layout = Layout.row_wise(shape, rows)
        z_layout = Layout.row_wise((5, 4), z_rows)
        state = {
            "w": _sharded(torch.zeros(shape, dtype=dtype), w_layout, tp, None),
            "z": _sharded(torch.zeros(5, 4), z_layout, dp, None),
        }
        folder = os.path.join(root, kind.replace(" ", "_"))
        try:
            swc.save(state, folder)
            out.append(("saved", "", False))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out.append((type(e).__name__, str(e), _wrote(folder)))
        if kind in ("shape", "dtype"):
            # DCP's planner keeps one item per (key, offsets): here row 0's two chunks (rank
            # 0's, rank 1's), which pass its own checks; row 1's copies are dropped unseen
            folder += "_writer"
            try:
                dcp.save({"w": state["w"]}, storage_writer=swc.Writer(folder))
                out.append(("saved", "", False))
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
                out.append((type(e).__name__, str(e).strip().splitlines()[-1], _wrote(folder)))
    return out


def _wrote(folder: str) -> bool:
    """Whether data files are in `folder` (another rank's failed save may be removing
    what it made meanwhile: gone is not written)."""
    try:
        return any(n.endswith(".distcp") for n in os.listdir(folder))
    except FileNotFoundError:
        return False


REPLICAS = (
    "partly overlap; ranks holding copies of a part (replicas, such as the data-parallel "
    "copies of a tensor-parallel weight) must hold identical blocks: give every copy the "
    "same layout"
)


def test_replicas_that_disagree_fail_on_every_rank_naming_key_and_ranks(tmp_path: Path) -> None:
    results = run_ranks(_disagreeing, 4, str(tmp_path), timeout=150)
    for attempt in range(6):
        assert len({results[r][attempt] for r in range(4)}) == 1  # the same error everywhere
    shape, shape_writer, dtype, dtype_writer, layout, dp_layout = results[0]
    expected = {
        "shape": "'w': rank 0 holds a tensor of dtype float32, shape (10, 6) but ranks 2, 3 "
        "hold a tensor of dtype float32, shape (10, 7)",
        "dtype": "'w': rank 0 holds a tensor of dtype float32, shape (10, 6) but ranks 2, 3 "
        "hold a tensor of dtype float64, shape (10, 6)",
        "layout": "'w': the block [0:7, 0:6] held by rank 0 and the block [0:5, 0:6] held by "
        f"rank 2 {REPLICAS}",
        "dp layout": "'z': the block [0:3, 0:4] held by rank 0 and the block [0:2, 0:4] held "
        f"by rank 1 {REPLICAS}",
    }
    for (kind, message), (error, text, wrote) in zip(
        expected.items(), (shape, dtype, layout, dp_layout)
    ):
        folder = tmp_path / kind.replace(" ", "_")
        assert error == "ShardMismatchError", (kind, text)
        assert text == f"cannot save to {folder}: {message}", kind
        assert not wrote, kind
    # stock dcp.save + swc.Writer: the coordinator's refusal, raised on every rank by DCP
    for kind, (error, last_line, wrote) in (("shape", shape_writer), ("dtype", dtype_writer)):
        folder = tmp_path / f"{kind}_writer"
        assert error == "CheckpointException", (kind, last_line)
        assert last_line == (
            f"shardwise.errors.ShardMismatchError: cannot save to {folder}: {expected[kind]}"
        )
        assert not wrote, kind


# -- a tensor only some ranks hold ------------------------------------------------------------


def _stages(rank: int, world: int, root: str) -> list[str]:
    """Pipeline stages: "s0.w" lives on group {0, 1}, "s1.w" on {2, 3}; a rank's state
    holds only its stage's key. Saved, then loaded by each stage in another layout."""
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    full = reference()["w"]
    stage = rank // 2
    key = f"s{stage}.w"
    saved = Layout.row_wise((10, 6), [7, 3] if stage == 0 else [0, 10])
    swc.save({key: _sharded(full * (stage + 1), saved, stages[stage], None)}, root)
    target = _sharded(full, Layout.column_wise((10, 6), [6, 0]), stages[stage], -7)
    swc.load({key: target}, root)
    bad = []
    for shard, block in zip(target.local_shards(), target.local_blocks):
        if not torch.equal(shard, (full * (stage + 1))[block.slices()]):
            bad.append(f"{key} {block}")
    return bad


def _both_stages(rank: int, world: int, root: str) -> list[str]:
    """Both stages' tensors into world-group ShardedTensors of 2 ranks."""
    full = reference()["w"]
    state = {f"s{s}.w": _sharded(full, Layout.chunked((10, 6), 1, world), None, -7) for s in (0, 1)}
    swc.load(state, root)
    return [
        f"{k} {block}"
        for s, (k, v) in enumerate(state.items())
        for shard, block in zip(v.local_shards(), v.local_blocks)
        if not torch.equal(shard, (full * (s + 1))[block.slices()])
    ]


def test_a_tensor_only_its_group_holds_saves_and_loads(tmp_path: Path) -> None:
    path = str(tmp_path / "stages")
    assert run_ranks(_stages, 4, path, timeout=150) == [[]] * 4
    metadata = FileSystemReader(path).read_metadata()
    chunks = {
        k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        for k, md in metadata.state_dict_metadata.items()
    }
    assert chunks == {
        "s0.w": [((0, 0), (7, 6)), ((7, 0), (3, 6))],
        "s1.w": [((0, 0), (10, 6))],  # rank 2's empty block adds no chunk
    }
    assert run_ranks(_both_stages, 2, path, timeout=150) == [[]] * 2

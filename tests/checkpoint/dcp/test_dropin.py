"""`swc.Writer` / `swc.Reader` / `swc.save` / `swc.load` as drop-ins for DCP's own:
one test per point of the drop-in contract (docs/dcp.md).

Single-process DCP (no process group) unless a test needs ranks.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io.commit import referenced_files
from shardwise.storage import open_folder
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

FOREIGN = {"notes.txt": b"keep me\n", "model.pt": b"\x00\x01" * 100, "__0_0.distcp.bak": b"mine"}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g), "step": seed}


def _targets() -> dict:
    return {"w": torch.zeros(6, 4), "b": torch.zeros(4), "step": -1}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def _plant(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in FOREIGN.items():
        (folder / name).write_bytes(data)


def _foreign_intact(folder: Path) -> bool:
    return all((folder / n).read_bytes() == d for n, d in FOREIGN.items())


def _files(folder: Path) -> set[str]:
    return set(os.listdir(folder))


def _index(folder: Path) -> str:
    """The index file of the checkpoint in `folder` (a data file of its save)."""
    index = Manifest.read_head(open_folder(folder)).index
    assert index is not None
    return index.file


# -- (1) an overwrite never deletes what the checkpoint did not write ------------------------


@pytest.mark.parametrize("how", ["swc.save", "dcp.save+Writer"])
def test_overwrite_keeps_foreign_files_and_collects_the_old_checkpoint(tmp_path, how):
    folder = tmp_path / "ckpt"
    _plant(folder)

    def save(state):
        if how == "swc.save":
            swc.save(state, folder, overwrite=True)
        else:
            dcp.save(state, storage_writer=swc.Writer(folder))

    save(_state(1))
    first = referenced_files(folder)
    assert len(first) == 2 and _index(folder) in first and _foreign_intact(folder)  # data, index
    save(_state(2))
    second = referenced_files(folder)
    assert len(second) == 2 and _index(folder) in second
    assert not (first & second)  # fresh names: nothing committed was overwritten
    assert _files(folder) == set(FOREIGN) | second | {".metadata", "shardwise.json", ".shardwise"}
    assert _foreign_intact(folder)
    loaded = _targets()
    swc.load(loaded, folder)
    assert _same(loaded, _state(2))
    stock = _targets()
    dcp.load(stock, storage_reader=FileSystemReader(folder))
    assert _same(stock, _state(2))


def test_overwriting_a_stock_checkpoint_removes_only_its_files(tmp_path):
    folder = tmp_path / "ckpt"
    _plant(folder)
    dcp.save(_state(1), storage_writer=FileSystemWriter(folder))
    stock_files = referenced_files(folder)
    assert stock_files == {"__0_0.distcp"}
    dcp.save(_state(2), storage_writer=swc.Writer(folder))
    assert not (folder / "__0_0.distcp").exists()
    assert _foreign_intact(folder)
    loaded = _targets()
    swc.load(loaded, folder)
    assert _same(loaded, _state(2))


def test_leftovers_of_a_dead_save_are_collected_by_the_next(tmp_path):
    folder = tmp_path / "ckpt"
    _plant(folder)
    swc.save(_state(1), folder)
    (folder / "__1_0.sw0123456789ab.distcp").write_bytes(b"half written")
    (folder / "shardwise.json.swba9876543210.tmp").write_bytes(b"{")
    swc.save(_state(2), folder, overwrite=True)
    assert _files(folder) == set(FOREIGN) | referenced_files(folder) | {
        ".metadata",
        "shardwise.json",
        ".shardwise",
    }


# -- (2) a reader never reads with stale state -----------------------------------------------


def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """Two checkpoints of the same keys whose chunks sit at different byte offsets."""
    a, b = tmp_path / "a", tmp_path / "b"
    dcp.save(_state(1), storage_writer=FileSystemWriter(a))  # stock
    bigger = _state(2)
    bigger["pad"] = torch.arange(1000.0)  # shifts every later record
    dcp.save({"pad": bigger.pop("pad"), **bigger}, storage_writer=FileSystemWriter(b))
    return a, b


@pytest.mark.parametrize("verify", [True, False])
def test_a_reused_reader_reads_each_checkpoint_from_its_own_metadata(tmp_path, verify):
    a, b = _two_checkpoints(tmp_path)
    swc.save(_state(3), tmp_path / "c")
    reader = swc.Reader(a, verify=verify)
    for folder, seed in ((a, 1), (b, 2), (tmp_path / "c", 3), (a, 1), (tmp_path / "c", 3)):
        loaded = _targets()
        dcp.load(loaded, checkpoint_id=folder, storage_reader=reader)
        assert _same(loaded, _state(seed)), folder


def test_a_reset_reader_refuses_to_read_before_it_is_set_up_again(tmp_path):
    a, b = _two_checkpoints(tmp_path)
    reader = swc.Reader(a)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    reader.reset(b)
    assert reader.storage_data == {} and reader.manifest is None
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    with pytest.raises(RuntimeError, match="before set_up_storage_reader"):
        reader.read_data(
            __import__("torch.distributed.checkpoint.planner", fromlist=["LoadPlan"]).LoadPlan([]),
            planner,
        )


# -- (4) overwrite semantics of FileSystemWriter ---------------------------------------------


def test_writer_defaults_to_overwrite_like_stock(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=swc.Writer(folder))
    dcp.save(_state(2), storage_writer=swc.Writer(folder))  # default overwrite=True, as stock
    loaded = _targets()
    swc.load(loaded, folder)
    assert _same(loaded, _state(2))


def test_writer_without_overwrite_refuses_only_a_folder_holding_a_checkpoint(tmp_path):
    empty = Path(tempfile.mkdtemp(dir=tmp_path))
    dcp.save(
        _state(1), storage_writer=swc.Writer(empty, overwrite=False)
    )  # an existing empty folder is fine
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(_state(2), storage_writer=swc.Writer(empty, overwrite=False))
    stock = tmp_path / "stock"
    dcp.save(_state(1), storage_writer=FileSystemWriter(stock))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(_state(2), storage_writer=swc.Writer(stock, overwrite=False))
    other = tmp_path / "other"
    _plant(other)
    dcp.save(
        _state(3), storage_writer=swc.Writer(other, overwrite=False)
    )  # unrelated files are no checkpoint
    loaded = _targets()
    swc.load(loaded, empty)
    assert _same(loaded, _state(1))


def test_swc_save_refuses_a_checkpoint_but_takes_empty_or_foreign_folders(tmp_path):
    empty = Path(tempfile.mkdtemp(dir=tmp_path))
    swc.save(_state(1), empty)
    with pytest.raises(FileExistsError, match="Checkpoint already exists"):
        swc.save(_state(2), empty)
    other = tmp_path / "other"
    _plant(other)
    swc.save(_state(3), other)
    loaded = _targets()
    swc.load(loaded, other)
    assert _same(loaded, _state(3)) and _foreign_intact(other)


# -- (6) storage extensions ------------------------------------------------------------------


def _zstd():
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        pytest.skip("zstandard is not installed")
    return ZStandard()


@pytest.mark.parametrize("writer", ["shardwise", "stock"])
def test_zstd_extension_both_ways(tmp_path, writer):
    folder = tmp_path / "zstd"
    cls = swc.Writer if writer == "shardwise" else FileSystemWriter
    state = _state(4)
    state["big"] = torch.zeros(4096)  # compresses: the stored bytes differ from the payload
    dcp.save(state, storage_writer=cls(folder, _extensions=[_zstd()]))
    assert os.path.getsize(next(folder.glob("__0_0*.distcp"))) < 4096 * 4
    for reader in (swc.Reader(folder), FileSystemReader(folder)):
        loaded = {**_targets(), "big": torch.ones(4096)}
        dcp.load(loaded, storage_reader=reader)
        assert _same(loaded, state) and torch.equal(loaded["big"], state["big"])
    loaded = {**_targets(), "big": torch.ones(4096)}
    swc.load(loaded, folder)
    assert torch.equal(loaded["big"], state["big"])


def test_damaged_compressed_chunk_is_reported(tmp_path):
    folder = tmp_path / "zstd"
    dcp.save({"x": torch.arange(10000.0)}, storage_writer=swc.Writer(folder, _extensions=[_zstd()]))
    data = next(folder.glob("__0_0*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(swc.CorruptCheckpointError, match="'x'"):
        swc.load({"x": torch.zeros(10000)}, folder)


def test_safetensors_serialization_is_refused_clearly(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    with pytest.raises(ValueError, match="TORCH_SAVE"):
        swc.Writer(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)


# -- (7) complete metadata ---------------------------------------------------------------------


def test_read_metadata_is_complete_like_stock(tmp_path):
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    state = {"model": {"layer": {"w": torch.nn.Parameter(torch.ones(3, 2))}}, "extra": [1, 2]}
    writer = swc.Writer(ours)
    dcp.save(state, storage_writer=writer)
    assert Path(writer.checkpoint_id) == ours  # the final folder, never a staging one
    dcp.save(state, storage_writer=FileSystemWriter(stock))
    mine = swc.Reader(ours).read_metadata()
    theirs = FileSystemReader(stock).read_metadata()
    assert mine.planner_data == theirs.planner_data
    assert mine.planner_data["model.layer.w"] == ("model", "layer", "w")
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.version == theirs.version
    assert (
        Path(mine.storage_meta.checkpoint_id) == ours
        and mine.storage_meta.save_id == writer.save_id
    )
    assert mine.storage_meta.load_id is not None


def test_load_state_dict_from_keys_and_dcp_to_torch_save_through_reader(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = tmp_path / "ckpt"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    swc.save(state, folder)
    got = _load_state_dict_from_keys({"model.w"}, storage_reader=swc.Reader(folder))
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    dcp_to_torch_save(folder, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert torch.equal(full["model"]["w"], state["model"]["w"]) and full["step"] == 7


def test_planner_data_that_is_not_json_comes_from_metadata(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def create_global_plan(self, plans):
            plans, metadata = super().create_global_plan(plans)
            metadata.planner_data = {"mapping": torch.Size([1, 2])}
            return plans, metadata

    folder = tmp_path / "ckpt"
    dcp.save({"x": torch.ones(2)}, storage_writer=swc.Writer(folder), planner=Planner())
    assert swc.Reader(folder).read_metadata().planner_data == {"mapping": torch.Size([1, 2])}


# -- (8) use_collectives=False ---------------------------------------------------------------


def _per_rank(rank: int, world: int, folder: str, writer: str, reader: str) -> bool:
    layout = Layout.row_wise((8, 2), [5, 3])
    full = torch.arange(16.0).reshape(8, 2)
    st = ShardedTensor.from_layout(layout, shard_of(full, layout, rank))
    state = {"st": st, "own": torch.full((2,), float(rank))}
    w = swc.Writer(folder) if writer == "shardwise" else FileSystemWriter(folder)
    dcp.save(state, storage_writer=w, use_collectives=False)
    out = {"st": ShardedTensor.zeros(layout), "own": torch.zeros(2)}
    r = swc.Reader(folder) if reader == "shardwise" else FileSystemReader(folder)
    metadata = r.read_metadata(rank=rank)
    assert set(metadata.state_dict_metadata) == {"st", "own"}
    dcp.load(out, storage_reader=r)
    return torch.equal(out["st"].local_shards()[0], st.local_shards()[0]) and torch.equal(
        out["own"], state["own"]
    )


@pytest.mark.parametrize(
    "writer, reader", [("shardwise", "shardwise"), ("shardwise", "stock"), ("stock", "shardwise")]
)
def test_use_collectives_false_both_directions(tmp_path, writer, reader):
    assert run_ranks(_per_rank, 2, str(tmp_path / "ckpt"), writer, reader, timeout=60) == [
        True,
        True,
    ]
    if writer == "shardwise":
        names = _files(tmp_path / "ckpt")
        assert {"__0.metadata", "__1.metadata", "__0.shardwise.json", "__1.shardwise.json"} <= names
        assert ".metadata" not in names


# -- (9) stock constructor arguments -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, files",
    [
        ({"thread_count": 3}, 3),
        ({"single_file_per_rank": False}, 5),
        ({"sync_files": False, "per_thread_copy_ahead": 0, "cache_staged_state_dict": True}, 1),
    ],
    ids=["thread_count", "file_per_item", "other_flags"],
)
def test_stock_writer_arguments(tmp_path, kwargs, files):
    folder = tmp_path / "ckpt"
    state = {f"t{i}": torch.full((100 * (i + 1),), float(i)) for i in range(4)} | {"obj": "hello"}
    dcp.save(state, storage_writer=swc.Writer(folder, **kwargs))
    written = {p.name for p in folder.glob("*.distcp")}
    assert _index(folder) in written and len(written - {_index(folder)}) == files
    loaded = {f"t{i}": torch.zeros(100 * (i + 1)) for i in range(4)} | {"obj": None}
    swc.load(loaded, folder)
    assert (
        all(torch.equal(loaded[k], state[k]) for k in state if k != "obj")
        and loaded["obj"] == "hello"
    )
    stock = {f"t{i}": torch.zeros(100 * (i + 1)) for i in range(4)} | {"obj": None}
    dcp.load(stock, storage_reader=FileSystemReader(folder))
    assert all(torch.equal(stock[k], state[k]) for k in state if k != "obj")


def test_reader_takes_an_extension_registry(tmp_path):
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    swc.save(_state(5), tmp_path / "c")
    loaded = _targets()
    dcp.load(
        loaded, storage_reader=swc.Reader(tmp_path / "c", _extension_registry=ExtensionRegistry())
    )
    assert _same(loaded, _state(5))


# -- (10) what dcp.save / dcp.load accept ----------------------------------------------------


def test_stateful_values_and_nested_containers(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()

    class Wrapper:  # a Stateful that does not pickle: DCP calls state_dict() first
        def __init__(self, m):
            self.m = m
            self.lock = __import__("threading").Lock()

        def state_dict(self):
            return self.m.state_dict()

        def load_state_dict(self, sd):
            self.m.load_state_dict(sd)

    state = {
        "model": Wrapper(model),
        "optim": optim,
        "nested": {"list": [1, torch.ones(2)], "t": (3, "x")},
    }
    swc.save(state, tmp_path / "c")
    fresh = torch.nn.Linear(4, 3)
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh(torch.randn(2, 4)).sum().backward()
    fresh_optim.step()
    target = {
        "model": Wrapper(fresh),
        "optim": fresh_optim,
        "nested": {"list": [0, torch.zeros(2)], "t": None},
    }
    swc.load(target, tmp_path / "c")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    buf = fresh_optim.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, optim.state_dict()["state"][0]["momentum_buffer"])
    assert torch.equal(target["nested"]["list"][1], torch.ones(2)) and target["nested"]["t"] == (
        3,
        "x",
    )


def test_dtype_difference_is_an_error_unless_cast_is_asked_for(tmp_path):
    swc.save({"w": torch.arange(6.0, dtype=torch.float32)}, tmp_path / "c")
    target = {"w": torch.zeros(6, dtype=torch.bfloat16)}
    with pytest.raises(swc.CheckpointMismatchError, match="dtype"):
        swc.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.zeros(6, dtype=torch.bfloat16))
    swc.load(target, tmp_path / "c", cast_dtype=True)
    assert torch.equal(target["w"], torch.arange(6.0).to(torch.bfloat16))
    stock = {"w": torch.zeros(6, dtype=torch.bfloat16)}
    dcp.load(stock, checkpoint_id=tmp_path / "c")  # what stock does: the same cast
    assert torch.equal(stock["w"], target["w"])


def _sharded_optimizer(rank: int, world: int, folder: str) -> bool:
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    momentum = torch.arange(12.0).reshape(6, 2)
    state = {
        "model": {"w": torch.ones(6, 2)},
        "optim": {
            "state": {"w": {"momentum": momentum, "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1}],
        },
    }
    dcp.save(state, storage_writer=swc.Writer(folder))
    loaded = load_sharded_optimizer_state_dict(
        {"w": torch.zeros(6, 2)}, "optim", swc.Reader(folder)
    )
    shard = loaded["optim"]["state"]["w"][
        "momentum"
    ]  # a legacy ShardedTensor, rows chunked over ranks
    local = shard.local_shards()[0]
    rows = local.metadata.shard_offsets[0]
    return (
        torch.equal(local.tensor, momentum[rows : rows + local.tensor.shape[0]])
        and float(loaded["optim"]["state"]["w"]["step"]) == 3.0
        and loaded["optim"]["param_groups"] == [{"lr": 0.1}]
    )


def test_load_sharded_optimizer_state_dict_through_reader(tmp_path):
    """DCP's FSDP-era helper reads `format.entries` from `read_metadata()`."""
    assert run_ranks(_sharded_optimizer, 2, str(tmp_path / "ckpt"), timeout=60) == [True, True]


def test_a_planners_callbacks_run_on_the_callers_thread(tmp_path):
    """DCP calls `resolve_tensor` / `commit_tensor` from one thread; under `Reader` they
    stay there, though large local reads otherwise run on reader threads."""
    import threading

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    threads: set[str] = set()

    class Watching(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            threads.add(threading.current_thread().name)
            return super().resolve_tensor(read_item)

        def commit_tensor(self, read_item, tensor):
            threads.add(threading.current_thread().name)
            super().commit_tensor(read_item, tensor)

    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(4)}  # 4 MiB chunks
    dcp.save(state, storage_writer=swc.Writer(tmp_path), no_dist=True)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=swc.Reader(tmp_path), planner=Watching(), no_dist=True)
    assert threads == {threading.current_thread().name}
    assert all(torch.equal(target[k], v) for k, v in state.items())

"""Megatron's side files (`megatron_format`): `metadata.json` and a legacy `common.pt` are read
as every record is, through the `Folder`: never through a link, never blocking on a FIFO,
their size bounded, and `common.pt` unpickled with `weights_only` rules unless trusted.
No Megatron-Core needed: these are the files, not its values."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.clients.megatron_format import (
    metadata_json_problem,
    write_metadata_json,
)
from shardwise.checkpoint.megatron import read_common_state
from shardwise.errors import CheckpointExistsError, CorruptCheckpointError, UnsafeMetadataError
from shardwise.storage import open_folder


@dataclass
class Args:
    """A class nobody allowlisted (Megatron-Core allowlists its own `argparse.Namespace`)."""

    lr: float


_ARGS = f"{Args.__module__}.Args"
_MEGATRON_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
_TRUST = (
    "nothing was run; Megatron's common state loads with torch.load(weights_only=True) rules: "
    "if you trust this checkpoint, pass trust_objects=True, or allowlist the class with "
    "shardwise.checkpoint.allow_object_globals(...)"
)


def _weights() -> ShardedTensor:
    return ShardedTensor.from_layout(
        Layout.row_wise((4, 2), [4]), [torch.arange(8.0).reshape(4, 2)]
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A Megatron-readable checkpoint whose common state is {"step": 3}."""
    path = tmp_path / "ckpt"
    swc.save({"w": _weights(), "step": 3}, path, megatron=True)
    assert read_common_state(path) == {"step": 3}
    return path


def test_a_symlinked_common_pt_is_refused_not_followed(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.pt"
    torch.save({"secret": 1}, outside)
    os.symlink(outside, ckpt / "common.pt")
    with pytest.raises(CorruptCheckpointError) as info:
        read_common_state(ckpt)
    assert str(info.value) == (
        f"{ckpt / 'common.pt'} is a symbolic link: files of a checkpoint must be plain files "
        f"inside its folder (refused, nothing read through it)"
    )
    os.remove(ckpt / "common.pt")
    os.symlink(tmp_path / "nowhere.pt", ckpt / "common.pt")  # dangling: refused as well
    with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
        read_common_state(ckpt)


@pytest.mark.timeout(60)
def test_a_fifo_common_pt_is_refused_without_blocking(ckpt: Path) -> None:
    os.mkfifo(ckpt / "common.pt")
    with pytest.raises(CorruptCheckpointError) as info:
        read_common_state(ckpt)
    assert str(info.value) == (
        f"{ckpt / 'common.pt'} is not a plain file (a folder, device or pipe): refused"
    )


def test_an_oversized_common_pt_is_refused_unread(ckpt: Path) -> None:
    with open(ckpt / "common.pt", "wb") as f:  # sparse: 2 GiB claimed, nothing written
        f.truncate(2 << 30)
    with pytest.raises(CorruptCheckpointError) as info:
        read_common_state(ckpt)
    assert str(info.value) == (
        f"{ckpt / 'common.pt'} holds 2147483648 bytes, more than the 1073741824 a Megatron "
        f"common state may: refused unread"
    )


def test_common_pt_loads_with_weights_only_rules_unless_trusted(ckpt: Path) -> None:
    torch.save({"args": Args(lr=0.5), "w": torch.ones(2)}, ckpt / "common.pt")
    with pytest.raises(UnsafeMetadataError) as info:
        read_common_state(ckpt)
    assert str(info.value) == (f"{ckpt / 'common.pt'}: refused global {_ARGS}, {_TRUST}")
    trusted = read_common_state(ckpt, trust_objects=True)
    assert trusted["args"] == Args(lr=0.5)
    assert torch.equal(trusted["w"], torch.ones(2))
    torch.save({"step": 9}, ckpt / "common.pt")  # a plain one: read first, as Megatron does
    assert read_common_state(ckpt) == {"step": 9}


def test_common_state_object_refused_by_weights_only_names_it(tmp_path: Path) -> None:
    path = tmp_path / "ns"
    swc.save({"w": _weights(), "args": Args(lr=0.5)}, path, megatron=True)
    with pytest.raises(UnsafeMetadataError) as info:
        read_common_state(path)
    assert str(info.value) == (
        f"object 'common_state/shard_0_1' in {path}: refused global {_ARGS}, {_TRUST}"
    )
    assert read_common_state(path, trust_objects=True) == {"args": Args(lr=0.5)}


def test_common_state_on_fsspec(ckpt: Path, memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    root = memory_root[len("memory://") :]
    for p in ckpt.iterdir():
        fs.pipe(f"{root}/{p.name}", p.read_bytes())
    assert read_common_state(memory_root) == {"step": 3}
    assert read_common_state(open_folder(memory_root)) == {"step": 3}
    fs.pipe(f"{root}/common.pt", _saved({"step": 4}))
    assert read_common_state(memory_root) == {"step": 4}


def _saved(value: object) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "link", "oversized"])
def test_a_metadata_json_that_is_no_plain_file_is_in_the_way(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    target = path / "metadata.json"
    if kind == "fifo":
        os.mkfifo(target)
        why = f"{target} is not a plain file (a folder, device or pipe): refused"
    elif kind == "link":
        (tmp_path / "theirs.json").write_text(json.dumps(_MEGATRON_JSON))
        os.symlink(tmp_path / "theirs.json", target)
        why = (
            f"{target} is a symbolic link: files of a checkpoint must be plain files inside "
            f"its folder (refused, nothing read through it)"
        )
    else:
        with open(target, "wb") as f:
            f.truncate(1 << 20)
        why = f"{target} holds 1048576 bytes, more than the 65536 Megatron's metadata.json may: "
        why += "refused unread"
    problem = metadata_json_problem(path)
    assert type(problem) is CheckpointExistsError
    assert str(problem) == f"{why}; it is in the way of Megatron's metadata.json"
    with pytest.raises(CheckpointExistsError) as info:
        swc.save({"w": _weights(), "step": 3}, path, megatron=True)
    assert str(info.value) == f"{why}; it is in the way of Megatron's metadata.json"
    assert sorted(p.name for p in path.iterdir()) == ["metadata.json"]  # nothing written


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dangling-link"])
def test_a_common_pt_that_is_no_plain_file_is_in_the_way(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    if kind == "fifo":
        os.mkfifo(path / "common.pt")
    else:
        os.symlink(tmp_path / "nowhere", path / "common.pt")
    assert str(metadata_json_problem(path)) == (
        f"{path / 'common.pt'} exists (a legacy Megatron common state): Megatron and "
        f"read_common_state would read it instead of this save's; move it away first"
    )


@pytest.mark.timeout(60)
def test_write_metadata_json_never_opens_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "metadata.json")
    with pytest.raises(CorruptCheckpointError, match="is not a plain file"):
        write_metadata_json(tmp_path)
    write_metadata_json(tmp_path / "new")  # a missing folder is made
    assert json.loads((tmp_path / "new" / "metadata.json").read_text()) == _MEGATRON_JSON
    stat = os.stat(tmp_path / "new" / "metadata.json")
    write_metadata_json(open_folder(tmp_path / "new"))  # already Megatron's: left as it is
    assert os.stat(tmp_path / "new" / "metadata.json").st_mtime_ns == stat.st_mtime_ns
    (tmp_path / "new" / "metadata.json").write_text("not json")
    write_metadata_json(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "metadata.json").read_text()) == _MEGATRON_JSON


def test_a_metadata_json_nested_past_the_decoder_is_in_the_way_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "metadata.json").write_text("[" * 60_000)
    problem = metadata_json_problem(tmp_path)
    assert isinstance(problem, CheckpointExistsError)
    assert "is not Megatron's torch_dist metadata" in str(problem)
    with pytest.raises(CheckpointExistsError, match="not Megatron's torch_dist metadata"):
        swc.save({"w": torch.ones(2)}, tmp_path, megatron=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json"]  # nothing written


@pytest.mark.parametrize("stored", [[], 5, None], ids=["empty-list", "int", "none"])
def test_a_common_state_object_that_is_no_list_is_named(tmp_path: Path, stored: object) -> None:
    swc.save({"common_state/shard_0_1": stored, "w": torch.ones(1)}, tmp_path / "ck")
    with pytest.raises(
        CorruptCheckpointError, match=r"object 'common_state/shard_0_1' in .* not Megatron's"
    ):
        read_common_state(tmp_path / "ck")


def test_no_common_state_at_all_is_a_key_error_saying_so(tmp_path: Path) -> None:
    swc.save({"w": torch.ones(1)}, tmp_path / "ck")
    with pytest.raises(KeyError, match="no Megatron common state in .*neither a common.pt"):
        read_common_state(tmp_path / "ck")

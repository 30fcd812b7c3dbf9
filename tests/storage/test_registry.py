"""Storage backends by registry: a scheme a third party adds (by call or entry point) serves
every entry point with no edit to shardwise; read planning asks the folder, not its type."""

from __future__ import annotations

import importlib.metadata
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, UnsupportedStorageError
from shardwise.storage import (
    ENTRY_POINT_GROUP,
    Folder,
    FsspecFolder,
    LocalFolder,
    open_folder,
    register_backend,
    unregister_backend,
)
from shardwise.storage import location as registry


class Mem2Folder(FsspecFolder):
    """A toy backend: `mem2://bucket/key` on fsspec's memory filesystem, counting prefetches."""

    prefetches: list[dict[str, list[tuple[int, int]]]]

    def __init__(self, url: str, prefetch: bool = True) -> None:
        super().__init__(fsspec.filesystem("memory"), "/mem2-" + url[len("mem2://") :], url)
        self.wants_prefetch = prefetch
        self.prefetches = []

    def prefetch(self, ranges: dict[str, list[tuple[int, int]]]) -> None:
        self.prefetches.append(ranges)
        super().prefetch(ranges)


OPENED: list[Mem2Folder] = []


def mem2(location: str, options: dict[str, Any]) -> Folder:
    folder = Mem2Folder(location, prefetch=options.get("prefetch", True))
    OPENED.append(folder)
    return folder


@pytest.fixture
def url():
    """A fresh `mem2://` location; the scheme unregistered and the memory store emptied after."""
    key = f"b{uuid.uuid4().hex[:8]}"
    OPENED.clear()
    registry._rescan()
    yield f"mem2://{key}/ckpt"
    unregister_backend("mem2")
    registry._rescan()
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/mem2-{key}"):
        fs.rm(f"/mem2-{key}", recursive=True)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.ones(5)}


def test_a_registered_scheme_serves_save_load_and_read_tensor(url):
    register_backend("mem2", mem2)
    info = swc.save(_state(), url)
    assert info.path == url
    assert isinstance(open_folder(url), Mem2Folder)
    assert "shardwise.json" in open_folder(url).names()
    out = {"w": torch.zeros(4, 6), "b": torch.zeros(5)}
    swc.load(out, url)
    assert torch.equal(out["w"], _state()["w"]) and torch.equal(out["b"], torch.ones(5))
    part = swc.read_tensor(url, "w", Block((1, 2), (2, 3)))
    assert torch.equal(part, _state()["w"][1:3, 2:5])
    assert swc.Writer.validate_checkpoint_id(url) and swc.Reader.validate_checkpoint_id(url)
    # the load planned its reads and fetched them up front, as the folder asked
    assert any(f.prefetches for f in OPENED)


def test_read_planning_asks_the_folder_whether_to_prefetch(url):
    register_backend("mem2", mem2)
    swc.save(_state(), url)
    OPENED.clear()
    out = {"w": torch.zeros(4, 6), "b": torch.zeros(5)}
    swc.load(out, url, storage_options={"prefetch": False})
    assert torch.equal(out["w"], _state()["w"])
    assert OPENED and all(f.prefetches == [] for f in OPENED)


def test_capabilities_replace_type_checks(tmp_path):
    assert open_folder(tmp_path).local_path == tmp_path
    assert not open_folder(tmp_path).wants_prefetch
    remote = open_folder("memory://sw-registry-caps/ckpt")
    assert remote.local_path is None and remote.wants_prefetch


def test_a_non_local_backend_is_refused_where_a_local_path_is_needed(url, tmp_path):
    register_backend("mem2", mem2)
    with pytest.raises(ValueError, match="megatron=True saves to a local folder"):
        swc.save(_state(), url, megatron=True)
    fs = fsspec.filesystem("memory")
    key = url[len("mem2://") :]
    fs.pipe(f"/mem2-{key}/model.safetensors", b"not read")
    with pytest.raises(UnsupportedStorageError, match="a .safetensors input is read from a local"):
        swc.convert(f"{url}/model.safetensors", tmp_path / "out", "shardwise")
    assert os.listdir(tmp_path) == []


class _Entry:
    """What `importlib.metadata.entry_points` yields: a name, and `load` (counted)."""

    def __init__(self, name: str, factory: Any) -> None:
        self.name, self.factory, self.loads = name, factory, 0

    def load(self) -> Any:
        self.loads += 1
        return self.factory


def test_an_entry_point_backend_is_loaded_lazily_on_first_use(url, monkeypatch):
    entry = _Entry("MEM2", mem2)
    groups: list[str] = []

    def entry_points(*, group: str) -> list[_Entry]:
        groups.append(group)
        return [entry] if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert isinstance(open_folder("/tmp/sw-not-a-url"), LocalFolder)
    assert entry.loads == 0  # listed at most, never imported for a local path
    swc.save(_state(), url)
    assert entry.loads == 1 and groups == [ENTRY_POINT_GROUP]
    assert torch.equal(swc.read_tensor(url, "b"), torch.ones(5))
    assert entry.loads == 1  # loaded once, then registered
    assert unregister_backend("mem2") is mem2


def test_unregistered_and_unknown_schemes_are_refused_as_before(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    register_backend("mem2", mem2)
    swc.save(_state(), url)
    with pytest.raises(UnsupportedStorageError, match="looks like a URL without '//'"):
        open_folder("mem2:/b/ckpt")  # a registered scheme is never taken for a folder name
    assert unregister_backend("mem2") is mem2
    assert unregister_backend("mem2") is None
    with pytest.raises(UnsupportedStorageError, match=r"no fsspec backend serves 'mem2://'"):
        swc.load({"b": torch.zeros(5)}, url)
    with pytest.raises(UnsupportedStorageError, match=r"no fsspec backend serves 'nosuch://'"):
        swc.save(_state(), "nosuch://bucket/ckpt")
    assert not swc.Reader.validate_checkpoint_id(url)
    assert isinstance(open_folder("mem2:3"), LocalFolder)  # a plain name again
    assert os.listdir(tmp_path) == []


def test_a_registration_replaces_a_builtin_and_applies_to_plain_paths(tmp_path):
    seen: list[str] = []
    builtin = registry.backend_for("file")
    assert builtin is not None

    def spy(location: str, options: dict[str, Any]) -> Folder:
        seen.append(location)
        return builtin(location, options)

    register_backend("file", spy)
    try:
        assert isinstance(open_folder(tmp_path / "a"), LocalFolder)
        assert isinstance(open_folder(f"file://{tmp_path}/b"), LocalFolder)
    finally:
        register_backend("file", builtin)
    assert seen == [str(tmp_path / "a"), f"file://{tmp_path}/b"]
    assert open_folder(tmp_path).local_path == Path(tmp_path)

"""Which backend a location gets, and the refusals that keep a URL from becoming a local folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import UnsupportedStorageError
from shardwise.storage import FsspecFolder, LocalFolder, is_url, open_folder


def test_paths_and_file_urls_are_local_and_other_schemes_go_to_fsspec(tmp_path):
    assert isinstance(open_folder(tmp_path), LocalFolder)
    assert isinstance(open_folder(str(tmp_path)), LocalFolder)
    local = open_folder(f"file://{tmp_path}")
    assert isinstance(local, LocalFolder) and local.path == tmp_path
    remote = open_folder("memory://sw-location/ckpt")
    assert isinstance(remote, FsspecFolder)
    assert remote.location == "memory://sw-location/ckpt" and remote.root == "/sw-location/ckpt"
    assert open_folder(remote) is remote
    assert [is_url(x) for x in ("s3://b/k", "memory://x", "/tmp/x", tmp_path, "run:3")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_a_local_name_with_a_colon_stays_local(tmp_path):
    assert isinstance(open_folder("run:3"), LocalFolder)  # not a scheme fsspec knows


@pytest.mark.parametrize("bad", ["s3:/bucket/ckpt", "s3:bucket/ckpt", "gs:/b/c", "memory:/x"])
def test_a_url_missing_its_slashes_is_refused_not_made_a_local_folder(tmp_path, bad, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="looks like a URL without '//'"):
        swc.save({"w": torch.ones(2)}, bad)
    assert os.listdir(tmp_path) == []


def test_an_unknown_scheme_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match=r"no fsspec backend serves 'nosuch://'"):
        swc.save({"w": torch.ones(2)}, "nosuch://bucket/ckpt")
    with pytest.raises(UnsupportedStorageError, match=r"'nosuch://'"):
        swc.load({"w": torch.ones(2)}, "nosuch://bucket/ckpt")
    assert os.listdir(tmp_path) == []


def test_a_missing_backend_names_the_extra_to_install(tmp_path, monkeypatch):
    import fsspec

    try:
        fsspec.get_filesystem_class("gs")
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match=r"pip install 'shardwise\[gcs\]'"):
        swc.save({"w": torch.ones(2)}, "gs://bucket/ckpt")
    assert os.listdir(tmp_path) == []


def test_save_info_and_readers_report_the_url_as_given():
    url = "memory://sw-location-info/ckpt"
    info = swc.save({"w": torch.ones(2)}, url)
    assert info.path == url
    assert swc.Reader(url).checkpoint_id == url
    assert swc.Writer(url).checkpoint_id == url
    assert swc.Writer.validate_checkpoint_id(url) and swc.Reader.validate_checkpoint_id(url)
    assert not swc.Writer.validate_checkpoint_id("abc://abc.abc")  # no backend: declined
    assert not swc.Reader.validate_checkpoint_id("abc://abc.abc")
    assert swc.save(
        {"w": torch.ones(2)}, Path("/tmp") / "sw-location-local", overwrite=True
    ).path == Path("/tmp/sw-location-local")

"""The test infrastructure for remote storage: the local S3 server and in-memory roots."""

from __future__ import annotations

import socket

import fsspec
import pytest

from .s3_server import LocalS3

# The local S3 server is a subprocess (tests/s3_server.py), started by the session fixture
# and, in test_stop_closes_the_port, by the test itself.
pytestmark = pytest.mark.spawned


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_bucket_round_trip(s3_bucket):
    s3fs = pytest.importorskip("s3fs")
    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    data = bytes(range(256)) * 3
    fs.pipe_file(f"{url}/sub/key.bin", data)

    assert fs.cat_file(f"{url}/sub/key.bin", start=2, end=6) == data[2:6] == b"\x02\x03\x04\x05"
    assert fs.cat_file(f"{url}/sub/key.bin") == data
    bucket = url.removeprefix("s3://")
    assert fs.find(url) == [f"{bucket}/sub/key.bin"]
    assert fs.ls(f"{url}/sub") == [f"{bucket}/sub/key.bin"]
    assert fs.info(f"{url}/sub/key.bin")["size"] == len(data)


def test_buckets_are_fresh_and_distinct(s3_server):
    s3fs = pytest.importorskip("s3fs")
    first, second = s3_server.new_bucket(), s3_server.new_bucket("other")
    assert first != second and second.startswith("other-")
    fs = s3fs.S3FileSystem(**s3_server.storage_options, skip_instance_cache=True)
    fs.pipe_file(f"{first}/k", b"x")
    assert fs.ls(second) == []
    assert {first, second} <= set(fs.ls(""))
    assert s3_server.endpoint == f"http://127.0.0.1:{s3_server.port}"


def test_memory_root_round_trip(memory_root):
    assert memory_root.startswith("memory://sw-test-")
    fs, root = fsspec.core.url_to_fs(memory_root)
    assert not fs.exists(root)
    fs.pipe_file(f"{root}/a/b.bin", b"payload")
    with fsspec.open(f"{memory_root}/a/c.bin", "wb") as f:
        f.write(b"more")
    assert fs.cat_file(f"{root}/a/b.bin", start=1, end=4) == b"ayl"
    assert sorted(fs.find(root)) == [f"{root}/a/b.bin", f"{root}/a/c.bin"]


def test_stop_closes_the_port():
    pytest.importorskip("moto")
    server = LocalS3()
    port = server.port
    try:
        assert server.running and _accepts(port)
        assert server.startup_s < 20
    finally:
        server.stop()
    assert not server.running
    assert not _accepts(port)
    server.stop()  # idempotent

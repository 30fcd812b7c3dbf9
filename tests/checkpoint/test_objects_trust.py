"""Issue 20 points 9 and 10: stored objects unpickle only as far as
`torch.load(weights_only=True)` admits (plus an allowlist) unless the caller
trusts the checkpoint, on every load path and every rank; and `Reader` honours a
custom `_extension_registry` on every read path.

The crafted object is a real pickle that runs `os.system` on load (it touches a
marker file): each refusal asserts the marker is absent, and a trusted load
proves it appears, so the payload is live and the tests can fail.
"""

from __future__ import annotations

import io
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor, UnsafeMetadataError
from shardwise.testing import run_ranks

pytestmark = [
    pytest.mark.spawned,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


class _Payload:
    """Pickles as `os.system("touch <marker>")`: what a crafted checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@dataclass
class Point:
    """A class of the caller's own: refused until allowlisted."""

    x: int
    y: int


def _inner(e: BaseException) -> BaseException:
    """The error DCP wrapped in a CheckpointException (rank 0's)."""
    assert isinstance(e, CheckpointException), e
    failure = next(iter(e.failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


@pytest.fixture(params=["local", "memory"])
def where(request, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://objects-trust-{uuid.uuid4().hex}/ckpt"


def _crafted(where: str, marker: Path) -> None:
    swc.save({"w": torch.arange(4.0), "evil": _Payload(marker), "step": 3}, where)
    assert not marker.exists()  # saving pickles the payload, never runs it


def _targets() -> dict[str, Any]:
    return {"w": torch.zeros(4), "evil": None, "step": 0}


def test_allowed_values_load_exactly(where: str) -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.25, betas=(0.8, 0.9))
    opt.step()
    groups = opt.state_dict()["param_groups"]
    saved = {
        "step": 12,
        "lr": 0.125,
        "name": "run-7",
        "raw": b"\x00\x01",
        "nothing": None,
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "order": OrderedDict(a=1, b=2),
        "misc": [1, (2.5, "x"), {3, 4}, complex(1, 2)],
        "opt": {"param_groups": groups},
    }
    swc.save(saved, where)
    target = _blank(saved)
    assert target != saved
    swc.load(target, where)
    assert target == saved
    assert target["opt"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert target["opt"]["param_groups"][0]["lr"] == 0.25
    # the same through dcp.load with Reader (DCP's planner unpickles; it gets vetted bytes)
    again = _blank(saved)
    dcp.load(again, storage_reader=swc.Reader(where))
    assert again == saved


def test_bytes_io_values_load(where: str) -> None:
    """DCP's idiom for raw bytes (upstream's e2e train state stores a BytesIO)."""
    swc.save({"blob": io.BytesIO(b"\x00raw")}, where)
    target: dict[str, Any] = {"blob": None}
    swc.load(target, where)
    assert isinstance(target["blob"], io.BytesIO) and target["blob"].getvalue() == b"\x00raw"


def _blank(value: Any) -> Any:
    """`value`'s structure as DCP flattens it (dicts, lists of dicts), leaves None."""
    if isinstance(value, dict):
        return type(value)((k, _blank(v)) for k, v in value.items())
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return [_blank(v) for v in value]
    return None


def test_crafted_object_is_refused_by_swc_load_and_never_runs(where: str, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    _crafted(where, marker)
    target = _targets()
    with pytest.raises(UnsafeMetadataError) as caught:
        swc.load(target, where)
    message = str(caught.value)
    assert "object 'evil'" in message
    assert "refused global posix.system" in message
    assert "trust_objects=True" in message and "allow_object_globals" in message
    assert not marker.exists()
    assert target["evil"] is None and target["step"] == 0
    assert torch.equal(target["w"], torch.zeros(4))  # objects are read first: nothing filled
    # the payload is live: a trusting load runs it (which is what the default prevents)
    swc.load(target, where, trust_objects=True)
    assert marker.exists()


def test_crafted_object_is_refused_by_dcp_load_with_reader(where: str, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    _crafted(where, marker)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_targets(), storage_reader=swc.Reader(where))
    refused = _inner(caught.value)
    assert isinstance(refused, UnsafeMetadataError)
    assert "object 'evil'" in str(refused) and "posix.system" in str(refused)
    assert not marker.exists()
    dcp.load(_targets(), storage_reader=swc.Reader(where, trust_objects=True))
    assert marker.exists()


def test_crafted_object_in_a_stock_checkpoint_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = tmp_path / "stock"
    state = {"w": torch.arange(4.0), "evil": _Payload(marker), "step": 3}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    with pytest.raises(UnsafeMetadataError, match="object 'evil'.*posix.system"):
        swc.load(_targets(), path)  # stock checkpoints load through dcp.load + Reader
    assert not marker.exists()


def _load_crafted(rank: int, world: int, where: str, marker: str) -> tuple[str, str, bool, bool]:
    target = _targets()
    try:
        swc.load(target, where)
        kind, message = "no error", ""
    except Exception as e:  # noqa: BLE001 - the test compares what every rank saw
        kind, message = type(e).__name__, str(e)
    untouched = bool(torch.equal(target["w"], torch.zeros(4))) and target["evil"] is None
    return kind, message, untouched, os.path.exists(marker)


def test_every_rank_refuses_the_crafted_object(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    _crafted(str(tmp_path / "ckpt"), marker)
    results = run_ranks(_load_crafted, 2, str(tmp_path / "ckpt"), str(marker), timeout=60)
    for kind, message, untouched, ran in results:
        assert kind == "UnsafeMetadataError", results
        assert "object 'evil'" in message and "posix.system" in message
        assert untouched and not ran
    assert not marker.exists()


def test_allowlist_hook_admits_a_trusted_class(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    swc.save({"p": Point(1, 2)}, path)
    with pytest.raises(UnsafeMetadataError, match=r"object 'p'.*refused global .*Point"):
        swc.load({"p": None}, path)
    with torch.serialization.safe_globals([Point]):  # scoped
        target: dict[str, Any] = {"p": None}
        swc.load(target, path)
        assert target["p"] == Point(1, 2)
    before = torch.serialization.get_safe_globals()
    try:
        swc.allow_object_globals(Point)  # process-wide
        target = {"p": None}
        dcp.load(target, storage_reader=swc.Reader(path))
        assert target["p"] == Point(1, 2)
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    with pytest.raises(UnsafeMetadataError):
        swc.load({"p": None}, path)


def test_refused_object_through_a_stream_extension(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = tmp_path / "rot"
    state = {"w": torch.arange(4.0), "evil": _Payload(marker)}
    dcp.save(state, storage_writer=swc.Writer(path, _extensions=[Rot13Example()]))
    reader = swc.Reader(path, _extension_registry=get_test_extension_registry())
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(4), "evil": None}, storage_reader=reader)
    assert isinstance(_inner(caught.value), UnsafeMetadataError)
    assert not marker.exists()


# -- point 10: Reader(_extension_registry=...) on every read path ---------------------------


@pytest.mark.parametrize("writer", ["shardwise", "stock"])
@pytest.mark.parametrize("verify", [True, False])
def test_reader_honours_a_custom_extension_on_every_read_path(
    where: str, writer: str, verify: bool
) -> None:
    if writer == "stock" and where.startswith("memory://"):
        pytest.skip("stock FileSystemWriter writes local folders only")
    full = torch.arange(48.0).reshape(6, 8)
    halves = Layout((6, 8), [[Block((0, 0), (3, 8)), Block((3, 0), (3, 8))]])
    saved = {
        "plain": full,  # one chunk, read in parts (below)
        "sharded": ShardedTensor.from_layout(halves, [full[:3], full[3:]], rank=0),
        "meta": {"epoch": 4, "names": ["a", "b"]},
    }
    make = swc.Writer if writer == "shardwise" else dcp.FileSystemWriter
    dcp.save(saved, storage_writer=make(where, _extensions=[Rot13Example()]))
    cols = Layout((6, 8), [[Block((0, 0), (6, 5)), Block((0, 5), (6, 3))]])
    target = {
        "plain": ShardedTensor.from_layout(cols, [torch.zeros(6, 5), torch.zeros(6, 3)], rank=0),
        "sharded": torch.zeros(6, 8),
        "meta": {"epoch": 0, "names": None},
    }
    reader = swc.Reader(where, _extension_registry=get_test_extension_registry(), verify=verify)
    dcp.load(target, storage_reader=reader)
    got = target["plain"].local_shards()
    assert torch.equal(got[0], full[:, :5]) and torch.equal(got[1], full[:, 5:])
    assert torch.equal(target["sharded"], full)
    assert target["meta"] == {"epoch": 4, "names": ["a", "b"]}
    # without the registry the same load names the unknown extension
    with pytest.raises(CheckpointException, match="_extension_registry"):
        dcp.load({"sharded": torch.zeros(6, 8)}, storage_reader=swc.Reader(where))


@pytest.mark.parametrize("writer", ["shardwise", "stock"])
def test_swc_load_and_read_tensor_take_an_extension_registry(writer: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    full = torch.arange(48.0).reshape(6, 8)
    make = swc.Writer if writer == "shardwise" else dcp.FileSystemWriter
    dcp.save(
        {"w": full, "meta": {"epoch": 4}}, storage_writer=make(path, _extensions=[Rot13Example()])
    )
    registry = get_test_extension_registry()
    target = {"w": torch.zeros(6, 8), "meta": {"epoch": 0}}
    swc.load(target, path, extension_registry=registry)
    assert torch.equal(target["w"], full) and target["meta"] == {"epoch": 4}
    band = swc.read_tensor(path, "w", Block((1, 2), (3, 4)), extension_registry=registry)
    assert torch.equal(band, full[1:4, 2:6])
    # without it: the extension is named, with the fix; not taken for damage
    for call in (
        lambda: swc.load({"w": torch.zeros(6, 8)}, path),
        lambda: swc.read_tensor(path, "w"),
    ):
        with pytest.raises(swc.UnsupportedStorageError, match=r"stream\.rot13.*extension_registry"):
            call()


def test_empty_block_target_of_a_transformed_chunk(tmp_path: Path) -> None:
    """A target rank holding nothing of a key still loads the rest."""
    path = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.arange(6.0)}, storage_writer=swc.Writer(path, _extensions=[Rot13Example()])
    )
    layout = Layout((6,), [[Block((2,), (3,))]], allow_holes=True)
    target = {"w": ShardedTensor.from_layout(layout, [torch.zeros(3)], rank=0)}
    dcp.load(
        target, storage_reader=swc.Reader(path, _extension_registry=get_test_extension_registry())
    )
    assert torch.equal(target["w"].local_shards()[0], torch.tensor([2.0, 3.0, 4.0]))

"""Stored objects (`format.pickles`) unpickle only as far as `torch.load(weights_only=True)` admits
(plus an allowlist) unless the caller trusts the checkpoint, on every load path and every
rank (issue 20, point 9).

The crafted object is a real pickle that runs `os.system` on load (it touches a
marker file): each refusal asserts the marker is absent, and a trusted load
proves it appears, so the payload is live and the tests can fail.
"""

from __future__ import annotations

import io
import os
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
from shardwise import UnsafeMetadataError
from shardwise.checkpoint.format.pickles import load_object, vetted_stream
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


def _torch_saved(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def test_load_object_admits_weights_only_values_and_names_the_refused_global(tmp_path: Path):
    value = {"step": 3, "lr": [0.5], "t": torch.ones(2)}
    got = load_object(_torch_saved(value), "extra", "ckpt", trust=False)
    assert got.keys() == value.keys() and got["lr"] == [0.5] and torch.equal(got["t"], value["t"])
    marker = tmp_path / "PWNED"
    with pytest.raises(UnsafeMetadataError) as info:
        load_object(_torch_saved(_Payload(marker)), "evil", "ckpt", trust=False)
    assert str(info.value).startswith(
        "object 'evil' in ckpt: refused global posix.system, nothing was run;"
    )
    assert not marker.exists()


def test_a_damaged_torch_save_stream_is_corrupt():
    cut = _torch_saved({"a": 1})[:-30]  # no central directory
    with pytest.raises(swc.CorruptCheckpointError, match=r"^object 'x' in ckpt: cannot decode \("):
        load_object(cut, "x", "ckpt", trust=False)


def test_vetted_stream_is_a_fresh_serialization_unless_trusted(tmp_path: Path):
    data = _torch_saved(OrderedDict(a=1))
    trusted = vetted_stream(data, "x", "ckpt", trust=True)
    assert trusted.getvalue() == data  # the file's own bytes
    vetted = vetted_stream(data, "x", "ckpt", trust=False)
    assert vetted.tell() == 0 and torch.load(vetted, weights_only=True) == OrderedDict(a=1)
    marker = tmp_path / "PWNED"
    with pytest.raises(UnsafeMetadataError):
        vetted_stream(_torch_saved(_Payload(marker)), "evil", "ckpt", trust=False)
    assert not marker.exists()

"""Saves and loads of GPU-resident state: through bounded pinned slabs on side streams.

Runs wherever CUDA is available and skips elsewhere (the pipeline's logic is
checked on CPU by tests/checkpoint/io/test_staged_writer.py,
test_device_landing.py and tests/checkpoint/engine/test_rank_file.py). Budgets
here are a few MiB, so every state goes in waves and the largest tensor is cut
into slab-sized pieces on the way out and on the way in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise import Block, CorruptCheckpointError, Layout, ShardedTensor
from shardwise.checkpoint.io.device import slabs_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIB = 1 << 20
COLS = Layout((64, 40), [[Block((0, 0), (64, 15)), Block((0, 15), (64, 25))]])  # both on rank 0


def _values(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1200, 900, generator=g),  # 4.3 MB: more than the whole budget
        "bf": torch.randn(300, 257, generator=g).to(torch.bfloat16),
        "nc": torch.randn(64, 48, generator=g),
        "small": {f"s{i}": torch.randn(i + 1, generator=g) for i in range(300)},
        "st": torch.randn(64, 40, generator=g),
    }


def _on(values: dict, device: str) -> dict:
    def sharded(full: torch.Tensor) -> ShardedTensor:
        shards = [full[b.slices()].clone().to(device) for b in COLS.blocks_of(0)]
        return ShardedTensor.from_layout(COLS, shards, rank=0)

    return {
        "big": values["big"].to(device),
        "bf": values["bf"].to(device),
        "nc": values["nc"].to(device).t(),  # not contiguous
        "small": {k: v.to(device) for k, v in values["small"].items()},
        "st": sharded(values["st"]),
        "step": 5,
    }


def _zeros(device: str) -> dict:
    return _on({k: _zero(v) for k, v in _values(0).items()}, device) | {"step": 0}


def _zero(v: object) -> object:
    return (
        {k: torch.zeros_like(x) for k, x in v.items()}
        if isinstance(v, dict)
        else torch.zeros_like(v)
    )  # type: ignore[arg-type]


def _assert_holds(got: dict, values: dict) -> None:
    assert torch.equal(got["big"].cpu(), values["big"])
    assert torch.equal(got["bf"].cpu(), values["bf"])
    assert torch.equal(got["nc"].cpu(), values["nc"].t())
    assert all(torch.equal(got["small"][k].cpu(), v) for k, v in values["small"].items())
    st = got["st"]
    full = torch.cat([s.cpu() for s in st.local_shards()], dim=1)
    assert torch.equal(full, values["st"])
    assert got["step"] == 5


def test_a_save_from_cuda_goes_in_waves_and_reads_back_everywhere(tmp_path: Path) -> None:
    values = _values(1)
    swc.save(_on(values, "cuda"), tmp_path / "ck", staging_bytes=4 * MIB)
    pool = slabs_for("save", 4 * MIB)
    assert pool.allocated <= 4 * MIB and pool.free == pool.count
    into_cuda = _zeros("cuda")
    swc.load(into_cuda, tmp_path / "ck", staging_bytes=2 * MIB)  # `big` read piecewise
    _assert_holds(into_cuda, values)
    assert into_cuda["big"].device.type == "cuda"
    into_cpu = _zeros("cpu")
    swc.load(into_cpu, tmp_path / "ck")
    _assert_holds(into_cpu, values)
    stock = {"big": torch.zeros(1200, 900), "bf": torch.zeros(300, 257, dtype=torch.bfloat16)}
    dcp.load(stock, checkpoint_id=tmp_path / "ck", no_dist=True)  # stock reads it
    assert torch.equal(stock["big"], values["big"]) and torch.equal(stock["bf"], values["bf"])


def test_copies_follow_the_callers_stream(tmp_path: Path) -> None:
    """Also for a transposed tensor, whose contiguous copy the save makes itself."""
    x = torch.zeros(4 * MIB, device="cuda")
    base = torch.zeros(1024, 1536, device="cuda")
    torch.cuda._sleep(200_000_000)  # the fills below run late on the caller's stream
    x.fill_(3.0)
    base.fill_(3.0)
    state = {"x": x, "xt": base.t()}
    swc.save(state, tmp_path / "sync", staging_bytes=2 * MIB)
    torch.cuda._sleep(200_000_000)
    x.fill_(5.0)
    base.fill_(5.0)
    fut = swc.async_save(state, tmp_path / "async", staging="background", staging_bytes=2 * MIB)
    fut.staged.result(timeout=60)
    x.fill_(7.0)  # after staged: never in the checkpoint
    base.fill_(7.0)
    fut.result(timeout=60)
    for name, value in (("sync", 3.0), ("async", 5.0)):
        got = {"x": torch.zeros(4 * MIB), "xt": torch.zeros(1536, 1024)}
        swc.load(got, tmp_path / name)
        assert torch.equal(got["x"], torch.full((4 * MIB,), value)), name
        assert torch.equal(got["xt"], torch.full((1536, 1024), value)), name


def test_background_async_save_returns_before_staged_and_keeps_the_values_of_the_call(
    tmp_path: Path,
) -> None:
    values = _values(2)
    state = _on(values, "cuda")
    fut = swc.async_save(state, tmp_path / "ck", staging="background", staging_bytes=4 * MIB)
    assert isinstance(fut, swc.SaveFuture) and fut.upload_completion is fut
    fut.staged.result(timeout=60)
    state["big"].add_(1)  # the state is free once staged
    state["small"]["s0"].zero_()
    info = fut.result(timeout=60)
    assert Path(info.path) == tmp_path / "ck"
    got = _zeros("cuda")
    swc.load(got, tmp_path / "ck")
    _assert_holds(got, values)


def test_blocking_async_save_is_staged_when_it_returns(tmp_path: Path) -> None:
    values = _values(3)
    state = _on(values, "cuda")
    fut = swc.async_save(state, tmp_path / "ck", staging_bytes=4 * MIB)
    assert fut.staged.done()
    state["big"].mul_(0)
    fut.result(timeout=60)
    got = _zeros("cpu")
    swc.load(got, tmp_path / "ck")
    _assert_holds(got, values)


def test_corruption_in_a_chunk_read_piecewise_into_cuda_is_refused(tmp_path: Path) -> None:
    values = _values(4)
    swc.save(_on(values, "cuda"), tmp_path / "ck")
    data_files = sorted((tmp_path / "ck").glob("*.distcp"))
    blob = bytearray(data_files[0].read_bytes())
    at = blob.find(values["big"].numpy().tobytes()[:4096])
    assert at > 0
    blob[at + 3_000_000] ^= 0x10
    data_files[0].write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match="'big'.*fail their checksum"):
        swc.load(_zeros("cuda"), tmp_path / "ck", staging_bytes=2 * MIB)


def test_a_stock_checkpoint_loads_into_cuda_targets(tmp_path: Path) -> None:
    values = _values(5)
    dcp.save(_on(values, "cuda"), checkpoint_id=tmp_path / "ck", no_dist=True)
    got = _zeros("cuda")
    swc.load(got, tmp_path / "ck", staging_bytes=2 * MIB)
    _assert_holds(got, values)

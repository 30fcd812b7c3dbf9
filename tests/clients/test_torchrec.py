"""TorchRec DistributedModelParallel state through shardwise checkpoints (real torchrec, CPU/gloo).

One real multi-rank run per world size (DMP start-up is slow), results shared:

- save, 2 ranks, plan A2: t0 table-wise, t1 row-wise, t2 column-wise, t3
  table-row-wise, t4 column-wise with both shards on one rank; fused per-table
  EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD state, dense Linear (DDP) + Adam. After
  one real training step every tensor is overwritten with distinct known values
  (`pattern`) through TorchRec's `load_state_dict`, then `swc.save` with the DMP
  and optimizer as Stateful values (and stock `dcp.save` of the same state).
- load, 3 ranks, plan B3 (every table under another sharding type, t4 in four
  column shards, two on rank 0): `swc.load` of the state dicts, `swc.load` of the
  Stateful DMP/optimizer, stock `dcp.load` with `swc.Reader` and with
  `FileSystemReader`; then a DMP of the same plan with DTensor
  (LocalShardsWrapper) state dicts: `swc.load` and stock `dcp.load` into it,
  and `swc.save` from it (a second checkpoint, 3 ranks).
- load, 1 rank, plan C1 (t2 in four column shards on the one rank): both
  shardwise checkpoints through `swc.load` and stock `dcp.load`, and the stock
  DCP checkpoint through `swc.load`.

Each load zeroes the model first (and checks it), then every table's weight and
optimizer state and the dense weights and Adam state are gathered to whole
tensors from a fresh `state_dict()` and compared with `torch.equal`.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import require

require("torchrec.distributed")

import torch  # noqa: E402

from shardwise.testing import run_ranks  # noqa: E402
from tests.clients import torchrec_harness as h  # noqa: E402

pytestmark = pytest.mark.spawned

TIMEOUT = 180.0
# 7 model tensors (5 tables + dense weight/bias), 5 fused momenta, 6 dense Adam states
N_TENSORS = 18


def _quiet() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")


def _state(dmp: Any, optimizer: Any) -> dict[str, Any]:
    return {"model": dmp.state_dict(), "optim": optimizer.state_dict()}


def _mismatches(full: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k for k, v in full.items() if not torch.equal(v, h.pattern(k, tuple(v.shape), v.dtype))
    )


def _apply(dmp: Any, optimizer: Any, sd: dict[str, Any]) -> None:
    """What a TorchRec user does with a loaded state dict."""
    dmp.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optim"])


def _zeroed(dmp: Any, optimizer: Any) -> None:
    sd = _state(dmp, optimizer)
    h.zero_all(sd)
    _apply(dmp, optimizer, sd)
    full = h.gather_full(_state(dmp, optimizer))
    assert all(not bool(v.any()) for v in full.values()), "targets not zeroed"


def _attempt(load: Any, dmp: Any, optimizer: Any) -> dict[str, Any]:
    """Zero the model, load (`load(state_dict)` then TorchRec's `load_state_dict`,
    or `load(dmp, optimizer)` for a loader marked `stateful` that hands them to
    `swc.load` as Stateful values), gather; errors are returned."""
    try:
        _zeroed(dmp, optimizer)
        if getattr(load, "stateful", False):
            load(dmp, optimizer)
        else:
            sd = _state(dmp, optimizer)
            load(sd)
            _apply(dmp, optimizer, sd)
        full = h.gather_full(_state(dmp, optimizer))
        return {"keys": sorted(full), "mismatches": _mismatches(full)}
    except Exception as e:  # noqa: BLE001 - reported to the test that owns this path
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _loaders(path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import shardwise.checkpoint as swc

    def stateful(
        dmp: Any, optimizer: Any
    ) -> None:  # dcp.load-style: state_dict() / load_state_dict() done for us
        swc.load({"model": dmp, "optim": optimizer}, path)

    stateful.stateful = True  # type: ignore[attr-defined]
    return {
        "swc.load": lambda sd: swc.load(sd, path),
        "swc.load Stateful": stateful,
        "dcp.load+swc.Reader": lambda sd: dcp.load(sd, storage_reader=swc.Reader(path)),
        "dcp.load+FileSystemReader": lambda sd: dcp.load(sd, storage_reader=FileSystemReader(path)),
    }


def _save_2(rank: int, world_size: int, path: str, stock: str) -> dict[str, Any]:
    _quiet()
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    dmp, optimizer = h.build("A2")
    h.train_step(dmp, optimizer)  # real state in every optimizer
    sd = _state(dmp, optimizer)
    h.fill_with_pattern(sd)
    _apply(dmp, optimizer, sd)
    full = h.gather_full(_state(dmp, optimizer))  # what the model now holds
    swc.save({"model": dmp, "optim": optimizer}, path)  # Stateful values, as with dcp.save
    dcp.save(_state(dmp, optimizer), checkpoint_id=stock)  # the same state by stock DCP
    return {"keys": sorted(full), "mismatches": _mismatches(full)}


def _load_3(rank: int, world_size: int, path: str, resave: str) -> dict[str, Any]:
    _quiet()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import shardwise.checkpoint as swc

    out: dict[str, Any] = {}
    dmp, optimizer = h.build("B3")
    optimizer.init_state()  # the dense Adam has state to load into, as TorchRec users do
    for name, load in _loaders(path).items():
        out[name] = _attempt(load, dmp, optimizer)

    dmp, optimizer = h.build("B3", output_dtensor=True)
    optimizer.init_state()
    out["dtensor swc.load"] = _attempt(lambda sd: swc.load(sd, path), dmp, optimizer)
    out["dtensor dcp.load+FileSystemReader"] = _attempt(
        lambda sd: dcp.load(sd, storage_reader=FileSystemReader(path)), dmp, optimizer
    )
    try:  # re-save from the DTensor model (it holds the pattern after the last load)
        swc.save(_state(dmp, optimizer), resave)
        out["dtensor swc.save"] = {"ok": True}
    except Exception as e:  # noqa: BLE001
        out["dtensor swc.save"] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


def _load_1(rank: int, world_size: int, path: str, resave: str, stock: str) -> dict[str, Any]:
    _quiet()
    dmp, optimizer = h.build("C1")
    optimizer.init_state()
    out: dict[str, Any] = {}
    for tag, p in (("2 ranks", path), ("3 ranks dtensor", resave)):
        loaders = _loaders(p)
        for name in ("swc.load", "swc.load Stateful", "dcp.load+FileSystemReader"):
            out[f"{tag} {name}"] = _attempt(loaders[name], dmp, optimizer)
    out["stock dcp.save, 2 ranks swc.load"] = _attempt(_loaders(stock)["swc.load"], dmp, optimizer)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three real multi-rank runs, once for the module; failures are kept
    and raised by the tests that look at them."""
    root = tmp_path_factory.mktemp("torchrec")
    path, resave = str(root / "dmp_2ranks"), str(root / "dmp_3ranks_dtensor")
    stock = str(root / "dmp_2ranks_stock_dcp")
    results: dict[str, Any] = {"path": path, "resave": resave}
    for name, fn, ws, args in (
        ("save2", _save_2, 2, (path, stock)),
        ("load3", _load_3, 3, (path, resave)),
        ("load1", _load_1, 1, (path, resave, stock)),
    ):
        try:
            results[name] = run_ranks(fn, ws, *args, timeout=TIMEOUT)
        except Exception as e:  # noqa: BLE001
            results[name] = e
    return results


def _per_rank(runs: dict[str, Any], run: str) -> list[dict[str, Any]]:
    value = runs[run]
    if isinstance(value, BaseException):
        raise value
    return value


def _check(result: dict[str, Any]) -> None:
    assert "error" not in result, result.get("error")
    assert len(result["keys"]) == N_TENSORS and result["keys"] == h.state_keys(), result["keys"]
    assert result["mismatches"] == [], f"not bit exact: {result['mismatches']}"


def test_save_2_ranks_every_sharding_type(runs: dict[str, Any]) -> None:
    import shardwise.checkpoint as swc

    for result in _per_rank(runs, "save2"):
        _check(result)
    # the files hold the values, read offline (no process group), whole tensors
    ckpt = swc.open_checkpoint(runs["path"])
    assert sorted(ckpt.tensor_keys()) == h.state_keys()
    for key in ckpt.tensor_keys():
        t = ckpt.read(key)
        assert torch.equal(t, h.pattern(key, tuple(t.shape), t.dtype)), key
    assert Path(runs["path"], ".metadata").is_file()


LOAD3 = [
    "swc.load",
    "swc.load Stateful",
    "dcp.load+swc.Reader",
    "dcp.load+FileSystemReader",
    "dtensor swc.load",
    "dtensor dcp.load+FileSystemReader",
]


@pytest.mark.parametrize("how", LOAD3)
def test_load_2_to_3_ranks_other_plan(runs: dict[str, Any], how: str) -> None:
    for result in _per_rank(runs, "load3"):
        _check(result[how])


def test_save_3_ranks_dtensor_state(runs: dict[str, Any]) -> None:
    import shardwise.checkpoint as swc

    for result in _per_rank(runs, "load3"):
        assert "error" not in result["dtensor swc.save"], result["dtensor swc.save"].get("error")
    ckpt = swc.open_checkpoint(runs["resave"])
    assert sorted(ckpt.tensor_keys()) == h.state_keys()
    for key in ckpt.tensor_keys():
        t = ckpt.read(key)
        assert torch.equal(t, h.pattern(key, tuple(t.shape), t.dtype)), key


LOAD1 = [
    f"{tag} {name}"
    for tag in ("2 ranks", "3 ranks dtensor")
    for name in ("swc.load", "swc.load Stateful", "dcp.load+FileSystemReader")
] + ["stock dcp.save, 2 ranks swc.load"]


@pytest.mark.parametrize("how", LOAD1)
def test_load_to_1_rank_other_plan(runs: dict[str, Any], how: str) -> None:
    (result,) = _per_rank(runs, "load1")
    _check(result[how])

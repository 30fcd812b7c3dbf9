"""Helpers shared by the tests/upstream ports (not a test module).

- the storage swap and its two control switches: `SHARDWISE_UPSTREAM_STOCK=1`
  (`STOCK`: `Writer` / `Reader` / `sw_save` / `sw_load` / `save_as` / `load_as` fall back
  to DCP's own storage) for the DTensor / resharding / format-utils / planner / e2e
  ports, and `SHARDWISE_UPSTREAM_BASELINE=1` (`IMPL`, `STORAGE`) for the file-system,
  fault-injection and save/load-API ports;
- per-rank assertion recording: upstream's assertions are recorded (`Check`) rather
  than raised mid-scenario, so that every rank keeps issuing the same collectives;
  the scenarios of a file run in one spawned group of ranks (`scenario_results`) and
  each pytest test reports its own scenario's failures from every rank (`verdict`);
- ranks on a device (`run_on`, `setup_rank`, `devices`, `needs_cuda`);
- model builders used by more than one port (`TestDummyModel`).
"""

from __future__ import annotations

import importlib
import os
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import shardwise.checkpoint as swc
from shardwise.testing import run_ranks

# -- the storage under test and the control switches ------------------------------------

STOCK = os.environ.get("SHARDWISE_UPSTREAM_STOCK") == "1"
IMPL = "stock" if os.environ.get("SHARDWISE_UPSTREAM_BASELINE") == "1" else "shardwise"
STORAGE: dict[str, tuple[type, type]] = {  # (writer class, reader class) by IMPL
    "shardwise": (swc.Writer, swc.Reader),
    "stock": (FileSystemWriter, FileSystemReader),
}

FORMS = ["Writer/Reader", "swc.save/load"]
by_form = pytest.mark.parametrize("form", FORMS)
# DCP's "assuming single process" notes
ignore_user_warnings = pytest.mark.filterwarnings("ignore::UserWarning")


def Writer(*args: Any, **kwargs: Any) -> Any:
    return (FileSystemWriter if STOCK else swc.Writer)(*args, **kwargs)


def Reader(*args: Any, **kwargs: Any) -> Any:
    return (FileSystemReader if STOCK else swc.Reader)(*args, **kwargs)


def sw_save(state: dict, path: Path) -> None:
    if STOCK:
        dcp.save(state, checkpoint_id=path)
    else:
        swc.save(state, path, overwrite=True)


def sw_load(state: dict, path: Path) -> None:
    if STOCK:
        dcp.load(state, checkpoint_id=path)
    else:
        swc.load(state, path)


def uses_swc(form: str) -> bool:
    """The forms of a port: "Writer/Reader", "Writer", "storage" (dcp.save / dcp.load with
    Writer / Reader) or "swc.save/load", "swc.save", "swc" (swc.save / swc.load)."""
    return form.startswith("swc")


def save_as(
    form: str,
    state_dict: Any,
    path: Path,
    writer_kwargs: dict[str, Any] | None = None,
    **dcp_kwargs: Any,
) -> None:
    """dcp.save(state_dict, storage_writer=Writer(path, **writer_kwargs), **dcp_kwargs) (upstream's
    DCP.save(..., checkpoint_id=path) with the storage swapped), or sw_save in the swc forms."""
    if uses_swc(form):
        sw_save(state_dict, path)
    else:
        dcp.save(state_dict, storage_writer=Writer(path, **(writer_kwargs or {})), **dcp_kwargs)


def load_as(
    form: str,
    state_dict: Any,
    path: Path,
    reader_kwargs: dict[str, Any] | None = None,
    **dcp_kwargs: Any,
) -> None:
    """dcp.load(state_dict, storage_reader=Reader(path, **reader_kwargs), **dcp_kwargs), or sw_load
    in the swc forms."""
    if uses_swc(form):
        sw_load(state_dict, path)
    else:
        dcp.load(state_dict, storage_reader=Reader(path, **(reader_kwargs or {})), **dcp_kwargs)


# -- soft checks: upstream's assertions, recorded so every rank keeps issuing the same collectives


def assert_equal(expected: Any, actual: Any) -> None:
    """torch TestCase.assertEqual for what these tests compare (tensors, containers, scalars)."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        torch.testing.assert_close(actual, expected)
    elif isinstance(expected, dict) and isinstance(actual, dict):
        assert set(expected) == set(actual), f"keys differ: {sorted(expected)} vs {sorted(actual)}"
        for k in expected:
            try:
                assert_equal(expected[k], actual[k])
            except AssertionError as e:
                raise AssertionError(f"[{k!r}] {e}") from None
    elif isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        assert len(expected) == len(actual), f"lengths differ: {len(expected)} vs {len(actual)}"
        for i, (a, b) in enumerate(zip(expected, actual)):
            try:
                assert_equal(a, b)
            except AssertionError as e:
                raise AssertionError(f"[{i}] {e}") from None
    else:
        assert expected == actual, f"{expected!r} != {actual!r}"


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def equal(self, expected: Any, actual: Any, what: str) -> None:
        try:
            assert_equal(expected, actual)
        except AssertionError as e:
            self.failures.append(f"{what}: {e}")

    def true(self, cond: Any, what: str) -> None:
        if not cond:
            self.failures.append(f"{what}: not true")

    def raises(self, types: Any, pattern: str, fn: Callable[[], Any], what: str) -> None:
        """assertRaisesRegex: `fn()` must raise one of `types` with `pattern` in its message."""
        try:
            fn()
        except types as e:
            if not re.search(pattern, str(e)):
                self.failures.append(f"{what}: {describe(e)} raised but {pattern!r} not in it")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self.failures.append(
                f"{what}: expected {types} matching {pattern!r}, got {describe(e)}"
            )
        else:
            self.failures.append(f"{what}: expected {types} matching {pattern!r}, nothing raised")


def describe(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException shows the ranks' own errors."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = []
        for r, f in sorted(failures.items()):
            exc = getattr(f, "exc", f[0] if isinstance(f, tuple) else f)
            inner.append(f"rank {r}: {type(exc).__name__}: {exc}")
        return f"{type(e).__name__} [" + "; ".join(inner) + "]"
    return f"{type(e).__name__}: {e}"


def bind(fn: Callable[..., None], *args: Any, **kwargs: Any) -> Callable[[Path, Check], None]:
    """A scenario: `fn(path, check, *args, **kwargs)`."""
    return lambda path, check: fn(path, check, *args, **kwargs)


def _dirname(name: str) -> str:
    return re.sub(r"\W+", "_", name)


def run_scenarios(
    rank: int, world: int, module: str, root: str, names: list[str]
) -> dict[str, list[str]]:
    """On every rank: run `module.SCENARIOS[name](folder, check)` for each name, in order
    (`module` may be "package.module:TABLE" for another table than SCENARIOS). A scenario's
    failed checks and exception are reported under its name."""
    module_name, _, table = module.partition(":")
    scenarios = getattr(importlib.import_module(module_name), table or "SCENARIOS")
    out: dict[str, list[str]] = {}
    for name in names:
        check = Check()
        try:
            scenarios[name](Path(root) / _dirname(name), check)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            check.failures.append(f"raised {describe(e)}\n{traceback.format_exc()}")
        out[name] = check.failures
    return out


def run_cuda_scenarios(
    rank: int, world: int, module: str, root: str, names: list[str]
) -> dict[str, list[str]]:
    torch.cuda.set_device(rank)
    return run_scenarios(rank, world, module, root, names)


def scenario_results(
    stem: str,
    module: str,
    world: int,
    timeout: float,
    body: Callable[..., dict[str, list[str]]] = run_scenarios,
    name: str = "results",
    **run_kwargs: Any,
) -> Any:
    """A module-scoped fixture `name`: every scenario of `module`'s table (see run_scenarios),
    run once in one group of `world` ranks under a fresh folder named after `stem`."""

    @pytest.fixture(scope="module", name=name)
    def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
        module_name, _, table = module.partition(":")
        names = list(getattr(importlib.import_module(module_name), table or "SCENARIOS"))
        root = tmp_path_factory.mktemp(stem)
        return run_ranks(body, world, module, str(root), names, timeout=timeout, **run_kwargs)

    return results


def verdict(results: list[dict[str, list[str]]], name: str) -> None:
    ranks_of: dict[str, list[int]] = {}
    for rank, res in enumerate(results):
        for msg in res[name]:
            ranks_of.setdefault(msg, []).append(rank)
    if ranks_of:
        pytest.fail("\n".join(f"ranks {r}: {m}" for m, r in ranks_of.items()), pytrace=False)


# -- ranks on a device ---------------------------------------------------------------------


def cuda_devices(n: int) -> bool:
    """Whether `n` CUDA devices are present."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= n


def needs_cuda(n: int, reason: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not cuda_devices(n), reason=reason)


def devices(n: int, reason: str) -> list[Any]:
    """["cpu", "cuda"], the CUDA form skipped (with `reason`) without `n` CUDA devices."""
    return ["cpu", pytest.param("cuda", marks=needs_cuda(n, reason))]


def setup_rank(device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank())
    torch.manual_seed(0)  # same stream on every rank, as upstream's fresh processes have


def run_on(
    device: str, body: Callable[..., Any], world: int, *args: Any, timeout: float
) -> list[Any]:
    """run_ranks on gloo (cpu) or NCCL (cuda)."""
    backend = "nccl" if device == "cuda" else "gloo"
    return run_ranks(body, world, *args, timeout=timeout, backend=backend)


# -- model builders ---------------------------------------------------------------------------


class TestDummyModel(nn.Module):
    """Upstream's TestDummyModel (torch.testing._internal.distributed.common_state_dict and
    the format-utils tests): four seeded Linear layers."""

    __test__ = False  # a model, not a pytest class

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 32)
        self.net3 = nn.Linear(32, 64)
        self.net4 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.net1(x))
        x = F.relu(self.net2(x))
        x = F.relu(self.net3(x))
        return F.relu(self.net4(x))

    def get_input(self) -> torch.Tensor:
        return torch.rand(8, 8, device=next(self.parameters()).device)

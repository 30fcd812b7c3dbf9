from __future__ import annotations

import ast
import os
import sys
from functools import cache
from pathlib import Path
from types import FunctionType, ModuleType

import pytest
from hypothesis import settings

# Ranks share two cores; keep each process to one thread so tests don't thrash.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# CI replays a fixed set of examples (no flaky landings); local runs explore anew.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# -- the `spawned` marker ----------------------------------------------------------------------
#
# A test module that starts processes (ranks through `shardwise.testing.run_ranks`, or
# `subprocess`, `multiprocessing`, `torch.multiprocessing`), directly or through a helper
# of the tests package (`chaos.crash_save`, `harness.run_on`, ...), carries
#
#     pytestmark = pytest.mark.spawned
#
# so that `-m "not spawned"` runs the in-process tests alone. Collection fails, naming the
# modules, when a spawning module lacks the marker.

SPAWNING_NAMES = frozenset({"run_ranks", "ProcessPoolExecutor"})
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
# Modules that spawn but whose owner has not added the marker yet (files other people are
# editing): marked here meanwhile. Remove an entry once its module has `pytestmark`.
MARKED_HERE: frozenset[str] = frozenset()
_ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "spawned: the test starts processes (ranks via shardwise.testing.run_ranks, "
        "subprocess, multiprocessing); deselect with -m 'not spawned'",
    )


def _spawns_directly(node: ast.AST) -> str | None:
    """What in `node` starts processes itself: a spawning name or module, else None."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in SPAWNING_NAMES:
            return sub.id
        if isinstance(sub, ast.Attribute) and sub.attr in SPAWNING_NAMES:
            return sub.attr
        if isinstance(sub, ast.Import):
            for alias in sub.names:
                if alias.name in SPAWNING_MODULES:
                    return alias.name
        if isinstance(sub, ast.ImportFrom):
            if sub.module in SPAWNING_MODULES:
                return sub.module
            if any(a.name in SPAWNING_NAMES for a in sub.names):
                return next(a.name for a in sub.names if a.name in SPAWNING_NAMES)
    return None


@cache
def _tree(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


@cache
def _spawning_functions(path: str) -> dict[str, str]:
    """The top-level functions of a helper module that start processes, directly or by
    calling another such function of the module: name -> what they reach."""
    tree = _tree(path)
    if tree is None:
        return {}
    functions = {
        n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = {name: why for name, fn in functions.items() if (why := _spawns_directly(fn))}
    grew = True
    while grew:
        grew = False
        for name, fn in functions.items():
            if name in found:
                continue
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Name) and sub.id in found:
                    found[name] = f"{sub.id} -> {found[sub.id]}"
                    grew = True
                    break
    return found


def _is_helper(module: ModuleType | None, test_module: ModuleType) -> bool:
    file = getattr(module, "__file__", None)
    return (
        module is not None
        and module is not test_module
        and file is not None
        and Path(file).resolve().is_relative_to(_ROOT / "tests")
    )


def _why_it_spawns(module: ModuleType) -> str | None:
    """What makes a collected test module start processes, or None."""
    file = getattr(module, "__file__", None)
    tree = _tree(file) if file else None
    if tree is None:
        return None
    if why := _spawns_directly(tree):
        return why
    attributes = {
        (n.value.id, n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    for alias, value in vars(module).items():
        if isinstance(value, ModuleType) and _is_helper(value, module):
            # `from . import chaos` ... `chaos.crash_save(...)`
            spawners = _spawning_functions(value.__file__)
            for used in sorted(attr for a, attr in attributes if a == alias and attr in spawners):
                return f"{alias}.{used} -> {spawners[used]}"
        elif isinstance(value, FunctionType):
            # `from .harness import run_on`
            home = sys.modules.get(value.__module__)
            if _is_helper(home, module):
                spawners = _spawning_functions(home.__file__)
                if value.__name__ in spawners:
                    return f"{value.__module__}.{value.__name__} -> {spawners[value.__name__]}"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked: dict[str, str] = {}
    verdicts: dict[str, str | None] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None or item.get_closest_marker("spawned"):
            continue
        key = module.__name__
        if key not in verdicts:
            verdicts[key] = _why_it_spawns(module)
        why = verdicts[key]
        if why is None:
            continue
        where = Path(module.__file__).resolve()
        name = str(where.relative_to(_ROOT)) if where.is_relative_to(_ROOT) else str(where)
        if name in MARKED_HERE:
            item.add_marker(pytest.mark.spawned)
            continue
        unmarked.setdefault(name, why)
    if unmarked:
        lines = "\n".join(f"  {name} (it reaches {why})" for name, why in sorted(unmarked.items()))
        raise pytest.UsageError(
            "these test modules start processes but are not marked `spawned`:\n"
            f"{lines}\n"
            "add `pytestmark = pytest.mark.spawned` at module level (after the imports), "
            "so that `-m 'not spawned'` leaves them out"
        )


# -- local S3 (moto's standalone server) and in-memory fsspec roots ---------------------------
#
# Tests that use `s3_server` / `s3_bucket` reach a subprocess (the server, shared by the
# session): see tests/s3_server.py, also for s3fs's instance cache.


@pytest.fixture(scope="session")
def s3_server():
    """A `tests.s3_server.LocalS3`, shared by the session and stopped at its end."""
    for needed in ("moto", "s3fs"):
        try:
            __import__(needed)
        except ImportError:
            pytest.skip(f"{needed} is not installed (pip install -r requirements/clients.txt)")
    from .s3_server import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """`(url, storage_options)`: `s3://<fresh bucket>` on the session's local S3 server."""
    return f"s3://{s3_server.new_bucket()}", s3_server.storage_options


@pytest.fixture
def memory_root():
    """A unique `memory://sw-test-<uuid>` root, removed from fsspec's memory store after."""
    import uuid

    import fsspec

    name = f"sw-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)

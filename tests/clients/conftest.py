"""Client tests run against the real, pinned packages (requirements/clients*.txt).

`make test` installs them. A package that is not installed skips its tests
with the install command, except in CI (CI set), where it fails them: a client
test skipped in CI verifies nothing. A package that is installed but does not
import (a broken dependency) always fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from types import ModuleType

import pytest

INSTALL = (
    "make test (or: pip install -c requirements/constraints.txt -r requirements/clients.txt; "
    "pip install -c requirements/constraints.txt --no-deps --ignore-requires-python -r requirements/clients-nodeps.txt)"
)


def require(module: str) -> ModuleType:
    """Import `module` of a client package, or skip (fail in CI) saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") or _installed(module):
            raise
        pytest.skip(
            f"{module} is not installed ({e}); install it with {INSTALL}", allow_module_level=True
        )


_DISTRIBUTIONS = {
    "megatron": "megatron-core",
    "physicsnemo": "nvidia-physicsnemo",
    "torchrec": "torchrec",
}


def _installed(module: str) -> bool:
    """Whether the distribution that provides `module` is installed."""
    name = _DISTRIBUTIONS.get(module.split(".")[0], module.split(".")[0])
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True

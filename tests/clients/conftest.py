"""Client tests run against the real, pinned packages (requirements/clients*.txt).

`make test` installs them. Outside CI a missing package skips its tests with
the install command; in CI (CI set) it fails them: a client test skipped in
CI verifies nothing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

INSTALL = "make test (or: pip install -c requirements/constraints.txt -r requirements/clients.txt; " \
    "pip install -c requirements/constraints.txt --no-deps --ignore-requires-python -r requirements/clients-nodeps.txt)"


def require(module: str) -> ModuleType:
    """Import `module` of a client package, or skip (fail in CI) saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{module} is not installed ({e}); install it with {INSTALL}", allow_module_level=True)

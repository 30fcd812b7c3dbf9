"""Which backend opens a location: a scheme -> factory table, open to third parties.

A factory takes the location as the caller wrote it (a plain path, or a
`scheme://` URL) and the `storage_options`, and returns a `Folder`. The
built-ins: `"file"` opens plain paths and `file://` URLs (`LocalFolder`), and
the fallback (scheme `None`) serves every other scheme fsspec knows
(`FsspecFolder`). A package adds a scheme without editing shardwise, either by
calling `register_backend("mem2", factory)` or by declaring an entry point in
the `shardwise.storage_backends` group (name: the scheme; value: the factory),
which is imported only when a location with that scheme is first opened.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from .folder import Folder

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendFactory",
    "backend_for",
    "fallback",
    "register_backend",
    "unregister_backend",
]

ENTRY_POINT_GROUP = "shardwise.storage_backends"

BackendFactory = Callable[[str, dict[str, Any]], Folder]

_factories: dict[str | None, BackendFactory] = {}
_pending: dict[str, Any] = {}  # scheme -> an entry point not loaded yet
_scanned = False  # whether the entry points of the group have been listed


def _key(scheme: str | None) -> str | None:
    return None if scheme is None else scheme.lower()


def register_backend(scheme: str | None, factory: BackendFactory) -> None:
    """Open locations of `scheme` (`"mem2"` for `mem2://...`; `"file"` also serves plain
    paths) with `factory(location, storage_options)`; `None` replaces the fallback that
    serves schemes nothing else claims. A later registration for the same scheme wins."""
    _pending.pop(_key(scheme) or "", None)
    _factories[_key(scheme)] = factory


def unregister_backend(scheme: str | None) -> BackendFactory | None:
    """Forget the factory of `scheme` (registered or from an entry point); returns it."""
    _scan()
    _pending.pop(_key(scheme) or "", None)
    return _factories.pop(_key(scheme), None)


def backend_for(scheme: str) -> BackendFactory | None:
    """The factory registered for `scheme` itself (not the fallback), loading its entry
    point on first use; None when nothing claims it."""
    key = scheme.lower()
    factory = _factories.get(key)
    if factory is not None:
        return factory
    _scan()
    entry = _pending.pop(key, None)
    if entry is None:
        return None
    loaded: BackendFactory = entry.load()
    _factories[key] = loaded
    return loaded


def fallback() -> BackendFactory | None:
    """The factory for schemes no registration claims (fsspec's, unless replaced)."""
    return _factories.get(None)


def _scan() -> None:
    """List the group's entry points once (names only: nothing is imported here)."""
    global _scanned
    if _scanned:
        return
    _scanned = True
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = entry.name.lower()
        if key not in _factories:
            _pending.setdefault(key, entry)


def _rescan() -> None:
    """Forget the listing so the next lookup lists the entry points again (tests)."""
    global _scanned
    _scanned = False
    _pending.clear()

"""Where a checkpoint's bytes live: a path or URL opened as a `Folder`, through
the registry of storage backends.

`open_folder` takes a local path, a `file://` or any fsspec URL and picks the
backend registered for its scheme (`register_backend`), falling back to fsspec.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from importlib import metadata
from typing import Any

from ..errors import UnsupportedStorageError
from .folder import Folder
from .local import LocalFolder
from .remote import FsspecFolder

__all__ = [
    "BACKEND_EXTRAS",
    "BackendFactory",
    "ENTRY_POINT_GROUP",
    "backend_for",
    "fallback",
    "is_url",
    "open_folder",
    "register_backend",
    "served_url",
    "unregister_backend",
]


# -----------------------------------------------------------------------------
# Which backend opens a location: a scheme -> factory table, open to third parties.
#
# A factory takes the location as the caller wrote it (a plain path, or a
# `scheme://` URL) and the `storage_options`, and returns a `Folder`. The
# built-ins: `"file"` opens plain paths and `file://` URLs (`LocalFolder`), and
# the fallback (scheme `None`) serves every other scheme fsspec knows
# (`FsspecFolder`). A package adds a scheme without editing shardwise, either by
# calling `register_backend("mem2", factory)` or by declaring an entry point in
# the `shardwise.storage_backends` group (name: the scheme; value: the factory),
# which is imported only when a location with that scheme is first opened.
# -----------------------------------------------------------------------------

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


# -----------------------------------------------------------------------------
# From what a caller passes (a path, or a URL) to a `Folder`; the one place that tells them apart.
#
# A location is a URL when it starts with `scheme://`. Which backend opens it
# is the registry's answer (`storage.location.py`): built in, `file://` URLs and plain
# paths are local (`LocalFolder`, no fsspec detour) and every other scheme goes
# to the fsspec backend registered for it. A scheme no installed backend
# serves is refused, naming the package (extra) to install, before anything is
# written — never taken for a local folder named `s3:`.
# -----------------------------------------------------------------------------

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")

# `s3:/bucket` or `gs:bucket`: a URL missing a slash, which a local path must not swallow
_LOOKS_LIKE_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)")

# scheme -> the shardwise extra that installs its fsspec backend
BACKEND_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}


def is_url(location: Any) -> bool:
    """Whether `location` is a `scheme://` URL (a `str`; paths never are)."""
    return isinstance(location, str) and _URL.match(location) is not None


def served_url(location: Any) -> bool:
    """Whether `location` is a URL whose scheme an installed fsspec backend serves (what
    DCP's storage auto-detection asks a storage class: an unknown scheme is declined)."""
    match = _URL.match(location) if isinstance(location, str) else None
    if match is None:
        return False
    if backend_for(match.group(1)) is not None:
        return True
    import fsspec

    try:
        fsspec.get_filesystem_class(match.group(1).lower())
    except (ImportError, ValueError):
        return False
    return True


def open_folder(
    location: str | os.PathLike | Folder, storage_options: dict[str, Any] | None = None
) -> Folder:
    """The `Folder` at `location`; `storage_options` go to the fsspec backend (e.g.
    `{"endpoint_url": ...}` for s3fs), as with `fsspec.open`."""
    if isinstance(location, Folder):
        return location
    text = os.fspath(location)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    match = _URL.match(text) if isinstance(location, str) else None
    if match is None:
        odd = _LOOKS_LIKE_URL.match(text) if isinstance(location, str) else None
        if odd is not None and _known_scheme(odd.group(1)):
            raise UnsupportedStorageError(
                f"{text!r} looks like a URL without '//' (did you mean "
                f"'{odd.group(1)}://{text[len(odd.group(0)) :].lstrip('/')}'?); "
                "it is not taken for a local folder"
            )
        return _opener("file")(text, storage_options or {})
    return _opener(match.group(1).lower())(text, storage_options or {})


def _opener(scheme: str) -> BackendFactory:
    """The factory for `scheme`: its own registration, else the fallback (fsspec's)."""
    factory = backend_for(scheme) or fallback()
    if factory is None:
        raise UnsupportedStorageError(f"no storage backend serves '{scheme}://'")
    return factory


def _open_local(location: str, options: dict[str, Any]) -> Folder:
    """The built-in `file` backend: a plain path or a `file://` URL, straight to the OS
    (a `file://` URL with storage options goes through fsspec, which takes them)."""
    if not location.startswith("file://"):
        return LocalFolder(location)
    if options:
        return _open_fsspec(location, options)
    return LocalFolder(location[len("file://") :])


def _open_fsspec(location: str, options: dict[str, Any]) -> Folder:
    """The built-in fallback: any scheme an installed fsspec backend serves."""
    match = _URL.match(location)
    assert match is not None  # plain paths go to the `file` backend
    return FsspecFolder(*_filesystem(location, match.group(1).lower(), options), location)


def _known_scheme(scheme: str) -> bool:
    """Whether fsspec knows `scheme` (installed or not): `s3:x` is a broken URL, `run:3` a name."""
    from fsspec.registry import known_implementations, registry

    if backend_for(scheme) is not None:
        return True
    return scheme.lower() in known_implementations or scheme.lower() in registry


def _filesystem(url: str, scheme: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec  # torch depends on it; imported here so local paths never load it
    from fsspec.core import url_to_fs

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        extra = BACKEND_EXTRAS.get(scheme)
        hint = f"pip install 'shardwise[{extra}]'" if extra else "install its fsspec backend"
        raise UnsupportedStorageError(
            f"cannot open {url}: the fsspec backend for '{scheme}://' is not installed "
            f"({hint}; {e})"
        ) from e
    except ValueError as e:
        raise UnsupportedStorageError(
            f"cannot open {url}: no fsspec backend serves '{scheme}://' ({e})"
        ) from e
    fs, root = url_to_fs(url, **options)
    return fs, root


register_backend("file", _open_local)

register_backend(None, _open_fsspec)

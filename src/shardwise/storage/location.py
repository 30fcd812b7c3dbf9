"""From what a caller passes (a path, or a URL) to a `Folder`; the one place that tells them apart.

A location is a URL when it starts with `scheme://`. Which backend opens it
is the registry's answer (`registry.py`): built in, `file://` URLs and plain
paths are local (`LocalFolder`, no fsspec detour) and every other scheme goes
to the fsspec backend registered for it. A scheme no installed backend
serves is refused, naming the package (extra) to install, before anything is
written — never taken for a local folder named `s3:`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UnsupportedStorageError
from .folder import Folder
from .local import LocalFolder
from .registry import BackendFactory, backend_for, fallback, register_backend
from .remote import FsspecFolder

__all__ = ["BACKEND_EXTRAS", "is_url", "open_folder", "served_url"]

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

"""Tests that craft chunk entries as JSON: a saved checkpoint's manifest rewritten in
format version 3, which lists the chunks in the manifest itself (still read)."""

from __future__ import annotations

import os

from shardwise.checkpoint.format.manifest import MANIFEST, Manifest
from shardwise.storage import open_folder

__all__ = ["inline_manifest"]


def inline_manifest(path: str | os.PathLike, name: str = MANIFEST) -> Manifest:
    """Rewrite `path`'s manifest `name` (version 4: chunks in the index) as version 3,
    the same checkpoint with every chunk listed inline; returns it."""
    folder = open_folder(path)
    m = Manifest.read(folder, name)
    m.version, m.index = 3, None
    folder.write_durably(name, m.to_json().encode())
    return m

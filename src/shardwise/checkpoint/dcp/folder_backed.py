"""What `Writer` and `Reader` share on top of stock's file-system classes: a `Folder`.

Stock `FileSystemWriter`/`FileSystemReader` keep `self.path` as a `Path`,
which mangles a URL (`s3://b/k` becomes `s3:/b/k`); these keep the folder
(local or fsspec) beside it, and `self.path` as stock's `Path` or the URL.
"""

from __future__ import annotations

import os
from typing import Any

from ...storage import Folder, open_folder, served_url

__all__ = ["FolderBacked"]


class FolderBacked:
    """Mixed in before stock's writer or reader class (which `super()` reaches)."""

    folder: Folder
    path: Any
    storage_options: dict[str, Any] | None

    def _use(self, folder: Folder) -> None:
        self.folder = folder
        self.path = folder.checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)  # type: ignore[misc]
        if checkpoint_id:
            self._use(open_folder(checkpoint_id, self.storage_options))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths and URLs an installed backend serves (stock's file-system classes
        refuse every URL; an unknown scheme is declined, so DCP tries its next class)."""
        return served_url(checkpoint_id) or super().validate_checkpoint_id(checkpoint_id)  # type: ignore[misc]

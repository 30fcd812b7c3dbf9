"""The public entry points: `save`, `async_save`, `load`, `read_tensor`.

`edge` holds what each of them does first (open the folder on every rank, read
the caller's `Stateful` values, agree on problems); `save` and `load` hand the
state to the engine (`checkpoint.engine`).
"""

from .async_save import SaveFuture, async_save
from .edge import SaveInfo
from .load import LoadInfo, load, read_tensor
from .save import save

__all__ = ["LoadInfo", "SaveFuture", "SaveInfo", "async_save", "load", "read_tensor", "save"]

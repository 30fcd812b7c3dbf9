"""The public entry points: `save`, `async_save`, `load`, `read_tensor`.

`edge` holds what each of them does first (open the folder on every rank, read
the caller's `Stateful` values, agree on problems); `save` and `load` hand the
state to the engine (`checkpoint.engine`).
"""

from .edge import SaveInfo
from .load import LoadInfo, load, read_tensor
from .save import async_save, save

__all__ = ["LoadInfo", "SaveInfo", "async_save", "load", "read_tensor", "save"]

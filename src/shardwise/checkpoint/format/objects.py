"""Unpickling the non-tensor values of a checkpoint: safe unless the caller trusts it.

A checkpoint is untrusted input, and a pickle can name any callable
(`os.system`) for the loader to run. So by default every stored object is
read with PyTorch's `weights_only` unpickler (`torch.load(weights_only=True)`):
ints, floats, strings, bytes, `None`, containers (dict, list, tuple, set,
OrderedDict), tensors, dtypes, `torch.Size`, and so optimizer `param_groups`
and the like; plus `io.BytesIO`, DCP's idiom for raw bytes in a state dict
(PyTorch's own DCP tests store them), which holds bytes and runs nothing: it is
added to PyTorch's allowlist on first use. Every other global is refused before
it is looked up, so nothing in the file runs. Two ways to admit more:

* `allow_object_globals(cls, ...)`: allowlist classes (or functions) you
  trust, process-wide (PyTorch's `torch.serialization.add_safe_globals`, which
  `torch.serialization.safe_globals(...)` scopes to a `with` block);
* `trust_objects=True` on `swc.load` / `Reader`: plain `pickle` for that
  load, running whatever the file names. Only for checkpoints you trust.

DCP's own load planner unpickles object bytes with `weights_only=False`; the
`Reader` therefore decodes them here first and hands the planner a fresh
serialization of the vetted value (`vetted_stream`), never the file's bytes.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from ...errors import CorruptCheckpointError, UnsafeMetadataError

__all__ = ["allow_object_globals", "load_object", "vetted_stream"]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_DETAIL = re.compile(r"WeightsUnpickler error: ([^\n]*(?:\n\n[^\n]+)?)")
_HOW = (
    "non-tensor values load with torch.load(weights_only=True) rules by default; if you "
    "trust this checkpoint, pass trust_objects=True (swc.load / Reader), or allowlist the "
    "class with shardwise.checkpoint.allow_object_globals(...)"
)


def allow_object_globals(*globals_: Any) -> None:
    """Admit these classes or functions when unpickling checkpoint objects, in every
    later load of this process (`torch.serialization.add_safe_globals`). Entries may
    also be `(obj, "module.name")` pairs, as PyTorch accepts."""
    torch.serialization.add_safe_globals(list(globals_))


def load_object(data: bytes | memoryview, key: str, where: str, *, trust: bool) -> Any:
    """The value stored as `data` (`torch.save` bytes) for object `key` of `where`.

    Untrusted (the default), only what `torch.load(weights_only=True)` admits loads;
    anything else raises `UnsafeMetadataError` naming the key and the refused global,
    before the global is looked up. Bytes that are no `torch.save` stream raise
    `CorruptCheckpointError`."""
    stream = io.BytesIO(data)
    if trust:
        return torch.load(stream, weights_only=False)
    _admit_bytes_io()
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeMetadataError(_refusal(key, where, str(e))) from None
    except Exception as e:  # noqa: BLE001 - any other decoding failure means damaged bytes
        raise CorruptCheckpointError(
            f"object '{key}' in {where}: cannot decode ({type(e).__name__}: {e})"
        ) from e


def vetted_stream(data: bytes | memoryview, key: str, where: str, *, trust: bool) -> io.BytesIO:
    """What to hand DCP's planner (`load_bytes`, which unpickles with `weights_only=False`):
    the file's bytes when trusted, else a fresh `torch.save` of the value `load_object`
    admitted, so the planner never unpickles anything the file chose."""
    if trust:
        return io.BytesIO(data)
    value = load_object(data, key, where, trust=False)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _admit_bytes_io() -> None:
    """`io.BytesIO` in PyTorch's weights-only allowlist (again, if someone cleared it)."""
    if io.BytesIO not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([io.BytesIO])


def _refusal(key: str, where: str, message: str) -> str:
    """One line naming the key and what the weights-only unpickler refused."""
    found = _GLOBAL.search(message)
    if found:
        what = f"refused global {found.group(1)}"
    else:
        detail = _DETAIL.search(message)
        reason = " ".join(detail.group(1).split()) if detail else "not a weights-only pickle"
        what = f"refused ({reason})"
    return f"object '{key}' in {where}: {what}, nothing was run; {_HOW}"

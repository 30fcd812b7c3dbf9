"""Run Megatron-Core's own `dist_checkpointing.save/load` on CPU gloo ranks.

Test-only stand-ins; nothing here belongs in the library. Megatron's
`torch_dist` save path assumes a CUDA job launched by torchrun:

- `torch.cuda.synchronize()` after the device-to-host copy and
  `torch.cuda.current_device()` as the device of the tiny int tensors it
  all-reduces / broadcasts: here a no-op and `"cpu"` (gloo reduces CPU tensors).
- `psutil` (not among megatron-core's declared dependencies) for a debug log
  of the writer's memory use: reported as 0 when psutil is not installed.
- a `multiprocessing` Manager queue for write results, started from the rank:
  `run_ranks` ranks are daemonic processes, which may not have children, so
  the (synchronous) save gets a plain in-process `queue.Queue` instead.

A GPU run under torchrun needs none of this: call `patch_for_cpu()` only
where no CUDA device is present.
"""

from __future__ import annotations

import queue

import torch

__all__ = ["patch_for_cpu"]


def patch_for_cpu() -> None:
    """Install the CPU stand-ins in this process (a rank); idempotent."""
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

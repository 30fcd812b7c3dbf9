"""What `shardwise bench gpu` measures with: host-memory peaks and a stand-in
training step (benchmarks/bench_gpu.py says what each case reports).

Host memory: a thread samples /proc/self/statm every 2 ms during a case (pinned
pages are resident, so they count) and VmHWM, reset before the case where the
kernel allows, backs the samples up; the figure is the peak over the RSS just
before the case, taken after trimming the heap and emptying torch's caches.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

# -- host memory ------------------------------------------------------------------------


def _status_bytes(field: str) -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def quiesce(device: torch.device) -> None:
    """Free what earlier cases left: Python garbage, cached GPU blocks, torch's cached
    pinned host blocks (else a later case reuses them unseen by RSS), the heap's tail."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class HostPeak:
    """`with HostPeak(device) as m:` ... `m.growth`: peak RSS bytes over the RSS at entry."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.growth = math.nan

    def __enter__(self) -> HostPeak:
        quiesce(self.device)
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.base = self.peak = self._rss()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the RSS now
            self._hwm = True
        except OSError:
            self._hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        return int(os.pread(self._fd, 256, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        if self._hwm:
            self.peak = max(self.peak, _status_bytes("VmHWM") or 0)
        os.close(self._fd)
        self.growth = float(self.peak - self.base)


# -- the training step ------------------------------------------------------------------


class Step:
    """A stand-in training step on the default stream: `k` matmuls of n x n (bf16 8192
    on CUDA, fp32 256 on CPU), `k` set so a step takes about `ms`; each step is waited
    for, so steps track the GPU's progress. Timed with CUDA events (perf_counter on CPU)."""

    def __init__(self, device: torch.device, ms: float) -> None:
        self.cuda = device.type == "cuda"
        self.n, dtype = (8192, torch.bfloat16) if self.cuda else (256, torch.float32)
        self.a = torch.randn(self.n, self.n, dtype=dtype, device=device)
        self.b = torch.randn(self.n, self.n, dtype=dtype, device=device)
        self.c = torch.empty_like(self.a)
        if self.cuda:
            self.events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        self.k = 1
        for _ in range(3):  # warm: cuBLAS handles, clocks
            self.run()
        while self.run() < ms / 4e3 and self.k < 1 << 14:  # steps long enough to time
            self.k *= 2
        self.k = max(1, round(self.k * ms / 1e3 / min(self.run() for _ in range(3))))

    def run(self) -> float:
        """One step's seconds."""
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.k):
                torch.mm(self.a, self.b, out=self.c)
            return time.perf_counter() - start
        first, last = self.events
        first.record()
        for _ in range(self.k):
            torch.mm(self.a, self.b, out=self.c)
        last.record()
        last.synchronize()
        return first.elapsed_time(last) / 1e3

    def baseline(self, count: int = 10) -> list[float]:
        return [self.run() for _ in range(count)]

    def while_pending(self, staged: Future | None, cap_s: float = 120.0) -> list[float]:
        """Steps run until `staged` is done (each started before it was)."""
        times: list[float] = []
        start = time.perf_counter()
        while staged is not None and not staged.done() and time.perf_counter() - start < cap_s:
            times.append(self.run())
        return times

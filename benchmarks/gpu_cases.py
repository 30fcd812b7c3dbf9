"""The cases of `shardwise bench gpu` (benchmarks/bench_gpu.py), on one rank: the
two states, the raw probes, and one function per kind of case (sync save, async
save, load), each measured with benchmarks/gpu_measure.py.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from gpu_measure import HostPeak, Step

from shardwise.cli.sizes import format_size

MiB = 2**20
_CHUNK = 64 * MiB  # bytes per write/read system call of the probes
State = dict[str, torch.Tensor]


# -- states -----------------------------------------------------------------------------


def _layer_bytes(h: int) -> int:
    return 2 * (4 * h * h + 3 * h * (7 * h // 2) + 2 * h)  # bf16: 4 h x h, 3 h x 3.5h, 2 norms


def llm_state(nbytes: int, device: torch.device) -> tuple[State, str]:
    """bf16 decoder layers: wq, wk, wv, wo (h x h), gate, up, down (h x 3.5h), two norms;
    h = 4096 and as many layers as `nbytes` holds (18 for 8 GiB), or below that 4 layers
    of a narrower h. Returns the state and a line describing it."""
    h, layers = 4096, round(nbytes / _layer_bytes(4096))
    if layers < 1:
        layers = 4
        h = max(64, round(math.sqrt(nbytes / layers / 29) / 64) * 64)
    ff, state = 7 * h // 2, {}
    torch.manual_seed(0)
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape in (
            *((f"attn.w{x}", (h, h)) for x in "qkvo"),
            ("mlp.gate", (ff, h)),
            ("mlp.up", (ff, h)),
            ("mlp.down", (h, ff)),
            ("attn_norm", (h,)),
            ("mlp_norm", (h,)),
        ):
            state[p + name] = torch.randn(shape, dtype=torch.bfloat16, device=device)
    return state, f"{layers} bf16 layers, h {h}, ff {ff}"


def small_state(count: int, device: torch.device) -> tuple[State, str]:
    """`count` fp32 tensors of 64 x 256 (64 KiB) and five of odd shapes and dtypes."""
    torch.manual_seed(1)
    state = {f"p{i}": torch.randn(64, 256, device=device) for i in range(count)}
    state["odd.step"] = torch.tensor(7, dtype=torch.int64, device=device)
    state["odd.bf16"] = torch.randn(3, 5, 7, dtype=torch.bfloat16, device=device)
    state["odd.fp16"] = torch.randn(17, dtype=torch.float16, device=device)
    state["odd.u8"] = torch.randint(0, 256, (1025,), dtype=torch.uint8, device=device)
    state["odd.long1d"] = torch.randn(100_003, device=device)
    return state, f"{count:,} fp32 64x256 tensors + 5 odd shapes"


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- raw probes -------------------------------------------------------------------------


def _drop_cache(path: Path) -> None:
    """Evict a file's (or a folder's files') pages, so reads come from the device
    (no effect on tmpfs: there the pages are the files)."""
    for p in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _check_cuda(code: Any) -> None:
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister/Unregister failed with CUDA error {int(code)}")


def _best(fn: Callable[[], None], repeat: int, sync: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def probes(state: State, folder: Path, pinned: bool, threads: int) -> dict[str, float]:
    """Seconds of the raw steps of a save and a load of `state`, each alone: copy to
    one (pinned) host buffer tensor by tensor (best of 2), write it with fsync as
    `threads` files by `threads` threads, read them back (page cache dropped),
    copy host to device tensor by tensor (best of 2)."""
    tensors = list(state.values())
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += (t.numel() * t.element_size() + 63) // 64 * 64
    host = torch.empty(total, dtype=torch.uint8)
    if pinned:  # registered in place: torch's pinned allocator would round up to 2^k bytes
        _check_cuda(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), total, 0))
    device = tensors[0].device
    back = torch.empty(total, dtype=torch.uint8, device=device)

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        return [
            buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors)
        ]

    host_views, back_views = views(host), views(back)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    out = {"bytes": float(state_bytes(state))}

    def copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=pinned)

        return run

    out["d2h"] = _best(copy(host_views, tensors), 2, sync)
    mem = host.numpy().data  # a memoryview of its bytes
    step = (total // threads + _CHUNK - 1) // _CHUNK * _CHUNK
    pieces = [(folder / f"probe-{i}", i * step) for i in range(threads) if i * step < total]

    def write(path: Path, start: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in range(start, min(start + step, total), _CHUNK):
                done, end = a, min(a + _CHUNK, start + step, total)
                while done < end:
                    done += os.pwrite(fd, mem[done:end], done - start)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(path: Path, start: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for a in range(start, min(start + step, total), _CHUNK):
                done, end = a, min(a + _CHUNK, start + step, total)
                while done < end:
                    done += os.preadv(fd, [mem[done:end]], done - start)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda p: write(*p), pieces))
        out["write"] = time.perf_counter() - start
        for path, _ in pieces:
            _drop_cache(path)
        start = time.perf_counter()
        list(pool.map(lambda p: read(*p), pieces))
        out["read"] = time.perf_counter() - start
    for path, _ in pieces:
        path.unlink()
    out["h2d"] = _best(copy(back_views, host_views), 2, sync)
    out["read ok"] = float(all(torch.equal(b, t) for b, t in zip(back_views, tensors)))
    del host_views, back_views, back
    if pinned:
        _check_cuda(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))
    return out


# -- cases ------------------------------------------------------------------------------


def clean(path: Path) -> None:
    """Remove a checkpoint folder and any staging siblings (`.NAME.*`)."""
    shutil.rmtree(path, ignore_errors=True)
    for p in path.parent.glob(f".{path.name}.*"):
        shutil.rmtree(p, ignore_errors=True)


def check_room(folder: Path, nbytes: int, kind: str) -> None:
    """Room for one checkpoint at a time (+20%) in `folder`, and for stock DefaultStager's
    shared-memory copy of the state in /dev/shm (the same space when `folder` is there)."""
    shm = Path("/dev/shm")
    same = shm.is_dir() and os.stat(shm).st_dev == os.stat(folder).st_dev
    need = nbytes * (2.2 if same else 1.2)
    if shutil.disk_usage(folder).free < need:
        raise SystemExit(
            f"{folder}: {format_size(shutil.disk_usage(folder).free)} free, the {kind} state "
            f"needs {format_size(need)} (a checkpoint{' and stock staging' if same else ''}); pass --dir"
        )
    if shm.is_dir() and not same and shutil.disk_usage(shm).free < nbytes * 1.1:
        print(
            f"warning: /dev/shm has under {format_size(nbytes * 1.1)} free: stock DefaultStager's shared-memory staging may fail"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def sync_save(save: Callable[[Path], Any], path: Path, device: torch.device) -> dict:
    """A save that returns when committed: blocking = total."""
    with HostPeak(device) as mem:
        start = time.perf_counter()
        save(path)
        seconds = time.perf_counter() - start
    return {"blocking_s": seconds, "staged_s": seconds, "total_s": seconds, "rss": mem.growth}


def _stamp(future: Future | None, start: float) -> list[float]:
    box: list[float] = []
    if future is not None:
        future.add_done_callback(lambda _: box.append(time.perf_counter() - start))
    return box


def _async_call(
    start_save: Callable[[Path], tuple[Future | None, Future]], path: Path, step: Step | None
) -> tuple[float, float, float, list[float]]:
    """(blocking, staged, total seconds, step times while staging) of one call."""
    start = time.perf_counter()
    staged, done = start_save(path)
    blocking = time.perf_counter() - start
    staged_at, done_at = _stamp(staged, start), _stamp(done, start)
    steps = step.while_pending(staged) if step is not None else []
    done.result()
    now = time.perf_counter() - start  # a done callback may still be on its way
    total = done_at[0] if done_at else now
    staged_s = staged_at[0] if staged_at else (now if staged is not None else blocking)
    return blocking, min(staged_s, total), total, steps  # staged: never after the commit


def async_save(
    start_save: Callable[[Path], tuple[Future | None, Future]],
    path: Path,
    step: Step,
    device: torch.device,
) -> dict:
    """The 2nd call of an async save (the 1st allocates staging buffers, as a training
    loop's first checkpoint does), training steps running until it is staged; host
    memory over both calls; the step-time ratio against steps run just before."""
    with HostPeak(device) as mem:
        first = _async_call(start_save, path, None)[0]
        clean(path)
        base = step.baseline()
        blocking, staged, total, steps = _async_call(start_save, path, step)
        clean(path)
    during, before = (sum(steps) / len(steps) if steps else None), sum(base) / len(base)
    return {
        "blocking_s": blocking,
        "staged_s": staged,
        "total_s": total,
        "rss": mem.growth,
        "first_blocking_s": first,
        "step_ratio": None if during is None else during / before,
        "steps_while_staging": len(steps),
        "step_s": during,
        "step_baseline_s": before,
        "step_times_s": steps,
        "step_baseline_times_s": base,
    }


def load(
    load_into: Callable[[State, Path], Any], path: Path, state: State, device: torch.device
) -> dict:
    """A load into zeroed targets on the device (page cache dropped first), checked
    bit-exact against `state` with torch.equal."""
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    _drop_cache(path)
    with HostPeak(device) as mem:
        start = time.perf_counter()
        load_into(targets, path)
        _sync(device)
        seconds = time.perf_counter() - start
    exact = all(torch.equal(targets[k], v) for k, v in state.items())
    del targets
    return {
        "blocking_s": seconds,
        "staged_s": seconds,
        "total_s": seconds,
        "rss": mem.growth,
        "exact": exact,
    }

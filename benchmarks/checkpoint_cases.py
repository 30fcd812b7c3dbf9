"""The rank functions of `shardwise bench checkpoint` (each runs on every rank
under `run_ranks`) and what they measure with.

Every timed call also measures the peak RSS growth of its process: before the
call the heap is trimmed (`malloc_trim`) and the kernel's peak-RSS mark reset
(`/proc/self/clear_refs`), after it the peak (`VmHWM`) is read; the growth is
that peak minus the RSS just before. Reported: the largest growth of any rank
in any run (the first run included: a cache kept across calls shows there).
Bytes read where an API has no counter (stock `dcp.load`, `swc.read_tensor`)
are `/proc/self/io` `rchar` deltas: bytes passed to read-like system calls
(file reads, and socket reads made with read()), not pages of an mmap.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROW_BYTES = 512 * 1024  # rows of the large tensors: column bands of 4 ranks are 128 KiB each
SMALL_SHAPE = (8, 128)  # 4 KiB of float32 per tensor


# -- measuring ---------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


_LIBC: Any = None


def _quiesce() -> int | None:
    """Trim the heap, reset the peak-RSS mark; return the RSS now (None: no peak reset here)."""
    global _LIBC
    gc.collect()
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _growth(rss_before: int | None) -> float:
    return math.nan if rss_before is None else float(_status_bytes("VmHWM") - rss_before)


def rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def max_over_ranks(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(
    fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None
) -> tuple[float, float]:
    """(best of `repeat` runs of the slowest rank's seconds, largest peak-RSS growth
    in bytes of any rank in any run). Collective; no warm-up: `before()` runs untimed
    ahead of each run (clearing a folder, spoiling targets)."""
    best, growth = math.inf, 0.0
    for _ in range(repeat):
        if before is not None:
            before()
        rss = _quiesce()
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds, grew = max_over_ranks(time.perf_counter() - start, _growth(rss))
        best, growth = min(best, seconds), max(growth, grew)
    return best, growth


def record(out: dict, name: str, fn: Callable[[], Any], repeat: int, before=None) -> None:
    out[name], out[f"{name} rss"] = timed(fn, repeat, before)


def clean(path: Path) -> None:
    """Remove a checkpoint folder (and shardwise's staging siblings). Collective."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        for p in path.parent.glob(f".{path.name}.*"):
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def _local_bytes(state: dict) -> float:
    return float(sum(_shards_nbytes(v) for v in state.values()))


def _shards_nbytes(v: Any) -> int:
    return sum(s.nbytes for s in v.local_shards()) if hasattr(v, "local_shards") else v.nbytes


def _local(v: Any) -> list[torch.Tensor]:
    return v.local_shards() if hasattr(v, "local_shards") else [v]


def _spoil(state: dict) -> None:
    for v in state.values():
        for s in _local(v):
            s.fill_(-1.0)


def _check(what: str, ok: bool) -> None:
    if not ok:
        raise AssertionError(f"{what} loaded wrong values")


# -- states --------------------------------------------------------------------------------


def _row_values(row0: int, rows: int, i: int) -> torch.Tensor:
    """A column of the values of rows `row0...` of tensor `i`: exact in float32."""
    return ((torch.arange(row0, row0 + rows) * 31 + i) % 65521).to(torch.float32).unsqueeze(1)


def _row_matrix_shape(nbytes: int, n_tensors: int, world: int) -> tuple[int, int]:
    per_tensor = max(4, nbytes // n_tensors)
    rows = max(world, per_tensor // ROW_BYTES)
    return rows, max(1, per_tensor // 4 // rows)


def row_state(rank: int, world: int, nbytes: int, n_tensors: int, dim: int = 0, fill=True) -> dict:
    """`n_tensors` float32 matrices of `nbytes` in all, rows of about ROW_BYTES,
    split along `dim` (torch.chunk's way); values from `_row_values`, or -1."""
    import shardwise as sw

    shape = _row_matrix_shape(nbytes, n_tensors, world)
    layout = sw.Layout.chunked(shape, dim, world)
    state = {}
    for i in range(n_tensors):
        shards = []
        for b in layout.blocks_of(rank):
            if fill:
                shards.append(_row_values(b.offsets[0], b.sizes[0], i).expand(b.sizes).clone())
            else:
                shards.append(torch.full(b.sizes, -1.0))
        state[f"layer{i}.weight"] = sw.ShardedTensor.from_layout(layout, shards)
    return state


def row_state_ok(state: dict) -> bool:
    for i, v in enumerate(state.values()):
        for b, s in zip(v.local_blocks, v.local_shards()):
            if not torch.equal(s, _row_values(b.offsets[0], b.sizes[0], i).expand(b.sizes)):
                return False
    return True


def small_state(rank: int, world: int, count: int, kind: str, fill=True) -> dict:
    """`count` tensors of 4 KiB: plain tensors (the same on every rank) or row-wise ShardedTensors."""
    import shardwise as sw

    def value(i: int) -> float:
        return float(i % 65521) if fill else -1.0

    if kind == "replicated":
        return {f"t{i}": torch.full(SMALL_SHAPE, value(i)) for i in range(count)}
    layout = sw.Layout.chunked(SMALL_SHAPE, 0, world)
    blocks = layout.blocks_of(rank)
    return {
        f"t{i}": sw.ShardedTensor.from_layout(
            layout, [torch.full(b.sizes, value(i)) for b in blocks]
        )
        for i in range(count)
    }


def same_values(a: dict, b: dict) -> bool:
    return all(
        torch.equal(x, y) for k in a for x, y in zip(_local(a[k]), _local(b[k]), strict=True)
    )


# -- cases ----------------------------------------------------------------------------------


def small_rank(
    rank: int, world: int, folder: str, count: int, kind: str, engines: tuple, repeat: int
) -> dict:
    """Save and load `count` 4 KiB tensors with each of `engines` (stock, shardwise, peer)."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    base = Path(folder)
    state = small_state(rank, world, count, kind)
    targets = small_state(rank, world, count, kind, fill=False)
    out: dict[str, Any] = {"state bytes": max_over_ranks(_local_bytes(state))[0], "peer": None}
    calls: dict[str, tuple[Callable, Callable]] = {
        "stock": (
            lambda p: dcp.save(state, checkpoint_id=p),
            lambda p: dcp.load(targets, checkpoint_id=p),
        ),
        "shardwise": (lambda p: swc.save(state, p), lambda p: swc.load(targets, p)),
    }
    if "peer" in engines:
        import bytecheckpoint_peer as peer

        out["peer"] = peer.setup()
        if out["peer"] is None:
            calls["peer"] = (lambda p: peer.save(state, p), lambda p: peer.load(targets, p))
    for engine in engines:
        if engine not in calls:
            continue
        save, load = calls[engine]
        path = base / f"small_{kind}_{engine}"
        record(out, f"{engine} save", lambda: save(path), repeat, lambda: clean(path))
        record(out, f"{engine} load", lambda: load(path), repeat, lambda: _spoil(targets))
        _check(f"{engine}, {count} {kind} tensors:", same_values(state, targets))
        clean(path)
    return out


def _raw_probe(out: dict, state: dict, probe: Path, repeat: int) -> None:
    """One file per rank, written with fsync, then read back: the ceiling for any checkpoint."""
    blob = torch.cat([s.reshape(-1) for v in state.values() for s in v.local_shards()])
    back = torch.empty_like(blob)

    def raw_write() -> None:
        with open(probe, "wb") as f:
            f.write(memoryview(blob.numpy()))
            f.flush()
            os.fsync(f.fileno())

    def raw_read() -> None:
        with open(probe, "rb") as f:
            f.readinto(memoryview(back.numpy()))

    out["raw write"] = timed(raw_write, repeat)[0]
    out["raw read"] = timed(raw_read, repeat)[0]
    probe.unlink()


def _large_loads(out: dict, targets: dict, stock: Path, ours: Path, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    for name, load in (
        ("stock", lambda: dcp.load(targets, checkpoint_id=stock)),
        ("shardwise", lambda: swc.load(targets, ours)),
    ):
        record(out, f"{name} load", load, repeat, lambda: _spoil(targets))
        _check(f"{name}, same layout:", row_state_ok(targets))


def _async_saves(out: dict, state: dict, stock: Path, ours: Path, repeat: int) -> None:
    """The blocking part of the 2nd and later calls (best); peak RSS growth over
    whole saves, the first included (it allocates the staging buffers)."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    for name, path, start_save in (
        ("stock async", stock, lambda: dcp.async_save(state, checkpoint_id=stock)),
        ("shardwise async", ours, lambda: swc.async_save(state, ours)),
    ):
        blocking, growth = math.inf, 0.0
        for call in range(repeat + 1):
            clean(path)
            rss = _quiesce()
            dist.barrier()
            start = time.perf_counter()
            future = start_save()
            seconds = time.perf_counter() - start
            future.result()
            seconds, grew = max_over_ranks(seconds, _growth(rss))
            growth = max(growth, grew)
            if call > 0:
                blocking = min(blocking, seconds)
        out[f"{name} blocking"], out[f"{name} rss"] = blocking, growth


def large_rank(rank: int, world: int, folder: str, nbytes: int, repeat: int) -> dict:
    """Large tensors, same layout: raw probe, sync save, load, async save."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    base = Path(folder)
    state = row_state(rank, world, nbytes, n_tensors=8)
    out: dict[str, Any] = {"state bytes": max_over_ranks(_local_bytes(state))[0]}
    _raw_probe(out, state, base / f"probe_{rank}.bin", repeat)

    stock, ours = base / "stock", base / "ours"
    record(
        out,
        "stock save",
        lambda: dcp.save(state, checkpoint_id=stock),
        repeat,
        lambda: clean(stock),
    )
    for threads in (2, 4):
        out[f"stock save {threads} threads"], _ = timed(
            lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(stock, thread_count=threads)
            ),
            repeat,
            lambda: clean(stock),
        )
    record(out, "shardwise save", lambda: swc.save(state, ours), repeat, lambda: clean(ours))
    _large_loads(out, row_state(rank, world, nbytes, n_tensors=8, fill=False), stock, ours, repeat)
    _async_saves(out, state, stock, ours, repeat)
    clean(stock)
    clean(ours)
    return out


def _reshard_saves(out: dict, state: dict, stock: Path, ours: Path) -> None:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    out["state bytes"] = max_over_ranks(_local_bytes(state))[0]
    record(out, "stock save", lambda: dcp.save(state, checkpoint_id=stock), 1)
    record(out, "shardwise save", lambda: swc.save(state, ours), 1)


def reshard_rank(rank: int, world: int, folder: str, nbytes: int, repeat: int) -> dict:
    """Saved row-wise, loaded column-wise on the same ranks; bytes read per rank."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc
    from shardwise import Block

    base = Path(folder)
    out: dict[str, Any] = {}
    stock, ours = base / "rs_stock", base / "rs_ours"
    clean(stock)
    clean(ours)
    _reshard_saves(out, row_state(rank, world, nbytes, n_tensors=4, dim=0), stock, ours)
    targets = row_state(rank, world, nbytes, n_tensors=4, dim=1, fill=False)
    needed = _local_bytes(targets)
    out["rows"], out["cols"] = next(iter(targets.values())).shape

    def read_ratio(load: Callable[[], Any]) -> tuple[float, float]:
        """(bytes read / needed by the load's own counter, by rchar): max over ranks."""
        _spoil(targets)
        before = rchar()
        reader = load()
        by_rchar = (rchar() - before) / needed
        own = reader.bytes_read / needed if hasattr(reader, "bytes_read") else math.nan
        return max_over_ranks(own, by_rchar)

    for name, load in (
        ("stock", lambda: dcp.load(targets, checkpoint_id=stock)),
        ("shardwise", lambda: swc.load(targets, ours)),
        ("shardwise verify=False", lambda: swc.load(targets, ours, verify=False)),
    ):
        record(out, f"{name} load", load, repeat, lambda: _spoil(targets))
        _check(f"{name}, row-wise -> column-wise:", row_state_ok(targets))
        out[f"{name} read/needed"], out[f"{name} read/needed rchar"] = read_ratio(load)
        _check(f"{name}, row-wise -> column-wise:", row_state_ok(targets))

    # offline: one column band of one tensor, the band rank 1 holds
    if rank == 0:
        rows, cols = out["rows"], out["cols"]
        c0, width = cols // world, cols // world
        region = Block((0, c0), (rows, width))
        before, start = rchar(), time.perf_counter()
        band = swc.read_tensor(ours, "layer0.weight", region=region)
        out["read_tensor seconds"] = time.perf_counter() - start
        out["read_tensor read/needed rchar"] = (rchar() - before) / band.nbytes
        out["read_tensor bytes"] = band.nbytes
        _check(
            "swc.read_tensor, a column band:",
            torch.equal(band, _row_values(0, rows, 0).expand(rows, width)),
        )
    dist.barrier()
    clean(stock)
    clean(ours)
    return out

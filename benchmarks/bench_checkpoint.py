"""shardwise checkpoints against stock DCP, same state, same target, one run.

Run: `shardwise bench checkpoint [--size 2GiB] [--dirs /dev/shm /tmp]`.
For each target folder, on 2 local ranks (gloo), with the same state dict of
ShardedTensors (stock DCP saves them through their DCP hooks):

* raw write/read probe: each rank writes (fsync) and reads back its bytes as
  one file, the ceiling for any checkpoint;
* sync save: stock `dcp.save` (default FileSystemWriter, then its best
  thread_count of 1, 2, 4) vs `swc.save`;
* async save, blocking part of the 2nd call: stock `dcp.async_save` vs `swc.async_save`;
* load in the same layout: stock `dcp.load` vs `swc.load`;
* load row-wise -> column-wise on 4 ranks, with bytes read per rank;
* 10,000 tensors of 4 KiB: save and load;
* peak RSS growth per rank during a sync save.

Times are the slowest rank's, best of `--repeat`. Ratios > 1 mean shardwise is faster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.cli.sizes import parse_size
from shardwise.testing import seconds_across_ranks


def _best(fn, repeat: int, before=None) -> float:
    """Best of `repeat` (no warm-up: each save writes a fresh checkpoint)."""
    return seconds_across_ranks(fn, repeat, before=before, warmup=False, pick=min)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark for this process; return the current RSS in bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def _state(rank: int, world: int, nbytes: int, n_tensors: int = 8) -> dict:
    import shardwise as sw

    rows = 1024
    cols = max(1, nbytes // 4 // n_tensors // rows)
    state = {}
    for i in range(n_tensors):
        layout = sw.Layout.chunked((rows, cols), 0, world)
        state[f"layer{i}.weight"] = sw.ShardedTensor.from_layout(
            layout, [torch.full(b.sizes, float(i + rank)) for b in layout.blocks_of(rank)]
        )
    return state


def _clean(path: Path) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        for p in path.parent.glob(f".{path.name}.*"):
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def _main_rank(rank: int, world: int, folder: str, nbytes: int, repeat: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    torch.set_num_threads(1)
    base = Path(folder)
    state = _state(rank, world, nbytes)
    local_bytes = sum(s.nbytes for v in state.values() for s in v.local_shards())
    out: dict[str, float] = {}

    # raw probe: one file per rank, written with fsync, then read back
    blob = torch.cat([s.reshape(-1) for v in state.values() for s in v.local_shards()])
    probe = base / f"probe_{rank}.bin"

    def raw_write() -> None:
        with open(probe, "wb") as f:
            f.write(memoryview(blob.numpy()))
            f.flush()
            os.fsync(f.fileno())

    def raw_read() -> None:
        with open(probe, "rb") as f:
            f.readinto(memoryview(torch.empty_like(blob).numpy()))

    out["raw write"] = _best(raw_write, repeat)
    out["raw read"] = _best(raw_read, repeat)
    probe.unlink()

    stock, ours = base / "stock", base / "ours"
    out["stock save"] = _best(
        lambda: dcp.save(state, checkpoint_id=stock), repeat, lambda: _clean(stock)
    )
    best_threads = {}
    for threads in (2, 4):
        best_threads[threads] = _best(
            lambda: dcp.save(
                state, storage_writer=dcp.FileSystemWriter(stock, thread_count=threads)
            ),
            repeat,
            lambda: _clean(stock),
        )
    out["stock save best threads"] = min(out["stock save"], *best_threads.values())
    out["shardwise save"] = _best(lambda: swc.save(state, ours), repeat, lambda: _clean(ours))

    # peak RSS during a sync save, over the RSS just before it (Linux: reset the peak first)
    _clean(ours)
    rss_before = _reset_peak_rss()
    swc.save(state, ours)
    out["rss growth MiB"] = (_status_kib("VmHWM") * 1024 - rss_before) / 2**20

    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    out["stock load"] = _best(lambda: dcp.load(targets, checkpoint_id=stock), repeat)
    out["shardwise load"] = _best(lambda: swc.load(targets, ours), repeat)

    # async: the blocking part of the second call
    def blocking_part(path: Path, start_save) -> float:
        _clean(path)
        dist.barrier()
        t = time.perf_counter()
        future = start_save()
        blocking = time.perf_counter() - t
        future.result()
        return blocking

    for name, path, start_save in (
        ("stock async blocking", stock, lambda: dcp.async_save(state, checkpoint_id=stock)),
        ("shardwise async blocking", ours, lambda: swc.async_save(state, ours)),
    ):
        blocking_part(path, start_save)  # the first call warms caches and staging buffers
        samples = [blocking_part(path, start_save) for _ in range(repeat)]
        worst = torch.tensor([min(samples)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = float(worst)
    out["local GiB"] = local_bytes / 2**30
    _clean(stock)
    _clean(ours)
    return out


def _reshard_rank(rank: int, world: int, folder: str, nbytes: int, repeat: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import shardwise as sw
    import shardwise.checkpoint as swc

    torch.set_num_threads(1)
    base = Path(folder)
    state = _state(rank, world, nbytes, n_tensors=4)  # row-wise on 4 ranks
    stock, ours = base / "rs_stock", base / "rs_ours"
    _clean(stock)
    _clean(ours)
    dcp.save(state, checkpoint_id=stock)
    swc.save(state, ours)
    targets = {
        k: sw.ShardedTensor.zeros(sw.Layout.chunked(v.shape, 1, world)) for k, v in state.items()
    }
    needed = sum(s.nbytes for v in targets.values() for s in v.local_shards())
    out = {
        "stock reshard load": _best(lambda: dcp.load(targets, checkpoint_id=stock), repeat),
        "shardwise reshard load": _best(lambda: swc.load(targets, ours), repeat),
    }
    reader = swc.load(targets, ours, verify=False)
    out["shardwise reshard load (verify=False)"] = _best(
        lambda: swc.load(targets, ours, verify=False), repeat
    )
    read = torch.tensor([reader.bytes_read / needed], dtype=torch.float64)
    dist.all_reduce(read, op=dist.ReduceOp.MAX)
    out["bytes read / needed (verify=False)"] = float(read)
    verified = swc.load(targets, ours)
    ratio = torch.tensor([verified.bytes_read / needed], dtype=torch.float64)
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    out["bytes read / needed (verify=True)"] = float(ratio)
    _clean(stock)
    _clean(ours)
    return out


def _small_rank(rank: int, world: int, folder: str, count: int, repeat: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import shardwise as sw
    import shardwise.checkpoint as swc

    torch.set_num_threads(1)
    base = Path(folder)
    layout = sw.Layout.chunked((8, 128), 0, world)  # 4 KiB per tensor
    state = {
        f"t{i}": sw.ShardedTensor.from_layout(
            layout, [torch.full(b.sizes, float(i)) for b in layout.blocks_of(rank)]
        )
        for i in range(count)
    }
    stock, ours = base / "small_stock", base / "small_ours"
    out = {
        "stock save small": _best(
            lambda: dcp.save(state, checkpoint_id=stock), repeat, lambda: _clean(stock)
        ),
        "shardwise save small": _best(lambda: swc.save(state, ours), repeat, lambda: _clean(ours)),
    }
    out["stock load small"] = _best(lambda: dcp.load(state, checkpoint_id=stock), repeat)
    out["shardwise load small"] = _best(lambda: swc.load(state, ours), repeat)
    _clean(stock)
    _clean(ours)
    return out


def _ratio(stock: float, ours: float) -> str:
    return f"{stock / ours:5.2f}x" if ours > 0 else "  n/a"


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="2GiB", help="global state size (default 2GiB)")
    parser.add_argument("--dirs", nargs="+", default=["/dev/shm", tempfile.gettempdir()])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--small", type=int, default=10_000, help="count of 4 KiB tensors")
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    for target in args.dirs:
        folder = tempfile.mkdtemp(prefix="shardwise-bench-", dir=target)
        try:
            r = run_ranks(_main_rank, 2, folder, nbytes, args.repeat, timeout=3600)[0]
            rs = run_ranks(_reshard_rank, 4, folder, nbytes, args.repeat, timeout=3600)[0]
            sm = run_ranks(_small_rank, 2, folder, args.small, args.repeat, timeout=3600)[0]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        gib = r["local GiB"]
        print(
            f"\n== {target}: {args.size} state, 2 ranks ({gib:.2f} GiB per rank), best of {args.repeat}"
        )
        print(f"{'':44}{'seconds':>9}{'GiB/s/rank':>12}{'shardwise gain':>16}")
        rows = [
            ("raw write probe (fsync)", r["raw write"], None),
            ("stock dcp.save", r["stock save"], None),
            ("stock dcp.save, best thread_count", r["stock save best threads"], None),
            ("shardwise save", r["shardwise save"], r["stock save"] / r["shardwise save"]),
            ("raw read probe", r["raw read"], None),
            ("stock dcp.load", r["stock load"], None),
            ("shardwise load", r["shardwise load"], r["stock load"] / r["shardwise load"]),
        ]
        for name, seconds, gain in rows:
            print(
                f"  {name:42}{seconds:9.3f}{gib / seconds:12.2f}{(f'{gain:.2f}x' if gain else ''):>16}"
            )
        print(
            f"  {'shardwise save vs raw write probe':42}{'':21}{r['raw write'] / r['shardwise save']:15.2f}x"
        )
        print(
            f"  {'shardwise save vs stock best threads':42}{'':21}{r['stock save best threads'] / r['shardwise save']:15.2f}x"
        )
        print(
            f"  {'async blocking: stock / shardwise':42}{r['stock async blocking']:9.3f} / {r['shardwise async blocking']:.3f}"
            f"{_ratio(r['stock async blocking'], r['shardwise async blocking']):>10}"
        )
        print(f"  {'peak RSS growth during sync save':42}{r['rss growth MiB']:9.0f} MiB per rank")
        print("  reshard load row-wise -> column-wise, 4 ranks:")
        print(
            f"    stock {rs['stock reshard load']:.3f}s, shardwise {rs['shardwise reshard load']:.3f}s "
            f"({_ratio(rs['stock reshard load'], rs['shardwise reshard load'])}), verify=False "
            f"{rs['shardwise reshard load (verify=False)']:.3f}s "
            f"({_ratio(rs['stock reshard load'], rs['shardwise reshard load (verify=False)'])})"
        )
        print(
            f"    bytes read / needed: {rs['bytes read / needed (verify=False)']:.2f} (verify=False), "
            f"{rs['bytes read / needed (verify=True)']:.2f} (verify=True)"
        )
        print(
            f"  {args.small} tensors of 4 KiB: save stock {sm['stock save small']:.2f}s / shardwise "
            f"{sm['shardwise save small']:.2f}s ({_ratio(sm['stock save small'], sm['shardwise save small'])}); "
            f"load stock {sm['stock load small']:.2f}s / shardwise {sm['shardwise load small']:.2f}s "
            f"({_ratio(sm['stock load small'], sm['shardwise load small'])})"
        )


if __name__ == "__main__":
    main()

"""Saving and loading training state that lives on the GPU: stock DCP vs shardwise.

Run: `shardwise bench gpu [--size 8GiB] [--small 10000] [--dir /dev/shm] [--json out.json]`
(or `python benchmarks/bench_gpu.py`). One process, one rank (a gloo world of 1).
Without CUDA (or with `--device cpu`) it is a smoke run of the same cases:
64 MiB and 200 small tensors unless told, pageable memory; its figures say
nothing about GPUs.

For each state, "large" (`--size` of bf16 LLM layers, 18 layers for 8 GiB) and
"small" (`--small` fp32 tensors of 64 KiB and five odd ones), built on the device:

* raw probes, each alone: copy to a pinned host buffer, write + fsync with
  `--probe-threads` threads, read back, copy to the device. Save limit =
  min(copy, write); load limit = min(read, copy to device): the physical floor.
* stock `dcp.save` (FileSystemWriter, defaults); stock `dcp.async_save` with
  `DefaultStager(StagingOptions(True, True, True, True))` (the zero-overhead
  checkpointing of torchtitan); `swc.save`; `swc.async_save(staging="background")`
  with the default staging budget and with `staging_bytes` >= the state;
  stock `dcp.load` and `swc.load` into zeroed device tensors, checked bit-exact.

Async saves: the 2nd call is timed (the 1st allocates the staging buffers);
blocking = until the call returns, staged = until the state may change again,
total = until committed; a stand-in training step (matmuls on the default
stream, about `--step-ms`) runs while staging, its mean time over the mean of
steps just before is the step ratio. Host memory: peak RSS growth during the
case (both calls for async). Every checkpoint is removed after its case; the
run's folder is `--dir`/shardwise-bench-gpu-PID. Targets are those of issue 23.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import gpu_cases as cases  # noqa: E402
import gpu_measure as measure  # noqa: E402
import gpu_report as report  # noqa: E402
from gpu_report import (  # noqa: E402
    CASES,
    OUR_ASYNC,
    OUR_ASYNC_BIG,
    OUR_LOAD,
    OUR_SAVE,
    PROBES,
    STOCK_ASYNC,
    STOCK_LOAD,
    STOCK_SAVE,
    MiB,
)

from shardwise.cli.sizes import format_size, parse_size  # noqa: E402


def _options(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--size", help="bytes of the large state (default 8GiB; CPU 64MiB)")
    p.add_argument("--small", type=int, help="count of small tensors (default 10000; CPU 200)")
    p.add_argument("--states", nargs="+", choices=["large", "small"], default=["large", "small"])
    p.add_argument(
        "--dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="parent of the run's folder",
    )
    p.add_argument("--staging-bytes", help="swc staging budget (default: the library's)")
    p.add_argument("--probe-threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--step-ms", type=float, help="stand-in step time (default 30; CPU 10)")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    cpu = args.device == "cpu"
    args.size = parse_size(args.size or ("64MiB" if cpu else "8GiB"))
    args.small = args.small if args.small is not None else (200 if cpu else 10_000)
    args.step_ms = args.step_ms or (10.0 if cpu else 30.0)
    return args


def _budget(args: argparse.Namespace) -> int:
    """The staging budget the default-budget cases run with: `--staging-bytes`, else
    the library's default (SHARDWISE_STAGING_BYTES, else 1 GiB)."""
    given = parse_size(args.staging_bytes) if args.staging_bytes else None
    try:
        from shardwise.checkpoint.io.device import staging_bytes
    except ImportError:  # before the staging pipeline: its documented default
        return given or parse_size(os.environ.get("SHARDWISE_STAGING_BYTES") or "1GiB")
    return staging_bytes(given)


def _api() -> dict[str, bool]:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

        stager = "async_stager" in inspect.signature(dcp.async_save).parameters
    except ImportError:
        stager = False
    return {
        "stock DefaultStager": stager,
        "swc.save staging_bytes": "staging_bytes" in inspect.signature(swc.save).parameters,
        "swc.async_save staging": "staging" in inspect.signature(swc.async_save).parameters,
        "swc.load staging_bytes": "staging_bytes" in inspect.signature(swc.load).parameters,
    }


def _run_cases(
    state: dict, folder: Path, args: argparse.Namespace, api: dict, step: measure.Step, limits: dict
) -> dict:
    """Every case on `state`, printed as it finishes: a case whose API is missing is
    None, one that raised is {"error": ...} (the run goes on: GPU time is scarce)."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    device, pinned = torch.device(args.device), args.device == "cuda"
    nbytes = cases.state_bytes(state)
    budget: dict[str, Any] = {}
    if args.staging_bytes:
        budget["staging_bytes"] = parse_size(args.staging_bytes)
    big: dict[str, Any] = {"staging_bytes": nbytes + nbytes // 16 + 64 * MiB}
    save_kw = budget if api["swc.save staging_bytes"] else {}
    load_kw = budget if api["swc.load staging_bytes"] else {}
    out: dict[str, dict | None] = {}

    def stock_async(path: Path):
        # a fresh stager per call: torch 2.11's DefaultStager cannot be reused
        # (pytorch/pytorch#183413, fixed by #183424), so each call pins anew there
        fresh = (
            DefaultStager(StagingOptions(pinned, True, True, pinned)) if reuse_broken else stager
        )
        resp: Any = dcp.async_save(state, checkpoint_id=str(path), async_stager=fresh)
        return (
            (resp.staging_completion, resp.upload_completion)
            if hasattr(resp, "staging_completion")
            else (None, resp)
        )

    def ours_async(kw: dict):
        def start(path: Path):
            future = swc.async_save(state, path, staging="background", **kw)
            return getattr(future, "staged", None), future

        return start

    stager = None
    if api["stock DefaultStager"]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(pinned, True, True, pinned))
    reuse_broken = torch.__version__.startswith("2.11")
    runs = {
        STOCK_SAVE: lambda p: cases.sync_save(
            lambda q: dcp.save(state, checkpoint_id=str(q)), p, device
        ),
        STOCK_LOAD: lambda p: cases.load(
            lambda t, q: dcp.load(t, checkpoint_id=str(q)), p, state, device
        ),
        STOCK_ASYNC: (lambda p: cases.async_save(stock_async, p, step, device)) if stager else None,
        OUR_SAVE: lambda p: cases.sync_save(lambda q: swc.save(state, q, **save_kw), p, device),
        OUR_LOAD: lambda p: cases.load(lambda t, q: swc.load(t, q, **load_kw), p, state, device),
        OUR_ASYNC: (lambda p: cases.async_save(ours_async(budget), p, step, device))
        if api["swc.async_save staging"]
        else None,
        OUR_ASYNC_BIG: (lambda p: cases.async_save(ours_async(big), p, step, device))
        if api["swc.async_save staging"]
        else None,
    }
    paths = {
        STOCK_SAVE: "stock",
        STOCK_LOAD: "stock",
        STOCK_ASYNC: "stock-async",
        OUR_SAVE: "ours",
        OUR_LOAD: "ours",
    }
    for name in CASES:
        path = folder / paths.get(name, "ours-async")
        run = runs[name]
        try:
            r = out[name] = None if run is None else run(path)
        except Exception as e:  # noqa: BLE001 - reported in its row and the JSON
            r = out[name] = {"error": f"{type(e).__name__}: {e}"}
        if name not in (STOCK_SAVE, OUR_SAVE):  # a sync save's folder is for the load after it
            cases.clean(path)
        if name == STOCK_ASYNC and stager is not None:
            stager.close()
        if r is not None and "error" not in r:
            r["GBps"] = nbytes / r["total_s"] / 1e9
            r["of_limit"] = r["GBps"] / limits["load GBps" if "load" in name else "save GBps"]
        report.print_case(name, r)
        measure.quiesce(device)
    return out


def _measure_state(
    kind: str, args: argparse.Namespace, folder: Path, api: dict, step: measure.Step
) -> dict:
    device = torch.device(args.device)
    build = cases.llm_state if kind == "large" else cases.small_state
    state, what = build(args.size if kind == "large" else args.small, device)
    nbytes = cases.state_bytes(state)
    cases.check_room(folder, nbytes, kind)
    print(f"\n== {kind}: {what}, {nbytes / 2**30:.2f} GiB in {len(state):,} tensors", flush=True)
    p = cases.probes(state, folder, args.device == "cuda", args.probe_threads)
    for key, name in PROBES:
        print(f"  {name:56}{p[key]:9.3f} s{nbytes / p[key] / 1e9:8.2f} GB/s", flush=True)
    limits = {
        "save GBps": nbytes / max(p["d2h"], p["write"]) / 1e9,
        "load GBps": nbytes / max(p["read"], p["h2d"]) / 1e9,
    }
    print(
        f"  save limit min(copy, write) {limits['save GBps']:.2f} GB/s; load limit min(read, copy) {limits['load GBps']:.2f} GB/s"
    )
    print(
        f"  {'case':56}{'blocking':>9}{'staged':>9}{'total s':>9}{'GB/s':>8}{'limit':>7}{'host MiB':>10}{'step':>7}{'1st call':>9}"
    )
    runs = _run_cases(state, folder, args, api, step, limits)
    del state
    measure.quiesce(device)
    return {"description": what, "bytes": nbytes, "probes": p, "limits": limits, "cases": runs}


def main(argv: list[str] | None = None) -> int:
    args = _options(argv)
    device = torch.device(args.device)
    if args.device == "cpu":  # a smoke run: intra-op threads on a busy small box stall for ms
        torch.set_num_threads(1)
    api = _api()
    budget = _budget(args)
    name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else "CPU (smoke run: GPU figures need a GPU)"
    )
    results: dict = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "api": api,
        "args": vars(args),
        "staging_budget_bytes": budget,
        "states": {},
    }
    print(
        f"device {name}; torch {torch.__version__}; CUDA {torch.version.cuda}; {os.cpu_count()} CPUs"
    )
    print(
        f"staging budget {format_size(budget)}; probe threads {args.probe_threads}; available: {api}"
    )
    folder = Path(args.dir or tempfile.gettempdir()) / f"shardwise-bench-gpu-{os.getpid()}"
    folder.mkdir(parents=True)
    from shardwise.testing import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    start = time.perf_counter()
    try:
        step = measure.Step(device, args.step_ms)
        results["step"] = {"matmuls": step.k, "n": step.n, "seconds": sum(step.baseline()) / 10}
        print(
            f"stand-in step: {step.k} matmuls of {step.n}x{step.n}, {results['step']['seconds'] * 1e3:.1f} ms; run folder {folder}"
        )
        for kind in args.states:
            results["states"][kind] = res = _measure_state(kind, args, folder, api, step)
            res["targets"] = report.targets(res, budget)
        report.print_targets(results)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        dist.destroy_process_group()
        results["seconds"] = time.perf_counter() - start
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nran {results['seconds']:.0f} s")
    wrong = [
        n
        for s in results["states"].values()
        for n, r in s["cases"].items()
        if r and r.get("exact") is not True and "load" in n
    ]
    return 1 if wrong or any(not s["probes"]["read ok"] for s in results["states"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

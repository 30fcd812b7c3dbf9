"""shardwise checkpoints against stock DCP and ByteCheckpoint: same state, same target, one run.

Run: `shardwise bench checkpoint [--size 2GiB] [--small 10000] [--repeat 2]
[--dirs /dev/shm /tmp] [--quick]` (or `python benchmarks/bench_checkpoint.py`).
`--quick` is a smoke run: 16 MiB, 200 small tensors, 1 repeat, /dev/shm only.

`--url s3://BUCKET/PREFIX [--storage-option KEY=VALUE ...]` (or `--url local-s3`:
moto's server on 127.0.0.1, started and stopped by the run) measures object
storage instead: benchmarks/remote_cases.py says what (default 256 MiB, 200
small tensors, 2 repeats; `--quick` 16 MiB, 1 repeat).

For each target folder, on local gloo ranks (2 unless said), every engine
gets the same state dict (shardwise ShardedTensors reach stock DCP and
ByteCheckpoint through their DCP hooks):

1. `--small` (10,000) tensors of 4 KiB, replicated (plain tensors, the same on
   both ranks) and sharded (row-wise ShardedTensors): save and load with stock
   `dcp.save`/`dcp.load`, `swc.save`/`swc.load` and ByteCheckpoint 0.0.2
   (optional; without it its column says n/a). It declares torch<=2.5.0, so
   it is installed beside the pinned torch without dependency resolution:

       pip install -c requirements/constraints.txt --no-deps bytecheckpoint==0.0.2
       pip install -c requirements/constraints.txt "mmh3>=4.1.0,<=4.2.0" \\
           "universal-pathlib>=0.2.2,<=1.0.0" "cachetools>=5.4.0,<=10.0.0" \\
           grpcio==1.69.0 protobuf==3.20.3

   benchmarks/bytecheckpoint_peer.py says how it is called (its `ddp`
   framework, default options; it caches its save plan between calls on the
   same state, so its best of 2 is a cached-plan save).
2. The curve: shardwise at --small/10, --small and 10 x --small sharded tensors
   (1,000 / 10,000 / 100,000), seconds and microseconds per tensor; stock at
   the two smaller counts only (at 100,000 it takes minutes).
3. `--size` of matrices with rows of 512 KiB saved row-wise and loaded
   column-wise on 4 ranks: stock vs shardwise with verification on (the
   default) and off, bytes read / needed on the worst rank (shardwise: its
   reader's `bytes_read`; stock: /proc/self/io rchar), and `swc.read_tensor`
   of one column band (rchar: read_tensor has no counter).
4. `--size` of large tensors, same layout: raw write/read probe (one file per
   rank, fsync), sync save (stock default and thread_count 2 and 4), load,
   and the blocking part of the 2nd `async_save`.
5. Peak RSS growth per rank during every save and load above (heap trimmed and
   the peak reset via /proc/self/clear_refs before each call), beside the
   rank's state bytes.

Times are the slowest rank's, best of `--repeat`. Ratios > 1: shardwise is
faster. The final table lists every target with its measured figure and
whether it is met; nothing in it is fixed in advance.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import checkpoint_cases as cases  # noqa: E402
import checkpoint_report as report  # noqa: E402
import remote_cases  # noqa: E402

from shardwise.cli.sizes import parse_size  # noqa: E402
from shardwise.cli.storage_options import add_storage_options, storage_options  # noqa: E402

QUICK = {"size": "16MiB", "small": 200, "repeat": 1}
FULL = {"size": "2GiB", "small": 10_000, "repeat": 2}


def _options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", help="global size of the large state (default 2GiB)")
    parser.add_argument("--dirs", nargs="+", help="target folders (default /dev/shm and $TMPDIR)")
    parser.add_argument("--repeat", type=int, help="runs per measurement, best kept (default 2)")
    parser.add_argument("--small", type=int, help="count of 4 KiB tensors (default 10000)")
    parser.add_argument(
        "--quick", action="store_true", help="16MiB, 200 small tensors, 1 repeat: a smoke run"
    )
    parser.add_argument(
        "--url",
        help=f"benchmark object storage instead: s3://BUCKET/PREFIX, or {remote_cases.LOCAL} "
        "(a local moto server for the run); default size then 256MiB",
    )
    add_storage_options(parser)
    args = parser.parse_args(argv)
    if args.url:
        if args.dirs:
            parser.error("--dirs names local folders; --url benchmarks object storage instead")
        defaults = remote_cases.QUICK if args.quick else remote_cases.FULL
    elif args.storage_option:
        parser.error("--storage-option applies to --url only")
    else:
        defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dirs is None:
        shm = [d for d in ["/dev/shm"] if Path(d).is_dir()]
        args.dirs = (
            (shm or [tempfile.gettempdir()]) if args.quick else [*shm, tempfile.gettempdir()]
        )
    if args.small < 10 or args.repeat < 1:
        parser.error("--small must be at least 10 and --repeat at least 1")
    return args


def _run(label: str, fn, world: int, *args) -> dict:
    from shardwise.testing import run_ranks

    start = time.perf_counter()
    print(f"  {label} ...", end="", flush=True)
    result = run_ranks(fn, world, *args, timeout=3600)[0]
    print(f" {time.perf_counter() - start:.0f}s", flush=True)
    return result


def _measure(folder: str, nbytes: int, small: int, repeat: int) -> dict:
    both = ("stock", "shardwise", "peer")
    return {
        "large": _run("large tensors, 2 ranks", cases.large_rank, 2, folder, nbytes, repeat),
        "reshard": _run(
            "row-wise -> column-wise, 4 ranks", cases.reshard_rank, 4, folder, nbytes, repeat
        ),
        "replicated": _run(
            f"{small:,} replicated tensors",
            cases.small_rank,
            2,
            folder,
            small,
            "replicated",
            both,
            repeat,
        ),
        "sharded": _run(
            f"{small:,} sharded tensors",
            cases.small_rank,
            2,
            folder,
            small,
            "sharded",
            both,
            repeat,
        ),
        "curve low": _run(
            f"{small // 10:,} sharded tensors",
            cases.small_rank,
            2,
            folder,
            small // 10,
            "sharded",
            ("stock", "shardwise"),
            repeat,
        ),
        "curve high": _run(
            f"{small * 10:,} sharded tensors (shardwise only)",
            cases.small_rank,
            2,
            folder,
            small * 10,
            "sharded",
            ("shardwise",),
            repeat,
        ),
    }


def _print_details(target: str, size: str, repeat: int, m: dict) -> None:
    r = m["large"]
    gib = r["state bytes"] / 2**30
    print(
        f"\n== {target}: large state {size} on 2 ranks ({gib:.2f} GiB per rank), best of {repeat}"
    )
    print(f"  {'':42}{'seconds':>9}{'GiB/s/rank':>12}")
    for name, key in (
        ("raw write probe (fsync)", "raw write"),
        ("stock dcp.save", "stock save"),
        ("stock dcp.save, thread_count=2", "stock save 2 threads"),
        ("stock dcp.save, thread_count=4", "stock save 4 threads"),
        ("shardwise save", "shardwise save"),
        ("raw read probe", "raw read"),
        ("stock dcp.load", "stock load"),
        ("shardwise load", "shardwise load"),
        ("stock async_save, blocking part", "stock async blocking"),
        ("shardwise async_save, blocking part", "shardwise async blocking"),
    ):
        print(f"  {name:42}{r[key]:9.3f}{gib / r[key]:12.2f}")
    rs = m["reshard"]
    print(
        f"  row->col on 4 ranks: {rs['rows']} x {rs['cols']} float32 matrices "
        f"({rs['cols'] * 4 // 1024} KiB rows, column bands of {rs['cols'] // 4 * 4 // 1024} KiB), "
        f"{rs['state bytes'] / 2**20:.0f} MiB per rank; read_tensor band "
        f"{rs['read_tensor bytes'] / 2**20:.1f} MiB"
    )


def _rows(m: dict, small: int) -> list[report.Row]:
    return [
        *report.small_rows(small, m["replicated"], "replicated"),
        *report.small_rows(small, m["sharded"], "sharded"),
        *report.curve_rows(
            [(small // 10, m["curve low"]), (small, m["sharded"]), (small * 10, m["curve high"])]
        ),
        *report.reshard_rows(m["reshard"]),
        *report.large_rows(m["large"]),
        *report.rss_rows(
            [
                (f"{small:,} replicated", m["replicated"]),
                (f"{small:,} sharded", m["sharded"]),
                (f"{small // 10:,} sharded", m["curve low"]),
                (f"{small * 10:,} sharded", m["curve high"]),
            ],
            m["large"],
            m["reshard"],
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = _options(argv)
    nbytes = parse_size(args.size)
    if args.url:
        remote_cases.main(
            args.url, storage_options(args), nbytes, args.size, args.small, args.repeat
        )
        return
    tables = []
    for target in args.dirs:
        print(f"== {target}: measuring", flush=True)
        folder = tempfile.mkdtemp(prefix="shardwise-bench-", dir=target)
        try:
            m = _measure(folder, nbytes, args.small, args.repeat)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        _print_details(target, args.size, args.repeat, m)
        peer_note = m["replicated"].get("peer")
        title = f"{target}: {args.size} large state, {args.small:,} small tensors, best of {args.repeat}"
        tables.append((title, _rows(m, args.small), peer_note))
    for title, rows, peer_note in tables:
        report.print_table(title, rows, peer_note)


if __name__ == "__main__":
    main()

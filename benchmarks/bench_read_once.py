"""Every stored byte read once per load? (`shardwise bench read_once`, issue 41, item 5).

    shardwise bench read_once [--world 8[,16,32]] [--tp 4] [--mib 64] [--tensors 8]
        [--storage shm,throttled[,local-s3]] [--mbps 200] [--layouts dp-tp,hsdp,row-col]
        [--repeat 2] [--quick] [--json FILE]

W real gloo ranks on this machine (`shardwise.testing.run_ranks`, one thread each),
for each W of `--world`, load R = `--tensors` float32 matrices of S = `--mib` MiB
in all, as DTensors, in three layouts; each layout's checkpoint is saved once
with `swc.save` (untimed) and loaded, in the same run, by stock `dcp.load`, by
`swc.load` (its defaults: `read_once="auto"`) and by stock `dcp.load` with
`swc.Reader` ("reader": read once routed by DCP's coordinator, `read_once="auto"`)
into the same targets, spoiled before each run and checked bit for bit after it
(values are exact functions of tensor and position); on `shm` also by
`swc.load(read_once=True)` ("once"), the exchange forced where the rule keeps each
rank reading its own bytes:

- `dp-tp`: mesh ("dp", "tp") = (W / TP, TP), placements (Replicate(), Shard(0)):
  TP-sharded weights replicated over DP, saved and loaded so. Each stored byte
  is needed by DP ranks.
- `hsdp`: mesh ("replicate", "shard") = (2, W / 2), (Replicate(), Shard(0)).
- `row-col`: saved row-wise over the W ranks (1-d mesh, Shard(0)), loaded
  column-wise (Shard(1)): every rank needs part of every stored row chunk.

Rows are 256 KiB (a column band of 1/W of a row: 32 KiB at W = 8), their count a
multiple of W. Storage (`--storage`):

- `shm`: a folder under /dev/shm.
- `throttled`: the same folder, every read of a data file (`*.distcp`) by either
  loader passing through one FIFO link of `--mbps` MB/s (10^6 bytes) shared by all
  ranks (`throttled_storage.Link`: a state file in /dev/shm under a lock), standing
  in for a shared file system. For `swc.load` a storage backend
  (`shardwise.storage.register_backend`, scheme `throttled://`), for `dcp.load` a
  `FileSystemReader` whose file system puts the link under stock's buffered stream.
- `local-s3`: moto's S3 server on 127.0.0.1 (one Python process, a request at a
  time), stock through `FsspecReader`, shardwise with `storage_options`; GETs and
  their bytes counted at s3fs (`remote_cases.count_s3_calls`): records included.

On `shm` data reads go through the same link without its throttle (counted only),
so "bytes read from storage" is counted the same way for both loaders everywhere:
the bytes of data files the OS returned (for stock: what its buffered stream asked
for, read-ahead included; torch.load also re-reads each record's zip headers).
Stored bytes: the data files' bytes (the checkpoint's records not counted, nor
read through the link). Times are the slowest rank's, best of `--repeat`.

Report, per storage x layout x W: stock and swc seconds, stock/swc, bytes read from
storage / stored bytes for each (summed over ranks: stock reads each byte once per
rank that needs it, the DP degree; W for row-col), GETs on S3, and the floor of
the throttled link (stored bytes / bandwidth). Then the issue's targets beside the
measured figures (met or not; nothing here fails on a time):
  bytes read / stored <= 1.05 for every layout (stock: the DP degree): swc's on the
    shared media (throttled, S3), where the rule reads once; the forced "once" on shm;
  throttled, W = 32 (DP 8 x TP 4), dp-tp: stock / swc >= 5x;
  shm: swc no slower than today's load: the rule keeps today's path there (each rank
    reads its own bytes: swc read/stored >= 0.95 x the ranks per byte); the forced
    exchange's time beside it (once / swc), not judged;
  object store: GETs <= 1.1 x the stored files touched.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import checkpoint_cases as cases  # noqa: E402
import checkpoint_report as report  # noqa: E402
import remote_cases as remote  # noqa: E402
import throttled_storage as links  # noqa: E402
from scale_processes import _one_thread  # noqa: E402

MiB = 2**20
MB = 1e6
ROW = 65536  # float32 per row: 256 KiB
LAYOUTS = ("dp-tp", "hsdp", "row-col")
STORAGES = ("shm", "throttled", remote.LOCAL)
# "once": swc.load(read_once=True), on shm only; "reader": stock dcp.load with swc.Reader
LOADERS = ("stock", "swc", "once", "reader")
SCHEMES = {"shm": "counted", "throttled": "throttled"}  # swc.load's backend for each
QUICK = {"world": "8", "mib": 8.0, "tensors": 4, "repeat": 1}
READ_TARGET = 1.05
SPEEDUP_TARGET = 5.0
GETS_TARGET = 1.1


# -- the states ---------------------------------------------------------------------------------


def shape_of(world: int, nbytes: int, tensors: int) -> tuple[int, int]:
    """One matrix: rows of ROW float32 (a multiple of W wide), a multiple of W rows."""
    cols = -(-ROW // world) * world
    rows = max(1, round(nbytes / tensors / (cols * 4) / world)) * world
    return rows, cols


def meshes(layout: str, world: int, tp: int) -> tuple[tuple, tuple, tuple, tuple]:
    """(mesh shape, its dimension names, placements saved, placements loaded)."""
    from torch.distributed.tensor import Replicate, Shard

    if layout == "dp-tp":
        return (world // tp, tp), ("dp", "tp"), (Replicate(), Shard(0)), (Replicate(), Shard(0))
    if layout == "hsdp":
        both = (Replicate(), Shard(0))
        return (2, world // 2), ("replicate", "shard"), both, both
    if layout == "row-col":
        return (world,), ("w",), (Shard(0),), (Shard(1),)
    raise ValueError(f"no layout {layout!r} (known: {', '.join(LAYOUTS)})")


def readers_per_byte(layout: str, world: int, tp: int) -> int:
    """How many ranks need each stored byte: stock's bytes read / stored."""
    return {"dp-tp": world // tp, "hsdp": 2, "row-col": world}[layout]


def _values(i: int, cols: int, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """Tensor `i`'s box at `offsets` of `sizes`: below 2**16, exact in float32."""
    r = torch.arange(offsets[0], offsets[0] + sizes[0]).unsqueeze(1)
    c = torch.arange(offsets[1], offsets[1] + sizes[1]).unsqueeze(0)
    return (((r * cols + c) * 7 + i * 131) % 65521).to(torch.float32)


def _box(value: Any) -> tuple[tuple, tuple]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(offsets), tuple(sizes)


def state(mesh: Any, placements: tuple, shape: tuple, tensors: int, fill: bool) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    out = {}
    for i in range(tensors):
        local = _values(i, shape[1], offsets, sizes) if fill else torch.full(sizes, -1.0)
        out[f"layer{i:03d}.weight"] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=(shape[1], 1)
        )
    return out


def spoil(targets: dict) -> None:
    for v in targets.values():
        v._local_tensor.fill_(-1.0)


def exact(what: str, targets: dict) -> None:
    for i, v in enumerate(targets.values()):
        offsets, sizes = _box(v)
        cases._check(
            f"{what}, tensor {i}:",
            torch.equal(v._local_tensor, _values(i, v.shape[1], offsets, sizes)),
        )


# -- one rank -------------------------------------------------------------------------------------


def _gathered(value: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _stored(path: str, options: dict) -> dict:
    """The data files' bytes and count, every file's count, the items' bytes (.metadata)."""
    fs = remote._fs(path, options) if path.startswith("s3://") else None
    if fs is not None:
        fs.invalidate_cache()
        sizes = {Path(f["name"]).name: int(f["size"]) for f in fs.ls(path, detail=True)}
    else:
        sizes = {p.name: p.stat().st_size for p in Path(path).iterdir() if p.is_file()}
    data = {n: s for n, s in sizes.items() if links.is_data(n)}
    return {"data": sum(data.values()), "data files": len(data), "files": len(sizes)}


def _loads(
    storage: str, path: str, url: str | None, options: dict, link: links.Link, targets: dict
) -> dict[str, Callable[[], Any]]:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    if storage == remote.LOCAL:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return {
            "stock": lambda: dcp.load(targets, storage_reader=FsspecReader(url, **options)),
            "swc": lambda: swc.load(targets, url, storage_options=options),
            "reader": lambda: dcp.load(
                targets, storage_reader=swc.Reader(url, storage_options=options)
            ),
        }
    where = f"{SCHEMES[storage]}://{path}"
    loads = {
        "stock": lambda: dcp.load(targets, storage_reader=links.stock_reader(path, link)),
        "swc": lambda: swc.load(targets, where),
    }
    if storage == "shm":
        loads["once"] = lambda: swc.load(targets, where, read_once=True)
    loads["reader"] = lambda: dcp.load(targets, storage_reader=swc.Reader(where))
    return loads


def rank_main(
    rank: int,
    world: int,
    base: str,
    s3: tuple[str, dict] | None,
    state_file: str,
    mbps: float,
    tp: int,
    layouts: list[str],
    storages: list[str],
    shape: tuple[int, int],
    tensors: int,
    repeat: int,
) -> dict:
    """Per layout: save once (untimed), then each storage's stock and swc loads; rank 0's
    result holds every rank's (bytes, reads) of data files through the link, and GETs."""
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise.checkpoint as swc

    _one_thread()
    # what the imports made stays out of the collections each timed run starts with
    # (`cases.timed`: W ranks collecting a heap of torch's on 2 cores take a second)
    gc.freeze()
    counted, throttled = links.Link(), links.Link(state_file, mbps * MB)
    links.register(SCHEMES["shm"], counted)
    links.register(SCHEMES["throttled"], throttled)
    by_storage = {"shm": counted, "throttled": throttled, remote.LOCAL: counted}
    if s3 is not None:
        remote.count_s3_calls()
    out: dict[str, Any] = {"S": shape[0] * shape[1] * 4 * tensors, "shape": list(shape)}
    for layout in layouts:
        dims, names, saved, loaded = meshes(layout, world, tp)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        path = str(Path(base) / layout)
        url = f"{s3[0]}/{layout}" if s3 is not None else None
        options = dict(s3[1]) if s3 is not None else {}
        values = state(mesh, saved, shape, tensors, fill=True)
        swc.save(values, path)
        if url is not None and remote.LOCAL in storages:
            swc.save(values, url, storage_options=options)
        del values
        gc.collect()
        gc.freeze()
        targets = state(mesh, loaded, shape, tensors, fill=False)
        if rank == 0:
            out[f"{layout} stored"] = _stored(path, {})
            if url is not None and remote.LOCAL in storages:
                out[f"{layout} stored s3"] = _stored(url, options)
        for storage in storages:
            link = by_storage[storage]
            for loader, load in _loads(storage, path, url, options, link, targets).items():
                last: list[Any] = []

                def run(load: Callable[[], Any] = load, last: list[Any] = last) -> None:
                    link.reset()
                    gets = (remote.CALLS["get_object"], remote.CALLS["get bytes"])
                    load()
                    last[:] = [
                        *link.counts(),
                        remote.CALLS["get_object"] - gets[0],
                        remote.CALLS["get bytes"] - gets[1],
                    ]

                key = f"{storage} {layout} {loader}"
                out[key], _ = cases.timed(run, repeat, lambda: spoil(targets))
                exact(f"{key}, {world} ranks", targets)
                out[f"{key} per rank"] = _gathered(tuple(last))
        dist.barrier()
    return out


# -- the run ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _place(storages: list[str]) -> Iterator[tuple[str, tuple[str, dict] | None]]:
    """A folder under /dev/shm, and a moto S3 bucket when asked; removed after."""
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = tempfile.mkdtemp(prefix="shardwise-read-once-", dir=shm)
    server = None
    try:
        s3 = None
        if remote.LOCAL in storages:
            server = remote._local_s3()
            print(f"  local S3 (moto) on {server.endpoint}, up in {server.startup_s:.1f}s")
            s3 = (f"s3://{server.new_bucket('bench')}/read-once", dict(server.storage_options))
        yield base, s3
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if server is not None:
            server.stop()


def measure(
    world: int,
    tp: int,
    nbytes: int,
    tensors: int,
    storages: list[str],
    layouts: list[str],
    mbps: float,
    repeat: int,
) -> dict:
    """Rank 0's results of `rank_main` on `world` spawned gloo ranks."""
    from shardwise.testing import run_ranks

    shape = shape_of(world, nbytes, tensors)
    state_file = links.Link.create()
    try:
        with _place(storages) as (base, s3):
            m = run_ranks(
                rank_main,
                world,
                base,
                s3,
                state_file,
                mbps,
                tp,
                layouts,
                storages,
                shape,
                tensors,
                repeat,
                timeout=3600,
            )[0]
    finally:
        os.unlink(state_file)
    m.update(
        world=world,
        tp=tp,
        tensors=tensors,
        mbps=mbps,
        layouts=layouts,
        storages=storages,
        repeat=repeat,
    )
    return m


# -- the report -----------------------------------------------------------------------------------


def _stored_of(m: dict, storage: str, layout: str) -> dict:
    return m[f"{layout} stored s3"] if storage == remote.LOCAL else m[f"{layout} stored"]


def figures(m: dict, storage: str, layout: str) -> dict:
    """One row's numbers: seconds, bytes read / stored data bytes, GETs, the floor."""
    stored = _stored_of(m, storage, layout)
    row: dict[str, Any] = {"stored": stored["data"], "files": stored["files"]}
    for loader in LOADERS:
        key = f"{storage} {layout} {loader}"
        if key not in m:
            row[loader] = row[f"{loader} read"] = row[f"{loader} ratio"] = None
            row[f"{loader} gets"] = None
            continue
        per_rank = m[f"{key} per rank"]
        row[loader] = m[key]
        if storage == remote.LOCAL:
            row[f"{loader} read"] = sum(r[3] for r in per_rank)
            row[f"{loader} gets"] = sum(r[2] for r in per_rank)
        else:
            row[f"{loader} read"] = sum(r[0] for r in per_rank)
            row[f"{loader} gets"] = None
        row[f"{loader} ratio"] = report.ratio(row[f"{loader} read"], stored["data"])
    row["speedup"] = report.ratio(row["stock"], row["swc"])
    row["reader speedup"] = report.ratio(row["stock"], row["reader"])
    row["floor"] = stored["data"] / (m["mbps"] * MB) if storage == "throttled" else None
    return row


def _mesh_text(layout: str, world: int, tp: int) -> str:
    return {
        "dp-tp": f"{world // tp}x{tp}",
        "hsdp": f"2x{world // 2}",
        "row-col": f"{world}->{world}",
    }[layout]


HEAD = (
    "stock s",
    "swc s",
    "stock/swc",
    "stock rd/st",
    "swc rd/st",
    "once s",
    "once rd/st",
    "rdr s",
    "st/rdr",
    "rdr rd/st",
    "GETs st",
    "GETs swc",
    "GETs rdr",
    "floor",
)


def print_table(results: list[dict]) -> list[report.Check]:
    """The table, then the issue's targets beside the measured figures; returns the checks."""
    first = results[0]
    rows = [(m, s, layout) for m in results for s in m["storages"] for layout in m["layouts"]]
    sizes = "; ".join(
        f"W={m['world']}: {m['tensors']} x {m['shape'][0]}x{m['shape'][1]} float32"
        f" = {report.mib(m['S'])}"
        for m in results
    )
    print(
        f"\n== read-once: stock dcp.load vs swc.load, gloo ranks on one host, slowest rank, "
        f"best of {first['repeat']}; S {sizes}; throttled link {first['mbps']:g} MB/s shared"
    )
    print(f"  {'storage':10}{'layout':9}{'W':>4}{'mesh':>7}" + "".join(f"{h:>12}" for h in HEAD))
    checks = []
    for m, storage, layout in rows:
        f = figures(m, storage, layout)
        cells = (
            report.secs(f["stock"]),
            report.secs(f["swc"]),
            f"{f['speedup']:.2f}x",
            f"{f['stock ratio']:.3f}",
            f"{f['swc ratio']:.3f}",
            "-" if f["once"] is None else report.secs(f["once"]),
            "-" if f["once ratio"] is None else f"{f['once ratio']:.3f}",
            "-" if f["reader"] is None else report.secs(f["reader"]),
            "-" if f["reader"] is None else f"{f['reader speedup']:.2f}x",
            "-" if f["reader ratio"] is None else f"{f['reader ratio']:.3f}",
            "-" if f["stock gets"] is None else str(f["stock gets"]),
            "-" if f["swc gets"] is None else str(f["swc gets"]),
            "-" if f["reader gets"] is None else str(f["reader gets"]),
            "-" if f["floor"] is None else report.secs(f["floor"]),
        )
        mesh = _mesh_text(layout, m["world"], m["tp"])
        print(
            f"  {storage:10}{layout:9}{m['world']:>4}{mesh:>7}" + "".join(f"{c:>12}" for c in cells)
        )
        checks.extend(_checks(m, storage, layout, f))
    print(
        "  rd/st: data-file bytes read from storage, summed over ranks, over the data files' "
        "bytes;\n  stock/swc: stock's seconds over swc's (> 1: swc faster); once: swc.load("
        "read_once=True); rdr: stock dcp.load with swc.Reader (read_once='auto');\n  floor: "
        "stored bytes at the throttled bandwidth; GETs: S3 GetObject calls, all ranks, records "
        "included\n  (under dcp.load every rank reads the records: DCP calls read_metadata on "
        "each)"
    )
    print("\n== targets (issue 41), this run's figures")
    width = max(len(c.shown) for c in checks)
    for c in checks:
        print(f"  {c.shown:{width}}  {c.target:>22}  {c.met}")
    met = sum(c.ok is True for c in checks)
    judged = sum(c.ok is not None for c in checks)
    print(f"targets met: {met} of {judged}")
    return checks


def _checks(m: dict, storage: str, layout: str, f: dict) -> list[report.Check]:
    world, tp = m["world"], m["tp"]
    where = f"{storage} {layout} W={world}"
    dp = readers_per_byte(layout, world, tp)
    out = [
        report.Check(f"{where}: stock read/stored {f['stock ratio']:.3f} (ranks per byte: {dp})"),
    ]
    if storage == "shm":  # the rule reads locally here: the exchange's own figure is "once"
        out.append(report.at_most(f"{where}: once read/stored", f["once ratio"], READ_TARGET))
    else:
        out.append(report.at_most(f"{where}: swc read/stored", f["swc ratio"], READ_TARGET))
        if f["reader ratio"] is not None:
            out.append(
                report.at_most(f"{where}: reader read/stored", f["reader ratio"], READ_TARGET)
            )
    if storage == "throttled" and layout == "dp-tp":
        if world == 32 and tp == 4:
            out.append(report.at_least(f"{where}: stock/swc", f["speedup"], SPEEDUP_TARGET))
        else:
            out.append(
                report.Check(f"{where}: stock/swc {f['speedup']:.2f}x (target set at W=32, TP=4)")
            )
        if f["reader"] is not None:
            out.append(report.Check(f"{where}: stock/reader {f['reader speedup']:.2f}x"))
    if storage == "shm":
        # the "no slower than today's": the rule keeps today's path here (each rank
        # reads its own bytes, nothing sent); the forced exchange's time beside it, unjudged
        out.append(
            report.at_least(
                f"{where}: swc read/stored, today's path (DP {dp})", f["swc ratio"], dp * 0.95
            )
        )
        out.append(
            report.Check(f"{where}: once / swc s {f['once'] / f['swc']:.2f} (forced exchange)")
        )
    if storage == remote.LOCAL:
        files = f["files"]
        out.append(
            report.at_most(f"{where}: swc GETs / {files} files", f["swc gets"] / files, GETS_TARGET)
        )
    return out


def _list(text: str, known: tuple[str, ...] | None, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"no {what} in {text!r}")
    if known is not None:
        unknown = [t for t in items if t not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown)} (known: {', '.join(known)})"
            )
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", default="8", help="ranks, a comma list (default 8)")
    parser.add_argument("--tp", type=int, default=4, help="TP degree of dp-tp (default 4)")
    parser.add_argument("--mib", type=float, default=64, help="stored MiB in all (default 64)")
    parser.add_argument("--tensors", type=int, default=8, help="matrices (default 8)")
    parser.add_argument(
        "--storage",
        default="shm,throttled",
        type=lambda t: _list(t, STORAGES, "storage"),
        help=f"of {', '.join(STORAGES)} (default shm,throttled)",
    )
    parser.add_argument(
        "--mbps", type=float, default=200, help="throttled link, MB/s for all ranks (default 200)"
    )
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        type=lambda t: _list(t, LAYOUTS, "layout"),
        help=f"of {', '.join(LAYOUTS)} (default all)",
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs, best kept (default 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"W=8, {QUICK['mib']:g} MiB in {QUICK['tensors']} tensors, 1 run (a smoke run)",
    )
    parser.add_argument("--json", help="also write the measurements to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.world, args.mib, args.tensors, args.repeat = (
            QUICK["world"],
            QUICK["mib"],
            QUICK["tensors"],
            QUICK["repeat"],
        )
    try:
        worlds = [int(w) for w in _list(args.world, None, "world size")]
    except (ValueError, argparse.ArgumentTypeError) as e:
        parser.error(f"--world takes a comma list of rank counts ({e})")
    if min(args.tensors, args.repeat, args.tp) < 1 or args.mib <= 0 or args.mbps <= 0:
        parser.error("--tensors, --repeat and --tp must be at least 1, --mib and --mbps above 0")
    for w in worlds:
        if w < 2 or w % 2 or w % args.tp:
            parser.error(f"--world {w}: an even count of ranks, a multiple of --tp {args.tp}")
    results = []
    for w in worlds:
        start = time.perf_counter()
        print(f"== W={w} (DP {w // args.tp} x TP {args.tp}) ...", end="", flush=True)
        m = measure(
            w,
            args.tp,
            int(args.mib * MiB),
            args.tensors,
            args.storage,
            args.layouts,
            args.mbps,
            args.repeat,
        )
        print(f" {time.perf_counter() - start:.0f}s", flush=True)
        results.append(m)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

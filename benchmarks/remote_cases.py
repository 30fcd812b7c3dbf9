"""`shardwise bench checkpoint --url ...`: checkpoints on object storage (S3), shardwise
beside stock DCP's fsspec classes in the same run, reported as ratios.

    shardwise bench checkpoint --url s3://BUCKET/PREFIX [--storage-option KEY=VALUE ...]
    shardwise bench checkpoint --url local-s3 [--quick]

`local-s3` starts moto's S3 server on 127.0.0.1 (tests/s3_server.py `LocalS3`),
makes a bucket and stops the server at the end. With a real URL everything is
written under `PREFIX/shardwise-bench-<random>/` and deleted at the end.

On 2 gloo ranks (`shardwise.testing.run_ranks`); times are the slowest rank's,
best of `--repeat`; ratios > 1 mean shardwise is faster (or fetches less):

1. Save and load of one sharded state: `--size` (default 256 MiB in all) of
   row-wise ShardedTensors of 8 large matrices (rows of 512 KiB) plus `--small`
   (200) sharded tensors of 4 KiB. shardwise: `swc.save` / `swc.load` with
   `storage_options`; stock: `dcp.save(storage_writer=FsspecWriter(url, **opts))`
   / `dcp.load(storage_reader=FsspecReader(url, **opts))` with their defaults
   (FsspecWriter's default `sync_files=True` ends each file with `os.sync()`,
   S3 files having no descriptor to fsync: part of stock's default cost). Every
   save goes to a fresh prefix (stock needs one or `overwrite=True`), deleted
   after, untimed.
2. A row-wise -> column-wise reshard load on 2 ranks (4 matrices of a quarter
   of `--size` in all, at least 16 MiB; each rank then needs half of every row,
   one ranged GET per row and file for a reader that fetches only those bytes):
   seconds, and bytes fetched from the store on the worst rank over the bytes
   its targets need. shardwise: its `FsspecFolder` counters (`range_bytes` of
   ranged GETs and `whole_bytes` of whole-object reads, i.e. the manifest,
   shown apart), the folder passed as `path` to `swc.load`. Both engines (and shardwise's counters, as a cross-check) are
   also counted at the network client: every S3 call s3fs makes in a rank goes
   through `s3fs.S3FileSystem._call_s3`, which this module wraps in the rank
   processes to count calls per operation and the bytes of each `GetObject`
   response (its `ContentLength`: the body s3fs then reads whole) and of each
   `PutObject` / `UploadPart` body. That sees the bytes actually requested from
   the server, whatever buffering a reader does above s3fs (stock's
   `FsspecReader` reads through `fs.open` files with s3fs's 50 MiB readahead
   cache, so what it fetches is not what it parses).
3. The physical limit here: one object per rank of the rank's state bytes, put
   (`fs.pipe_file`, multipart with s3fs's concurrency) and got back
   (`fs.cat_file`; and as concurrent 8 MiB ranged GETs, `fs.cat_ranges`, the
   way shardwise's prefetch fetches) through the same endpoint with the same
   s3fs options, both ranks at once: MB/s (10^6 bytes) of both ranks' bytes.
   Each engine's save and load throughput is shown as a share of it (probe
   seconds / engine seconds). For the reshard: the same objects' column bands
   fetched by exactly one ranged GET per row (`cat_ranges`), and whole.

On `local-s3` the server is moto: one Python process (requests served about
one at a time), which reads the whole object for every ranged GET and slices
it, so a ranged GET costs about what the object's size costs, not the range's.
Strategies of many ranged GETs (shardwise's) pay for that there, and would
not on S3, where a ranged GET costs its range plus a request's latency; the
ranged probes show what any reader of those ranges pays on the server at hand.

Only `s3://` URLs are measured (the call counter is s3fs's). Also printed: the
requests of one save and one load of each engine (both ranks), and peak RSS
growth per rank (as in checkpoint_cases). The table's one target is the bound
shardwise.storage.remote states: at most 1.1x the needed bytes cross the network.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoint_cases as cases
import checkpoint_report as report
import torch
import torch.distributed as dist

QUICK = {"size": "16MiB", "small": 200, "repeat": 1}
FULL = {"size": "256MiB", "small": 200, "repeat": 2}
RESHARD_SHARE = 4  # the reshard case is this share of --size (at least RESHARD_MIN)
RESHARD_MIN = 16 * 2**20
LOCAL = "local-s3"
MB = 1e6
MiB = 2**20

# -- counting S3 calls at the client ------------------------------------------------------

CALLS: Counter = Counter()  # operation -> calls made; "get bytes", "put bytes"


def count_s3_calls() -> None:
    """Wrap `S3FileSystem._call_s3` and `call_s3` (once per process) to count into `CALLS`."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    original = s3fs.S3FileSystem._call_s3
    if getattr(original, "counting", False):
        return

    async def counting(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS[str(method)] += 1
        out = await original(self, method, *args, **kwargs)
        if method == "get_object":
            CALLS["get bytes"] += int(out.get("ContentLength") or 0)
        elif method in ("put_object", "upload_part"):
            body = kwargs.get("Body")
            CALLS["put bytes"] += len(body) if hasattr(body, "__len__") else 0
        return out

    counting.counting = True  # type: ignore[attr-defined]
    s3fs.S3FileSystem._call_s3 = counting
    # the blocking `call_s3` (what S3File's uploads use) wraps the original: wrap ours
    s3fs.S3FileSystem.call_s3 = sync_wrapper(counting)


def _calls_of(fn: Callable[[], Any]) -> tuple[Any, Counter]:
    before = Counter(CALLS)
    result = fn()
    return result, Counter({k: v - before[k] for k, v in CALLS.items() if v != before[k]})


def _summed(calls: Counter) -> dict:
    """Calls summed over ranks. Collective."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(calls))
    total: Counter = Counter()
    for c in everyone:
        total.update(c)
    return dict(total)


def _requests(calls: dict) -> str:
    """`get 12, put 3, ...` (bytes apart), for the details."""
    names = {
        "get_object": "get",
        "head_object": "head",
        "put_object": "put",
        "upload_part": "part",
        "create_multipart_upload": "mpu",
        "complete_multipart_upload": "mpu done",
        "list_objects_v2": "list",
        "copy_object": "copy",
        "delete_object": "delete",
        "delete_objects": "delete many",
    }
    shown = [
        f"{names.get(k, k)} {v}"
        for k, v in sorted(calls.items(), key=lambda kv: -kv[1])
        if not k.endswith("bytes")
    ]
    moved = f"GET {calls.get('get bytes', 0) / MiB:.1f} MiB, PUT {calls.get('put bytes', 0) / MiB:.1f} MiB"
    return f"{', '.join(shown) or 'none'} ({moved})"


# -- helpers of the rank functions --------------------------------------------------------


def _fs(url: str, options: dict) -> Any:
    from fsspec.core import url_to_fs

    return url_to_fs(url, **options)[0]


def remove(url: str, options: dict) -> None:
    """Delete everything under `url` (rank 0), then barrier. Collective."""
    if dist.get_rank() == 0:
        fs = _fs(url, options)
        try:
            fs.rm(url, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache()
    dist.barrier()


class Fresh:
    """A new prefix under `base` per run (`next`, untimed: the previous one is deleted)."""

    def __init__(self, base: str, name: str, options: dict) -> None:
        self.base, self.name, self.options = base, name, options
        self.count, self.url = 0, ""

    def next(self) -> None:
        self.done()
        self.count += 1
        self.url = f"{self.base}/{self.name}-{self.count}"

    def done(self) -> None:
        if self.url:
            remove(self.url, self.options)


def _timed_counted(out: dict, name: str, fn: Callable[[], Any], repeat: int, before=None) -> None:
    """`cases.record`, plus the S3 calls of the last run summed over ranks (`name calls`)."""
    last: list[Counter] = [Counter()]

    def run() -> None:
        last[0] = _calls_of(fn)[1]

    cases.record(out, name, run, repeat, before)
    out[f"{name} calls"] = _summed(last[0])


def _state_blob(state: dict) -> bytes:
    """The rank's shards end to end, as its data file holds them."""
    return (
        torch.cat([s.reshape(-1) for v in state.values() for s in cases._local(v)])
        .numpy()
        .tobytes()
    )


def _probe(out: dict, fs: Any, base: str, state: dict, repeat: int, options: dict) -> None:
    """Raw s3fs put and get of the rank's state bytes, one object per rank; also got as
    concurrent ranged GETs of PART bytes (`cat_ranges`, as shardwise's prefetch does)."""
    from shardwise.storage.remote import PART

    data = _state_blob(state)
    path = f"{base}/probe/rank{dist.get_rank()}.bin"
    got: list[Any] = [b"", []]
    starts = list(range(0, len(data), PART))
    ends = [min(s + PART, len(data)) for s in starts]

    def get() -> None:
        got[0] = fs.cat_file(path)

    def get_parts() -> None:
        got[1] = fs.cat_ranges([path] * len(starts), starts, ends)

    out["probe put"], _ = cases.timed(lambda: fs.pipe_file(path, data), repeat)
    out["probe get"], _ = cases.timed(get, repeat)
    out["probe get parts"], _ = cases.timed(get_parts, repeat)
    out["probe part MiB"] = PART / MiB
    cases._check("raw s3fs probe:", got[0] == data and b"".join(got[1]) == data)
    remove(f"{base}/probe", options)


# -- rank functions --------------------------------------------------------------------------


def save_load_rank(
    rank: int, world: int, url: str, options: dict, nbytes: int, small: int, repeat: int
) -> dict:
    """Raw probe, then save and load of the same state with each engine."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import shardwise.checkpoint as swc

    count_s3_calls()
    large = cases.row_state(rank, world, nbytes, n_tensors=8)
    smalls = cases.small_state(rank, world, small, "sharded")
    state = {**large, **smalls}
    out: dict[str, Any] = {
        "state bytes": cases.max_over_ranks(cases._local_bytes(state))[0],
        "total bytes": _summed(Counter(b=int(cases._local_bytes(state))))["b"],
        "shape": next(iter(large.values())).shape,
    }
    _probe(out, _fs(url, options), url, state, repeat, options)

    large_t = cases.row_state(rank, world, nbytes, n_tensors=8, fill=False)
    smalls_t = cases.small_state(rank, world, small, "sharded", fill=False)
    targets = {**large_t, **smalls_t}
    engines: dict[str, tuple[Callable[[str], Any], Callable[[str], Any]]] = {
        "stock": (
            lambda p: dcp.save(state, storage_writer=FsspecWriter(p, **options)),
            lambda p: dcp.load(targets, storage_reader=FsspecReader(p, **options)),
        ),
        "shardwise": (
            lambda p: swc.save(state, p, storage_options=options),
            lambda p: swc.load(targets, p, storage_options=options),
        ),
    }
    for engine, (save, load) in engines.items():
        fresh = Fresh(url, engine, options)
        _timed_counted(out, f"{engine} save", lambda: save(fresh.url), repeat, fresh.next)
        _timed_counted(
            out, f"{engine} load", lambda: load(fresh.url), repeat, lambda: cases._spoil(targets)
        )
        cases._check(
            f"{engine} on S3:",
            cases.row_state_ok(large_t) and cases.same_values(smalls, smalls_t),
        )
        fresh.done()
    return out


def _band_probe(
    out: dict, fs: Any, base: str, source: dict, targets: dict, repeat: int, options: dict
) -> None:
    """The reshard's physical limits: each rank puts an object of its row-wise shards (as
    its data file), then fetches from every rank's object either exactly its column band
    of every row (concurrent ranged GETs, `cat_ranges`: what a reader fetching only the
    needed bytes must issue) or the whole objects (`cat_file`: what a whole-file reader
    fetches)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    paths = [f"{base}/rank{r}.bin" for r in range(world)]
    fs.pipe_file(paths[rank], _state_blob(source))
    dist.barrier()
    where, starts, ends = [], [], []
    for r in range(world):  # every rank's object: its rows of each tensor, row-major
        at = 0
        for key, v in source.items():
            rows = v.layout_spec.blocks_of(r)[0].sizes[0]
            cols = v.shape[1]
            band = targets[key].local_blocks[0]
            c0, width = band.offsets[1], band.sizes[1]
            starts += [at + (i * cols + c0) * 4 for i in range(rows)]
            ends += [at + (i * cols + c0 + width) * 4 for i in range(rows)]
            where += [paths[r]] * rows
            at += rows * cols * 4
    out["probe bands"], _ = cases.timed(lambda: fs.cat_ranges(where, starts, ends), repeat)
    out["probe whole"], _ = cases.timed(lambda: [fs.cat_file(p) for p in paths], repeat)
    out["probe band GETs"] = len(starts)
    remove(base, options)


def reshard_rank(rank: int, world: int, url: str, options: dict, nbytes: int, repeat: int) -> dict:
    """Saved row-wise by each engine, loaded column-wise: seconds, bytes fetched / needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import shardwise.checkpoint as swc
    from shardwise.storage import open_folder

    count_s3_calls()
    stock, ours = f"{url}/rs-stock", f"{url}/rs-ours"
    source = cases.row_state(rank, world, nbytes, n_tensors=4, dim=0)
    out: dict[str, Any] = {"state bytes": cases.max_over_ranks(cases._local_bytes(source))[0]}
    dcp.save(source, storage_writer=FsspecWriter(stock, **options))
    swc.save(source, ours, storage_options=options)
    targets = cases.row_state(rank, world, nbytes, n_tensors=4, dim=1, fill=False)
    needed = cases._local_bytes(targets)
    out["rows"], out["cols"] = next(iter(targets.values())).shape
    _band_probe(out, _fs(url, options), f"{url}/rs-probe", source, targets, repeat, options)
    del source

    loads: dict[str, Callable[[], Any]] = {
        "stock": lambda: dcp.load(targets, storage_reader=FsspecReader(stock, **options)),
        "shardwise": lambda: swc.load(targets, ours, storage_options=options),
    }
    for name, load in loads.items():
        cases.record(out, f"{name} load", load, repeat, lambda: cases._spoil(targets))
        cases._check(f"{name}, row-wise -> column-wise on S3:", cases.row_state_ok(targets))

    # one more load of each, counted: the network client's view (both), shardwise's own
    cases._spoil(targets)
    _, calls = _calls_of(loads["stock"])
    cases._check("stock, row-wise -> column-wise on S3:", cases.row_state_ok(targets))
    cases._spoil(targets)
    folder = open_folder(ours, options)
    reader, ours_calls = _calls_of(lambda: swc.load(targets, folder))
    cases._check("shardwise, row-wise -> column-wise on S3:", cases.row_state_ok(targets))
    (
        out["stock fetched/needed"],
        out["stock gets"],
        out["shardwise range/needed"],
        out["shardwise whole/needed"],
        out["shardwise fetched/needed"],
        out["shardwise net/needed"],
        out["shardwise read/needed"],
        out["shardwise range gets"],
        out["shardwise gets"],
    ) = cases.max_over_ranks(
        calls["get bytes"] / needed,
        calls["get_object"],
        folder.range_bytes / needed,
        folder.whole_bytes / needed,
        (folder.range_bytes + folder.whole_bytes) / needed,
        ours_calls["get bytes"] / needed,
        reader.bytes_read / needed,
        folder.range_requests,
        ours_calls["get_object"],
    )
    out["needed"] = cases.max_over_ranks(needed)[0]
    out["stock load calls"] = _summed(calls)
    out["shardwise load calls"] = _summed(ours_calls)
    remove(stock, options)
    remove(ours, options)
    return out


# -- the run -------------------------------------------------------------------------------------


def _run(label: str, fn: Callable, *args: Any) -> dict:
    from shardwise.testing import run_ranks

    start = time.perf_counter()
    print(f"  {label} ...", end="", flush=True)
    result = run_ranks(fn, 2, *args, timeout=3600)[0]
    print(f" {time.perf_counter() - start:.0f}s", flush=True)
    return result


def _local_s3() -> Any:
    try:
        from tests.s3_server import LocalS3
    except ImportError:  # run as `python benchmarks/bench_checkpoint.py`: the checkout's root
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.s3_server import LocalS3
    return LocalS3()


def measure(url: str, options: dict | None, nbytes: int, small: int, repeat: int) -> dict:
    """Everything, on `url` (`local-s3`: a server started and stopped here)."""
    options = dict(options or {})
    server = None
    if url == LOCAL:
        server = _local_s3()
        print(f"  local S3 (moto) on {server.endpoint}, up in {server.startup_s:.1f}s", flush=True)
        options = {**server.storage_options, **options}
        where = f"s3://{server.new_bucket('bench')}"
    else:
        if not url.startswith(("s3://", "s3a://")):
            raise ValueError(f"--url takes s3://BUCKET/PREFIX or {LOCAL}, not {url!r}")
        where = f"{url.rstrip('/')}/shardwise-bench-{uuid.uuid4().hex[:8]}"
    try:
        return {
            "where": where,
            "endpoint": options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS",
            "save/load": _run(
                f"save and load, {small} small tensors, 2 ranks",
                save_load_rank,
                where,
                options,
                nbytes,
                small,
                repeat,
            ),
            "reshard": _run(
                "row-wise -> column-wise, 2 ranks",
                reshard_rank,
                where,
                options,
                min(nbytes, max(RESHARD_MIN, nbytes // RESHARD_SHARE)),
                repeat,
            ),
        }
    finally:
        if server is not None:
            server.stop()
        else:
            try:
                _fs(where, options).rm(where, recursive=True)
            except FileNotFoundError:
                pass


def _mbps(nbytes: float, seconds: float) -> float:
    return nbytes / MB / seconds if seconds and not math.isnan(seconds) else math.nan


def print_details(size: str, repeat: int, m: dict) -> None:
    r, rs = m["save/load"], m["reshard"]
    total = r["total bytes"]
    rows, cols = r["shape"]
    print(
        f"\n== {m['where']} (endpoint {m['endpoint']}): {size} on 2 ranks, "
        f"{r['state bytes'] / MiB:.0f} MiB per rank ({rows} x {cols} float32 matrices "
        f"and the small tensors), best of {repeat}"
    )
    print(f"  {'':40}{'seconds':>9}{'MB/s':>9}{'RSS growth':>12}  requests of one run, both ranks")
    part = f"{r['probe part MiB']:.0f} MiB"
    for label, key in (
        ("raw s3fs put (pipe_file)", "probe put"),
        ("raw s3fs get (cat_file)", "probe get"),
        (f"raw s3fs get as {part} ranges (cat_ranges)", "probe get parts"),
        ("stock dcp.save(FsspecWriter)", "stock save"),
        ("shardwise swc.save", "shardwise save"),
        ("stock dcp.load(FsspecReader)", "stock load"),
        ("shardwise swc.load", "shardwise load"),
    ):
        _detail_line(r, label, key, f"{_mbps(total, r[key]):9.0f}")
    print(
        f"  row->col: {rs['rows']} x {rs['cols']} float32 matrices, "
        f"{rs['needed'] / MiB:.1f} MiB needed per rank"
    )
    for label, key in (
        (f"raw band GETs ({rs['probe band GETs']}/rank, cat_ranges)", "probe bands"),
        ("raw whole-object GETs (cat_file)", "probe whole"),
        ("stock dcp.load(FsspecReader)", "stock load"),
        ("shardwise swc.load", "shardwise load"),
    ):
        _detail_line(rs, label, key, f"{'':9}")
    print(
        f"  shardwise, worst rank: FsspecFolder {rs['shardwise range gets']:.0f} ranged GETs, "
        f"fetched {rs['shardwise fetched/needed']:.3f}x needed; network client "
        f"{rs['shardwise gets']:.0f} GETs, {rs['shardwise net/needed']:.3f}x; "
        f"reader.bytes_read {rs['shardwise read/needed']:.3f}x"
    )


def _detail_line(results: dict, label: str, key: str, rate: str) -> None:
    """One engine's line: seconds, `rate` (MB/s or blank), RSS growth, S3 calls."""
    rss = report.mib(results.get(f"{key} rss"))
    calls = _requests(results[f"{key} calls"]) if f"{key} calls" in results else "-"
    print(f"  {label:40}{results[key]:9.3f}{rate}{rss:>12}  {calls}")


def rows(m: dict) -> list[report.Row]:
    r, rs = m["save/load"], m["reshard"]
    total = r["total bytes"]
    ratio, info = report.ratio, report.info

    def cell(seconds: float) -> str:
        return f"{report.secs(seconds)}, {_mbps(total, seconds):.0f} MB/s"

    stock, ours, probe = r["stock save"], r["shardwise save"], r["probe put"]
    out = [
        report.Row(
            "save, 2 ranks (probe: put)",
            cell(stock),
            cell(ours),
            cell(probe),
            [
                info("stock/sw", ratio(stock, ours)),
                info("sw/probe MB/s", ratio(probe, ours)),
                info("stock/probe MB/s", ratio(probe, stock)),
            ],
        )
    ]
    stock, ours, probe = r["stock load"], r["shardwise load"], r["probe get"]
    out.append(
        report.Row(
            "load, same layout (probe: get)",
            cell(stock),
            cell(ours),
            cell(probe),
            [
                info("stock/sw", ratio(stock, ours)),
                info("sw/probe MB/s", ratio(probe, ours)),
                info("stock/probe MB/s", ratio(probe, stock)),
            ],
        )
    )
    parts = r["probe get parts"]
    out.append(
        report.Row(
            f"load vs get as {r['probe part MiB']:.0f} MiB ranges",
            cell(stock),
            cell(ours),
            cell(parts),
            [
                info("sw/probe MB/s", ratio(parts, ours)),
                info("stock/probe MB/s", ratio(parts, stock)),
            ],
        )
    )
    stock, ours = rs["stock load"], rs["shardwise load"]
    bands, whole = rs["probe bands"], rs["probe whole"]
    out.append(
        report.Row(
            "row->col load, 2 ranks (probe: bands; whole)",
            report.secs(stock),
            report.secs(ours),
            f"{report.secs(bands)}; {report.secs(whole)}",
            checks=[
                info("stock/sw", ratio(stock, ours)),
                info("bands/sw", ratio(bands, ours)),
                info("whole/stock", ratio(whole, stock)),
            ],
        )
    )
    fetched = rs["shardwise fetched/needed"]
    out.append(
        report.Row(
            "row->col fetched/needed, worst rank",
            f"{rs['stock fetched/needed']:.2f} ({rs['stock gets']:.0f} GETs)",
            f"{fetched:.2f}: ranged {rs['shardwise range/needed']:.3f} + whole "
            f"{rs['shardwise whole/needed']:.4f} ({rs['shardwise gets']:.0f} GETs)",
            f"1.00 ({rs['probe band GETs']} GETs)",
            checks=[
                report.at_most("sw", fetched, 1.1),
                info("stock/sw bytes", ratio(rs["stock fetched/needed"], fetched)),
            ],
        )
    )
    return out


def print_table(title: str, rows: list[report.Row]) -> None:
    report.print_table(title, rows, None, peer="raw s3fs probe")


def main(url: str, options: dict | None, nbytes: int, size: str, small: int, repeat: int) -> None:
    print(f"== {url}: measuring", flush=True)
    m = measure(url, options, nbytes, small, repeat)
    print_details(size, repeat, m)
    print_table(f"{url}: {size} state + {small} small tensors, 2 ranks, best of {repeat}", rows(m))

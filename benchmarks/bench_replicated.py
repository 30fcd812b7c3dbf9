"""Replicated values read once and broadcast (`shardwise bench replicated`, issue 22).

    shardwise bench replicated [--url local-s3 | --url s3://BUCKET/PREFIX
        [--storage-option KEY=VALUE ...] | --dir PATH] [--world 4] [--tensors 32]
        [--tensor-mib 2] [--repeat 2]

W gloo ranks (`shardwise.testing.run_ranks`) each hold the same R plain float32
tensors (S = R x `--tensor-mib` bytes, values exact functions of tensor and
index: every load is checked bit for bit). One `swc.save` (untimed), then in
the same run: stock `dcp.load` (`FsspecReader`, or `FileSystemReader` for
`--dir`), where every rank reads every tensor; `swc.load` with
`broadcast_replicated=False`, `True`, and for `--dir` also `None` (auto: on one
host and a local folder it does not broadcast). Times are the slowest rank's,
best of `--repeat`, into preallocated targets spoiled before each run. Bytes
per rank of the last run: fetched from the store (on S3 the GetObject bytes
s3fs received, and its GETs, `remote_cases.count_s3_calls`; on a folder
`/proc/self/io` `rchar`, bytes through read(): gloo receives by recv()) and
`LoadInfo.bytes_read` ("read"). Physical limits: a rank must fetch S / W bytes
when broadcasting, S when not; probes fetch exactly that (its 1/W of the data
files, or all of them; `cat_ranges`, all ranks at once), and time a raw gloo
broadcast of S bytes in W parts, the rest of the broadcast's floor.

When it pays: on an object store each rank's GETs cost requests and bytes the
store bills and serves W times, and a file system shared by several hosts
carries S x W bytes over its network; broadcasting cuts both to S. On one
host with a local folder it does not: after the first read the page cache
serves every rank at memory speed, and gloo's broadcast adds a copy through
a socket (and a pack of small values into a batch), so `None` keeps reading.
On `local-s3` (moto: one Python process serving about one request at a time,
reading the whole object for each ranged GET) GETs cost as much as bytes: a
broadcast that fetches S / W in more, scattered GETs can be slower there.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import checkpoint_cases as cases  # noqa: E402
import checkpoint_report as report  # noqa: E402
import remote_cases as remote  # noqa: E402
from scale_processes import _one_thread  # noqa: E402

from shardwise.cli.storage_options import add_storage_options, storage_options  # noqa: E402

MiB = 2**20
LABELS = {
    "stock": "stock dcp.load",
    "off": "swc.load broadcast=False",
    "on": "swc.load broadcast=True",
    "auto": "swc.load broadcast=None",
}


def _values(i: int, numel: int) -> torch.Tensor:
    """Tensor `i`: below 2**16, exact in float32."""
    return ((torch.arange(numel) * 7 + i * 131) % 65521).to(torch.float32)


def _state(tensors: int, numel: int, fill: bool) -> dict[str, torch.Tensor]:
    return {
        f"rep{i:04d}": _values(i, numel) if fill else torch.full((numel,), -1.0)
        for i in range(tensors)
    }


def _exact(what: str, state: dict[str, torch.Tensor]) -> None:
    for i, value in enumerate(state.values()):
        cases._check(f"{what}, tensor {i}:", torch.equal(value, _values(i, value.numel())))


def _loads(where: str, options: dict, targets: dict, s3: bool) -> dict[str, Callable[[], Any]]:
    """Each mode's load of `where` into `targets`; each returns its LoadInfo (stock: None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    import shardwise.checkpoint as swc

    def stock() -> None:
        reader = FsspecReader(where, **options) if s3 else dcp.FileSystemReader(where)
        dcp.load(targets, storage_reader=reader)

    def ours(broadcast: bool | None) -> Callable[[], Any]:
        opts = options or None
        return lambda: swc.load(
            targets, where, storage_options=opts, broadcast_replicated=broadcast
        )

    loads = {"stock": stock, "off": ours(False), "on": ours(True)}
    if not s3:
        loads["auto"] = ours(None)
    return loads


def _gathered(value: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _probe(out: dict, where: str, options: dict, repeat: int) -> None:
    """The floors: every rank reads its 1/W of the data files, or all of them, at once;
    a raw gloo broadcast of S bytes, each rank sending its 1/W."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fs = remote._fs(where, options)
    fs.invalidate_cache()
    files = sorted((f["name"], int(f["size"])) for f in fs.ls(where, detail=True))
    files = [(name, size) for name, size in files if name.endswith(".distcp")]
    total = sum(size for _, size in files)
    lo, hi = total * rank // world, total * (rank + 1) // world
    share: tuple[list, list, list] = ([], [], [])
    at = 0
    for name, size in files:  # the files end to end: this rank's [lo, hi) of them
        start, end = max(lo - at, 0), min(hi - at, size)
        if start < end:
            for part, v in zip(share, (name, start, end), strict=True):
                part.append(v)
        at += size
    names = [name for name, _ in files]
    out["probe share"], _ = cases.timed(lambda: fs.cat_ranges(*share), repeat)
    out["probe all"], _ = cases.timed(
        lambda: fs.cat_ranges(names, [0] * len(files), [s for _, s in files]), repeat
    )
    parts = [
        torch.empty((total * (r + 1) // world) - (total * r // world), dtype=torch.uint8)
        for r in range(world)
    ]

    def broadcast() -> None:
        for r, part in enumerate(parts):
            dist.broadcast(part, r)

    out["probe broadcast"], _ = cases.timed(broadcast, repeat)
    out["data bytes"] = total


def rank_main(
    rank: int, world: int, where: str, options: dict, tensors: int, numel: int, repeat: int
) -> dict:
    """Save once, then each mode's load: seconds, and each rank's (fetched, bytes_read,
    GETs) of its last run (GETs: None on a folder)."""
    import shardwise.checkpoint as swc

    _one_thread()
    s3 = where.startswith(("s3://", "s3a://"))
    if s3:
        remote.count_s3_calls()

    def fetched() -> tuple[int, int]:
        if s3:
            return int(remote.CALLS["get bytes"]), int(remote.CALLS["get_object"])
        return cases.rchar(), 0

    swc.save(_state(tensors, numel, fill=True), where, storage_options=options or None)
    targets = _state(tensors, numel, fill=False)
    out: dict[str, Any] = {"S": tensors * numel * 4}
    for mode, load in _loads(where, options, targets, s3).items():
        last: list[Any] = [0, None, None]

        def run(load: Callable[[], Any] = load, last: list[Any] = last) -> None:
            (net, gets), info = fetched(), load()
            after = fetched()
            last[:] = [after[0] - net, getattr(info, "bytes_read", None), after[1] - gets]
            if not s3:
                last[2] = None

        out[mode], _ = cases.timed(run, repeat, lambda: cases._spoil(targets))
        _exact(f"{LABELS[mode]}, {world} ranks", targets)
        out[f"{mode} per rank"] = _gathered(tuple(last))
    _probe(out, where, options, repeat)
    return out


def measure(
    where: str, options: dict | None, world: int, tensors: int, numel: int, repeat: int
) -> dict:
    """Rank 0's results of `rank_main` on `world` spawned gloo ranks."""
    from shardwise.testing import run_ranks

    return run_ranks(
        rank_main, world, where, dict(options or {}), tensors, numel, repeat, timeout=3600
    )[0]


@contextlib.contextmanager
def _place(url: str | None, folder: str | None, options: dict | None) -> Iterator[tuple[str, dict]]:
    """Where to save and its storage options; whatever was written is removed after."""
    opts = dict(options or {})
    if folder is not None:
        base = tempfile.mkdtemp(prefix="shardwise-replicated-", dir=folder)
        try:
            yield str(Path(base) / "ck"), opts
        finally:
            shutil.rmtree(base, ignore_errors=True)
    elif url == remote.LOCAL:
        server = remote._local_s3()
        print(f"  local S3 (moto) on {server.endpoint}, up in {server.startup_s:.1f}s", flush=True)
        try:
            yield (
                f"s3://{server.new_bucket('bench')}/replicated",
                {**server.storage_options, **opts},
            )
        finally:
            server.stop()
    else:
        if not str(url).startswith(("s3://", "s3a://")):
            raise ValueError(f"--url takes s3://BUCKET/PREFIX or {remote.LOCAL}, not {url!r}")
        where = f"{str(url).rstrip('/')}/shardwise-bench-{uuid.uuid4().hex[:8]}"
        try:
            yield where, opts
        finally:
            with contextlib.suppress(FileNotFoundError):
                remote._fs(where, opts).rm(where, recursive=True)


def _cell(values: list[int | None], total: bool) -> str:
    if any(v is None for v in values):
        return "-"
    return report.mib(sum(values) if total else max(values))


def print_table(title: str, m: dict, world: int) -> None:
    size, modes = m["S"], [k for k in LABELS if k in m]
    print(f"\n== {title}")
    head = ("seconds", "/stock", "/False", "fetched max", "sum", "read max", "sum", "GETs max")
    print(f"  {'':26}" + "".join(f"{h:>12}" for h in head))
    for mode in modes:
        net, read, gets = zip(*m[f"{mode} per rank"], strict=True)
        cells = (
            report.secs(m[mode]),
            f"{report.ratio(m['stock'], m[mode]):.2f}x",
            f"{report.ratio(m['off'], m[mode]):.2f}x",
            _cell(list(net), False),
            _cell(list(net), True),
            _cell(list(read), False),
            _cell(list(read), True),
            "-" if None in gets else str(max(gets)),
        )
        print(f"  {LABELS[mode]:26}" + "".join(f"{c:>12}" for c in cells))
    data = m["data bytes"]
    print(
        f"  limit, broadcast: each rank fetches >= S/W = {report.mib(size / world)} "
        f"(data files {report.mib(data)}): its 1/W at once {report.secs(m['probe share'])}"
        f", + raw gloo broadcast of S {report.secs(m['probe broadcast'])}"
    )
    print(
        f"  limit, no broadcast: each rank fetches >= S = {report.mib(size)}: "
        f"all data files, all ranks at once {report.secs(m['probe all'])}"
    )
    print("  /stock, /False: their seconds over the row's (> 1: the row is faster)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--url", help=f"s3://BUCKET/PREFIX or {remote.LOCAL} (default: {remote.LOCAL})"
    )
    parser.add_argument("--dir", help="a local folder instead of object storage")
    add_storage_options(parser)
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tensors", type=int, default=32, help="replicated tensors (default 32)")
    parser.add_argument("--tensor-mib", type=float, default=2, help="MiB per tensor (default 2)")
    parser.add_argument("--repeat", type=int, default=2, help="runs, best kept (default 2)")
    args = parser.parse_args(argv)
    if args.dir and (args.url or args.storage_option):
        parser.error("--dir names a local folder; --url and --storage-option object storage")
    if min(args.world, args.tensors, args.repeat) < 1 or args.tensor_mib <= 0:
        parser.error("--world, --tensors and --repeat must be at least 1, --tensor-mib above 0")
    numel = max(1, int(args.tensor_mib * MiB) // 4)
    url = None if args.dir else args.url or remote.LOCAL
    with _place(url, args.dir, storage_options(args)) as (where, options):
        print(f"== {where}: measuring", flush=True)
        m = measure(where, options, args.world, args.tensors, numel, args.repeat)
    title = (
        f"{url or args.dir}: {args.tensors} replicated float32 tensors of "
        f"{report.mib(numel * 4)} (S = {report.mib(m['S'])}), {args.world} gloo ranks, "
        f"slowest rank, best of {args.repeat}"
    )
    print_table(title, m, args.world)


if __name__ == "__main__":
    main()

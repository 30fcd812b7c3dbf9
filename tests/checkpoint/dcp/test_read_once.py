"""Read once under stock `dcp.load` with `swc.Reader` (`engine.read_once.routed_plans`):
DCP's coordinator routes each stored chunk several ranks read from to one reader, which
reads the bounds of their boxes and sends each the bytes of its items.

Spawned gloo ranks with DTensors on a DP x TP mesh, and the routes themselves on
made-up plans. Values are checked bit for bit, bytes read and sent exactly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from shardwise.checkpoint.engine import read_once
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.storage import open_folder
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

W = 4
ROWS, COLS = 64, 6
KEYS = "xyz"
STORED = len(KEYS) * ROWS * COLS * 4  # the checkpoint's tensor bytes
# target placements on the (dp, tp) mesh: DP replicas of row halves, of column halves
# (a reshard: each rank a band of every stored chunk), columns over DP and rows over TP
LAYOUTS = ("rep-rows", "rep-cols", "cols-rows")


# on the object store: 32 KiB a row half, so the bytes between two chunks of a file are
# under a tenth (`io.chunks.GAP`: read with them) and a file's chunks are one range
BIG_KEYS, BIG = "wxyz", (256, 64)


def _full(big: bool = False) -> dict[str, torch.Tensor]:
    keys, shape = (BIG_KEYS, BIG) if big else (KEYS, (ROWS, COLS))
    return {k: torch.arange(math.prod(shape) * 1.0).reshape(shape) + i for i, k in enumerate(keys)}


def _placements(name: str) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    return {
        "rep-rows": (Replicate(), Shard(0)),
        "rep-cols": (Replicate(), Shard(1)),
        "cols-rows": (Shard(1), Shard(0)),
    }[name]


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _save(path: str, mesh: Any, options: dict | None = None) -> None:
    """The checkpoint: DP replicas of row halves (the big one on the object store)."""
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc
    from shardwise.checkpoint.io import chunks

    if options is None:  # bytes read are exactly the ranges read
        chunks.GAP = 0
    full = _full(big=options is not None)
    state = {k: distribute_tensor(v, mesh, _placements("rep-rows")) for k, v in full.items()}
    swc.save(state, path, storage_options=options)


def _load(path: str, mesh: Any, layout: str, **reader: Any) -> tuple[int, int, bool]:
    """(bytes read, bytes sent, bit exact) of one `dcp.load` through `swc.Reader`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    group = reader.pop("group", None)
    targets = {
        k: distribute_tensor(torch.full((ROWS, COLS), -1.0), mesh, _placements(layout))
        for k in KEYS
    }
    r = swc.Reader(path, **reader)
    dcp.load(targets, storage_reader=r, process_group=group)
    exact = all(torch.equal(targets[k].full_tensor(), v) for k, v in _full().items())
    return r.bytes_read, r.bytes_sent, exact


def _layouts(rank: int, world: int, path: str) -> list[tuple[int, int, bool]]:
    mesh = _mesh()
    _save(path, mesh)
    return [
        _load(path, mesh, layout, read_once=once) for once in (False, True) for layout in LAYOUTS
    ]


def test_each_stored_byte_is_read_once_and_sent_to_the_ranks_needing_it(tmp_path: Path) -> None:
    out = run_ranks(_layouts, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert all(exact for rank in out for _read, _sent, exact in rank)
    alone = [[rank[i] for rank in out] for i in range(len(LAYOUTS))]
    once = [[rank[len(LAYOUTS) + i] for rank in out] for i in range(len(LAYOUTS))]
    # alone: each rank reads its row half of each tensor whole (a column band of it too:
    # checksums cover whole tiles), nothing sent
    assert [[read for read, _s, _e in ranks] for ranks in alone] == [
        [STORED // 2] * W,
        [STORED] * W,
        [STORED // 2] * W,
    ]
    assert all(sent == 0 for ranks in alone for _r, sent, _e in ranks)
    # once: every stored byte read by one rank
    assert [sum(read for read, _s, _e in ranks) for ranks in once] == [STORED] * 3
    # sent: the other replica's half (rep-rows); 3 of 4 column bands of every chunk
    # (rep-cols); the other column half of each row half (cols-rows)
    assert [sum(sent for _r, sent, _e in ranks) for ranks in once] == [
        STORED,
        STORED * 3 // 2,
        STORED // 2,
    ]


def _corrupt(rank: int, world: int, path: str) -> tuple[str, list[str]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    committed: list[str] = []

    class Recording(DefaultLoadPlanner):
        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            committed.append(f"{read_item.dest_index.fqn}@{read_item.storage_index.offset[0]}")

    mesh = _mesh()
    _save(path, mesh)
    torch.distributed.barrier()
    if rank == 0:  # a flipped bit inside the stored bottom half of "y"
        payload = _full()["y"][ROWS // 2 :].contiguous().numpy().tobytes()
        flipped = 0
        for p in sorted(Path(path).glob("*.distcp")):
            raw = bytearray(p.read_bytes())
            at = raw.find(payload)
            if at >= 0:
                raw[at + 10] ^= 0x10
                p.write_bytes(bytes(raw))
                flipped += 1
        assert flipped == 1
    torch.distributed.barrier()
    targets = {
        k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, _placements("rep-rows")) for k in KEYS
    }
    try:
        reader = swc.Reader(path, read_once=True)
        dcp.load(targets, storage_reader=reader, planner=Recording())
    except CheckpointException as e:
        return str(e), committed
    return "loaded", committed


def test_a_corrupt_chunk_read_for_others_fails_every_rank_naming_it(tmp_path: Path) -> None:
    """Only the reader of the flipped chunk reads it; DCP's read step raises its
    checksum mismatch on every rank, receivers included, naming the tensor; the
    receiver commits none of the bytes its reader sent after finding it."""
    out = run_ranks(_corrupt, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert all("'y'" in text and "checksum" in text and ".distcp" in text for text, _c in out), out
    # ranks 1 and 3 hold the bottom halves (TP rank 1): neither commits "y"'s
    assert all(f"y@{ROWS // 2}" not in committed for _t, committed in out)
    assert all("y@0" in out[r][1] for r in (0, 2))  # the top half, read clean, is


def _groups(rank: int, world: int, path: str) -> list[tuple[int, int, bool]]:
    """Ranks {0, 1} and {2, 3} each load over their own group: the Reader's group must be
    DCP's for it to route anything (by default it is the whole world: no route)."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    mesh = _mesh()
    _save(path, mesh)
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    group = pairs[rank // 2]
    out = []
    for mine in (False, True):
        targets = {k: torch.full((ROWS, COLS), -1.0) for k in KEYS}
        r = swc.Reader(path, read_once=True, process_group=group if mine else None)
        dcp.load(targets, storage_reader=r, process_group=group)
        exact = all(torch.equal(targets[k], v) for k, v in _full().items())
        out.append((r.bytes_read, r.bytes_sent, exact))
    return out


def test_a_load_over_a_subgroup_routes_only_with_the_readers_group_its_own(tmp_path: Path) -> None:
    out = run_ranks(_groups, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert all(exact for rank in out for _r, _s, exact in rank)
    assert [rank[0][:2] for rank in out] == [(STORED, 0)] * W  # each reads all: no route
    for pair in ((0, 1), (2, 3)):  # each pair reads the checkpoint once between them
        assert sum(out[r][1][0] for r in pair) == STORED
        assert sum(out[r][1][1] for r in pair) == STORED


def _one_declines(rank: int, world: int, path: str) -> tuple[int, int, bool]:
    mesh = _mesh()
    _save(path, mesh)
    return _load(path, mesh, "rep-rows", read_once=rank != 2)


def test_one_rank_declining_leaves_every_rank_reading_its_own(tmp_path: Path) -> None:
    out = run_ranks(_one_declines, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert out == [(STORED // 2, 0, True)] * W


def _resolve_fails(rank: int, world: int, path: str) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    class Refusing(DefaultLoadPlanner):
        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            if read_item.dest_index.fqn == "z":
                raise RuntimeError(f"rank {rank} cannot place z")
            return super().resolve_tensor(read_item)

    mesh = _mesh()
    _save(path, mesh)
    targets = {
        k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, _placements("rep-rows")) for k in KEYS
    }
    planner = Refusing() if rank == 1 else DefaultLoadPlanner()
    try:
        dcp.load(targets, storage_reader=swc.Reader(path, read_once=True), planner=planner)
    except CheckpointException as e:
        return str(e)
    return "loaded"


def test_a_rank_that_cannot_place_an_item_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    out = run_ranks(_resolve_fails, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert all("rank 1 cannot place z" in text for text in out), out


@contextlib.contextmanager
def _counted(fs: Any, out: collections.Counter, once: bool) -> Iterator[None]:
    """Each whole or ranged read `fs` makes counted in `out[(once, file name)]`."""
    real_file, real_ranges = fs.cat_file, fs.cat_ranges

    def one(path: str, *a: Any, **k: Any) -> Any:
        out[(once, path.rsplit("/", 1)[-1])] += 1
        return real_file(path, *a, **k)

    def ranges(paths: list[str], *a: Any, **k: Any) -> Any:
        out.update((once, p.rsplit("/", 1)[-1]) for p in paths)
        return real_ranges(paths, *a, **k)

    fs.cat_file, fs.cat_ranges = one, ranges
    try:
        yield
    finally:  # s3fs's own (sync mirrors it sets on the instance)
        fs.cat_file, fs.cat_ranges = real_file, real_ranges


def _on_s3(rank: int, world: int, url: str, options: dict) -> dict[str, int]:
    """Requests this rank made while loading, alone then read once ("once:file" -> count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    mesh = _mesh()
    _save(url, mesh, options)
    out: collections.Counter = collections.Counter()
    full = _full(big=True)
    for once in (False, True):
        reader = swc.Reader(url, storage_options=options, read_once=once)
        targets = {
            k: distribute_tensor(torch.zeros(BIG), mesh, _placements("rep-rows")) for k in full
        }
        with _counted(reader.folder.fs, out, once):  # type: ignore[attr-defined]
            dcp.load(targets, storage_reader=reader)
        assert all(torch.equal(targets[k].full_tensor(), v) for k, v in full.items())
    return {f"{once}:{name}": n for (once, name), n in out.items() if name.endswith(".distcp")}


def test_on_an_object_store_each_data_file_is_one_request(s3_bucket) -> None:
    url, options = s3_bucket
    out = run_ranks(_on_s3, W, url + "/ck", options, timeout=180)
    totals: dict[str, int] = {}
    for mine in out:
        for name, n in mine.items():
            totals[name] = totals.get(name, 0) + n
    index = Manifest.read_head(open_folder(url + "/ck", options)).index
    assert index is not None
    # every rank reads the index in `read_metadata` (DCP calls it on every rank)
    assert totals == {**totals, f"False:{index.file}": W, f"True:{index.file}": W}
    alone = {n[6:]: c for n, c in totals.items() if n.startswith("False:") and index.file not in n}
    once = {n[5:]: c for n, c in totals.items() if n.startswith("True:") and index.file not in n}
    # one data file a writer, each read by both ranks of its pair, its chunks and the
    # checksums its writer keeps after them in one request; read once: by one of them
    assert len(alone) == W
    assert alone == dict.fromkeys(alone, 2)
    assert once == dict.fromkeys(alone, 1)


# -- the routes themselves -------------------------------------------------------------


def _item(
    fqn: str, chunk: tuple[int, ...], at: tuple[int, ...], lengths: tuple[int, ...]
) -> ReadItem:
    index = MetadataIndex(fqn, chunk)
    return ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex(fqn, at),
        torch.Size([0] * len(at)),
        index,
        torch.Size(at),
        torch.Size(lengths),
    )


def test_routes_read_each_shared_chunk_once_in_rounds_within_the_batch() -> None:
    """Three ranks: "a"'s chunk (4 x 4 floats) all three read whole, "b"'s (4 x 4) ranks
    0 and 1 read a column band each, "c"'s (4 x 4) rank 2 alone reads."""
    a = _item("a", (0, 0), (0, 0), (4, 4))
    b0, b1 = _item("b", (0, 0), (0, 0), (4, 2)), _item("b", (0, 0), (0, 2), (4, 2))
    c = _item("c", (0, 0), (0, 0), (4, 4))
    items = [[a, b0], [a, b1], [a, c]]
    files = {"a": ("f0", 0), "b": ("f1", 0), "c": ("f1", 64)}
    routes = read_once.item_routes(
        items, lambda i: files[i.fqn], lambda fqn: torch.float32, batch=64
    )
    readers = {f.index.fqn: r for r, route in enumerate(routes) for _rnd, f in route.fetches}
    assert set(readers) == {"a", "b"}  # "c" is read by its one rank, as without a route
    for r, route in enumerate(routes):
        got = {it for _rnd, _src, it, _d in route.incoming}
        want = {
            it
            for it in items[r]
            if it.storage_index.fqn in readers and readers[it.storage_index.fqn] != r
        }
        assert got == want
        assert route.covered(r) == {it for it in items[r] if it.storage_index.fqn in readers}
    a_reader = readers["a"]
    assert routes[a_reader].bytes_sent(a_reader) == 2 * 64 + (32 if readers["b"] == a_reader else 0)
    (fa,) = [f for _rnd, f in routes[a_reader].fetches if f.index.fqn == "a"]
    assert fa.region.sizes == (4, 4) and [r for r, _it, _b in fa.parts] == [0, 1, 2]
    # 64 bytes a round: "a" (64 bytes to each of three ranks) and "b" cannot share one
    rounds = {f.index.fqn: rnd for route in routes for rnd, f in route.fetches}
    assert rounds == {"a": 0, "b": 1}
    assert all(
        rnd == rounds[it.storage_index.fqn]
        for route in routes
        for rnd, _s, it, _d in route.incoming
    )


def test_plans_are_routed_only_when_every_rank_asks_alike() -> None:
    a = _item("a", (0, 0), (0, 0), (4, 4))

    def plans(*asks: Any) -> list[LoadPlan]:
        return [LoadPlan([a], storage_data=ask) for ask in asks]

    def routed(ps: list[LoadPlan]) -> list[Any]:
        out = read_once.routed_plans(ps, lambda i: ("f", 0), lambda fqn: torch.float32)
        return [type(p.storage_data).__name__ for p in out]

    def ask(rank: int, group_rank: int, world: int, verify: bool, pays: bool, ck: str = "s1"):
        return read_once.Ask(rank, group_rank, world, verify, pays, ck)

    good = [ask(0, 0, 2, True, True), ask(1, 1, 2, True, True)]
    assert routed(plans(*good)) == ["ItemRoute", "ItemRoute"]
    assert routed(plans(good[0], None)) == ["NoneType", "NoneType"]
    assert routed(plans(good[0], ask(1, 1, 2, False, True))) == ["NoneType", "NoneType"]
    assert routed(plans(good[0], ask(1, 1, 2, True, False))) == ["NoneType", "NoneType"]
    assert routed(plans(good[0], ask(1, 0, 2, True, True))) == ["NoneType", "NoneType"]
    assert routed(plans(good[0], ask(1, 1, 4, True, True))) == ["NoneType", "NoneType"]
    # another checkpoint (another save, or a copy at another path)
    assert routed(plans(good[0], ask(1, 1, 2, True, True, "s2"))) == ["NoneType", "NoneType"]
    assert routed(plans(good[0])) == ["NoneType"]
    # another storage layer's data in a plan is left as it is
    assert routed(plans(good[0], "theirs")) == ["NoneType", "str"]


def _arrival(rank: int, world: int, path: str, late: bool) -> tuple[str, int, int]:
    """Rank 1's Reader raises before `read_data` (or, `late`, reaches it 3 s after the
    others, past a 1 s arrival wait): (what this rank raised, bytes read, bytes sent)."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    read_once.ARRIVAL_S = 1.0

    class Late(swc.Reader):
        def read_data(self, plan: LoadPlan, planner: Any) -> Any:
            if rank == 1:
                if not late:
                    raise RuntimeError("rank 1 fails before reading")
                time.sleep(3.0)
            return super().read_data(plan, planner)

    mesh = _mesh()
    _save(path, mesh)
    targets = {
        k: distribute_tensor(torch.zeros(ROWS, COLS), mesh, _placements("rep-rows")) for k in KEYS
    }
    reader = Late(path, read_once=True)
    try:
        dcp.load(targets, storage_reader=reader)
    except CheckpointException as e:
        return str(e), reader.bytes_read, reader.bytes_sent
    assert all(torch.equal(targets[k].full_tensor(), v) for k, v in _full().items())
    return "loaded", reader.bytes_read, reader.bytes_sent


def test_a_rank_failing_before_read_data_fails_every_rank_without_a_hang(tmp_path: Path) -> None:
    """The others give up waiting for it after `ARRIVAL_S`, read their own items, and
    DCP's gather raises its error on every rank, as stock does."""
    out = run_ranks(_arrival, W, os.fspath(tmp_path / "ck"), False, timeout=120)
    assert all("rank 1 fails before reading" in text for text, _r, _s in out), out
    assert [(read, sent) for _t, read, sent in out] == [(STORED // 2, 0), (0, 0)] + [
        (STORED // 2, 0)
    ] * 2


def test_a_rank_reaching_read_data_late_leaves_every_rank_reading_its_own(tmp_path: Path) -> None:
    out = run_ranks(_arrival, W, os.fspath(tmp_path / "ck"), True, timeout=120)
    assert out == [("loaded", STORED // 2, 0)] * W


def test_ranks_agree_on_arrival_through_the_store() -> None:
    """Every rank sees "go" only when all reached the route in time; one past the wait
    sees what the others decided (each then reads alone)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))

    def run(token: str, delays: list[float]) -> list[bool]:
        route = read_once.ItemRoute(token=token, world=len(delays))
        got: list[bool] = [False] * len(delays)

        def one(i: int) -> None:  # each rank its own client, as in a job
            mine = dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))
            time.sleep(delays[i])
            got[i] = read_once.arrived(mine, route, timeout=2.0)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(delays))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    assert run("all", [0.0, 0.1, 0.2]) == [True, True, True]
    assert run("late", [0.0, 0.0, 4.0]) == [False, False, False]


def _planners(rank: int, world: int, path: str) -> list[bool]:
    """Two planners: one whose `commit_tensor` doubles each target in place (as a planner
    that post-processes may), one whose `finish_plan` drops "z" after routing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.tensor import distribute_tensor

    import shardwise.checkpoint as swc

    class Doubling(DefaultLoadPlanner):
        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            tensor.mul_(2)

    class DropsZ(DefaultLoadPlanner):
        def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
            items = [i for i in new_plan.items if i.dest_index.fqn != "z"]
            return dataclasses.replace(new_plan, items=items)

    mesh = _mesh()
    _save(path, mesh)
    out = []
    for planner in (Doubling(), DropsZ()):
        targets = {
            k: distribute_tensor(torch.full((ROWS, COLS), -1.0), mesh, _placements("rep-rows"))
            for k in KEYS
        }
        reader = swc.Reader(path, read_once=True)
        dcp.load(targets, storage_reader=reader, planner=planner)
        got = {k: v.full_tensor() for k, v in targets.items()}
        if isinstance(planner, Doubling):
            out.append(all(torch.equal(got[k], 2 * v) for k, v in _full().items()))
        else:
            out.append(
                torch.equal(got["z"], torch.full((ROWS, COLS), -1.0))
                and all(torch.equal(got[k], _full()[k]) for k in "xy")
            )
        out.append(reader.bytes_sent > 0)
    return out


def test_a_planners_commit_and_finish_plan_act_as_without_the_route(tmp_path: Path) -> None:
    """A reader commits its own target only after sending from it (the receivers are
    sent the stored bytes, not what commit made of them), and an item `finish_plan`
    dropped is neither filled nor committed."""
    out = run_ranks(_planners, W, os.fspath(tmp_path / "ck"), timeout=120)
    assert out == [[True, True, True, True]] * W


def _whole_targets(rank: int, world: int, path: str, device: str) -> tuple[bool, int, int]:
    """Plain tensors every rank loads whole, read once: on CUDA, received in host memory
    and copied to the device (gloo carries CPU messages)."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc

    full = _full()
    swc.save({k: v.clone() for k, v in full.items()}, path)  # replicated: written once
    targets = {k: torch.zeros(ROWS, COLS, device=device) for k in KEYS}
    reader = swc.Reader(path, read_once=True)
    dcp.load(targets, storage_reader=reader)
    exact = all(torch.equal(targets[k].cpu(), v) for k, v in full.items())
    return exact, reader.bytes_read, reader.bytes_sent


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tensors_every_rank_loads_whole_are_read_once(tmp_path: Path, device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = run_ranks(_whole_targets, 2, os.fspath(tmp_path / "ck"), device, timeout=120)
    assert all(exact for exact, _r, _s in out)
    assert sum(read for _e, read, _s in out) == STORED  # each stored byte read once
    assert sum(sent for _e, _r, sent in out) == STORED  # and sent to the other rank


def _sharded_targets(rank: int, world: int, path: str, device: str) -> tuple[bool, int, int]:
    """ShardedTensor targets on `device` (DP replicas of column halves: each a band of
    every stored row half) loaded through `dcp.load` + `Reader`: on CUDA the bytes a
    rank receives land in pinned host memory and go on to its device."""
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc
    from shardwise import Block, Layout, ShardedTensor
    from shardwise.testing import shard_of

    _save(path, _mesh())
    halves = [Block((0, 0), (ROWS, COLS // 2)), Block((0, COLS // 2), (ROWS, COLS - COLS // 2))]
    layout = Layout((ROWS, COLS), {r: [halves[r % 2]] for r in range(world)}, world)
    targets = {
        k: ShardedTensor.from_layout(
            layout,
            [s.to(device) for s in shard_of(torch.full((ROWS, COLS), -1.0), layout, rank)],
            rank=rank,
        )
        for k in KEYS
    }
    reader = swc.Reader(path, read_once=True)
    dcp.load(targets, storage_reader=reader)
    exact = all(
        all(
            g.device.type == device and torch.equal(g.cpu(), w)
            for g, w in zip(targets[k].local_shards(), shard_of(v, layout, rank), strict=True)
        )
        for k, v in _full().items()
    )
    return exact, reader.bytes_read, reader.bytes_sent


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sharded_targets_on_each_device_are_read_once(tmp_path: Path, device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = run_ranks(_sharded_targets, W, os.fspath(tmp_path / "ck"), device, timeout=120)
    assert all(exact for exact, _r, _s in out)
    assert sum(read for _e, read, _s in out) == STORED  # each stored row half read once
    # each row half's reader keeps its column half and sends the 3 other ranks theirs
    assert sum(sent for _e, _r, sent in out) == STORED * 3 // 2

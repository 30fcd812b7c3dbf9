"""Bad input on ONE rank for every collective entry point: the table of cases.

Each case is a named function `(rank, folder) -> anything`, run on 2 ranks;
rank 1 (or the source rank) gets the bad input. Every rank must raise the same
exception type, promptly, and nothing on disk may change. `CASES` maps each
case's name (its function's name, dashed) to a `Case`. Used by
tests/reliability/test_bad_input.py and by `shardwise bench reliability`,
which prints the table.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import Layout, ShardedTensor, distribute, equal, from_local
from shardwise.checkpoint import load, save
from shardwise.checkpoint.format.manifest import ChunkEntry, Manifest
from shardwise.testing import run_ranks, shard_of

__all__ = ["CASES", "Case", "prepare", "run_case"]

SHAPE = (8, 6)
# the row chunk of the reference checkpoint's "w" that only rank 1 of a row split reads
CORRUPT_ROWS = (4, 8)


@dataclass(frozen=True)
class Case:
    name: str
    entry: str  # the collective entry point
    what: str  # what is wrong, and on which rank
    call: Callable[[int, Path], Any]


CASES: dict[str, Case] = {}


def case(entry: str, what: str) -> Callable[[Callable[[int, Path], Any]], Callable]:
    """Register the decorated function as the case named after it (`fls_overlap`: "fls-overlap")."""

    def register(fn: Callable[[int, Path], Any]) -> Callable[[int, Path], Any]:
        name = fn.__name__.replace("_", "-")
        assert name not in CASES, f"two cases named {name}"
        CASES[name] = Case(name, entry, what, fn)
        return fn

    return register


# -- building blocks ---------------------------------------------------------------------


def _full() -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(SHAPE)


def _st(layout: Any, rank: int) -> ShardedTensor:
    return ShardedTensor.from_layout(layout, shard_of(_full(), layout, rank))


def _rows(world: int = 2) -> Layout:
    return Layout.chunked(SHAPE, 0, world)


def _cols(world: int = 2) -> Layout:
    return Layout.chunked(SHAPE, 1, world)


def _ranked(rank: int, good: Any, bad: Any) -> Any:
    return bad if rank == 1 else good


def _good_rows(rank: int) -> tuple[list, list]:
    return [_full()[4 * rank : 4 * rank + 4].clone()], [(4 * rank, 0)]


def _fls_bad_on_rank1(rank: int, shards: Any, offsets: Any, **kw: Any) -> ShardedTensor:
    """`from_local_shards` with rank 0's good rows, and `shards`/`offsets` on rank 1."""
    if rank != 1:
        shards, offsets = _good_rows(rank)
    return ShardedTensor.from_local_shards(shards, offsets, **kw)


def _state(rank: int, world: int = 2, layout: Any = None) -> dict:
    return {"w": _st(layout or _rows(world), rank), "b": torch.ones(3), "meta": {"n": 1}}


def _target(rank: int, **override: Any) -> dict:
    t = {"w": ShardedTensor.zeros(_cols()), "b": torch.zeros(3), "meta": {"n": 0}}
    t.update(override)
    return t


def _save(rank: int, folder: Path, path: Any = None, **kw: Any) -> Any:
    return save(_state(rank), path if path is not None else folder / "new", **kw)


def _load(rank: int, folder: Path, target: dict | None = None, path: Any = None, **kw: Any) -> Any:
    return load(
        target if target is not None else _target(rank),
        path if path is not None else folder / "ref",
        **kw,
    )


def corrupt_chunk(folder: Path) -> ChunkEntry:
    """The manifest entry of the reference checkpoint's "w" chunk at rows `CORRUPT_ROWS`."""
    manifest = Manifest.read(folder / "ref")  # from version 4 its chunks are in the index
    (chunk,) = [c for c in manifest.tensors["w"].chunks if c.offsets[0] == CORRUPT_ROWS[0]]
    assert chunk.sizes[0] == CORRUPT_ROWS[1] - CORRUPT_ROWS[0], chunk
    return chunk


def _corrupt_rank1_chunk(folder: Path) -> Path:
    """A copy of ref whose second row chunk (read only by rank 1 of a row split) is damaged."""
    bad = folder / "bad"
    if not bad.exists():
        shutil.copytree(folder / "ref", bad)
        chunk = corrupt_chunk(folder)
        assert chunk.payload is not None
        with open(bad / chunk.file, "r+b") as f:
            f.seek(chunk.payload[0])
            f.write(b"\xff\xff\xff\xff")
    return bad


# -- from_local_shards ---------------------------------------------------------------------


@case("from_local_shards", "rank 1's block overlaps rank 0's")
def fls_overlap(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [_full()[2:6].clone()], [(2, 0)])


@case("from_local_shards", "rank 1's block runs past global_shape")
def fls_out_of_bounds(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [torch.zeros(5, 6)], [(4, 0)], global_shape=SHAPE)


@case("from_local_shards", "rank 1 holds nothing: rows 4..8 uncovered")
def fls_hole(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [], [], global_shape=SHAPE)


@case("from_local_shards", "rank 1's shard is float64")
def fls_dtype(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [_full()[4:].double()], [(4, 0)])


@case("from_local_shards", "rank 1's shard is a transposed view")
def fls_non_contiguous(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [torch.zeros(6, 4).t()], [(4, 0)])


@case("from_local_shards", "rank 1 passes 1 shard and 2 offsets")
def fls_lengths(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [_full()[4:].clone()], [(4, 0), (0, 0)])


@case("from_local_shards", "rank 1's shard is 3-d")
def fls_ndim(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [torch.zeros(4, 6, 1)], [(4, 0, 0)])


@case("from_local_shards", "rank 1 passes another global_shape")
def fls_global_shape(r: int, f: Path) -> Any:
    return ShardedTensor.from_local_shards(*_good_rows(r), global_shape=_ranked(r, (8, 6), (9, 6)))


@case("from_local_shards", "rank 1 passes a list as a shard")
def fls_not_a_tensor(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [[1.0, 2.0]], [(4, 0)])


@case("from_local_shards", "rank 1's offsets are negative")
def fls_negative_offset(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [_full()[4:].clone()], [(-4, 0)])


@case("from_local_shards", "rank 1's offsets are strings")
def fls_offsets_not_ints(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, [_full()[4:].clone()], [("4", "0")])


@case("from_local_shards", "rank 1 passes None for its shards")
def fls_shards_not_a_list(r: int, f: Path) -> Any:
    return _fls_bad_on_rank1(r, None, None)


@case("from_local_shards", "rank 1's global_shape is a string")
def fls_global_shape_garbage(r: int, f: Path) -> Any:
    return ShardedTensor.from_local_shards(*_good_rows(r), global_shape=_ranked(r, SHAPE, "8x6"))


# -- from_local ----------------------------------------------------------------------------


@case("from_local", "rank 1's tensor does not fit its block")
def from_local_shape(r: int, f: Path) -> Any:
    return from_local(_ranked(r, _full()[4 * r : 4 * r + 4].clone(), torch.zeros(3, 6)), _rows())


@case("from_local", "rank 1's tensor is float64")
def from_local_dtype(r: int, f: Path) -> Any:
    return from_local(_ranked(r, _full()[:4].clone(), _full()[4:].double()), _rows())


@case("from_local", "rank 1 passes a list")
def from_local_not_a_tensor(r: int, f: Path) -> Any:
    return from_local(_ranked(r, _full()[:4].clone(), [[0.0] * 6] * 4), _rows())


@case("from_local", "rank 1 passes another layout")
def from_local_layout_differs(r: int, f: Path) -> Any:
    piece = _full()[:, 3 * r : 3 * r + 3].clone() if r else _full()[:4].clone()
    return from_local(piece, _ranked(r, _rows(), _cols()))


@case("from_local", "rank 1 splits along dimension 2 of a 2-d tensor")
def from_local_dim_out_of_range(r: int, f: Path) -> Any:
    return from_local(_full()[4 * r : 4 * r + 4].clone(), _ranked(r, 0, 2), "infer")


@case("from_local", "rank 1's piece has 5 columns, rank 0's 6")
def from_local_infer_other_dims(r: int, f: Path) -> Any:
    return from_local(_ranked(r, _full()[:4].clone(), torch.zeros(4, 5)), 0, "infer")


@case("from_local", "rank 1's piece is 3-d")
def from_local_ndim(r: int, f: Path) -> Any:
    return from_local(_ranked(r, _full()[:4].clone(), torch.zeros(4, 6, 1)), 0, "chunk")


@case("from_local", "rank 1's sizes list adds up to 9, rank 0's to 8")
def from_local_sizes_sum(r: int, f: Path) -> Any:
    return from_local(_full()[4 * r : 4 * r + 4].clone(), 0, _ranked(r, [4, 4], [5, 4]))


@case("from_local", "rank 1's size in the list is not its tensor's")
def from_local_sizes_wrong(r: int, f: Path) -> Any:
    return from_local(_full()[4 * r : 4 * r + 4].clone(), 0, _ranked(r, [4, 4], [4, 3]))


# -- redistribute, full_tensor, gather ---------------------------------------------------


@case("redistribute", "rank 1 asks for another target layout")
def redistribute_other_layout(r: int, f: Path) -> Any:
    return _st(_rows(), r).redistribute(_ranked(r, _cols(), _rows()))


@case("redistribute", "rank 1's target spans 3 ranks")
def redistribute_world_size(r: int, f: Path) -> Any:
    return _st(_rows(), r).redistribute(_ranked(r, _cols(), _cols(3)))


@case("redistribute", "rank 1's target has another global shape")
def redistribute_shape(r: int, f: Path) -> Any:
    return _st(_rows(), r).redistribute(_ranked(r, _cols(), Layout.chunked((8, 7), 1, 2)))


@case("redistribute", "rank 1 passes a string")
def redistribute_not_a_layout(r: int, f: Path) -> Any:
    return _st(_rows(), r).redistribute(_ranked(r, _cols(), "columns"))


@case("redistribute", "rank 1's tensor was built with another layout")
def redistribute_source_differs(r: int, f: Path) -> Any:
    return _st(_ranked(r, _rows(), _cols()), r).redistribute(_cols())


@case("full_tensor", "rank 1's tensor was built with another layout")
def full_tensor_source_differs(r: int, f: Path) -> Any:
    return _st(_ranked(r, _rows(), _cols()), r).full_tensor()


@case("gather", "rank 1 gathers to rank 1, rank 0 to rank 0")
def gather_dst_differs(r: int, f: Path) -> Any:
    return _st(_rows(), r).gather(dst=r)


@case("gather", "rank 1 gathers to rank 5")
def gather_dst_out_of_range(r: int, f: Path) -> Any:
    return _st(_rows(), r).gather(dst=_ranked(r, 0, 5))


@case("gather", "rank 1's tensor was built with another layout")
def gather_source_differs(r: int, f: Path) -> Any:
    return _st(_ranked(r, _rows(), _cols()), r).gather(0)


# -- distribute ------------------------------------------------------------------------------


@case("distribute", "the source passes a (9, 6) tensor")
def distribute_wrong_shape(r: int, f: Path) -> Any:
    return distribute(torch.zeros(9, 6) if r == 0 else None, _rows(), src=0)


@case("distribute", "the source passes None")
def distribute_no_tensor(r: int, f: Path) -> Any:
    return distribute(None, _rows(), src=0)


@case("distribute", "rank 1 passes another layout")
def distribute_layout_differs(r: int, f: Path) -> Any:
    return distribute(_full() if r == 0 else None, _ranked(r, _rows(), _cols()), src=0)


@case("distribute", "rank 1 names itself the source")
def distribute_src_differs(r: int, f: Path) -> Any:
    return distribute(_full(), _rows(), src=r)


@case("distribute", "the source passes a string as the layout")
def distribute_source_not_a_layout(r: int, f: Path) -> Any:
    return distribute(_full() if r == 0 else None, _ranked(r, "rows", _rows()), src=0)


@case("distribute", "rank 1 names rank 5 the source")
def distribute_src_out_of_range(r: int, f: Path) -> Any:
    return distribute(_full() if r == 0 else None, _rows(), src=_ranked(r, 0, 5))


# -- equal ---------------------------------------------------------------------------------


@case("equal", "rank 1's first tensor has another layout")
def equal_layouts_differ(r: int, f: Path) -> Any:
    return equal(_st(_ranked(r, _rows(), _cols()), r), _st(_rows(), r))


@case("equal", "rank 1's second tensor has another layout")
def equal_second_differs(r: int, f: Path) -> Any:
    return equal(_st(_rows(), r), _st(_ranked(r, _cols(), _rows()), r))


@case("equal", "rank 1's second operand is a plain tensor")
def equal_plain_tensor(r: int, f: Path) -> Any:
    return equal(_st(_rows(), r), _ranked(r, _st(_rows(), r), _full()))


# -- save ----------------------------------------------------------------------------------


@case("save", "rank 1 saves to another path")
def save_path_differs(r: int, f: Path) -> Any:
    return _save(r, f, path=f / ("new" if r == 0 else "other"))


@case("save", "rank 1 passes overwrite=True")
def save_overwrite_differs(r: int, f: Path) -> Any:
    return _save(r, f, overwrite=r == 1)


@case("save", "the checkpoint exists and overwrite=False")
def save_exists(r: int, f: Path) -> Any:
    return _save(r, f, path=f / "ref")


@case("save", "rank 1's 'w' overlaps rank 0's (inconsistent layouts)")
def save_layouts_differ(r: int, f: Path) -> Any:
    return save(_state(r, layout=_ranked(r, _rows(), _cols())), f / "new")


@case("save", "rank 1 stores a lambda as an object")
def save_unpicklable(r: int, f: Path) -> Any:
    return save({**_state(r), "fn": _ranked(r, 1, lambda: 0)}, f / "new")


# -- load ----------------------------------------------------------------------------------


@case("load", "rank 1 loads another path")
def load_path_differs(r: int, f: Path) -> Any:
    return _load(r, f, path=f / ("ref" if r == 0 else "missing"))


@case("load", "rank 1 asks for a key the checkpoint lacks")
def load_missing_key(r: int, f: Path) -> Any:
    return _load(r, f, target=_target(r, **({"extra": torch.zeros(1)} if r == 1 else {})))


@case("load", "rank 1's 'b' has shape (4,)")
def load_shape(r: int, f: Path) -> Any:
    return _load(r, f, target=_target(r, b=torch.zeros(3 if r == 0 else 4)))


@case("load", "rank 1's 'b' is float64")
def load_dtype(r: int, f: Path) -> Any:
    dtype = torch.float32 if r == 0 else torch.float64
    return _load(r, f, target=_target(r, b=torch.zeros(3, dtype=dtype)))


@case("load", "rank 1 passes strict=False")
def load_strict_differs(r: int, f: Path) -> Any:
    return _load(r, f, strict=r == 0)


@case("load", "no checkpoint at the path (every rank)")
def load_no_checkpoint(r: int, f: Path) -> Any:
    return _load(r, f, path=f / "nothing")


@case("load", "the manifest is gone (an uncommitted save)")
def load_incomplete(r: int, f: Path) -> Any:
    return _load(r, f, path=f / "incomplete")


@case("load", "a chunk only rank 1 reads fails its checksum")
def load_corrupt_one_rank(r: int, f: Path) -> Any:
    # row-split targets: rank 0's rows 0..4 do not overlap the damaged rows 4..8
    path = _corrupt_rank1_chunk(f) if r == 1 else f / "bad"
    return _load(r, f, target=_target(r, w=ShardedTensor.zeros(_rows())), path=path)


# -- running -------------------------------------------------------------------------------


def prepare(folder: Path) -> None:
    """The checkpoints the load cases read: a reference, an incomplete one, a damaged one."""
    if not (folder / "ref").exists():
        run_ranks(_save_ref, 2, str(folder), timeout=60)
        shutil.copytree(folder / "ref", folder / "incomplete")
        (folder / "incomplete" / "shardwise.json").unlink()
        _corrupt_rank1_chunk(folder)


def _save_ref(rank: int, world: int, folder: str) -> None:
    save(_state(rank), Path(folder) / "ref")


def run_case(rank: int, world: int, name: str, folder: str) -> tuple[str, str]:
    """(exception type, first line of its message) this rank saw, or ("no error", "")."""
    try:
        CASES[name].call(rank, Path(folder))
    except Exception as e:  # noqa: BLE001 - recording every type is the point
        dist.barrier()  # the process group still works afterwards
        return type(e).__name__, (str(e).strip().splitlines() or [""])[0][:200]
    return "no error", ""

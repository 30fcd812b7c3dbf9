"""Bad input on ONE rank for every collective entry point: the table of cases.

Each case runs on 2 ranks; rank 1 (or the source rank) gets the bad input.
Every rank must raise the same exception type, promptly, and nothing on disk
may change. Used by tests/reliability/test_bad_input.py and by
`shardwise bench reliability`, which prints the table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CASES", "run_case"]

SHAPE = (8, 6)


def _full() -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(SHAPE)


def _st(layout: Any, rank: int) -> Any:
    from shardwise import ShardedTensor
    from shardwise.testing import shard_of

    return ShardedTensor.from_layout(layout, shard_of(_full(), layout, rank))


def _rows(world: int = 2) -> Any:
    from shardwise import Layout

    return Layout.chunked(SHAPE, 0, world)


def _cols(world: int = 2) -> Any:
    from shardwise import Layout

    return Layout.chunked(SHAPE, 1, world)


def _fls(rank: int, shards: list, offsets: list, **kw: Any) -> Any:
    from shardwise import ShardedTensor

    return ShardedTensor.from_local_shards(shards, offsets, **kw)


def _good_rows(rank: int) -> tuple[list, list]:
    return [_full()[4 * rank : 4 * rank + 4].clone()], [(4 * rank, 0)]


def _fl(tensor: Any, layout: Any, *args: Any) -> Any:
    from shardwise import from_local

    return from_local(tensor, layout, *args)


def _flsc(rank: int, bad: Callable[[], tuple[list, list]], **kw: Any) -> Any:
    shards, offsets = bad() if rank == 1 else _good_rows(rank)
    return _fls(rank, shards, offsets, **kw)


def _state(rank: int, world: int = 2, layout: Any = None) -> dict:
    return {"w": _st(layout or _rows(world), rank), "b": torch.ones(3), "meta": {"n": 1}}


def _target(rank: int, **override: Any) -> dict:
    from shardwise import ShardedTensor

    t = {"w": ShardedTensor.zeros(_cols()), "b": torch.zeros(3), "meta": {"n": 0}}
    t.update(override)
    return t


def _save(rank: int, folder: Path, path: Any = None, **kw: Any) -> Any:
    from shardwise.checkpoint import save

    return save(_state(rank), path if path is not None else folder / "new", **kw)


def _load(rank: int, folder: Path, target: dict | None = None, path: Any = None, **kw: Any) -> Any:
    from shardwise.checkpoint import load

    return load(
        target if target is not None else _target(rank),
        path if path is not None else folder / "ref",
        **kw,
    )


def _corrupt_rank1_chunk(folder: Path) -> Path:
    """A copy of ref whose second row chunk (read only by rank 1 of a row split) is damaged."""
    import shutil

    bad = folder / "bad"
    if not bad.exists():
        shutil.copytree(folder / "ref", bad)
        chunk = next(
            c
            for c in json.loads((bad / "shardwise.json").read_text())["tensors"]["w"]["chunks"]
            if c["offsets"][0] == 4
        )
        with open(bad / chunk["file"], "r+b") as f:
            f.seek(chunk["payload"][0])
            f.write(b"\xff\xff\xff\xff")
    return bad


def _ranked(rank: int, good: Any, bad: Any) -> Any:
    return bad if rank == 1 else good


# entry point, what is wrong, the call (rank, folder) -> anything
CASES: dict[str, tuple[str, str, Callable[[int, Path], Any]]] = {
    "fls-overlap": (
        "from_local_shards",
        "rank 1's block overlaps rank 0's",
        lambda r, f: _flsc(r, lambda: ([_full()[2:6].clone()], [(2, 0)])),
    ),
    "fls-out-of-bounds": (
        "from_local_shards",
        "rank 1's block runs past global_shape",
        lambda r, f: _flsc(r, lambda: ([torch.zeros(5, 6)], [(4, 0)]), global_shape=SHAPE),
    ),
    "fls-hole": (
        "from_local_shards",
        "rank 1 holds nothing: rows 4..8 uncovered",
        lambda r, f: _flsc(r, lambda: ([], []), global_shape=SHAPE),
    ),
    "fls-dtype": (
        "from_local_shards",
        "rank 1's shard is float64",
        lambda r, f: _flsc(r, lambda: ([_full()[4:].double()], [(4, 0)])),
    ),
    "fls-non-contiguous": (
        "from_local_shards",
        "rank 1's shard is a transposed view",
        lambda r, f: _flsc(r, lambda: ([torch.zeros(6, 4).t()], [(4, 0)])),
    ),
    "fls-lengths": (
        "from_local_shards",
        "rank 1 passes 1 shard and 2 offsets",
        lambda r, f: _flsc(r, lambda: ([_full()[4:].clone()], [(4, 0), (0, 0)])),
    ),
    "fls-ndim": (
        "from_local_shards",
        "rank 1's shard is 3-d",
        lambda r, f: _flsc(r, lambda: ([torch.zeros(4, 6, 1)], [(4, 0, 0)])),
    ),
    "fls-global-shape": (
        "from_local_shards",
        "rank 1 passes another global_shape",
        lambda r, f: _fls(r, *_good_rows(r), global_shape=(8, 6) if r == 0 else (9, 6)),
    ),
    "fls-not-a-tensor": (
        "from_local_shards",
        "rank 1 passes a list as a shard",
        lambda r, f: _flsc(r, lambda: ([[1.0, 2.0]], [(4, 0)])),
    ),
    "fls-negative-offset": (
        "from_local_shards",
        "rank 1's offsets are negative",
        lambda r, f: _flsc(r, lambda: ([_full()[4:].clone()], [(-4, 0)])),
    ),
    "fls-offsets-not-ints": (
        "from_local_shards",
        "rank 1's offsets are strings",
        lambda r, f: _flsc(r, lambda: ([_full()[4:].clone()], [("4", "0")])),
    ),
    "fls-shards-not-a-list": (
        "from_local_shards",
        "rank 1 passes None for its shards",
        lambda r, f: _flsc(r, lambda: (None, None)),
    ),
    "fls-global-shape-garbage": (
        "from_local_shards",
        "rank 1's global_shape is a string",
        lambda r, f: _fls(r, *_good_rows(r), global_shape=_ranked(r, SHAPE, "8x6")),
    ),
    "from-local-shape": (
        "from_local",
        "rank 1's tensor does not fit its block",
        lambda r, f: _fl(
            _ranked(r, _full()[4 * r : 4 * r + 4].clone(), torch.zeros(3, 6)), _rows()
        ),
    ),
    "from-local-dtype": (
        "from_local",
        "rank 1's tensor is float64",
        lambda r, f: _fl(_ranked(r, _full()[:4].clone(), _full()[4:].double()), _rows()),
    ),
    "from-local-not-a-tensor": (
        "from_local",
        "rank 1 passes a list",
        lambda r, f: _fl(_ranked(r, _full()[:4].clone(), [[0.0] * 6] * 4), _rows()),
    ),
    "from-local-layout-differs": (
        "from_local",
        "rank 1 passes another layout",
        lambda r, f: _fl(
            _full()[:, 3 * r : 3 * r + 3].clone() if r else _full()[:4].clone(),
            _ranked(r, _rows(), _cols()),
        ),
    ),
    "from-local-dim-out-of-range": (
        "from_local",
        "rank 1 splits along dimension 2 of a 2-d tensor",
        lambda r, f: _fl(_full()[4 * r : 4 * r + 4].clone(), _ranked(r, 0, 2), "infer"),
    ),
    "from-local-infer-other-dims": (
        "from_local",
        "rank 1's piece has 5 columns, rank 0's 6",
        lambda r, f: _fl(_ranked(r, _full()[:4].clone(), torch.zeros(4, 5)), 0, "infer"),
    ),
    "from-local-ndim": (
        "from_local",
        "rank 1's piece is 3-d",
        lambda r, f: _fl(_ranked(r, _full()[:4].clone(), torch.zeros(4, 6, 1)), 0, "chunk"),
    ),
    "from-local-sizes-sum": (
        "from_local",
        "rank 1's sizes list adds up to 9, rank 0's to 8",
        lambda r, f: _fl(_full()[4 * r : 4 * r + 4].clone(), 0, _ranked(r, [4, 4], [5, 4])),
    ),
    "from-local-sizes-wrong": (
        "from_local",
        "rank 1's size in the list is not its tensor's",
        lambda r, f: _fl(_full()[4 * r : 4 * r + 4].clone(), 0, _ranked(r, [4, 4], [4, 3])),
    ),
    "redistribute-other-layout": (
        "redistribute",
        "rank 1 asks for another target layout",
        lambda r, f: _st(_rows(), r).redistribute(_ranked(r, _cols(), _rows())),
    ),
    "redistribute-world-size": (
        "redistribute",
        "rank 1's target spans 3 ranks",
        lambda r, f: _st(_rows(), r).redistribute(_ranked(r, _cols(), _cols(3))),
    ),
    "redistribute-shape": (
        "redistribute",
        "rank 1's target has another global shape",
        lambda r, f: _st(_rows(), r).redistribute(
            _ranked(r, _cols(), __import__("shardwise").Layout.chunked((8, 7), 1, 2))
        ),
    ),
    "redistribute-not-a-layout": (
        "redistribute",
        "rank 1 passes a string",
        lambda r, f: _st(_rows(), r).redistribute(_ranked(r, _cols(), "columns")),
    ),
    "redistribute-source-differs": (
        "redistribute",
        "rank 1's tensor was built with another layout",
        lambda r, f: _st(_ranked(r, _rows(), _cols()), r).redistribute(_cols()),
    ),
    "full-tensor-source-differs": (
        "full_tensor",
        "rank 1's tensor was built with another layout",
        lambda r, f: _st(_ranked(r, _rows(), _cols()), r).full_tensor(),
    ),
    "gather-dst-differs": (
        "gather",
        "rank 1 gathers to rank 1, rank 0 to rank 0",
        lambda r, f: _st(_rows(), r).gather(dst=r),
    ),
    "gather-dst-out-of-range": (
        "gather",
        "rank 1 gathers to rank 5",
        lambda r, f: _st(_rows(), r).gather(dst=_ranked(r, 0, 5)),
    ),
    "gather-source-differs": (
        "gather",
        "rank 1's tensor was built with another layout",
        lambda r, f: _st(_ranked(r, _rows(), _cols()), r).gather(0),
    ),
    "distribute-wrong-shape": (
        "distribute",
        "the source passes a (9, 6) tensor",
        lambda r, f: __import__("shardwise").distribute(
            torch.zeros(9, 6) if r == 0 else None, _rows(), src=0
        ),
    ),
    "distribute-no-tensor": (
        "distribute",
        "the source passes None",
        lambda r, f: __import__("shardwise").distribute(None, _rows(), src=0),
    ),
    "distribute-layout-differs": (
        "distribute",
        "rank 1 passes another layout",
        lambda r, f: __import__("shardwise").distribute(
            _full() if r == 0 else None, _ranked(r, _rows(), _cols()), src=0
        ),
    ),
    "distribute-src-differs": (
        "distribute",
        "rank 1 names itself the source",
        lambda r, f: __import__("shardwise").distribute(_full(), _rows(), src=r),
    ),
    "distribute-source-not-a-layout": (
        "distribute",
        "the source passes a string as the layout",
        lambda r, f: __import__("shardwise").distribute(
            _full() if r == 0 else None, _ranked(r, "rows", _rows()), src=0
        ),
    ),
    "distribute-src-out-of-range": (
        "distribute",
        "rank 1 names rank 5 the source",
        lambda r, f: __import__("shardwise").distribute(
            _full() if r == 0 else None, _rows(), src=_ranked(r, 0, 5)
        ),
    ),
    "equal-layouts-differ": (
        "equal",
        "rank 1's first tensor has another layout",
        lambda r, f: __import__("shardwise").equal(
            _st(_ranked(r, _rows(), _cols()), r), _st(_rows(), r)
        ),
    ),
    "equal-second-differs": (
        "equal",
        "rank 1's second tensor has another layout",
        lambda r, f: __import__("shardwise").equal(
            _st(_rows(), r), _st(_ranked(r, _cols(), _rows()), r)
        ),
    ),
    "equal-plain-tensor": (
        "equal",
        "rank 1's second operand is a plain tensor",
        lambda r, f: __import__("shardwise").equal(
            _st(_rows(), r), _ranked(r, _st(_rows(), r), _full())
        ),
    ),
    "save-path-differs": (
        "save",
        "rank 1 saves to another path",
        lambda r, f: _save(r, f, path=f / ("new" if r == 0 else "other")),
    ),
    "save-overwrite-differs": (
        "save",
        "rank 1 passes overwrite=True",
        lambda r, f: _save(r, f, overwrite=r == 1),
    ),
    "save-exists": (
        "save",
        "the checkpoint exists and overwrite=False",
        lambda r, f: _save(r, f, path=f / "ref"),
    ),
    "save-layouts-differ": (
        "save",
        "rank 1's 'w' overlaps rank 0's (inconsistent layouts)",
        lambda r, f: __import__("shardwise.checkpoint", fromlist=["save"]).save(
            _state(r, layout=_ranked(r, _rows(), _cols())), f / "new"
        ),
    ),
    "save-unpicklable": (
        "save",
        "rank 1 stores a lambda as an object",
        lambda r, f: __import__("shardwise.checkpoint", fromlist=["save"]).save(
            {**_state(r), "fn": _ranked(r, 1, lambda: 0)}, f / "new"
        ),
    ),
    "load-path-differs": (
        "load",
        "rank 1 loads another path",
        lambda r, f: _load(r, f, path=f / ("ref" if r == 0 else "missing")),
    ),
    "load-missing-key": (
        "load",
        "rank 1 asks for a key the checkpoint lacks",
        lambda r, f: _load(
            r, f, target=_target(r, **({"extra": torch.zeros(1)} if r == 1 else {}))
        ),
    ),
    "load-shape": (
        "load",
        "rank 1's 'b' has shape (4,)",
        lambda r, f: _load(r, f, target=_target(r, b=torch.zeros(3 if r == 0 else 4))),
    ),
    "load-dtype": (
        "load",
        "rank 1's 'b' is float64",
        lambda r, f: _load(
            r,
            f,
            target=_target(r, b=torch.zeros(3, dtype=torch.float32 if r == 0 else torch.float64)),
        ),
    ),
    "load-strict-differs": (
        "load",
        "rank 1 passes strict=False",
        lambda r, f: _load(r, f, strict=r == 0),
    ),
    "load-no-checkpoint": (
        "load",
        "no checkpoint at the path (every rank)",
        lambda r, f: _load(r, f, path=f / "nothing"),
    ),
    "load-incomplete": (
        "load",
        "the manifest is gone (an uncommitted save)",
        lambda r, f: _load(r, f, path=f / "incomplete"),
    ),
    "load-corrupt-one-rank": (
        "load",
        "a chunk only rank 1 reads fails its checksum",
        lambda r, f: _load(
            r,
            f,
            target=_target(r, w=__import__("shardwise").ShardedTensor.zeros(_rows())),
            path=_corrupt_rank1_chunk(f) if r == 1 else f / "bad",
        ),
    ),
}


def prepare(folder: Path) -> None:
    """The checkpoints the load cases read: a reference, an incomplete one, a damaged one."""
    import shutil

    from shardwise.testing import run_ranks

    if not (folder / "ref").exists():
        run_ranks(_save_ref, 2, str(folder), timeout=60)
        shutil.copytree(folder / "ref", folder / "incomplete")
        (folder / "incomplete" / "shardwise.json").unlink()
        _corrupt_rank1_chunk(folder)


def _save_ref(rank: int, world: int, folder: str) -> None:
    from shardwise.checkpoint import save

    save(_state(rank), Path(folder) / "ref")


def run_case(rank: int, world: int, name: str, folder: str) -> tuple[str, str]:
    """(exception type, first line of its message) this rank saw, or ("no error", "")."""
    import torch.distributed as dist

    try:
        CASES[name][2](rank, Path(folder))
    except Exception as e:  # noqa: BLE001 - recording every type is the point
        dist.barrier()  # the process group still works afterwards
        return type(e).__name__, (str(e).strip().splitlines() or [""])[0][:200]
    return "no error", ""

"""Crash, corruption and bad-input scenarios, shared by `tests/reliability/` and
`shardwise bench reliability` (which runs them many times and prints figures).

Each scenario runs real ranks (`shardwise.testing.run_ranks`), does damage,
then checks from a fresh process what a user would see: nothing committed is
lost, nothing damaged loads silently, no rank hangs.

Every helper takes a location: a local `Path`, or a `Where` (a path, or an fsspec
URL such as `s3://bucket/prefix` with its `storage_options`). Files are listed,
planted, copied and damaged through `shardwise.storage.open_folder`, so the same
scenarios run on a local disk and on an object store.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shardwise.storage import Folder

__all__ = [
    "ALLOWED_STATES",
    "COORDINATOR_POINTS",
    "CORRUPTIONS",
    "CRASH_POINTS",
    "CrashOutcome",
    "CorruptionOutcome",
    "Location",
    "Where",
    "corrupt_and_load",
    "crash_save",
    "expected_states",
    "make_state",
    "observe",
    "reference_tensors",
]

CRASH_POINTS = (
    "before-write",
    "mid-data",
    "after-data",
    "before-commit",
    "between-records",
    "before-collect",
    "mid-collect",
)
# reached only by the coordinator (rank 0): killing another rank there does nothing
COORDINATOR_POINTS = ("before-commit", "between-records", "before-collect", "mid-collect")
# files a user keeps beside (or inside) a checkpoint folder: no save may touch them
FOREIGN_FILES = {
    "notes.txt": b"do not delete\n",
    "model.pt": bytes(range(256)) * 4,
    "__9_9.distcp": b"not ours",
}
SHAPES = {"emb": (48, 16), "dense": (12, 10), "bias": (10,)}


# -- locations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """A checkpoint folder: a local path, or a URL with the `storage_options` its
    fsspec backend needs (plain data, so ranks in other processes get it as an argument)."""

    location: str | Path
    options: dict[str, Any] | None = None

    @classmethod
    def of(cls, location: Location) -> Where:
        return location if isinstance(location, Where) else cls(location)

    @property
    def is_local(self) -> bool:
        from shardwise.storage import is_url

        return not is_url(self.location)

    @property
    def url(self) -> str:
        """What `save`/`load` take as `path` (a string: ranks get it pickled)."""
        return str(self.location)

    @property
    def name(self) -> str:
        return Path(self.location).name if self.is_local else self.url.rstrip("/").rsplit("/")[-1]

    def child(self, name: str) -> Where:
        if self.is_local:
            return Where(Path(self.location) / name, self.options)
        return Where(f"{self.url.rstrip('/')}/{name}", self.options)

    def folder(self) -> Folder:
        from shardwise.storage import open_folder

        return open_folder(self.location, self.options)

    def clear(self) -> None:
        """Remove the folder with everything in it (on an object store: every object)."""
        if self.is_local:
            shutil.rmtree(self.location, ignore_errors=True)
            return
        folder = self.folder()
        for name in folder.names():
            folder.remove(name)

    def copy_to(self, target: Where) -> None:
        """`target` made a copy of this folder, object by object (emptied first)."""
        target.clear()
        source, dest = self.folder(), target.folder()
        dest.make()
        for name in source.names():
            dest.write_durably(name, source.read(name))

    def __str__(self) -> str:
        return self.url


Location = Path | Where  # what every helper below takes


def reference_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def make_state(rank: int, world: int, seed: int) -> dict[str, Any]:
    """A small sharded state: row-wise uneven, column-wise, replicated, an object."""
    from shardwise import Layout, ShardedTensor
    from shardwise.testing import shard_of

    full = reference_tensors(seed)
    layouts = {
        "emb": Layout.row_wise(SHAPES["emb"], [30, 18] if world == 2 else [48 // world] * world),
        "dense": Layout.chunked(SHAPES["dense"], 1, world),
    }
    state: dict[str, Any] = {
        k: ShardedTensor.from_layout(lay, shard_of(full[k], lay, rank))
        for k, lay in layouts.items()
    }
    state["bias"] = full["bias"].clone()
    state["meta"] = {"seed": seed}
    return state


def load_plain(path: Location) -> dict[str, Any]:
    """Load a checkpoint in this process into full tensors (no process group)."""
    from shardwise.checkpoint import load

    where = Where.of(path)
    state: dict[str, Any] = {k: torch.zeros(s) for k, s in SHAPES.items()}
    state["meta"] = {"seed": -1}
    load(state, where.location, storage_options=where.options)
    return state


def holds(path: Location, seed: int) -> bool:
    state = load_plain(path)
    full = reference_tensors(seed)
    return state["meta"]["seed"] == seed and all(torch.equal(state[k], full[k]) for k in SHAPES)


def observe(path: Location, candidates: dict[str, int]) -> str:
    """What a fresh process sees at `path`, found by loading it: the name of the
    candidate (name -> seed) whose checkpoint it holds bit for bit, "incomplete"
    (`IncompleteCheckpointError`), "absent" (`FileNotFoundError`), "wrong data" (it
    loads, but as none of the candidates), or the unexpected error itself."""
    from shardwise.checkpoint import IncompleteCheckpointError

    try:
        state = load_plain(path)
    except IncompleteCheckpointError:
        return "incomplete"
    except FileNotFoundError:
        return "absent"
    except Exception as e:  # noqa: BLE001 - any other type is itself the finding
        return f"{type(e).__name__}: {e}"
    for name, seed in candidates.items():
        full = reference_tensors(seed)
        if state["meta"]["seed"] == seed and all(torch.equal(state[k], full[k]) for k in SHAPES):
            return name
    return "wrong data"


def _contents(folder: Where) -> dict[str, bytes]:
    files = folder.folder()
    return {n: files.read(n) for n in sorted(files.sizes())}


# -- crashes ---------------------------------------------------------------------------------


def _save_rank(
    rank: int,
    world: int,
    path: str,
    seed: int,
    failpoint: str | None,
    overwrite: bool,
    use_async: bool,
    storage_options: dict[str, Any] | None = None,
) -> None:
    from shardwise.checkpoint import async_save, save

    if failpoint:
        os.environ["SHARDWISE_FAILPOINT"] = failpoint  # this process only
    state = make_state(rank, world, seed)
    if use_async:
        future = async_save(state, path, overwrite=overwrite, storage_options=storage_options)
        make_state(rank, world, seed + 100)  # the trainer goes on meanwhile
        future.result()
    else:
        save(state, path, overwrite=overwrite, storage_options=storage_options)


def _save(
    where: Where,
    world: int,
    seed: int,
    failpoint: str | None = None,
    *,
    overwrite: bool,
    use_async: bool = False,
    allow_dead: bool = False,
) -> None:
    """`_save_rank` on `world` real ranks, into `where`."""
    from shardwise.testing import run_ranks

    run_ranks(
        _save_rank,
        world,
        where.url,
        seed,
        failpoint,
        overwrite,
        use_async,
        where.options,
        timeout=60,
        allow_dead=allow_dead,
    )


# The states an interrupted save may leave its path in, as `observe` names them
# ("previous": the checkpoint it was overwriting, bit for bit; "complete": the new
# one, bit for bit; "incomplete": loading raises IncompleteCheckpointError). An overwrite
# left "incomplete" has still lost the checkpoint it replaced: `lost_previous` says so.
ALLOWED_STATES = {
    "new path": ("absent", "incomplete", "complete"),
    "overwrite": ("previous", "complete", "incomplete"),
}


# Where a save becomes visible (commit.py): the coordinator renames `.metadata` into
# place, then `shardwise.json`. A new path has no manifest yet, so its `.metadata` alone
# reads as a complete stock checkpoint; on an overwrite the old manifest no longer
# matches `.metadata`'s checksum, and a shardwise reader then follows `.metadata`, as
# stock readers do (never the data it replaced): visible from the first rename on.
_COMMITTED_AFTER = {
    "new path": ("between-records", "before-collect", "mid-collect"),
    "overwrite": ("between-records", "before-collect", "mid-collect"),
}


def expected_states(point: str, overwrite: bool) -> tuple[str, ...]:
    """The states a kill at `point` (of any rank or all) may leave the save's path in:
    the new checkpoint once its commit record is in place, else what was there before."""
    target = "overwrite" if overwrite else "new path"
    if point in _COMMITTED_AFTER[target]:
        return ("complete",)
    return ("previous",) if overwrite else ("absent", "incomplete")


@dataclass
class CrashOutcome:
    point: str
    target: str  # "new path" or "overwrite"
    lost_previous: bool  # the earlier checkpoint no longer loads bit for bit (an overwrite:
    # the path loads as neither the earlier nor the new checkpoint)
    new_state: str  # what loading the interrupted save's path gave (`observe`)
    resave_ok: bool  # a later save to the same path succeeded and loads
    stray: list[str]  # files left in the folder after that later save that it does not name
    foreign_lost: list[str]  # files that no checkpoint wrote and that were changed or removed
    previous_changed: list[str]  # a save to a new path: files of the earlier checkpoint's
    # folder that it added, changed or removed
    seconds: float
    resave_error: str = ""  # why that later save failed, when it did

    @property
    def allowed_states(self) -> tuple[str, ...]:
        return ALLOWED_STATES[self.target]

    @property
    def ok(self) -> bool:
        return (
            not self.lost_previous
            and self.new_state in self.allowed_states
            and self.resave_ok
            and not self.stray
            and not self.foreign_lost
            and not self.previous_changed
        )


def _plant_foreign(folder: Where) -> None:
    files = folder.folder()
    files.make()
    for name, data in FOREIGN_FILES.items():
        files.write_durably(name, data)


def _foreign_lost(folder: Where) -> list[str]:
    """The user's files in `folder` that are gone or whose bytes changed."""
    files = folder.folder()
    present = files.sizes()
    lost = []
    for n, data in FOREIGN_FILES.items():
        try:
            intact = n in present and files.read(n) == data
        except OSError:
            intact = False
        if not intact:
            lost.append(f"{folder.name}/{n}")
    return sorted(lost)


def _stray(folder: Where) -> list[str]:
    """Files in a committed folder that neither its records nor the user put there."""
    from shardwise.checkpoint.io.commit import referenced_files

    files = folder.folder()
    expected = (
        referenced_files(files) | set(FOREIGN_FILES) | {".metadata", "shardwise.json", ".shardwise"}
    )
    return sorted(n for n in files.names() if n not in expected)


def crash_save(
    folder: Location,
    point: str,
    *,
    kill_rank: int | None = None,
    overwrite: bool = False,
    use_async: bool = False,
    world: int = 2,
) -> CrashOutcome:
    """SIGKILL a save (all ranks, or `kill_rank`) at `point` into a folder that
    also holds files of the user's (`FOREIGN_FILES`); report what a fresh process
    then observes (nothing is assumed from where the kill happened).

    `folder` is a local path or a `Where` (an object store URL): the earlier checkpoint
    lives in its `previous/`, a save to a new path goes to its `new/`."""
    start = time.monotonic()
    folder = Where.of(folder)
    folder.folder().make()
    previous = folder.child("previous")
    if not previous.folder().has("shardwise.json"):
        _plant_foreign(previous)
        _save(previous, world, 0, overwrite=False)
    target = previous if overwrite else folder.child("new")
    if not overwrite:
        _plant_foreign(target)
    before = _contents(previous)
    spec = point if kill_rank is None else f"{point}@{kill_rank}"
    _save(target, world, 1, spec, overwrite=overwrite, use_async=use_async, allow_dead=True)
    # what a fresh process sees now, at the interrupted save's path and at the earlier one
    if overwrite:
        new_state = observe(target, {"previous": 0, "complete": 1})
        lost = new_state not in ("previous", "complete")
        changed: list[str] = []
    else:
        new_state = observe(target, {"complete": 1})
        lost = observe(previous, {"previous": 0}) != "previous"
        after = _contents(previous)
        changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    foreign = set(_foreign_lost(target)) | set(_foreign_lost(previous))
    resave_error = ""
    try:
        _save(target, world, 2, overwrite=True)
        resaved = observe(target, {"resaved": 2})
        resave = resaved == "resaved"
        resave_error = "" if resave else f"it loads as: {resaved}"
    except Exception as e:  # noqa: BLE001 - reported in the outcome
        resave, resave_error = False, f"{type(e).__name__}: {e}"
    stray = _stray(target)
    foreign |= set(_foreign_lost(target))
    outcome = CrashOutcome(
        point,
        "overwrite" if overwrite else "new path",
        lost,
        new_state,
        resave,
        stray,
        sorted(foreign),
        changed,
        time.monotonic() - start,
        resave_error,
    )
    if overwrite:  # restore the reference checkpoint for the next scenario
        _save(previous, world, 0, overwrite=True)
    else:
        target.clear()
    return outcome


# -- corruption -------------------------------------------------------------------------------


@dataclass
class CorruptionOutcome:
    kind: str
    file: str
    offset: int
    load: str  # "detected: <Type>", "loaded correct", "loaded WRONG", "other error: <Type>"
    verify_found: bool

    @property
    def ok(self) -> bool:
        if self.load.startswith("loaded WRONG") or self.load.startswith("other error"):
            return False
        return self.load.startswith("detected") or self.verify_found


def _damage(folder: Where, rng: random.Random, kind: str) -> tuple[str, int]:
    """Damage one file of `folder` (`kind`): a bit flipped (read, changed, written back
    whole), cut short (rewritten shorter) or deleted. Returns its name and the offset."""
    files = folder.folder()
    sizes = files.sizes()
    names = sorted(n for n in sizes if n != ".shardwise")
    if kind in ("flip manifest", "truncate manifest", "delete manifest"):
        victim = "shardwise.json"
    elif kind == "flip .metadata":
        victim = ".metadata"
    else:
        victim = rng.choice([n for n in names if Path(n).suffix == ".distcp"])
    size = sizes[victim]
    if kind.startswith("truncate"):
        cut = rng.randrange(0, size)
        files.write_durably(victim, files.read(victim)[:cut])
        return victim, cut
    if kind.startswith("delete"):
        files.remove(victim)
        return victim, 0
    offset = rng.randrange(0, size)
    data = bytearray(files.read(victim))
    data[offset] ^= 1 << rng.randrange(8)
    files.write_durably(victim, bytes(data))
    return victim, offset


CORRUPTIONS = (
    "flip data",
    "truncate data",
    "delete data",
    "flip manifest",
    "truncate manifest",
    "delete manifest",
    "flip .metadata",
)


def corrupt_and_load(
    source: Location, scratch: Location, rng: random.Random, kind: str, seed: int = 0
) -> CorruptionOutcome:
    """Copy `source`, damage the copy (`kind`), load it and verify it."""
    from shardwise.checkpoint import (
        CheckpointMismatchError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
        verify,
    )

    scratch = Where.of(scratch)
    Where.of(source).copy_to(scratch)
    name, offset = _damage(scratch, rng, kind)
    try:
        ok = holds(scratch, seed)
        load = "loaded correct" if ok else "loaded WRONG"
    except (CorruptCheckpointError, IncompleteCheckpointError, CheckpointMismatchError) as e:
        load = f"detected: {type(e).__name__}"
    except Exception as e:  # noqa: BLE001 - an unexpected type is the finding
        load = f"other error: {type(e).__name__}: {e}"
    try:
        verify(scratch.location, storage_options=scratch.options)
        found = False
    except (CorruptCheckpointError, IncompleteCheckpointError, FileNotFoundError):
        found = True  # FileNotFoundError: damaged past being recognized as a checkpoint
    return CorruptionOutcome(kind, name, offset, load, found)


def save_reference(path: Location, world: int = 2, seed: int = 0) -> None:
    where = Where.of(path)
    where.clear()
    _save(where, world, seed, overwrite=False)

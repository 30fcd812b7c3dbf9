"""A save killed before its first data file is an interrupted save, not "no checkpoint"
(issue 35, point 13; SPEC §3): its folder holds only the save's lease, or temporary names
of its records (the key owners' parts, `.metadata` or the lock before their rename), and
every reader raises `IncompleteCheckpointError` naming them. An empty or absent folder, or
one holding only the user's files, stays `CheckpointNotFoundError`.

The files come from a real save, SIGKILLed at its first failpoint in a subprocess (its
lease and its parts written, its index not yet read back), with its data files taken
away: what a kill a moment earlier leaves."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise.checkpoint.engine import records
from shardwise.errors import CheckpointNotFoundError, IncompleteCheckpointError

from ..checkpoint.readers import READERS

pytestmark = pytest.mark.spawned

_SAVE = (
    "import sys, torch, shardwise.checkpoint as swc; swc.save({'a': torch.ones(3, 4)}, sys.argv[1])"
)
LEASE = ".shardwise.lock"


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """What a save SIGKILLed at `before-write` left: its lease, its part, its index file."""
    path = tmp_path_factory.mktemp("killed") / "ck"
    env = dict(os.environ, SHARDWISE_FAILPOINT="before-write")
    done = subprocess.run(
        [sys.executable, "-c", _SAVE, str(path)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    return path


def _part(killed: Path) -> str:
    (part,) = [
        n for n in os.listdir(killed) if re.fullmatch(r"shardwise\.json\.sw[0-9a-f]{12}\.tmp", n)
    ]
    return part


# what the folder holds: names taken from the killed save, or written as a save writes them
LEFT: dict[str, Callable[[Path, Path], list[str]]] = {}


def _case(
    name: str,
) -> Callable[[Callable[[Path, Path], list[str]]], Callable[[Path, Path], list[str]]]:
    def register(make: Callable[[Path, Path], list[str]]) -> Callable[[Path, Path], list[str]]:
        LEFT[name] = make
        return make

    return register


def _taken(killed: Path, to: Path, names: list[str]) -> list[str]:
    for n in names:
        shutil.copy2(killed / n, to / n)
    return sorted(names)


@_case("its lease only")
def _lease_only(killed: Path, to: Path) -> list[str]:
    return _taken(killed, to, [LEASE])


@_case("its part only")
def _part_only(killed: Path, to: Path) -> list[str]:
    return _taken(killed, to, [_part(killed)])


@_case("its lease and part")
def _lease_and_part(killed: Path, to: Path) -> list[str]:
    return _taken(killed, to, [LEASE, _part(killed)])


@_case("its lease beside the user's files")
def _beside_user_files(killed: Path, to: Path) -> list[str]:
    (to / "notes.txt").write_text("mine\n")
    (to / "__9_9.distcp").write_bytes(b"not ours")
    return _taken(killed, to, [LEASE])


@_case("a per-rank lease")
def _per_rank_lease(killed: Path, to: Path) -> list[str]:
    shutil.copy2(killed / LEASE, to / "__1.shardwise.lock")
    return ["__1.shardwise.lock"]


@_case("temporary records and lock")
def _temporaries(killed: Path, to: Path) -> list[str]:
    names = [".metadata.sw0123456789ab.tmp", ".shardwise.lock.swba9876543210.tmp"]
    for n in names:
        (to / n).write_bytes(b"unfinished")
    return sorted(names)


CASES = [(case, reader) for case in LEFT for reader in READERS]


@pytest.mark.parametrize("case, reader", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_a_save_killed_before_its_data_is_reported_incomplete(killed, tmp_path, case, reader):
    folder = tmp_path / "ck"
    folder.mkdir()
    left = LEFT[case](killed, folder)
    expected = (
        f"a save to {folder} started but never committed: it holds {', '.join(left)} (the "
        "lease or unfinished records of a save still running, or killed before its first "
        "data file) and no checkpoint; wait for that save, or save again"
    )
    if reader == "verify_report":
        assert READERS[reader](folder) == [expected]
        return
    with pytest.raises(IncompleteCheckpointError) as info:
        READERS[reader](folder)
    assert expected in str(info.value)


NOTHING: dict[str, Callable[[Path], None]] = {
    "absent": lambda p: None,
    "empty": lambda p: p.mkdir(),
    "the user's files only": lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine\n")) and None,
    "a lookalike of ours": lambda p: (p.mkdir(), (p / "model.lock").write_text("x")) and None,
}
EMPTY = [(case, reader) for case in NOTHING for reader in READERS if reader != "verify_report"]


@pytest.mark.parametrize("case, reader", EMPTY, ids=[f"{c}-{r}" for c, r in EMPTY])
def test_a_folder_no_save_touched_is_no_checkpoint(tmp_path, case, reader):
    folder = tmp_path / "ck"
    NOTHING[case](folder)
    with pytest.raises(
        CheckpointNotFoundError, match=f"^no checkpoint at {re.escape(str(folder))}$"
    ):
        READERS[reader](folder)


def test_only_a_saves_own_names_count():
    assert records.save_leftovers(
        [
            ".shardwise.lock",
            "__3.shardwise.lock",
            "shardwise.json.sw0123456789ab.tmp",
            "__2.shardwise.json.sw0123456789ab.tmp",
            "__2.metadata.sw0123456789ab.tmp",
            ".shardwise.sw0123456789ab.tmp",
            "notes.txt",
            "model.lock",
            "notes.txt.sw0123456789ab.tmp",
            "shardwise.json",
            "x.shardwise.lock",
        ]
    ) == [
        ".shardwise.lock",
        ".shardwise.sw0123456789ab.tmp",
        "__2.metadata.sw0123456789ab.tmp",
        "__2.shardwise.json.sw0123456789ab.tmp",
        "__3.shardwise.lock",
        "shardwise.json.sw0123456789ab.tmp",
    ]

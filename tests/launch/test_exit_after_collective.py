"""A job whose last gloo collective comes just before it exits ends with status 0 once
shardwise has talked to its process group.

torch 2.13's gloo workers free a finished collective's tensors after `wait()` returned,
and that takes the GIL: a worker still waiting for it when the interpreter finalizes is
ended by `pthread_exit`, and the job aborts ("terminate called without an active
exception"). Here the script drops its handle before the collective ends and holds the
GIL from then to the exit (`sys.setswitchinterval`, a busy wait on the output), so the
worker waits for the GIL on every run; the control run, which never builds a
communicator, shows it aborts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import jobs

pytestmark = pytest.mark.spawned

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from shardwise.comm.communicator import communicator

dist.init_process_group("gloo")
if sys.argv[1] == "shardwise":
    communicator(None)  # shardwise has talked to the group: nothing is sent
world, rank = dist.get_world_size(), dist.get_rank()
out, mine = torch.zeros(4 * world), torch.full((4 * world,), float(rank + 1))
seen, want = out.numpy(), [float(r + 1) for r in range(world) for _ in range(4)]
sys.setswitchinterval(30)  # this thread keeps the GIL from here to the exit
work = dist.all_to_all_single(out, mine, async_op=True)
del work  # the worker holds the last reference: it frees the tensors
while seen.tolist() != want:  # every rank's bytes arrived (no call that drops the GIL)
    pass
"""


def _job(tmp_path: Path, mode: str) -> tuple[int, str]:
    script = tmp_path / "last_collective.py"
    script.write_text(SCRIPT)
    code, out, err = jobs.torchrun(script, 3, mode)
    return code, out + err


def test_a_collective_just_before_exit_does_not_abort_the_rank(tmp_path: Path) -> None:
    code, out = _job(tmp_path, "shardwise")
    assert code == 0, out[-4000:]
    assert "terminate called" not in out


def test_without_a_communicator_the_same_job_aborts(tmp_path: Path) -> None:
    """The control: torch alone aborts a rank at exit, so the test above can fail."""
    code, out = _job(tmp_path, "torch")
    assert code != 0
    assert "terminate called without an active exception" in out
    assert "exitcode  : -6" in out  # SIGABRT
    assert "]: Traceback" not in out  # no rank raised ("[rank1]: Traceback ...")

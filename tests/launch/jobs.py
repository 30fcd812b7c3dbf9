"""`torchrun` jobs for tests: a script on N local ranks, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # one torchrun job; well below pytest's 600 s


def torchrun(
    script: Path, nproc: int, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `torchrun --nproc-per-node nproc script args...`
    from the repository's root, in `env` (default: this process's), one thread per rank;
    the whole job (launcher and ranks) is ended if it outlives TIMEOUT_S."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the ranks go with the launcher
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        name = Path(script).name
        pytest.fail(f"{name} on {nproc} ranks ran past {TIMEOUT_S} s\n{out[-4000:]}{err[-4000:]}")
    return proc.returncode, out, err

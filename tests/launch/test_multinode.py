"""A real two-node launch: two `torchrun` launchers meet by c10d rendezvous on 127.0.0.1,
save on 2 x 4 ranks, then two more launchers load on 2 x 3 ranks in other layouts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned

JOB = Path(__file__).with_name("multinode_job.py")
PHASE_TIMEOUT_S = 240
# Elements each rank handles (see multinode_job.py). Save: emb rows [7,0,5,9,3,6,4,6] x 12
# + proj columns [2,4,3,0,5,3,4,3] x 10. Load: emb 2 columns x 40 + proj 2 rows x 24 (none
# on rank 5) + the 16 bias values.
SAVED = [104, 40, 90, 108, 86, 102, 88, 102]
LOADED = [144, 144, 144, 144, 144, 96]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(mode: str, per_node: int, ckpt: Path, markers: Path, logs: Path) -> None:
    """Start both launchers at once and wait for them; fail with their output unless both
    exit 0."""
    rendezvous = [
        "--nnodes=2",
        f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        f"--rdzv-id={mode}-{uuid.uuid4().hex}",
        "--rdzv-conf=join_timeout=120",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, str(JOB)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs, outputs = [], []
    for launcher in range(2):
        out = logs / f"{mode}-launcher-{launcher}.log"
        with out.open("wb") as sink:
            procs.append(
                subprocess.Popen(
                    [*command, mode, str(ckpt), str(markers)],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        outputs.append(out)
    codes = _wait_both(procs)
    if codes != [0, 0]:
        text = "\n".join(f"--- {o.name}\n{o.read_text()[:6000]}" for o in outputs)
        pytest.fail(f"{mode} launchers ended with {codes} (None: stopped)\n{text}")


def _wait_both(procs: list[subprocess.Popen]) -> list[int | None]:
    """The launchers' exit codes, None for one stopped here: at the deadline, or as soon as
    the other fails (the survivor would sit in torchrun's 300 s exit barrier)."""
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        return [p.poll() for p in procs]
    finally:  # also when pytest is interrupted
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # torchrun passes it on to its workers
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _markers(mode: str, counts: list[int]) -> dict[str, str]:
    """What each rank writes (test_multinode's job); node-major ranks, as torchrun numbers them."""
    per_node = len(counts) // 2
    return {
        f"{mode}-{r}": f"{mode} rank={r} world={len(counts)} node={r // per_node} "
        f"local={r % per_node} elements={n}\n"
        for r, n in enumerate(counts)
    }


def test_save_on_two_nodes_of_four_load_on_two_nodes_of_three(tmp_path):
    ckpt, markers, logs = tmp_path / "ckpt", tmp_path / "markers", tmp_path / "logs"
    markers.mkdir()
    logs.mkdir()

    _run_two_nodes("save", 4, ckpt, markers, logs)
    _run_two_nodes("load", 3, ckpt, markers, logs)

    found = {p.name: p.read_text() for p in markers.iterdir()}
    assert found == _markers("save", SAVED) | _markers("load", LOADED)

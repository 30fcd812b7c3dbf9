"""`shardwise bench scale` in its quick mode, ranks as threads only: every phase runs,
loads are checked bit-exact by the bench itself, and every target reaches the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [
    "16x100: first save, slowest rank's planning CPU",
    "16x100: first save, slowest rank's CPU, whole save (its own thread)",
    "16x100: first save, most bytes a rank receives",
    "16x100: the records' join (rank 0's join thread CPU)",
    "16x100: stock create_global_plan / shardwise rank 0",
    "16x100: repeated save, slowest rank's planning CPU",
    "16x100: repeated save, slowest rank's CPU, whole save (its own thread)",
    "16x100: repeated save, most bytes a rank receives",
    "16x100: peak RSS growth per rank (process / W)",
    "16x100: load, slowest rank's CPU",
]
COORDINATOR = TARGETS[4]


def test_the_quick_scale_bench_prints_every_phase_and_target(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "bench_scale.py"
    args = ["--quick", "--skip-processes", "--kinds", "fsdp", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = [line.split()[2] for line in out.splitlines() if line.startswith("fsdp 16x100 ")]
    assert rows == ["save", "save_again", "load", "reshard_load"] * 2  # as it ends, then all
    table = out.split("== targets (issue 22)\n", 1)[1].splitlines()
    assert [line[: len(t)] for line, t in zip(table, TARGETS)] == TARGETS
    verdicts = {t: line.split()[-1] for line, t in zip(table, TARGETS)}
    assert set(verdicts.values()) <= {"yes", "NO"}
    # every target is met at this size but stock's global planning over rank 0's, a ratio
    # that grows with W (about 2x at W = 16, past 20x from W = 256: docs/performance.md):
    # a repeated save that replans, or a save that receives more, shows as a NO
    missed = [t for t, v in verdicts.items() if v == "NO" and t != COORDINATOR]
    assert missed == []
    met = sum(v == "yes" for v in verdicts.values())
    assert table[len(TARGETS)] == f"targets met: {met} of {len(TARGETS)}"
    assert list(tmp_path.iterdir()) == []  # the bench removes what it wrote

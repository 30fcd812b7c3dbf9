"""`shardwise bench journey`: the modules one plain save and one resharding load run
code in. A plain state runs no client's code and stays within the bound issue 36
set (25 of the package's modules); the tracer itself sees what it must."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned  # the bench runs in a process of its own

ROOT = Path(__file__).resolve().parents[1]


def _journeys() -> dict[str, list[str]]:
    code = (
        "import sys, json, tempfile; sys.path.insert(0, 'benchmarks'); import bench_journey as b\n"
        "from pathlib import Path\n"
        "out = {}\n"
        "with tempfile.TemporaryDirectory() as tmp:\n"
        "    for name, (package, call) in b._journeys(Path(tmp)).items():\n"
        "        t = b.Tracer(b.PACKAGES[package]); t.run(call)\n"
        "        out[name] = sorted(t.modules['all'])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_plain_save_and_load_stay_within_25_modules_and_ask_no_client() -> None:
    found = _journeys()
    for name in ("swc.save", "swc.load, resharded"):
        modules = found[name]
        assert len(modules) <= 25, (name, modules)
        asked = [
            m
            for m in modules
            if m.startswith(("shardwise.checkpoint.clients", "shardwise.interop"))
        ]
        assert asked == [], name
        assert all(m.startswith("shardwise.") for m in modules)
    # the tracer sees the calls it must: the engine of each journey, stock's own modules
    assert "shardwise.checkpoint.engine.save" in found["swc.save"]
    assert "shardwise.checkpoint.engine.load" in found["swc.load, resharded"]
    assert "torch.distributed.checkpoint.state_dict_saver" in found["stock dcp.save"]


def test_the_bench_prints_its_table() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_journey.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert rows == ["stock", "stock", "swc.save", "swc.load,"]

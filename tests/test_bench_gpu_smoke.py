"""`shardwise bench gpu` in its CPU smoke mode (its figures need a GPU; this checks
that every case runs, loads bit-exact, and every number reaches the output and JSON)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise.checkpoint as swc

pytestmark = pytest.mark.spawned

ROOT = Path(__file__).resolve().parents[1]
PROBES = [
    "probe: device->host copy",
    "probe: write+fsync",
    "probe: read",
    "probe: host->device copy",
]
CASES = [
    "stock dcp.save",
    "stock dcp.load",
    "stock dcp.async_save DefaultStager",
    "shardwise save",
    "shardwise load",
    "shardwise async_save background",
    "shardwise async_save background, staging_bytes>=state",
]
OURS_ASYNC = CASES[5:]
TARGETS = [
    "async save blocking <= 20 ms",
    "async save blocking <= 1/10 of stock DefaultStager's",
    "step time while staging <= 1.05 x without a save",
    "sync save >= 0.9 x save limit",
    "sync save >= 1.5 x stock dcp.save",
    "load into CUDA >= 0.9 x load limit",
    "load >= 1.5 x stock dcp.load",
    "host memory during save <= staging budget + 128 MiB",
]
# 4 bf16 layers of h 768 (ff 2688) for 64 MiB; 200 fp32 64x256 tensors + the odd ones
LARGE_BYTES = 4 * 2 * (4 * 768 * 768 + 3 * 768 * 2688 + 2 * 768)
SMALL_BYTES = 200 * 64 * 256 * 4 + 8 + 3 * 5 * 7 * 2 + 17 * 2 + 1025 + 100_003 * 4


def test_cpu_smoke_run_prints_every_case_and_target(tmp_path):
    out_json = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "shardwise", "bench", "gpu", "--device", "cpu"]
        + ["--size", "64MiB", "--small", "200", "--dir", str(tmp_path), "--json", str(out_json)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    ours_async = "staging" in inspect.signature(swc.async_save).parameters
    for name in PROBES:
        assert sum(line.startswith(f"  {name} ") and "GB/s" in line for line in lines) == 2
    for name in CASES:
        rows = [line[len(name) + 2 :].split() for line in lines if line.startswith(f"  {name} ")]
        rows = [r for r in rows if not r or r[0] != "background,"]  # a longer case name
        assert len(rows) == 2, (name, run.stdout)
        for row in rows:
            if name in OURS_ASYNC and not ours_async:
                assert row == ["not", "available"]
            else:
                float(row[0])  # a number, not "FAILED"
                assert ("bit-exact" in row) == name.endswith("load")
    target_lines = [line.strip() for line in lines if line.startswith("  [")]
    assert [line.split("  need")[0].rsplit(None, 1)[0] for line in target_lines] == [
        f"[{kind}] {t}" for kind in ("large", "small") for t in TARGETS
    ]
    assert "GPU figures need a GPU" in run.stdout
    assert list(tmp_path.iterdir()) == [out_json]  # the run's folder is gone

    res = json.loads(out_json.read_text())
    assert list(res["states"]) == ["large", "small"]
    assert res["states"]["large"]["bytes"] == LARGE_BYTES
    assert res["states"]["small"]["bytes"] == SMALL_BYTES
    for state in res["states"].values():
        cases = state["cases"]
        assert sorted(cases) == sorted(CASES)
        assert state["probes"]["read ok"] == 1.0
        for name, r in cases.items():
            if name in OURS_ASYNC and not ours_async:
                assert r is None
                continue
            assert 0 < r["blocking_s"] <= r["staged_s"] <= r["total_s"], name
            assert r["GBps"] == state["bytes"] / r["total_s"] / 1e9
        assert cases["stock dcp.load"]["exact"] is True and cases["shardwise load"]["exact"] is True
        by_label = {t["target"]: t for t in state["targets"]}
        assert list(by_label) == TARGETS
        speedup = by_label["sync save >= 1.5 x stock dcp.save"]
        assert (
            speedup["ratio"]
            == cases["stock dcp.save"]["total_s"] / cases["shardwise save"]["total_s"]
        )
        assert speedup["met"] == (speedup["ratio"] >= 1.5)
        limit = by_label["sync save >= 0.9 x save limit"]
        assert limit["ratio"] == cases["shardwise save"]["GBps"] / state["limits"]["save GBps"]

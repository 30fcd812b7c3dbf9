"""`shardwise bench ops --quick` at tiny sizes on 2 gloo ranks: the table has a row for every
op and pass, shardwise's and DTensor's cells are numbers (no timing asserted), every result
checked against plain torch is right but PhysicsNeMo's argmax along its sharded dim (its
indices are not the whole tensor's: [3, 2, 4] where torch gives [4, 2, 5] on rows 4 : 2),
and the JSON holds the same rows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned  # the bench starts its ranks as processes

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"^\d+(\.\d+)?$")
RATIO = re.compile(r"^\d+\.\d\dx$")
# rows whose PhysicsNeMo result the bench finds wrong, as observed with PhysicsNeMo 2.2.2
PEER_WRONG = ["x.argmax(dim=0) fwd 32x8: PhysicsNeMo"]


def test_the_quick_ops_bench_prints_every_op_with_numbers(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_ops
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "ops.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise",
            "bench",
            "ops",
            "--quick",
            "--world-size",
            "2",
            "--sizes",
            "32x8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("| 32x8 |")]
    expected = [
        (op, pass_)
        for op, (_fn, differentiable) in bench_ops.OPS.items()
        for pass_ in (bench_ops.PASSES if differentiable else bench_ops.PASSES[:1])
    ]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [(c[1].strip("`"), c[2]) for c in cells] == expected
    for c in cells:
        dtensor, ours, ratio, physicsnemo, ours_uneven = c[3], c[4], c[5], c[6], c[7]
        assert NUMBER.match(dtensor), c
        assert NUMBER.match(ours), c  # a number: neither an error nor WRONG
        assert NUMBER.match(ours_uneven), c
        assert RATIO.match(ratio), c
        wrong = f"{c[1].strip('`')} {c[2]} 32x8: PhysicsNeMo" in PEER_WRONG
        peer = physicsnemo.removesuffix(" WRONG") if wrong else physicsnemo
        assert NUMBER.match(peer) or peer.startswith(("error:", "n/a")), c
    wrong_lines = [line for line in done.stdout.splitlines() if "WRONG" in line]
    if "PhysicsNeMo not importable" in done.stdout:  # no peer result to find wrong
        assert wrong_lines == []
    else:
        assert wrong_lines[-1] == "WRONG results (against plain torch): " + "; ".join(PEER_WRONG)
    record = json.loads(out.read_text())
    assert [(r["op"], r["pass"]) for r in record["rows"]] == expected
    sums = [r for r in record["rows"] if r["op"] == "x.sum()"]
    assert sums[0]["shardwise even"]["sent"] == "-"  # pending: combined only when read
    assert sums[0]["shardwise even"]["sent bytes per rank"] == [0, 0]
    read = [r for r in record["rows"] if r["op"] == "x.sum().full_tensor()"]
    assert read[0]["shardwise even"]["sent"] == "all_reduce 4 B"  # one float32 scalar
    assert read[0]["shardwise even"]["sent bytes per rank"] == [4, 4]

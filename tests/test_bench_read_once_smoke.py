"""`shardwise bench read_once --quick` on /dev/shm and the throttled link: 8 gloo ranks
load each layout with stock `dcp.load` and `swc.load` (the bench checks every load
bit-exact), every layout reaches the table, and what passes through the link is what
each loader reads: stock reads every rank's own TP shard of `dp-tp`, so DP = 2 ranks
read each stored shard, the same bytes whether the link is throttled or not; swc reads
each stored byte once on the throttled link (a shared medium), and on shm only when
forced (`read_once=True`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned

ROOT = Path(__file__).resolve().parents[1]
WORLD, TP = 8, 4  # --quick's W, the default TP: DP = 2
LAYOUTS = ("dp-tp", "hsdp", "row-col")
STORAGES = ("shm", "throttled")


def test_the_quick_read_once_bench_counts_what_each_loader_reads(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    done = subprocess.run(
        [sys.executable, "-m", "shardwise", "bench", "read_once", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [m] = json.loads(out.read_text())
    assert (m["world"], m["tp"], m["storages"], m["layouts"]) == (
        WORLD,
        TP,
        [*STORAGES],
        [*LAYOUTS],
    )

    rows = [line.split()[:4] for line in done.stdout.splitlines() if line.startswith("  ")]
    for storage in STORAGES:
        for layout in LAYOUTS:
            assert [storage, layout, str(WORLD)] in [r[:3] for r in rows], (storage, layout)
    assert "== targets (issue 41)" in done.stdout

    def per_rank(storage: str, layout: str, loader: str) -> list[int]:
        return [data_bytes for data_bytes, *_ in m[f"{storage} {layout} {loader} per rank"]]

    stored = m["dp-tp stored"]["data"]
    assert stored >= m["S"]  # the values, and the frames beside them
    stock = per_rank("shm", "dp-tp", "stock")
    dp = WORLD // TP
    # rank r = (d, t) at d * TP + t: the DP replicas of a TP shard read the same bytes
    assert all(stock[r] == stock[r % TP] for r in range(WORLD))
    assert all(n > 0 for n in stock)
    # the TP ranks of one replica read every stored shard once, and a little more: stock's
    # buffered stream refills its 4 KiB buffer at each seek of torch.load's zip reader (a few
    # per record). So stock's bytes are DP x the stored bytes, and that little more
    one_replica = sum(stock[:TP])
    assert sum(stock) == dp * one_replica
    records = m["tensors"] * TP
    assert stored <= one_replica <= stored + records * 32 * 1024
    for layout in LAYOUTS:
        # the throttle changes when stock's bytes arrive, not which
        assert per_rank("throttled", layout, "stock") == per_rank("shm", layout, "stock")
        # the throttled link is a shared medium: swc's rule reads each stored byte once there,
        # as the exchange forced on shm does (the same plan: the same bytes on every rank)
        once = per_rank("shm", layout, "once")
        assert per_rank("throttled", layout, "swc") == once
        # each value byte once, and the few KiB of index rows and checksums a rank reads of
        # the data files its chunks lie in
        assert m["S"] <= sum(once) <= m[f"{layout} stored"]["data"] + WORLD * 4096
        assert max(once) < sum(once)  # spread over readers
        # on shm itself the rule reads locally: each rank its own bytes, as before
        assert sum(per_rank("shm", layout, "swc")) >= 2 * m["S"]
    # row-col: every rank needs part of every stored row chunk, and stock reads chunks whole
    assert sum(per_rank("shm", "row-col", "stock")) >= WORLD * m["S"]

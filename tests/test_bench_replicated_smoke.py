"""`shardwise bench replicated`'s measuring function, small: 2 gloo ranks load 4 replicated
tensors of 1 KiB from a local folder (the bench checks every load bit-exact), and each rank
reads half of the values' bytes when they are broadcast, all of them when not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawned

ROOT = Path(__file__).resolve().parents[1]
LABELS = {
    "stock": "stock dcp.load",
    "off": "swc.load broadcast=False",
    "on": "swc.load broadcast=True",
    "auto": "swc.load broadcast=None",
}
VALUES = 4 * 1024  # S: the values' bytes
INDEX = 1241  # the frame between two values in one data file, read with them in one preadv
RUN = """
import json, sys
sys.path.insert(0, "benchmarks")
import bench_replicated as bench
if __name__ == "__main__":
    m = bench.measure(sys.argv[1], None, 2, 4, 256, 1)
    bench.print_table("smoke", m, 2)
    print(json.dumps(m))
"""


def test_broadcast_halves_what_each_of_two_ranks_reads(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *table, last = done.stdout.splitlines()
    m = json.loads(last)
    assert m["S"] == VALUES

    def read(mode: str) -> list[int | None]:
        return [bytes_read for _fetched, bytes_read, _gets in m[f"{mode} per rank"]]

    assert read("stock") == [None, None]  # dcp.load returns no LoadInfo
    assert read("off") == [VALUES + 2 * INDEX] * 2  # every value, both files, the frames between
    assert read("on") == [VALUES // 2 + INDEX] * 2  # its two values, from its one file
    assert read("auto") == read("off")  # one host, a local folder: no broadcast
    # the last run's rchar, which counts far more than the files (imports, metadata)
    assert all(fetched >= read for fetched, read, _gets in m["on per rank"])
    assert {gets for mode in LABELS for *_, gets in m[f"{mode} per rank"]} == {None}  # no S3
    labels = [line[2:26].strip() for line in table[3:7]]
    assert labels == list(LABELS.values())

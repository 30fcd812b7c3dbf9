"""Every script in examples/ runs as its docstring says: under `torchrun`, on the CPU with
gloo, at its default (small) sizes, and prints what it checked; these tests read that.

- train_resume.py: an uninterrupted run on 2 ranks; a run on 2 ranks killed hard after
  step 7 (an async save in flight), whose latest committed step is read back here; the
  resume of that run on 3 ranks. Both final digests must be equal: bit-exact resume
  across world sizes.
- torchrec_reshard.py, megatron_gpt_tp.py, physicsnemo_domain_parallel.py, s3.py: save on
  one world size / plan / TP / domain split, load on another, every `PASS` line printed
  and no `FAIL`. The client examples skip where their package is not installed (fail in
  CI, as tests/clients/ do); s3.py runs against moto's server on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import shardwise.checkpoint as swc
from tests.clients.conftest import require
from tests.launch import jobs

pytestmark = pytest.mark.spawned

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def torchrun(script: str, nproc: int, *args: str, env: dict[str, str] | None = None) -> tuple:
    """(exit status, stdout, stderr) of `torchrun --nproc-per-node nproc examples/script
    args...` (`tests/launch/jobs.py`)."""
    return jobs.torchrun(EXAMPLES / script, nproc, *args, env=env)


def succeeded(script: str, nproc: int, *args: str, env: dict[str, str] | None = None) -> str:
    """The stdout of a torchrun job that must exit 0."""
    code, out, err = torchrun(script, nproc, *args, env=env)
    assert code == 0, f"{script} {' '.join(args)} exited {code}\n{out[-4000:]}\n{err[-6000:]}"
    return out


def verdicts(out: str) -> list[str]:
    """The PASS / FAIL lines an example printed."""
    return [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]


def all_pass(out: str, count: int) -> list[str]:
    found = verdicts(out)
    assert len(found) == count and all(v.startswith("PASS: ") for v in found), out
    return found


def needs(module: str) -> None:
    """Skip unless `module`'s package is installed (fail in CI), as tests/clients/ do;
    without importing it here (the example imports it, and fails if it is broken)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        require(module)


# -- train, save asynchronously, get killed, resume on another world size ------------------


def _digest(out: str) -> str:
    found = re.findall(r"^digest: ([0-9a-f]{64})$", out, re.MULTILINE)
    assert len(found) == 1, out
    return found[0]


def _losses(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss (\S+)$", out, re.MULTILINE)}


def test_train_resume_killed_and_resumed_on_three_ranks_ends_bit_exact(tmp_path: Path) -> None:
    steps = ["--steps", "12", "--save-every", "3", "--keep-last", "2"]
    whole = succeeded("train_resume.py", 2, "--root", str(tmp_path / "a"), *steps)
    assert "started fresh on 2 ranks" in whole
    assert "committed steps: [9, 12]" in whole  # keep-last 2
    assert sorted(_losses(whole)) == list(range(1, 13))

    killed = tmp_path / "b"
    code, out, err = torchrun(
        "train_resume.py", 2, "--root", str(killed), *steps, "--die-at-step", "7"
    )
    assert code != 0, out + err
    # every rank ended at the simulated preemption (torchrun's report of each exit), and
    # its "dying" line reached the output from at least one: the other's last line has
    # been seen missing from what torchrun passed on once the first rank exited
    exits = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*\n\s*exitcode\s*: (\d+)", err)
    assert sorted(exits) == [("0", "75"), ("1", "75")], err
    dying = re.findall(r"^rank (\d): dying after step 7", out, re.MULTILINE)
    assert dying and set(dying) <= {"0", "1"}, out + err
    assert "digest:" not in out
    # rank 0's lines of step 7 (its loss, its "dying" line) can be lost the same way, once
    # rank 1 exits first; every step before it was passed on, and none after
    assert sorted(_losses(out)) in (list(range(1, 7)), list(range(1, 8))), out
    latest = swc.CheckpointManager(killed).latest()  # the save of step 6 may not have committed
    assert latest in (3, 6), latest

    resumed = succeeded("train_resume.py", 3, "--root", str(killed), *steps)
    assert f"resumed from step {latest} on 3 ranks" in resumed
    # the steps after the resume as in the uninterrupted run, and the end bit for bit
    assert _losses(resumed) == {s: v for s, v in _losses(whole).items() if s > latest}
    assert "committed steps: [9, 12]" in resumed
    assert _digest(resumed) == _digest(whole)


# -- the clients ---------------------------------------------------------------------------


def test_torchrec_row_wise_on_two_ranks_loads_column_wise_on_three(tmp_path: Path) -> None:
    needs("torchrec.distributed")
    root = str(tmp_path)
    saved = succeeded("torchrec_reshard.py", 2, "save", "--root", root, "--plan", "row_wise")
    assert "saved under plan row_wise on 2 ranks" in saved
    out = succeeded("torchrec_reshard.py", 3, "load", "--root", root, "--plan", "column_wise")
    assert "loaded plan column_wise on 3 ranks (saved on 2)" in out
    found = all_pass(out, 3)
    assert found[0].startswith("PASS: state: 6 of 6 tensors"), found
    assert "pooled embeddings of the fixed batch (4, 48) match" in found[1], found
    assert "pooled embeddings after one more step (4, 48) match" in found[2], found


def test_megatron_gpt_saved_at_tp2_loads_at_tp1(tmp_path: Path) -> None:
    needs("megatron.core.dist_checkpointing")
    root = str(tmp_path)
    saved = succeeded("megatron_gpt_tp.py", 2, "save", "--root", root, "--tp", "2")
    assert "saved at TP 2 on 2 ranks" in saved
    assert (tmp_path / "ckpt" / "metadata.json").is_file()  # Megatron's format
    out = succeeded("megatron_gpt_tp.py", 1, "load", "--root", root, "--tp", "1")
    assert "loaded at TP 1 on 1 ranks (saved at TP 2), iteration 1" in out
    found = all_pass(out, 2)
    assert found[0] == "PASS: the fresh model's logits differed", found
    assert found[1].startswith("PASS: logits (2, 16, 64) match"), found


def test_physicsnemo_domain_split_15_14_loads_as_10_10_9(tmp_path: Path) -> None:
    needs("physicsnemo.domain_parallel")
    root = str(tmp_path)
    saved = succeeded("physicsnemo_domain_parallel.py", 2, "save", "--root", root)
    assert "saved on 2 ranks, field rows split [15, 14]" in saved
    out = succeeded("physicsnemo_domain_parallel.py", 3, "load", "--root", root)
    assert "loaded on 3 ranks (saved on 2), field rows split [10, 10, 9]" in out
    found = all_pass(out, 4)
    assert found[0] == "PASS: field: the ShardTensor holds the saved field, bit for bit", found


# -- S3 --------------------------------------------------------------------------------------


def test_s3_saved_on_two_ranks_loads_on_three(s3_server) -> None:
    from tests.s3_server import client_env

    url = f"s3://{s3_server.new_bucket()}/run1/step_100"
    env = client_env()  # credentials as boto finds them: the environment alone
    where = ["--url", url, "--endpoint-url", s3_server.endpoint]
    saved = succeeded("s3.py", 2, "save", *where, env=env)
    assert f"saved on 2 ranks to {url}" in saved
    out = succeeded("s3.py", 3, "load", *where, env=env)
    assert f"loaded on 3 ranks from {url}" in out
    assert len(re.findall(r"^  rank \d: fetched \d+ bytes", out, re.MULTILINE)) == 3
    assert all_pass(out, 1) == [
        "PASS: every element of emb, proj and bias, and the step, as saved (0 wrong)"
    ]
    assert swc.verify(url, storage_options=s3_server.storage_options) == []

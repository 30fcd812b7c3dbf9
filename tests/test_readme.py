"""The README's example runs as written (with its checkpoint path moved to a temp dir)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spawned

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    code = re.search(r"## Example\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code.replace("/tmp/shardwise-readme", str(tmp_path / "ckpt")))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("0 [(600, 256)] tensor([1.0000, 1.5000, 2.0000])")
    assert lines[1] == "1 [] holds nothing"
    assert lines[2].startswith("2 [(424, 256)]")

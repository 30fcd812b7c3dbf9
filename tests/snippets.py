"""Running a documentation snippet as a user would: a script in a temp folder."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys


def run_snippet(code: str, tmp_path: pathlib.Path) -> list[str]:
    """Run `code` as a script with /tmp/shardwise-* paths moved under `tmp_path`;
    its output lines (pip's WARNING lines left out). Fails with its stderr."""
    script = tmp_path / "snippet.py"
    script.write_text(re.sub(r"/tmp/shardwise-(\w+)", lambda m: str(tmp_path / m.group(1)), code))
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [line for line in proc.stdout.splitlines() if not line.startswith("WARNING:")]

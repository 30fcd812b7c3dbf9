from __future__ import annotations

import pytest

from shardwise.cli import main


def test_demo_passes(capsys, tmp_path):
    assert main(["demo", "--world-size", "2", "--load-world-size", "3", "--dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "saved on 2 ranks" in out


def test_bench_unknown_name_is_one_line(capsys):
    assert main(["bench", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "layout" in err


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "example" in capsys.readouterr().out or argv == ["--help"]

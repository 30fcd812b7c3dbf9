"""What an install from a wheel meets (issue 40, 6): the extras it declares, one version,
`shardwise bench` outside a checkout, `convert` without its optional package.

CI also builds the wheel, installs it into a fresh virtual environment and runs an
example there (`.ci/wheel`)."""

from __future__ import annotations

import sys
from importlib.metadata import metadata, version
from pathlib import Path

import pytest
import torch

import shardwise
import shardwise.checkpoint as swc
from shardwise import UnsupportedStorageError
from shardwise.cli import bench, main

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_extras_declared_and_the_license_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"safetensors", "zstd", "s3", "gcs", "azure", "docs", "test", "lint"} <= set(extras)
    assert extras["safetensors"] == ["safetensors>=0.4"]
    assert extras["zstd"] == ["zstandard>=0.22"]
    assert extras["s3"] == ["s3fs"]
    # the demo's install carries no test or lint tools
    assert not any(d.startswith(("pytest", "ruff", "mypy")) for d in project["dependencies"])
    assert project["license"] == "BSD-3-Clause"
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License\n")
    # the floor declared is the torch release CI tests
    (floor,) = [d for d in project["dependencies"] if d.startswith("torch")]
    assert floor == "torch>=2.13" and torch.__version__.startswith("2.13.")


def test_version_in_one_place(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert shardwise.__version__ == version("shardwise") == project["version"]
    assert metadata("shardwise")["Version"] == project["version"]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"shardwise {project['version']}\n"


def test_bench_outside_a_checkout_says_how_to_get_the_benchmarks(tmp_path, monkeypatch, capsys):
    # as installed from a wheel: site-packages/shardwise/cli/bench.py, no benchmarks/ near it
    site = tmp_path / "site-packages" / "shardwise" / "cli"
    site.mkdir(parents=True)
    monkeypatch.setattr(bench, "__file__", str(site / "bench.py"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(bench.ENV, raising=False)
    assert main(["bench", "layout"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "shardwise bench: error: shardwise bench runs the benchmarks of a source checkout, "
        "which a wheel does not carry (looked in "
    )
    assert f"{tmp_path / 'benchmarks'}" in err and "set SHARDWISE_BENCHMARKS" in err


def test_bench_runs_the_benchmarks_the_environment_names(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "clone" / "benchmarks"
    folder.mkdir(parents=True)
    (folder / "bench_hello.py").write_text("import sys\nprint('hello', sys.argv[1:])\n")
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "a" / "b" / "c" / "bench.py"))
    monkeypatch.setenv(bench.ENV, str(folder))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["bench", "hello", "--quick"]) == 0
    assert capsys.readouterr().out == "hello ['--quick']\n"
    (folder / "bench_read_once.py").write_text("print('read once')\n")
    assert main(["bench", "read-once"]) == 0  # a hyphen names the underscored file
    assert capsys.readouterr().out == "read once\n"
    assert main(["bench", "nope"]) == 1
    assert capsys.readouterr().err == (
        f"shardwise bench: error: no benchmark 'nope' in {folder} (available: hello, read_once)\n"
    )


def test_convert_from_safetensors_without_the_package_names_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "m.safetensors"))
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if never installed
    with pytest.raises(UnsupportedStorageError) as e:
        swc.convert(tmp_path / "m.safetensors", tmp_path / "out")
    assert str(e.value) == (
        f"cannot convert {tmp_path / 'm.safetensors'}: reading a .safetensors file needs the "
        "safetensors package (pip install 'shardwise[safetensors]')"
    )
    assert not (tmp_path / "out").exists()


def test_a_benchmarks_folder_named_wrongly_is_an_error_not_a_fallback(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(bench.ENV, str(tmp_path))  # no bench_*.py there; the checkout has them
    assert main(["bench", "layout"]) == 1
    assert capsys.readouterr().err == (
        f"shardwise bench: error: {bench.ENV}={tmp_path} holds no bench_*.py: "
        "not a benchmarks/ folder\n"
    )

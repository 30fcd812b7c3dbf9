"""The CLI in-process: main(argv) -> exit code, on shardwise and stock checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import shardwise.checkpoint as swc
from shardwise import InvalidArgumentError, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.cli import main
from shardwise.cli.sizes import parse_size
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned  # the demo and checkpoint commands run ranks

FULL = {
    "emb.weight": torch.arange(600, dtype=torch.float32).reshape(60, 10),
    "dense.bias": torch.linspace(-1, 1, 7).to(torch.bfloat16),
    "step_t": torch.tensor(11, dtype=torch.int64),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    layout = Layout.row_wise((60, 10), [25, 35], ranks=[0, 0])
    state = {
        "emb.weight": ShardedTensor.from_layout(
            layout, [FULL["emb.weight"][:25].clone(), FULL["emb.weight"][25:].clone()]
        ),
        "dense.bias": FULL["dense.bias"].clone(),
        "step_t": FULL["step_t"].clone(),
        "trainer": {"step": 11},
    }
    swc.save(state, path)
    return path


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "stock"
    dcp.save({k: v.clone() for k, v in FULL.items()}, checkpoint_id=path)
    return path


def test_inspect_table_and_json(ckpt, stock, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "shardwise checkpoint, format version 5, saved by 1 ranks" in out
    assert "row-wise, 2 parts (uneven)" in out and "trainer.step" in out
    for path, kind in ((ckpt, "shardwise"), (stock, "stock DCP")):
        assert main(["inspect", str(path), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["kind"] == kind
        assert data["tensors"]["emb.weight"]["shape"] == [60, 10]
        assert data["tensors"]["dense.bias"]["dtype"] == "bfloat16"


def test_verify_passes_then_prints_each_flipped_byte(ckpt, tmp_path, capsys):
    assert main(["verify", str(ckpt), "--quiet"]) == 0
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = Manifest.read(bad).tensors
    chunks = [tensors["emb.weight"].chunks[1], tensors["dense.bias"].chunks[0]]
    for chunk in chunks:
        assert chunk.payload is not None
        with open(bad / chunk.file, "r+b") as f:
            f.seek(chunk.payload[0] + 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    capsys.readouterr()
    assert main(["verify", str(bad), "--quiet"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("shardwise verify: ") for line in lines)
    emb, bias = sorted(lines, key=lambda line: "'dense.bias'" in line)
    assert "'emb.weight'" in emb and "checksum" in emb and chunks[0].file in emb
    assert "'dense.bias'" in bias and "checksum" in bias


def test_verify_a_stock_checkpoint(stock):
    assert main(["verify", str(stock), "--quiet"]) == 0


@pytest.mark.parametrize("source", ["ckpt", "stock"])
def test_convert_to_safetensors_and_torch(source, ckpt, stock, tmp_path, capsys):
    path = {"ckpt": ckpt, "stock": stock}[source]
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(path), str(out), "--format", "safetensors"]) == 0
    loaded = load_file(str(out))
    assert set(loaded) == set(FULL) and all(torch.equal(loaded[k], v) for k, v in FULL.items())
    pt = tmp_path / "model.pt"
    assert main(["convert", str(path), str(pt), "--format", "torch"]) == 0
    loaded = torch.load(pt, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in FULL.items())


def test_convert_splits_large_outputs_with_an_index(ckpt, tmp_path):
    out = tmp_path / "model.safetensors"
    assert (
        main(["convert", str(ckpt), str(out), "--format", "safetensors", "--max-file-size", "1KiB"])
        == 0
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0].startswith("model-00001-of-")
    merged = {}
    for f in files:
        merged.update(load_file(str(tmp_path / f)))
    assert all(torch.equal(merged[k], v) for k, v in FULL.items())


def test_convert_safetensors_back_to_a_checkpoint(tmp_path):
    src = tmp_path / "in.safetensors"
    save_file({k: v.contiguous() for k, v in FULL.items()}, str(src))
    out = tmp_path / "imported"
    assert main(["convert", str(src), str(out), "--format", "shardwise"]) == 0
    for k, v in FULL.items():
        assert torch.equal(swc.read_tensor(out, k), v)
    pt = tmp_path / "in.pt"
    assert main(["convert", str(src), str(pt), "--format", "torch"]) == 0
    assert torch.equal(torch.load(pt, weights_only=True)["emb.weight"], FULL["emb.weight"])


def _load_resharded(rank: int, world: int, path: str) -> bool:
    target = {
        "emb.weight": ShardedTensor.zeros(Layout.chunked((60, 10), 1, world), dtype=torch.float32),
        "dense.bias": torch.zeros(7, dtype=torch.bfloat16),
        "step_t": torch.zeros((), dtype=torch.int64),
        "trainer": {"step": 0},
    }
    swc.load(target, path)
    st = target["emb.weight"]
    return (
        all(
            torch.equal(s, FULL["emb.weight"][b.slices()])
            for s, b in zip(st.local_shards(), st.local_blocks)
        )
        and target["trainer"]["step"] == 11
        and torch.equal(target["dense.bias"], FULL["dense.bias"])
    )


@pytest.mark.parametrize("source", ["ckpt", "stock"])
def test_reshard_offline_then_load_on_m_ranks(source, ckpt, stock, tmp_path):
    path = {"ckpt": ckpt, "stock": stock}[source]
    out = tmp_path / "m3"
    assert main(["reshard", str(path), str(out), "--world-size", "3", "--dim", "1"]) == 0
    files = sorted(p.name for p in out.glob("*.distcp"))
    token = files[0].split(".")[1]  # the save's token: sw + 12 hex digits
    assert re.fullmatch(r"sw[0-9a-f]{12}", token)
    manifest = Manifest.read(out)
    assert manifest.index is not None and manifest.index.file == f"__0_1.{token}.distcp"
    data = [f"__{r}_0.{token}.distcp" for r in range(3)]  # one file per rank
    assert files == sorted([*data, manifest.index.file])
    assert sorted(c.file for c in manifest.tensors["emb.weight"].chunks) == data
    if source == "stock":
        return  # a stock source has no Python objects to compare
    assert run_ranks(_load_resharded, 3, str(out), timeout=60) == [True] * 3


def test_reshard_with_a_layout_file(ckpt, tmp_path):
    layout = Layout.row_wise((60, 10), [10, 50])
    spec = tmp_path / "layout.json"
    spec.write_text(json.dumps({"emb.weight": json.loads(layout.to_json())}))
    out = tmp_path / "custom"
    assert main(["reshard", str(ckpt), str(out), "--world-size", "2", "--layout", str(spec)]) == 0
    chunks = Manifest.read(out).tensors["emb.weight"].chunks
    assert [c.sizes for c in chunks] == [(10, 10), (50, 10)]


BAD = {
    "missing path": ["inspect", "/nonexistent/ckpt"],
    "not a checkpoint": ["verify", "{tmp}"],
    "existing output": ["convert", "{ckpt}", "{ckpt}", "--format", "safetensors"],
    "bad world size": ["reshard", "{ckpt}", "{tmp}/x", "--world-size", "0"],
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_non_zero(case, ckpt, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, ckpt=ckpt) for a in BAD[case]]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("shardwise ")


def test_demo_passes(capsys, tmp_path):
    argv = [
        "demo",
        "--world-size",
        "2",
        "--load-world-size",
        "3",
        "--size",
        "2MiB",
        "--dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "saved on 2 ranks" in out and "table-wise on rank 1" in out


def test_bench_unknown_name_is_one_line(capsys):
    assert main(["bench", "nope"]) == 1
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "layout" in err


@pytest.mark.parametrize("command", ["demo", "inspect", "verify", "convert", "reshard", "bench"])
def test_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "example" in capsys.readouterr().out


# -- exit codes: 0 success, 1 the command failed, 2 usage error -------------------------

USAGE_ERRORS = {
    "no command": [],
    "unknown command": ["nope"],
    "missing argument": ["inspect"],
    "invalid choice": ["convert", "a", "b", "--format", "zip"],
    "not an int": ["reshard", "a", "b", "--world-size", "many"],
    "unknown option": ["verify", "x", "--fast"],
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_usage_errors_exit_2_with_usage(case, capsys):
    assert main(USAGE_ERRORS[case]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: shardwise")
    assert err[-1].startswith("shardwise") and ": error: " in err[-1]


def test_a_missing_checkpoint_folder_exits_1_with_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardwise inspect: error: no checkpoint at {tmp_path / 'missing'}"]


def test_success_exits_0(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    assert capsys.readouterr().err == ""


def test_an_unexpected_exception_exits_1_naming_its_type(ckpt, capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr("shardwise.cli.inspect.main", boom)
    assert main(["inspect", str(ckpt)]) == 1
    assert capsys.readouterr().err == "shardwise inspect: error: RuntimeError: boom\n"


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    assert "0  success" in out and "1  the command failed" in out and "2  usage error" in out


def test_the_console_entry_point_exits_with_mains_code(monkeypatch, capsys):
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="shardwise")
    monkeypatch.setattr("sys.argv", ["shardwise", "nope"])
    with pytest.raises(SystemExit) as info:
        script.load()()
    assert info.value.code == 2


def test_a_size_that_is_no_size_is_an_invalid_argument():
    """A `ValueError` still, so argparse (`type=parse_size`) reports it as a usage error."""
    assert parse_size("256MiB") == 256 << 20
    with pytest.raises(InvalidArgumentError, match="not a size: '12XB'"):
        parse_size("12XB")


@pytest.mark.parametrize(
    "text, why",
    [
        ("infG", "'infG' (examples"),
        ("1e400G", "'1e400G' (examples"),
        ("nan", "'nan' (examples"),
        ("-5", "'-5' is -5 bytes; give a whole number of bytes, at least 1 and under 8 EiB"),
        ("0", "'0' is 0 bytes"),
        ("0.3K", "'0.3K' is 307.2 bytes"),
        ("8388608T", "'8388608T' is 9.22337e+18 bytes"),
    ],
)
def test_a_size_is_a_finite_whole_number_of_bytes(text, why):
    """Never rounded, never infinite (`int(inf)` raised OverflowError), never below 1."""
    with pytest.raises(InvalidArgumentError) as e:
        parse_size(text)
    assert str(e.value).startswith(f"not a size: {why}")


def test_a_size_is_counted_exactly():
    assert [parse_size(t) for t in ("1.5K", "0.5k", "1e3", " 7 ", "8388607T")] == [
        1536,
        512,
        1000,
        7,
        8388607 << 40,
    ]


ARGUMENT_ERRORS = {
    "infinite size": (
        ["convert", "a", "b.safetensors", "--format", "safetensors", "--max-file-size", "infG"],
        "shardwise convert: error: argument --max-file-size: not a size: 'infG' (examples: ",
    ),
    "overflowing size": (
        ["convert", "a", "b.safetensors", "--format", "safetensors", "--max-file-size", "1e400G"],
        "shardwise convert: error: argument --max-file-size: not a size: '1e400G' (examples: ",
    ),
    "negative size": (
        ["convert", "a", "b.safetensors", "--format", "safetensors", "--max-file-size=-5"],
        "shardwise convert: error: argument --max-file-size: not a size: '-5' is -5 bytes",
    ),
    "deeply nested option": (
        ["inspect", "a", "--storage-option", "k=" + "[" * 50000],
        "shardwise inspect: error: argument --storage-option: the value of 'k' nests too "
        "deeply to read as JSON (50000 characters)",
    ),
}


@pytest.mark.parametrize("case", ARGUMENT_ERRORS)
def test_a_bad_argument_is_a_one_line_usage_error(case, capsys):
    argv, line = ARGUMENT_ERRORS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"usage: shardwise {argv[0]}")
    assert lines[-1].startswith(line)


def test_whatever_a_type_function_raises_is_a_usage_error(monkeypatch, capsys):
    # argparse turns only ArgumentTypeError / TypeError / ValueError into usage errors
    def overflowing(text):
        raise OverflowError("too big")

    monkeypatch.setattr("shardwise.cli.storage_options._option", overflowing)
    assert main(["inspect", "a", "--storage-option", "k=v"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        "shardwise inspect: error: argument --storage-option: invalid value 'k=v': "
        "OverflowError: too big"
    )


def test_whatever_parsing_raises_is_a_usage_error(monkeypatch, capsys):
    def broken(self, argv=None):
        raise RecursionError("deep\nsecond line")

    monkeypatch.setattr("shardwise.cli._Parser.parse_args", broken)
    assert main(["inspect", "a"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: shardwise")
    assert lines[-1] == "shardwise: error: RecursionError: deep"

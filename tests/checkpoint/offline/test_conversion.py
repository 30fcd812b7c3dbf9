"""`convert`'s registry of targets: the formats it accepts are the ones it names and the CLI offers."""

from __future__ import annotations

import json
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.offline.conversion import TARGETS
from shardwise.checkpoint.offline.opening import OpenCheckpoint
from shardwise.cli import _parser
from shardwise.errors import CheckpointExistsError, InvalidArgumentError

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def ckpt(tmp_path):
    swc.save({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_an_unknown_format_lists_the_registered_ones(ckpt, tmp_path):
    from_checkpoint = sorted(n for n, t in TARGETS.items() if t.from_checkpoint)
    with pytest.raises(ValueError, match="unknown format 'nope' for a checkpoint") as e:
        swc.convert(ckpt, tmp_path / "out", "nope")
    assert all(f"'{n}'" in str(e.value) for n in from_checkpoint)


def test_a_checkpoint_is_not_written_from_a_checkpoint(ckpt, tmp_path):
    with pytest.raises(ValueError, match="use 'safetensors' or 'torch'"):
        swc.convert(ckpt, tmp_path / "out", "shardwise")


def test_the_cli_offers_exactly_the_registered_formats():
    sub = next(a for a in _parser()._actions if a.dest == "command")
    convert = sub.choices["convert"]
    (fmt,) = [a for a in convert._actions if a.dest == "format"]
    assert list(fmt.choices) == list(TARGETS) == ["safetensors", "torch", "shardwise"]


# -- an export replaces the old one as a whole, and nothing else ---------------------------------

PARTS = {k: torch.full((64,), float(i)) for i, k in enumerate("abc")}  # 256 bytes each


@pytest.fixture
def parts(tmp_path):
    swc.save(PARTS, tmp_path / "parts")
    return tmp_path / "parts"


def _export(parts, out, max_file_size, overwrite=False):
    """The files written, by name; the export as a loader reads it: the single file
    when there is one (Hugging Face takes it first), else the files the index names."""
    written = swc.convert(parts, out, max_file_size=max_file_size, overwrite=overwrite)
    return [Path(f).name for f in written]


def _current(folder):
    from safetensors.torch import load_file

    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    merged = {}
    for name in sorted(set(index["weight_map"].values())):
        merged.update(load_file(str(folder / name)))
    return merged


def _listing(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


SPLIT3 = [
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
]
SPLIT2 = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
]


INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize(
    "first, second, in_the_way",
    [
        (256, 256, SPLIT3),
        (256, 512, [INDEX]),  # the old shards' names differ, but its index would be replaced
        (256, None, [INDEX]),
        (None, 256, ["model.safetensors"]),
    ],
    ids=["split-over-same-split", "split-over-split", "single-over-split", "split-over-single"],
)
def test_without_overwrite_no_file_of_an_existing_export_is_replaced(
    parts, tmp_path, first, second, in_the_way
):
    out = tmp_path / "export" / "model.safetensors"
    _export(parts, out, first)
    before = _listing(out.parent)
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True") as e:
        _export(parts, out, second)
    # every file in the way is named, and no file was written or replaced
    assert {n for n in before if str(out.parent / n) in str(e.value)} == set(in_the_way)
    if in_the_way != ["model.safetensors"]:  # that one is `out` itself, refused as a file
        where = ", ".join(str(out.parent / n) for n in sorted(in_the_way))
        verb = "exists" if len(in_the_way) == 1 else "exist"
        assert str(e.value) == (
            f"{where} already {verb} (an export named model.safetensors); "
            "pass overwrite=True to replace it"
        )
    assert _listing(out.parent) == before


@pytest.mark.parametrize(
    "first, second, expected",
    [
        (256, 512, SPLIT2),
        (512, 256, SPLIT3),
        (256, None, ["model.safetensors"]),
        (None, 512, SPLIT2),
        (256, 256, SPLIT3),
    ],
    ids=["smaller-split", "larger-split", "single-over-split", "split-over-single", "same"],
)
def test_overwrite_replaces_the_old_export_as_a_whole(parts, tmp_path, first, second, expected):
    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, first)
    # files the old export's index does not name stay, whatever their names
    folder.joinpath("README.md").write_text("mine")
    folder.joinpath("model-00009-of-00009.safetensors").write_bytes(b"not ours")
    folder.joinpath("other.safetensors").write_bytes(b"not ours either")
    assert _export(parts, out, second, overwrite=True) == [
        n for n in expected if n.endswith(".safetensors")
    ] + [n for n in expected if n.endswith(".json")]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*expected, "README.md", "model-00009-of-00009.safetensors", "other.safetensors"]
    )
    got = _current(folder)
    assert list(got) == list(PARTS) and all(torch.equal(got[k], v) for k, v in PARTS.items())


def test_overwrite_removes_only_what_the_old_index_names_in_our_pattern(parts, tmp_path):
    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, 256)
    victims = {
        "victim.bin": b"v",
        "model-1-of-2.safetensors": b"w",
        "other-00001-of-00002.safetensors": b"x",
    }
    for name, data in victims.items():
        folder.joinpath(name).write_bytes(data)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"y")
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map.update({f"k{i}": n for i, n in enumerate([*victims, "../outside.safetensors"])})
    index.write_text(json.dumps({"weight_map": weight_map}))
    _export(parts, out, None, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["model.safetensors", *victims])
    assert all(folder.joinpath(n).read_bytes() == d for n, d in victims.items())
    assert outside.read_bytes() == b"y"


@pytest.mark.parametrize("index_text", ["{not json", "[1, 2]", '{"weight_map": 3}'])
def test_an_unreadable_old_index_removes_no_shard(parts, tmp_path, index_text):
    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, 256)
    (folder / "model.safetensors.index.json").write_text(index_text)
    _export(parts, out, None, overwrite=True)
    # the index itself goes (it is the old export's: a single file now stands for it)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["model.safetensors", *SPLIT3[:3]])


def test_a_torch_export_replaces_only_its_own_file(parts, tmp_path):
    out = tmp_path / "export" / "model.pt"
    swc.convert(parts, out, "torch")
    before = out.read_bytes()
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        swc.convert(parts, out, "torch")
    assert out.read_bytes() == before
    (out.parent / "model.safetensors.index.json").write_text("{}")
    assert swc.convert(parts, out, "torch", overwrite=True) == [out]
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "model.pt",
        "model.safetensors.index.json",
    ]
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in PARTS.items())


def _fail_reading_c(monkeypatch):
    read = OpenCheckpoint.read

    def failing(self, key, *args, **kwargs):
        if key == "c":
            raise OSError("disk gone")
        return read(self, key, *args, **kwargs)

    monkeypatch.setattr(OpenCheckpoint, "read", failing)


@pytest.mark.parametrize("max_file_size", [None, 256, 512], ids=["single", "same-split", "split"])
def test_a_failed_export_leaves_the_old_one_as_it_was(parts, tmp_path, monkeypatch, max_file_size):
    # the old export is changed only once the whole new one is written: a read that
    # fails on the last tensor, after other files were written, leaves it byte for byte
    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, 256)
    before = _listing(folder)
    swc.save({k: v + 10 for k, v in PARTS.items()}, tmp_path / "newer")  # other bytes
    _fail_reading_c(monkeypatch)
    with pytest.raises(OSError, match="disk gone"):
        _export(tmp_path / "newer", out, max_file_size, overwrite=True)
    assert _listing(folder) == before  # no temporary file left either


def test_a_dtype_safetensors_cannot_store_is_refused_before_any_write(parts, tmp_path):
    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, 256)
    before = _listing(folder)
    swc.save({**PARTS, "z": torch.zeros(64, dtype=torch.complex128)}, tmp_path / "bad")
    with pytest.raises(InvalidArgumentError, match="'z' has dtype torch.complex128"):
        _export(tmp_path / "bad", out, 256, overwrite=True)
    assert _listing(folder) == before


def test_an_export_under_a_url_replaces_the_old_one(parts):
    import fsspec

    root = f"/sw-convert-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    try:
        out = f"memory://{root}/export/model.safetensors"
        assert len(swc.convert(parts, out, max_file_size=256)) == 4
        assert swc.convert(parts, out, overwrite=True) == [out]
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{root}/export", detail=False)) == [
            "model.safetensors"
        ]
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_renames_cut_short_leave_no_mixed_export_looking_current(parts, tmp_path, monkeypatch):
    # the new shards take the old ones' names: the old index goes before the first
    # rename, so a crash between renames leaves no index naming a mix of both
    from shardwise.storage import LocalFolder

    folder = tmp_path / "export"
    out = folder / "model.safetensors"
    _export(parts, out, 256)
    swc.save({k: v + 10 for k, v in PARTS.items()}, tmp_path / "newer")
    replace, calls = LocalFolder.replace, []

    def crash_on_the_second(self, source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("power cut")
        replace(self, source, target)

    monkeypatch.setattr(LocalFolder, "replace", crash_on_the_second)
    with pytest.raises(OSError, match="power cut"):
        _export(tmp_path / "newer", out, 256, overwrite=True)
    assert not (folder / "model.safetensors.index.json").exists()
    assert calls == SPLIT3[:2]
    # the temporaries not renamed are removed: none is left beside the export
    assert sorted(_listing(folder)) == [SPLIT3[0], *SPLIT3[1:3]]


# -- dtypes: every one safetensors defines that torch has, the others refused by name --------------


def _bits(t):
    return t.dtype, tuple(t.shape), bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


DTYPES = {
    "U16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
    "U32": torch.arange(5, dtype=torch.int64).to(torch.uint32),
    "U64": (torch.arange(5) << 40).to(torch.uint64),
    "C64": torch.arange(6.0).view(torch.complex64),
    "F8_E4M3": torch.arange(6.0).to(torch.float8_e4m3fn),
    "F8_E4M3FNUZ": torch.arange(6.0).to(torch.float8_e4m3fnuz),
    "F8_E5M2": torch.arange(6.0).to(torch.float8_e5m2),
    "F8_E5M2FNUZ": torch.arange(6.0).to(torch.float8_e5m2fnuz),
    "F8_E8M0": torch.tensor([0.5, 1.0, 4.0]).to(torch.float8_e8m0fnu),
    "F4": torch.arange(6, dtype=torch.uint8).reshape(2, 3).view(torch.float4_e2m1fn_x2),
}


@pytest.mark.parametrize("name", DTYPES)
def test_every_safetensors_dtype_torch_has_converts_both_ways(name, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    t = DTYPES[name]
    src = tmp_path / "in.safetensors"
    save_file({"t": t}, str(src))
    with safe_open(str(src), framework="pt") as f:
        assert f.get_slice("t").get_dtype() == name  # the dtype under test
    swc.convert(src, tmp_path / "in.pt", "torch")
    assert _bits(torch.load(tmp_path / "in.pt", weights_only=True)["t"]) == _bits(t)
    swc.convert(src, tmp_path / "ckpt", "shardwise")
    assert _bits(swc.read_tensor(tmp_path / "ckpt", "t")) == _bits(t)
    swc.convert(tmp_path / "ckpt", tmp_path / "out.safetensors", "safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as f:
        assert f.get_slice("t").get_dtype() == name
        assert _bits(f.get_tensor("t")) == _bits(t)


def _safetensors_file(path, dtype, shape, nbytes):
    """A file holding one tensor 't' of a dtype `safetensors.torch` cannot write."""
    import struct

    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    text = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(nbytes))


@pytest.mark.parametrize("target", ["torch", "shardwise"])
def test_a_safetensors_dtype_torch_lacks_is_refused_naming_key_dtype_and_file(target, tmp_path):
    src = tmp_path / "in.safetensors"
    _safetensors_file(src, "F6_E2M3", [4], 3)
    out = tmp_path / "out"
    with pytest.raises(InvalidArgumentError) as e:
        swc.convert(src, out, target)
    assert str(e.value) == (
        f"'t' in {src} has safetensors dtype F6_E2M3, which shardwise does not convert (it "
        "converts BF16, BOOL, C64, F16, F32, F4, F64, F8_E4M3, F8_E4M3FNUZ, F8_E5M2, "
        "F8_E5M2FNUZ, F8_E8M0, I16, I32, I64, I8, U16, U32, U64, U8)"
    )
    assert not out.exists()


def test_a_zero_dimensional_packed_tensor_is_refused_before_any_write(tmp_path):
    zero_d = torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    swc.save({"z": zero_d}, tmp_path / "ckpt")
    with pytest.raises(InvalidArgumentError) as e:
        swc.convert(tmp_path / "ckpt", tmp_path / "out.safetensors")
    assert str(e.value) == (
        "'z' is a 0-d tensor of dtype torch.float4_e2m1fn_x2: safetensors stores that "
        "dtype's pairs along a last dimension; give it one"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- a file format is never written over a folder ------------------------------------------------


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no-overwrite"])
@pytest.mark.parametrize("format", ["torch", "safetensors"])
def test_a_file_format_is_never_written_over_a_folder(ckpt, tmp_path, format, overwrite):
    # `shardwise convert ck ck --format torch --overwrite`: the file was written whole,
    # then its rename onto the folder failed (IsADirectoryError), its temporary left
    empty = tmp_path / "empty"
    empty.mkdir()
    before = sorted(tmp_path.rglob("*"))
    for out in (ckpt, empty):
        with pytest.raises(InvalidArgumentError) as e:
            swc.convert(ckpt, out, format, overwrite=overwrite)
        assert str(e.value) == (
            f"cannot convert to {out}: it is a folder, and format {format!r} writes one file; "
            "name a file path instead (nothing was written)"
        )
    assert sorted(tmp_path.rglob("*")) == before  # no temporary file beside them
    swc.verify(ckpt)


@pytest.mark.parametrize("max_file_size", [0, -1, 1.5, True])
def test_max_file_size_is_a_whole_number_of_bytes(ckpt, tmp_path, max_file_size):
    with pytest.raises(InvalidArgumentError) as e:
        swc.convert(ckpt, tmp_path / "out.safetensors", max_file_size=max_file_size)
    assert str(e.value) == (
        f"max_file_size must be None or an int of at least 1 byte, got {max_file_size!r}"
    )
    assert not (tmp_path / "out.safetensors").exists()

"""Every dtype torch.save writes, through our records, our storage and stock DCP.

torch.save writes `_rebuild_tensor_v2` records for the dtypes that have a typed
storage class and `_rebuild_tensor_v3` records (an untyped storage counted in
bytes, plus the dtype) for the others (`torch.storage._new_dtypes()`); both kinds
are covered. Values are compared as bytes, so NaNs and odd bit patterns count.
"""

from __future__ import annotations

import io
import re
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.archive import read_archive_layout, tensor_archive
from shardwise.storage.local import LocalFile
from tests.checkpoint.format.test_records import saved_record

V3 = torch.storage._new_dtypes()
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.bits8,
    torch.bits16,
    torch.bits1x8,
    torch.bits2x4,
    torch.bits4x2,
]
NAMES = [str(d).removeprefix("torch.") for d in DTYPES]
# Stock DCP's planner cannot size the bits* dtypes (`torch._utils._element_size`
# raises), so no DCP checkpoint holds them; checkpoints cover every other dtype.
BITS = {torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2}
SHAPE = (6, 10)

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),  # complex32 is meant
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled"
    ),  # DCP in one process, by design
]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of `dtype` (NaNs and infinities included); 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_the_list_is_every_dtype_torch_save_writes():
    every = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    quantized = {
        torch.qint8,
        torch.qint32,
        torch.quint8,
        torch.quint4x2,
        torch.quint2x4,
    }  # no plain tensors
    sub_byte = {d for d in every if re.fullmatch(r"u?int[1-7]", str(d).removeprefix("torch."))}
    with pytest.raises(KeyError):  # which torch.save refuses
        torch.save(torch.empty(2, dtype=torch.uint4), io.BytesIO())
    assert every - quantized - sub_byte == set(DTYPES)
    assert set(DTYPES) & V3 and set(DTYPES) - V3  # both record kinds


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
@pytest.mark.parametrize("shape", [SHAPE, (), (0, 3)], ids=["2-d", "0-d", "empty"])
def test_our_record_is_what_torch_load_reads(dtype, shape):
    t = sample(dtype, shape)
    head, payload, tail = tensor_archive(t)
    back = torch.load(io.BytesIO(bytes(head) + bytes(payload) + bytes(tail)), weights_only=True)
    assert same_bits(back, t)


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
def test_our_record_parses_back(dtype):
    t = sample(dtype)
    head, payload, tail = tensor_archive(t)
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 100)
        f.write(head + payload + tail)
        f.flush()
        length = len(head) + len(payload) + len(tail)
        layout = read_archive_layout(LocalFile.wrap(f.fileno()), 100, length)
    assert layout.payload_offset == 100 + len(head) and layout.payload_length == len(payload)
    assert (layout.dtype, layout.shape, layout.c_contiguous) == (dtype, SHAPE, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES)
def test_stock_record_payload_is_found(dtype):
    t = sample(dtype)
    layout, raw = saved_record(t, prefix=b"prefix" * 7)
    assert (layout.dtype, layout.shape, layout.c_contiguous) == (dtype, SHAPE, True)
    assert layout.payload_length == layout.nbytes == t.numel() * dtype.itemsize
    assert same_bits(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(SHAPE), t)


def test_a_conjugate_view_is_written_as_its_values():
    """A conjugate bit is no flag in our records: the bytes must be the conjugated values."""
    z = torch.complex(torch.randn(4, 3), torch.randn(4, 3)).conj()
    head, payload, tail = tensor_archive(z)
    back = torch.load(io.BytesIO(bytes(head) + bytes(payload) + bytes(tail)), weights_only=True)
    assert not back.is_conj() and torch.equal(back, z.resolve_conj())


def test_a_stock_record_with_a_conjugate_bit_is_not_read_raw():
    z = torch.complex(torch.randn(4, 3), torch.randn(4, 3)).conj()
    with tempfile.TemporaryFile() as f:
        torch.save(z, f)  # stores the raw storage plus metadata {"conj": True}
        length = f.tell()
        f.flush()
        assert not read_archive_layout(LocalFile.wrap(f.fileno()), 0, length).c_contiguous


def _state(seed: int = 1) -> dict[str, torch.Tensor]:
    return {f"t.{name}": sample(d, seed=seed) for name, d in zip(NAMES, DTYPES) if d not in BITS}


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def _mismatched(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in want if not same_bits(got[k], want[k])]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The same state saved by dcp.save through our Writer and through stock FileSystemWriter."""
    root = tmp_path_factory.mktemp("dtypes")
    state = _state()
    dcp.save(dict(state), storage_writer=swc.Writer(root / "ours"))
    dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(root / "stock"))
    return state, root


@pytest.mark.parametrize("reader", ["swc.load", "dcp.load"])
@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_checkpoint_round_trip_is_bit_exact(written, writer, reader):
    state, root = written
    target = _empty_like(state)
    if reader == "swc.load":
        swc.load(target, root / writer)
    else:
        dcp.load(target, storage_reader=dcp.FileSystemReader(root / writer))
    assert _mismatched(target, state) == []


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_region_reads_bit_exact(written, writer):
    """A sub-box read goes through the byte-run arithmetic, where the item size matters."""
    state, root = written
    region = Block((1, 3), (4, 5))
    wrong = [
        k
        for k, v in state.items()
        if not same_bits(swc.read_tensor(root / writer, k, region=region), v[1:5, 3:8])
    ]
    assert wrong == []


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_conjugate_tensor_survives_a_checkpoint(tmp_path, writer):
    z = torch.complex(torch.randn(4, 3), torch.randn(4, 3))
    storage = swc.Writer(tmp_path) if writer == "ours" else dcp.FileSystemWriter(tmp_path)
    dcp.save({"z": z.conj()}, storage_writer=storage)
    target = {"z": torch.zeros_like(z)}
    swc.load(target, tmp_path)
    assert torch.equal(target["z"], z.conj().resolve_conj())


def test_a_resharded_load_is_bit_exact(tmp_path):
    """Column blocks saved, row blocks loaded: partial reads into strided targets, every dtype."""
    state = _state(seed=2)
    src = Layout.column_wise(SHAPE, [3, 7], ranks=[0, 0])
    dst = Layout.row_wise(SHAPE, [2, 4], ranks=[0, 0])
    swc.save(
        {
            k: ShardedTensor.from_layout(src, [v[b.slices()].clone() for b in src.blocks_of(0)])
            for k, v in state.items()
        },
        tmp_path / "ckpt",
    )
    target = {k: ShardedTensor.zeros(dst, dtype=v.dtype) for k, v in state.items()}
    swc.load(target, tmp_path / "ckpt")
    wrong = [
        k
        for k, st in target.items()
        if not all(
            same_bits(s, state[k][b.slices()]) for s, b in zip(st.local_shards(), st.local_blocks)
        )
    ]
    assert wrong == []


def test_convert_to_a_torch_file_keeps_every_dtype(written, tmp_path):
    state, root = written
    swc.convert(root / "ours", tmp_path / "all.pt", format="torch")
    back = torch.load(tmp_path / "all.pt", weights_only=True)
    assert _mismatched(back, state) == []

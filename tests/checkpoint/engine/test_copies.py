"""The copies of a snapshot (`engine.staging`): byte ranges cut into pieces for the kept pool, copied
by several threads (memcpy or `copy_`), bit for bit in every dtype."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardwise.checkpoint.engine import staging as copies
from shardwise.checkpoint.engine.staging import Stager, _pieces

from .stagers import cycle, pooled, stagers


@pytest.fixture(params=[1, 2], ids=["torch-1-thread", "torch-2-threads"])
def torch_threads(request):
    """Runs a test with torch on 1 thread (workers copy with copy_) and on 2 (memcpy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_chunked_threaded_copy_of_a_size_not_a_multiple_of_the_piece_count(
    monkeypatch, torch_threads
):
    copied_by: set[int] = set()
    primitives: set[bool] = set()
    copy_range = copies._copy_range

    def recording(dst, src, start, n, memcpy):
        copied_by.add(threading.get_ident())
        primitives.add(memcpy)
        time.sleep(0.002)  # lets every worker take pieces
        copy_range(dst, src, start, n, memcpy)

    monkeypatch.setattr(copies, "_copy_range", recording)
    stager = pooled(threads=3, piece=1 << 16)
    src = torch.randn(1_000_003)  # 4,000,012 bytes: 61 pieces of 64 KiB and a shorter one
    assert src.nbytes % (1 << 16) != 0
    other = torch.randn(77_777, dtype=torch.float64)  # a second tensor in the same stream
    staged = cycle(stager, {"x": src, "y": src[1:].clone(), "z": other})
    assert torch.equal(staged["x"], src)
    assert torch.equal(staged["y"], src[1:])
    assert torch.equal(staged["z"], other)
    assert len(copied_by) > 1  # really copied by more than one thread
    assert primitives == {torch_threads > 1}  # memcpy only where copy_ would fork OpenMP
    # and again into the same buffers, with other values
    src.mul_(-3)
    again = cycle(stager, {"x": src, "y": src[1:].clone(), "z": other})
    assert again["x"].data_ptr() == staged["x"].data_ptr()
    assert torch.equal(again["x"], src)
    assert torch.equal(again["y"], src[1:])


def test_default_threads_split_a_large_tensor():
    stager = Stager(threads=2)
    src = torch.randn(3, 1 << 20)  # 12 MiB, over the pool threshold
    for _ in range(2):
        src.add_(1)
        assert torch.equal(cycle(stager, {"x": src})["x"], src)
    stager.close()
    assert torch.equal(cycle(stager, {"x": src})["x"], src)  # a closed pool restarts


def test_one_thread_uses_no_pool():
    stager = Stager(threads=1)
    src = torch.randn(3, 1 << 20)
    assert torch.equal(cycle(stager, {"x": src})["x"], src)
    assert not stager._copy_pool.started


def test_pieces_cover_every_byte_once():
    views = [torch.empty(n, dtype=torch.uint8) for n in (10, 0, 7, 25)]
    copies = [(v, v) for v in views]
    pieces = _pieces(copies, 8)
    assert [sum(n for *_, n in p) for p in pieces] == [8, 8, 8, 8, 8, 2]
    covered = []
    for piece in pieces:
        for dst, src, start, n in piece:
            assert n > 0 and dst is src
            covered += [(id(dst), start + i) for i in range(n)]
    assert covered == [(id(v), i) for v in views for i in range(v.numel())]


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64]
)
def test_dtypes_copy_exactly(stager, dtype, torch_threads):
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1 << 19, generator=g)  # 512k values
    if dtype is torch.bool:
        src = raw > 0
    elif dtype is torch.int8:
        src = (raw * 50).to(torch.int8)
    elif dtype is torch.complex64:
        src = torch.complex(raw, -raw)
    else:
        src = raw.to(dtype)
    staged = cycle(stager, {"x": src, "small": src[:7]})
    assert staged["x"].dtype == dtype
    assert torch.equal(staged["x"].view(torch.uint8), src.view(torch.uint8))  # bit for bit
    assert torch.equal(staged["small"], src[:7])


@pytest.mark.parametrize(
    "t, expected",
    [
        (torch.arange(6.0).reshape(2, 3), True),
        (torch.arange(6.0).reshape(2, 3).t(), False),  # strided
        (torch.arange(6.0)[2:], True),  # contiguous, offset into its storage
        (torch.complex(torch.ones(2), torch.ones(2)).conj(), False),  # a lazy conj bit
        (torch.complex(torch.ones(2), torch.ones(2)).conj().imag, False),  # a neg bit
        (torch.tensor(1.5), True),
        (torch.zeros(2, 2).to_sparse(), False),
    ],
    ids=["contiguous", "transposed", "offset", "conj", "neg", "0-d", "sparse"],
)
def test_bytewise_is_whether_the_bytes_are_the_values(t, expected):
    assert copies.bytewise(t) is expected


def test_bytes_of_is_a_flat_byte_view():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    view = copies.bytes_of(t)
    assert view.dtype == torch.uint8 and view.shape == (12,)
    assert view.tolist() == list(t.numpy().tobytes())
    view[0] = 7  # a view: the tensor sees it
    assert int(t[0, 0]) == 7

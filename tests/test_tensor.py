from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from shardwise import Layout, ShardedTensor, ShardMismatchError
from shardwise.testing import shard_of

COLUMNS = Layout.column_wise((6, 8), [2, 2, 2, 2], ranks=[0, 1, 0, 1], world_size=3)


def make(layout: Layout, full: torch.Tensor, rank: int) -> ShardedTensor:
    return ShardedTensor.from_layout(layout, shard_of(full, layout, rank), rank=rank)


def test_global_metadata_and_accessors():
    full = torch.arange(48.0).reshape(6, 8)
    st = make(COLUMNS, full, 0)
    assert st.shape == torch.Size([6, 8]) and st.dtype == torch.float32
    assert st.device == torch.device("cpu") and not st.requires_grad
    assert st.layout_spec == COLUMNS and st.rank == 0 and st.group is None
    assert st.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 4])]
    assert st.local_sizes() == [torch.Size([6, 2])] * 2
    assert [c.offsets for c in st.local_chunks] == st.local_offsets()
    md = st.storage_metadata()
    assert md.size == torch.Size([6, 8]) and len(md.chunks) == 2
    assert not st.is_empty_shard() and not st.is_pinned() and not st.is_meta
    assert torch.equal(st.local_shards()[1], full[:, 4:6])


def test_local_shards_are_live():
    st = make(COLUMNS, torch.zeros(6, 8), 1)
    st.local_shards()[0].fill_(3)
    assert torch.equal((st + 0).local_shards()[0], torch.full((6, 2), 3.0))


def test_empty_rank_needs_dtype_only_there():
    st = ShardedTensor.from_layout(COLUMNS, [], rank=2, dtype=torch.float16)
    assert st.is_empty_shard() and st.local_shards() == [] and st.dtype == torch.float16
    assert (st * 2).dtype == torch.float16 and (st > 0).dtype == torch.bool
    default = ShardedTensor.from_layout(COLUMNS, [], rank=2)
    assert default.dtype == torch.get_default_dtype()


@pytest.mark.parametrize("factory", ["empty", "zeros", "full"])
def test_factories(factory):
    if factory == "full":
        st = ShardedTensor.full(COLUMNS, 7, rank=1)
        assert st.dtype == torch.int64 and all(bool((s == 7).all()) for s in st.local_shards())
    else:
        st = getattr(ShardedTensor, factory)(COLUMNS, rank=1)
        assert st.dtype == torch.get_default_dtype()
    assert [tuple(s.shape) for s in st.local_shards()] == [(6, 2), (6, 2)]
    assert (
        ShardedTensor.zeros(COLUMNS, dtype=torch.bfloat16, rank=0).local_shards()[0].dtype
        == torch.bfloat16
    )


@pytest.mark.parametrize(
    "shards, kwargs, error, words",
    [
        pytest.param(
            [torch.zeros(6, 2)], {}, ShardMismatchError, ["2 blocks", "1 shards"], id="count"
        ),
        pytest.param(
            [torch.zeros(6, 2), torch.zeros(6, 3)],
            {},
            ShardMismatchError,
            ["shard 1", "(6, 3)"],
            id="size",
        ),
        pytest.param(
            [torch.zeros(6, 2), torch.zeros(6, 2, dtype=torch.float64)],
            {},
            TypeError,
            ["mixed dtypes"],
            id="dtype",
        ),
        pytest.param(
            [torch.zeros(6, 2), torch.zeros(6, 2, device="meta")],
            {},
            ShardMismatchError,
            ["devices"],
            id="device",
        ),
        pytest.param(
            [torch.zeros(6, 2)] * 2, {"rank": 5}, ShardMismatchError, ["rank 5"], id="rank"
        ),
        pytest.param(["x", torch.zeros(6, 2)], {}, TypeError, ["shard 0"], id="not-a-tensor"),
    ],
)
def test_from_layout_rejects_bad_input(shards, kwargs, error, words):
    kwargs = {"rank": 0, **kwargs}
    with pytest.raises(error) as info:
        ShardedTensor.from_layout(COLUMNS, shards, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_zero_d():
    layout = Layout.replicated((), 2)
    st = ShardedTensor.from_layout(layout, [torch.tensor(2.5)], rank=1)
    assert st.shape == torch.Size([]) and st.dim() == 0
    assert torch.equal((st * 2).local_shards()[0], torch.tensor(5.0))
    st.add_(1)
    assert st.local_shards()[0].item() == 3.5
    nobody = ShardedTensor.from_layout(Layout.table_wise((), 0, 2), [], rank=1)
    assert nobody.is_empty_shard() and (nobody + 1).local_shards() == []


def test_pickle_and_torch_save_need_no_process_group():
    st = make(COLUMNS, torch.randn(6, 8), 1)
    for restored in (
        pickle.loads(pickle.dumps(st)),
        _torch_round_trip(st),
    ):
        assert isinstance(restored, ShardedTensor)
        assert restored.layout_spec == COLUMNS and restored.rank == 1
        assert torch.equal(restored, st)


def _torch_round_trip(st):
    buf = io.BytesIO()
    torch.save(st, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_deepcopy_and_parameter():
    st = make(COLUMNS, torch.randn(6, 8), 0)
    p = torch.nn.Parameter(st)
    assert isinstance(p, ShardedTensor) and p.requires_grad
    q = copy.deepcopy(p)
    assert q.requires_grad and torch.equal(q.detach(), st)
    q.detach().local_shards()[0].zero_()
    assert not torch.equal(q.detach(), st)  # a copy, not a view


def test_repr_names_layout():
    text = repr(make(COLUMNS, torch.zeros(6, 8), 0))
    assert "ShardedTensor(shape=(6, 8)" in text and "rank=0" in text

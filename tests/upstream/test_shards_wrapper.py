"""PyTorch's `LocalShardsWrapper` tests, reproduced on shardwise's `ShardedTensor`.

Origin: test/distributed/tensor/test_shards_wrapper.py in pytorch/pytorch (the one
stored version, commit 71a8f84; scenarios and assertions kept, code written anew;
each test names its origin as `LocalShardsWrapperPaddingTest.test_...`). Every test
of that file is about one op, `aten.constant_pad_nd` (`F.pad(mode="constant")`),
which LocalShardsWrapper handled in that version.

Torch 2.13 does not: its installed `_shards_wrapper.py` has no such handler and
raises NotImplementedError (asserted below). shardwise has a rule for it in any
layout: each block padded alone, the blocks at a padded edge taking its new
elements, no fallback. So each upstream scenario runs twice:

1. built in: the rule gives `F.pad` of the whole tensor (torch's own error for an
   invalid pad), where torch 2.13's LocalShardsWrapper refuses the op;
2. through the registry: `sw.register_op(aten.constant_pad_nd.default, pad_blocks)`
   with a handler written here on the public API only (Layout/Block geometry,
   `from_layout`), and every upstream assertion (shard values and shapes, offsets,
   storage metadata) checked on its result, plus the whole padded tensor against
   `F.pad` of the whole original.

Upstream's fixtures put the whole tensor on one rank, so there LocalShardsWrapper's
local "concatenated" shape and shardwise's global shape coincide. Deliberate
differences are marked `# shardwise differs:` with the SPEC line. The last section
(not from upstream, whose file has no such test) checks SPEC §2's accessors and ops
against the installed torch 2.13 LocalShardsWrapper on the same shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

import shardwise as sw
from shardwise import Block, Layout, ShardedTensor
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

UPSTREAM = "test/distributed/tensor/test_shards_wrapper.py"
PAD = torch.ops.aten.constant_pad_nd.default


# -- fixtures: upstream's shards, all held by rank 0 -----------------------------------------


def one_rank(shards: Sequence[torch.Tensor], offsets: Sequence[Sequence[int]]) -> ShardedTensor:
    """Rank 0 of a 1-rank layout holding `shards` at `offsets`; the global shape is
    their bounding box (the tensor upstream's wrapper stands for)."""
    blocks = [Block(tuple(o), tuple(s.shape)) for s, o in zip(shards, offsets)]
    shape = tuple(max(b.offsets[d] + b.sizes[d] for b in blocks) for d in range(blocks[0].ndim))
    return ShardedTensor.from_layout(Layout(shape, {0: blocks}), list(shards), rank=0)


def cw_2d() -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """Two column-wise shards of [[1, 2, 3, 4], [5, 6, 7, 8]]."""
    return [torch.tensor([[1.0, 2.0], [5.0, 6.0]]), torch.tensor([[3.0, 4.0], [7.0, 8.0]])], [
        (0, 0),
        (0, 2),
    ]


def rw_1d(n: int) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """Two row-wise shards 1..n and n+1..2n of a 1-d tensor."""
    return [torch.arange(1.0, n + 1), torch.arange(n + 1.0, 2 * n + 1)], [(0,), (n,)]


def whole(st: ShardedTensor) -> torch.Tensor:
    """The global tensor from this rank's shards (the fixtures hold all of it)."""
    out = torch.full(tuple(st.shape), float("nan"), dtype=st.dtype)
    for shard, block in zip(st.local_shards(), st.local_blocks):
        out[block.slices()] = shard
    return out


# -- the handler registered in part 2 ------------------------------------------------------


def pad_blocks(st: ShardedTensor, pad: Sequence[int], value: float = 0.0) -> ShardedTensor:
    """constant_pad_nd of the global tensor, with no communication: a block on a low
    edge of a dimension grows by that side's padding, the blocks after it shift, and a
    block on a high edge grows by the other side's. Any ndim (Block geometry is N-d)."""
    shape = st.layout_spec.global_shape
    ndim = len(shape)
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) > 2 * ndim:
        raise ValueError(f"padding {pad} must be pairs, at most one per dimension of {shape}")
    if min(pad, default=0) < 0:
        raise ValueError(f"padding {pad} is negative; cropping is not supported")
    low, high = [0] * ndim, [0] * ndim
    for i in range(len(pad) // 2):  # pairs run from the last dimension backwards, as in F.pad
        low[ndim - 1 - i], high[ndim - 1 - i] = pad[2 * i], pad[2 * i + 1]

    def grow(b: Block) -> tuple[Block, list[int]]:
        before = [low[d] if b.offsets[d] == 0 else 0 for d in range(ndim)]
        after = [high[d] if b.offsets[d] + b.sizes[d] == shape[d] else 0 for d in range(ndim)]
        offsets = tuple(b.offsets[d] + low[d] - before[d] for d in range(ndim))
        sizes = tuple(b.sizes[d] + before[d] + after[d] for d in range(ndim))
        return Block(offsets, sizes), [
            x for d in reversed(range(ndim)) for x in (before[d], after[d])
        ]

    src = st.layout_spec
    layout = Layout(
        tuple(n + lo + hi for n, lo, hi in zip(shape, low, high)),
        {r: [grow(b)[0] for b in src.blocks_of(r)] for r in range(src.world_size)},
        src.world_size,
    )
    shards = [F.pad(s, grow(b)[1], value=value) for s, b in zip(st.local_shards(), st.local_blocks)]
    return ShardedTensor.from_layout(
        layout, shards, rank=st.rank, dtype=st.dtype, device=st.device, group=st.group
    )


@pytest.fixture
def padding() -> Any:
    sw.register_op(PAD, pad_blocks)
    yield
    sw.unregister_op(PAD)


# Every upstream scenario: (its shards and offsets, the pad calls it makes)
SCENARIOS: dict[str, tuple[Callable[[], tuple[list, list]], list[tuple[list[int], float]]]] = {
    "test_invalid_1d_rw_padding": (lambda: rw_1d(2), [([1], 5.0)]),
    "test_invalid_2d_cw_padding": (cw_2d, [([1, 2, 3], 5.0), ([1], 5.0)]),
    "test_single_shard_padding_2d": (
        lambda: ([torch.tensor([[1.0, 2.0], [3.0, 4.0]])], [(0, 0)]),
        [([1, 2, 3, 4], 0.0)],
    ),
    "test_single_shard_padding_1d": (
        lambda: ([torch.tensor([1.0, 2.0, 3.0])], [(0,)]),
        [([2, 1], -1.0)],
    ),
    "test_2d_cw_sharding_top_padding": (cw_2d, [([0, 0, 2, 0], 0.0)]),
    "test_2d_cw_sharding_bottom_padding": (cw_2d, [([0, 0, 0, 1], -1.0)]),
    "test_2d_cw_sharding_left_padding": (cw_2d, [([3, 0, 0, 0], 2.0)]),
    "test_2d_cw_sharding_right_padding": (cw_2d, [([0, 2, 0, 0], 3.0), ([0, 2], 3.0)]),
    "test_2d_cw_sharding_mixed_padding": (cw_2d, [([1, 2, 1, 1], 0.0)]),
    "test_1d_rw_sharding_top_padding": (lambda: rw_1d(3), [([2, 0], 0.0)]),
    "test_1d_rw_sharding_bottom_padding": (lambda: rw_1d(3), [([0, 1], -1.0)]),
    "test_1d_rw_sharding_mixed_padding": (lambda: rw_1d(2), [([1, 2], 5.0)]),
    "test_higher_dimensions_not_implemented": (
        lambda: ([torch.rand(2, 3, 4), torch.rand(2, 3, 4)], [(0, 0, 0), (2, 0, 0)]),
        [([1, 1, 1, 1, 1, 1], 0.0)],
    ),
    "test_offsets_and_storage_metadata_after_padding_1d_rw": (lambda: rw_1d(2), [([1, 1], 0.0)]),
    "test_offsets_and_storage_metadata_after_padding_2d_cw": (cw_2d, [([1, 1, 0, 0], 0.0)]),
}
VALID = [name for name in SCENARIOS if "invalid" not in name]


# -- part 1: the op as built in, next to torch 2.13's LocalShardsWrapper ---------------------


@pytest.mark.parametrize("origin", list(SCENARIOS))
def test_padding_pads_each_block_to_f_pad_of_the_whole(origin):
    """Every LocalShardsWrapperPaddingTest scenario, built in: each block is padded alone,
    the blocks at a padded edge taking its new elements, with no fallback (torch 2.13's
    LocalShardsWrapper refuses the op)."""
    from shardwise.ops import FALLBACK_OPS

    make, calls = SCENARIOS[origin]
    shards, offsets = make()
    for pad, value in calls:
        st = one_rank(shards, offsets)
        whole = _assembled(st)
        if len(pad) % 2:  # torch's own error for an odd pad length, as on the whole tensor
            with pytest.raises(RuntimeError, match="Length of pad must be even"):
                PAD(st, pad, value)
            continue
        FALLBACK_OPS.clear()
        out = PAD(st, pad, value)
        assert FALLBACK_OPS == {}
        assert len(out.local_shards()) == len(st.local_shards())  # one block each, moved
        assert torch.equal(_assembled(out), F.pad(whole, pad, value=value))
        if "invalid_1d" not in origin:  # upstream's 1-d fixture is malformed (see below)
            with pytest.raises(NotImplementedError, match="constant_pad_nd"):
                PAD(LocalShardsWrapper(shards, offsets), pad, value)


def _assembled(st: ShardedTensor) -> torch.Tensor:
    """The whole tensor of a one-rank ShardedTensor, from its blocks."""
    out = torch.zeros(st.shape, dtype=st.dtype)
    for shard, block in zip(st.local_shards(), st.local_blocks):
        out[block.slices()] = shard
    return out


def test_empty_shards_padding():
    """LocalShardsWrapperPaddingTest.test_empty_shards_padding: upstream raises for a
    wrapper with no shards. shardwise differs: rank 1's one block spans every dim, so
    each rank pads its own blocks, and rank 0, holding nothing, gets the padded shape
    and no block of it (as through the registry, below)."""
    empty = ShardedTensor.from_layout(
        Layout((2, 2), {1: [Block((0, 0), (2, 2))]}, 2), [], rank=0, dtype=torch.float32
    )
    out = PAD(empty, [1, 2, 3, 4], 5.0)
    assert out.local_shards() == [] and out.shape == torch.Size([9, 5])
    assert out.layout_spec.blocks_of(1) == (Block((0, 0), (9, 5)),)
    with pytest.raises(Exception):
        PAD(LocalShardsWrapper([], []), [1, 2, 3, 4], 5.0)


# -- part 2: upstream's assertions, through the op registry ----------------------------------


@pytest.mark.parametrize("origin", VALID)
def test_padded_tensor_is_f_pad_of_the_whole(padding, origin):
    """Every valid upstream scenario: the padded blocks assemble into exactly
    F.pad of the whole tensor, and the layout stays a valid cover."""
    make, calls = SCENARIOS[origin]
    shards, offsets = make()
    st = one_rank(shards, offsets)
    for pad, value in calls:
        out = PAD(st, pad, value)
        assert isinstance(out, ShardedTensor) and out.layout_spec.is_fully_covered
        assert torch.equal(whole(out), F.pad(whole(st), pad, value=value))
        assert torch.equal(
            whole(F.pad(st, pad, value=value)), whole(out)
        )  # F.pad reaches the handler too


def test_empty_shards_padding_through_the_registry(padding):
    """LocalShardsWrapperPaddingTest.test_empty_shards_padding."""
    empty = ShardedTensor.from_layout(
        Layout((2, 2), {1: [Block((0, 0), (2, 2))]}, 2), [], rank=0, dtype=torch.float32
    )
    out = PAD(empty, [1, 2, 3, 4], 5.0)
    # shardwise differs: upstream raises for a wrapper with no shards; an op on a
    # ShardedTensor runs on every rank, one that holds nothing included, and leaves it
    # with no block of the new layout (SPEC §6: "A rank that holds nothing appears with
    # no blocks"), so rank 0 takes part and gets the padded global shape.
    assert out.is_empty_shard() and out.local_shards() == []
    assert out.shape == torch.Size([2 + 3 + 4, 2 + 1 + 2])
    assert out.layout_spec.blocks_of(1) == (Block((0, 0), (9, 5)),)


def test_invalid_1d_rw_padding(padding):
    """LocalShardsWrapperPaddingTest.test_invalid_1d_rw_padding."""
    # shardwise differs: upstream's fixture gives two 1-d shards a single 2-d offset
    # (2, 0), which LocalShardsWrapper accepts unchecked; shardwise refuses such
    # geometry (SPEC §1: blocks "of the layout's rank (ndim)"), so the port pads two
    # well-formed shards at (0,) and (2,).
    with pytest.raises(ValueError):
        Block((2, 0), (2,))
    with pytest.raises(ValueError):
        PAD(one_rank(*rw_1d(2)), [1], 5.0)


def test_invalid_2d_cw_padding(padding):
    """LocalShardsWrapperPaddingTest.test_invalid_2d_cw_padding."""
    st = one_rank(*cw_2d())
    with pytest.raises(ValueError):
        PAD(st, [1, 2, 3], 5.0)
    with pytest.raises(ValueError):
        PAD(st, [1], 5.0)


def test_single_shard_padding_2d(padding):
    """LocalShardsWrapperPaddingTest.test_single_shard_padding_2d."""
    tensor = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = PAD(one_rank([tensor], [(0, 0)]), [1, 2, 3, 4], 0.0)
    assert isinstance(out, ShardedTensor)
    assert len(out.local_shards()) == 1
    torch.testing.assert_close(out.local_shards()[0], F.pad(tensor, [1, 2, 3, 4], value=0.0))


def test_single_shard_padding_1d(padding):
    """LocalShardsWrapperPaddingTest.test_single_shard_padding_1d."""
    tensor = torch.tensor([1.0, 2.0, 3.0])
    out = PAD(one_rank([tensor], [(0,)]), [2, 1], -1.0)
    assert isinstance(out, ShardedTensor)
    assert len(out.local_shards()) == 1
    torch.testing.assert_close(out.local_shards()[0], F.pad(tensor, [2, 1], value=-1.0))


def test_2d_cw_sharding_top_padding(padding):
    """LocalShardsWrapperPaddingTest.test_2d_cw_sharding_top_padding: every shard grows."""
    (a, b), offsets = cw_2d()
    out = PAD(one_rank([a, b], offsets), [0, 0, 2, 0], 0.0)
    first, second = out.local_shards()
    assert first.shape == (4, 2) and second.shape == (4, 2)
    torch.testing.assert_close(first[:2], torch.zeros(2, 2))
    torch.testing.assert_close(second[:2], torch.zeros(2, 2))
    torch.testing.assert_close(first[2:], a)
    torch.testing.assert_close(second[2:], b)


def test_2d_cw_sharding_bottom_padding(padding):
    """LocalShardsWrapperPaddingTest.test_2d_cw_sharding_bottom_padding: every shard grows."""
    (a, b), offsets = cw_2d()
    out = PAD(one_rank([a, b], offsets), [0, 0, 0, 1], -1.0)
    first, second = out.local_shards()
    assert first.shape == (3, 2) and second.shape == (3, 2)
    torch.testing.assert_close(first[:2], a)
    torch.testing.assert_close(second[:2], b)
    torch.testing.assert_close(first[2:], torch.full((1, 2), -1.0))
    torch.testing.assert_close(second[2:], torch.full((1, 2), -1.0))


def test_2d_cw_sharding_left_padding(padding):
    """LocalShardsWrapperPaddingTest.test_2d_cw_sharding_left_padding: only the first shard."""
    (a, b), offsets = cw_2d()
    out = PAD(one_rank([a, b], offsets), [3, 0, 0, 0], 2.0)
    first, second = out.local_shards()
    assert first.shape == (2, 5) and second.shape == (2, 2)
    torch.testing.assert_close(first[:, :3], torch.full((2, 3), 2.0))
    torch.testing.assert_close(first[:, 3:], a)
    torch.testing.assert_close(second, b)


def test_2d_cw_sharding_right_padding(padding):
    """LocalShardsWrapperPaddingTest.test_2d_cw_sharding_right_padding: only the last
    shard; one pair of pads on a 2-d tensor pads the last dimension."""
    st = one_rank(*cw_2d())
    want_first = torch.tensor([[1.0, 2.0], [5.0, 6.0]])
    want_second = torch.tensor([[3.0, 4.0, 3.0, 3.0], [7.0, 8.0, 3.0, 3.0]])
    for pad in ([0, 2, 0, 0], [0, 2]):
        out = PAD(st, pad, 3.0)
        assert len(out.local_shards()) == 2
        torch.testing.assert_close(out.local_shards()[0], want_first)
        torch.testing.assert_close(out.local_shards()[1], want_second)


def test_2d_cw_sharding_mixed_padding(padding):
    """LocalShardsWrapperPaddingTest.test_2d_cw_sharding_mixed_padding."""
    out = PAD(one_rank(*cw_2d()), [1, 2, 1, 1], 0.0)
    assert len(out.local_shards()) == 2
    torch.testing.assert_close(
        out.local_shards()[0],
        torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 2.0], [0.0, 5.0, 6.0], [0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        out.local_shards()[1],
        torch.tensor([[0.0] * 4, [3.0, 4.0, 0.0, 0.0], [7.0, 8.0, 0.0, 0.0], [0.0] * 4]),
    )


@pytest.mark.parametrize(
    "origin, n, pad, value, want_first, want_second",
    [
        (
            "test_1d_rw_sharding_top_padding",
            3,
            [2, 0],
            0.0,
            [0.0, 0.0, 1.0, 2.0, 3.0],
            [4.0, 5.0, 6.0],
        ),
        (
            "test_1d_rw_sharding_bottom_padding",
            3,
            [0, 1],
            -1.0,
            [1.0, 2.0, 3.0],
            [4.0, 5.0, 6.0, -1.0],
        ),
        (
            "test_1d_rw_sharding_mixed_padding",
            2,
            [1, 2],
            5.0,
            [5.0, 1.0, 2.0],
            [3.0, 4.0, 5.0, 5.0],
        ),
    ],
)
def test_1d_rw_sharding_padding(padding, origin, n, pad, value, want_first, want_second):
    """LocalShardsWrapperPaddingTest.test_1d_rw_sharding_{top,bottom,mixed}_padding:
    the top pad goes to the first shard, the bottom pad to the last."""
    out = PAD(one_rank(*rw_1d(n)), pad, value)
    assert len(out.local_shards()) == 2
    torch.testing.assert_close(out.local_shards()[0], torch.tensor(want_first))
    torch.testing.assert_close(out.local_shards()[1], torch.tensor(want_second))


def test_higher_dimensions_not_implemented(padding):
    """LocalShardsWrapperPaddingTest.test_higher_dimensions_not_implemented."""
    a, b = torch.rand(2, 3, 4), torch.rand(2, 3, 4)
    st = one_rank([a, b], [(0, 0, 0), (2, 0, 0)])
    out = PAD(st, [1, 1, 1, 1, 1, 1], 0.0)
    # shardwise differs: upstream raises NotImplementedError ("Only 1D and 2D tensors
    # are currently supported"); shardwise's geometry is N-d in one place (Block,
    # Layout; STYLE habit 2, which names _shards_wrapper.py's ndim branches as the
    # counterexample), so a handler pads 3-d blocks like any other.
    assert out.local_sizes() == [torch.Size([3, 5, 6]), torch.Size([3, 5, 6])]
    assert out.local_offsets() == [torch.Size([0, 0, 0]), torch.Size([3, 0, 0])]
    torch.testing.assert_close(whole(out), F.pad(torch.cat([a, b]), [1] * 6))


def test_offsets_and_storage_metadata_after_padding_1d_rw(padding):
    """LocalShardsWrapperPaddingTest.test_offsets_and_storage_metadata_after_padding_1d_rw."""
    st = one_rank(*rw_1d(2))
    before = st.storage_metadata()
    # storage_metadata().size is the global size in shardwise (SPEC §6); upstream's
    # wrapper reports its local concatenation, the same [4] for this one-rank fixture.
    assert before.size == torch.Size([4])
    assert len(before.chunks) == 2
    assert (before.chunks[0].offsets, before.chunks[0].sizes) == (torch.Size([0]), torch.Size([2]))
    assert (before.chunks[1].offsets, before.chunks[1].sizes) == (torch.Size([2]), torch.Size([2]))

    out = PAD(st, [1, 1], 0.0)
    assert out.local_offsets() == [
        torch.Size([0]),
        torch.Size([3]),
    ]  # the second shifts by the top pad
    after = out.storage_metadata()
    assert after.size == torch.Size([6])  # [0, 1, 2, 3, 4, 0]
    assert len(after.chunks) == 2
    assert (after.chunks[0].offsets, after.chunks[0].sizes) == (torch.Size([0]), torch.Size([3]))
    assert (after.chunks[1].offsets, after.chunks[1].sizes) == (torch.Size([3]), torch.Size([3]))


def test_offsets_and_storage_metadata_after_padding_2d_cw(padding):
    """LocalShardsWrapperPaddingTest.test_offsets_and_storage_metadata_after_padding_2d_cw."""
    out = PAD(one_rank(*cw_2d()), [1, 1, 0, 0], 0.0)
    assert out.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 3])]
    after = out.storage_metadata()
    assert after.size == torch.Size([2, 6])  # [2, 4 + 1 + 1]
    assert (after.chunks[0].offsets, after.chunks[0].sizes) == (
        torch.Size([0, 0]),
        torch.Size([2, 3]),
    )
    assert (after.chunks[1].offsets, after.chunks[1].sizes) == (
        torch.Size([0, 3]),
        torch.Size([2, 3]),
    )


def test_padding_keeps_a_multi_rank_layout_consistent(padding):
    """Not upstream: the same handler on each rank of a 2-rank column-wise layout
    (several blocks per rank) gives every rank the same new layout and, together,
    F.pad of the whole; LocalShardsWrapper's per-rank rule (the first local shard
    takes the left pad) would pad in the middle of the tensor on rank 1."""
    full = torch.arange(24.0).reshape(4, 6)
    layout = Layout.column_wise((4, 6), [1, 2, 2, 1], ranks=[0, 1, 0, 1], world_size=2)
    outs = [
        PAD(
            ShardedTensor.from_layout(
                layout, [full[b.slices()].clone() for b in layout.blocks_of(r)], rank=r
            ),
            [2, 1, 1, 0],
            -7.0,
        )
        for r in range(2)
    ]
    assert outs[0].layout_spec == outs[1].layout_spec
    got = torch.full(tuple(outs[0].shape), float("nan"))
    for out in outs:
        for shard, block in zip(out.local_shards(), out.local_blocks):
            got[block.slices()] = shard
    assert torch.equal(got, F.pad(full, [2, 1, 1, 0], value=-7.0))


# -- not upstream: SPEC §2's accessors and ops next to torch 2.13's LocalShardsWrapper --------


def pair() -> tuple[LocalShardsWrapper, ShardedTensor, list[torch.Tensor]]:
    """The same two column blocks held by rank 0, as a wrapper and as a ShardedTensor
    of a (6, 8) tensor whose other columns rank 1 holds."""
    shards = [torch.arange(12.0).reshape(6, 2), torch.arange(12.0, 24.0).reshape(6, 2)]
    layout = Layout.column_wise((6, 8), [2, 2, 2, 2], ranks=[0, 1, 0, 1], world_size=2)
    return (
        LocalShardsWrapper(shards, [(0, 0), (0, 4)]),
        ShardedTensor.from_layout(layout, shards, rank=0),
        shards,
    )


def test_accessors_match_the_wrapper():
    lsw, st, shards = pair()
    assert all(x is y for x, y in zip(st.local_shards(), shards))  # live tensors, as the wrapper's
    assert all(x is y for x, y in zip(lsw.local_shards(), shards))
    assert st.local_offsets() == lsw.local_offsets() == [torch.Size([0, 0]), torch.Size([0, 4])]
    assert st.local_sizes() == lsw.local_sizes() == [torch.Size([6, 2])] * 2
    assert st.local_chunks == lsw.local_chunks
    assert st.storage_metadata().chunks == lsw.storage_metadata().chunks
    assert st.storage_metadata().properties == lsw.storage_metadata().properties
    assert st.device == lsw.device and st.is_meta == lsw.is_meta is False
    assert st.is_pinned() == lsw.is_pinned() is False
    assert st.is_empty_shard() == lsw.is_empty_shard() is False
    # shardwise differs: the wrapper's shape and storage size are its local shards side by
    # side, (6, 4); a ShardedTensor's are the global (6, 8) (SPEC §2 "st.shape is the
    # global shape"; SPEC §6 "storage_metadata().size is the global shape").
    assert lsw.shape == lsw.storage_metadata().size == torch.Size([6, 4])
    assert st.shape == st.storage_metadata().size == torch.Size([6, 8])
    st.requires_grad_()
    lsw.requires_grad_()
    assert (
        st.storage_metadata().properties.requires_grad
        is lsw.storage_metadata().properties.requires_grad
        is True
    )


def test_empty_rank_next_to_the_empty_wrapper():
    lsw = LocalShardsWrapper([], [])
    st = ShardedTensor.from_layout(Layout.table_wise((6, 8), 1, 2), [], rank=0, dtype=torch.float32)
    assert st.is_empty_shard() and lsw.is_empty_shard()
    assert st.local_shards() == lsw.local_shards() == []
    # shardwise differs: the empty wrapper is (0, 0), on "meta", and reports one fake
    # (0, 0) chunk; an empty rank keeps the global shape (SPEC §2), the device it was
    # given (SPEC §6 from_layout: dtype/device "needed only where the rank holds no
    # shard") and reports no chunk (SPEC §6: "appears with no blocks").
    assert lsw.shape == torch.Size([0, 0]) and lsw.is_meta and len(lsw.local_chunks) == 1
    assert st.shape == torch.Size([6, 8]) and not st.is_meta and st.device == torch.device("cpu")
    assert st.local_chunks == [] and st.local_offsets() == [] and st.storage_metadata().chunks == []


OPS: dict[str, Callable[[Any, torch.Size], Any]] = {
    "_to_copy": lambda t, shape: t.to(torch.float64),
    "view": lambda t, shape: t.view(shape),
    "detach": lambda t, shape: t.detach(),
    "clone": lambda t, shape: t.clone(),
    "new_empty": lambda t, shape: t.new_empty(shape),
}


@pytest.mark.parametrize("name", list(OPS))
def test_ops_match_the_wrapper(name):
    lsw, st, shards = pair()
    # each gets its own shape: the wrapper's view only accepts its local one (see above)
    a, b = OPS[name](lsw, lsw.shape), OPS[name](st, st.shape)
    assert isinstance(b, ShardedTensor) and b.layout_spec == st.layout_spec
    assert b.local_offsets() == a.local_offsets() and b.local_sizes() == a.local_sizes()
    assert [s.dtype for s in b.local_shards()] == [s.dtype for s in a.local_shards()]
    if name != "new_empty":  # uninitialised memory has no value to compare
        for x, y in zip(b.local_shards(), a.local_shards()):
            assert torch.equal(x, y)


def test_view_and_detach_share_storage_clone_does_not():
    lsw, st, shards = pair()
    assert [s.data_ptr() for s in st.view(6, 8).local_shards()] == [s.data_ptr() for s in shards]
    assert [s.data_ptr() for s in st.clone().local_shards()] != [s.data_ptr() for s in shards]
    st.requires_grad_()
    detached = st.detach()
    # shardwise differs: the wrapper's detach edits and returns the wrapper itself;
    # shardwise's is torch's detach, a new tensor sharing the data (SPEC §2: each op
    # "result a ShardedTensor of the same layout").
    assert lsw.detach() is lsw
    assert detached is not st and st.requires_grad and not detached.requires_grad
    assert [s.data_ptr() for s in detached.local_shards()] == [s.data_ptr() for s in shards]


def test_equal_matches_the_wrapper():
    lsw, st, shards = pair()
    twin_lsw = LocalShardsWrapper([s.clone() for s in shards], [(0, 0), (0, 4)])
    twin = ShardedTensor.from_layout(st.layout_spec, [s.clone() for s in shards], rank=0)
    assert torch.equal(st, twin) and torch.equal(lsw, twin_lsw)
    twin.local_shards()[1][0, 0] += 1
    twin_lsw.local_shards()[1][0, 0] += 1
    assert not torch.equal(st, twin) and not torch.equal(lsw, twin_lsw)
    moved = Layout.column_wise(
        (6, 8), [2, 2, 2, 2], ranks=[0, 0, 1, 1], world_size=2
    )  # same sizes, other offsets
    other = ShardedTensor.from_layout(moved, [s.clone() for s in shards], rank=0)
    other_lsw = LocalShardsWrapper([s.clone() for s in shards], [(0, 0), (0, 2)])
    assert not torch.equal(st, other) and not torch.equal(lsw, other_lsw)  # offsets count in both


def test_dcp_hooks_match_the_wrapper():
    lsw, st, shards = pair()
    assert st.__create_chunk_list__() == lsw.__create_chunk_list__()
    for i, offsets in enumerate(([0, 0], [0, 4])):
        for hint in (i, None):  # the fast path by index, then the fallback by offsets
            index = MetadataIndex("w", torch.Size(offsets), hint)
            assert st.__get_tensor_shard__(index) is lsw.__get_tensor_shard__(index) is shards[i]
    mine, theirs = st.__create_write_items__("w", st), lsw.__create_write_items__("w", lsw)
    assert [w.tensor_data.chunk for w in mine] == [w.tensor_data.chunk for w in theirs]
    # shardwise differs: a write item's size is the tensor's; the wrapper's is its local (6, 4)
    assert {w.tensor_data.size for w in mine} == {torch.Size([6, 8])}


def _all_gather_both(rank: int, world: int) -> list[bool]:
    """Functional all_gather_into_tensor + wait_tensor on the wrapper and on the
    ShardedTensor of the same shards: the same gathered rows."""
    c10d = torch.ops._c10d_functional
    shards = [torch.full((3, 2), 10.0 * rank + i) for i in range(2)]
    layout = Layout.column_wise((3, 8), [2] * 4, ranks=[0, 0, 1, 1], world_size=2)
    st = ShardedTensor.from_layout(layout, shards)
    lsw = LocalShardsWrapper(shards, [b.offsets for b in layout.blocks_of(rank)])
    group = dist.group.WORLD.group_name
    got = c10d.wait_tensor(c10d.all_gather_into_tensor(st, world, group))
    want = c10d.wait_tensor(c10d.all_gather_into_tensor(lsw, world, group))
    waited = c10d.wait_tensor(st)
    return [torch.equal(got, want), got.shape == (2 * 6, 2), waited is st]


def test_functional_all_gather_matches_the_wrapper():
    assert run_ranks(_all_gather_both, 2, timeout=60) == [[True] * 3] * 2

"""Op cases run on ShardedTensors and on the whole tensor, values and gradients compared.

Each case: a name, the input shapes, a function of the inputs (the same code runs
on ShardedTensors and on plain tensors), whether the result must be bit-exact
(ops that only move or select elements) or close (float64 arithmetic summed in
another order), and whether the rules may use the fallback (False: every aten
op of its forward and backward passes has a rule).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from shardwise import Block, Layout


@dataclass(frozen=True)
class Case:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    fn: Callable[..., Any]
    exact: bool = False
    # True where some layout needs the gather fallback (an op with no rule for it, e.g.
    # a boolean mask, a slice's backward whose
    # gradient blocks do not span the sliced dim); measured, not guessed.
    fallback_ok: bool = False
    # which inputs are sharded (the others are plain parameters that require grad)
    sharded: tuple[int, ...] = (0,)
    layouts: tuple[str, ...] = ("rows", "cols", "blocks", "replicated")
    integer_inputs: tuple[int, ...] = field(default=())


_SPANS1 = ("rows", "blocks", "replicated")  # layouts whose blocks span dim 1
# with "spatial": a grid over the last two dims, halos along both (corners included)
_HALO = ("rows", "cols", "blocks", "replicated", "spatial")
_MASK7 = torch.tensor([True, False, False, True, True, False, True])
_T7 = torch.tensor([0, 5, 2, 2, 1, 3, 4])  # a class per row
_W6 = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25, 3.0], dtype=torch.float64)
_T2D = torch.arange(2 * 4 * 5).reshape(2, 4, 5) % 3  # a class per pixel
_RM3 = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64)  # running statistics
_RV3 = torch.tensor([1.5, 0.5, 2.0], dtype=torch.float64)
_MASK6 = torch.tensor([False, True, True, False, True, True])


def _layer_norm(x: Any, w: Any, b: Any) -> Any:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def _cat_in_place(x: Any, dim: int) -> Any:
    a = x * 1
    y = torch.cat([a, a * 2], dim)
    y.add_(1)
    return a + y.narrow(dim, 0, x.shape[dim]) + y.narrow(dim, x.shape[dim], x.shape[dim])


def _attention(x: Any, wq: Any, wk: Any) -> Any:
    q, k = x @ wq, x @ wk
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ x


CASES: list[Case] = [
    # reductions, whole and per dim
    Case("sum", ((7, 6),), lambda x: x.sum()),
    Case("sum_dim0", ((7, 6),), lambda x: x.sum(dim=0)),
    Case("sum_dim1_keepdim", ((7, 6),), lambda x: x.sum(dim=1, keepdim=True)),
    Case("torch_sum_dims", ((7, 6),), lambda x: torch.sum(x, (0, 1))),
    Case("mean", ((7, 6),), lambda x: x.mean()),
    Case("mean_dim1", ((7, 6),), lambda x: x.mean(1)),
    Case("mean_dim0_keepdim", ((7, 6),), lambda x: x.mean(0, keepdim=True)),
    Case("amax", ((7, 6),), lambda x: x.amax()),
    Case("amax_dim0", ((7, 6),), lambda x: x.amax(dim=0)),
    Case("amin_dim1_keepdim", ((7, 6),), lambda x: x.amin(dim=1, keepdim=True)),
    Case("max", ((7, 6),), lambda x: x.max()),
    Case("min", ((7, 6),), lambda x: x.min()),
    Case("max_dim1", ((7, 6),), lambda x: x.max(dim=1).values, fallback_ok=True),
    Case("norm", ((7, 6),), lambda x: x.norm()),
    Case("norm_dim0", ((7, 6),), lambda x: torch.linalg.vector_norm(x, dim=0)),
    Case("norm_inf", ((7, 6),), lambda x: torch.linalg.vector_norm(x, ord=float("inf"))),
    Case("var", ((7, 6),), lambda x: x.var()),
    Case("var_dim0", ((7, 6),), lambda x: x.var(dim=0)),
    Case("std_dim1_keepdim", ((7, 6),), lambda x: x.std(dim=1, keepdim=True)),
    # along a dimension
    Case("softmax_dim1", ((7, 6),), lambda x: torch.softmax(x, dim=1)),
    Case("softmax_dim0", ((7, 6),), lambda x: F.softmax(x, dim=0)),
    Case("log_softmax_dim1", ((7, 6),), lambda x: F.log_softmax(x, dim=-1)),
    Case("log_softmax_dim0", ((7, 6),), lambda x: F.log_softmax(x, dim=0)),
    # along a sharded normalised dim ("cols", "blocks"): composed of reductions, no fallback
    Case("layer_norm", ((7, 6), (6,), (6,)), _layer_norm),
    Case("layer_norm_plain", ((7, 6),), lambda x: F.layer_norm(x, (6,))),
    Case(
        "layer_norm_last_two",
        ((5, 3, 4), (3, 4), (3, 4)),
        lambda x, w, b: F.layer_norm(x, (3, 4), w, b, eps=1e-3),
    ),
    Case("layer_norm_all", ((7, 6), (7, 6)), lambda x, w: F.layer_norm(x, (7, 6), w)),
    Case("rms_norm", ((7, 6), (6,)), lambda x, w: F.rms_norm(x, (6,), w)),
    # shape ops
    Case("transpose", ((7, 6),), lambda x: x.transpose(0, 1) * 2, exact=True),
    Case("t", ((7, 6),), lambda x: x.t() * 2, exact=True),
    Case("permute", ((5, 3, 4),), lambda x: x.permute(2, 0, 1) * 2, exact=True),
    Case("unsqueeze", ((7, 6),), lambda x: x.unsqueeze(1) * 2, exact=True),
    Case("squeeze", ((7, 1, 6),), lambda x: x.squeeze(1) * 2, exact=True),
    Case(
        "reshape_merge", ((5, 3, 4),), lambda x: x.reshape(5, 12) * 2, exact=True, fallback_ok=True
    ),
    Case("view_split", ((6, 8),), lambda x: x.view(6, 2, 4) * 2, exact=True, fallback_ok=True),
    Case("flatten", ((5, 3, 4),), lambda x: x.flatten(1) * 2, exact=True),
    Case("flatten_all", ((7, 6),), lambda x: x.flatten() * 2, exact=True),
    Case("expand", ((7, 1),), lambda x: x.expand(7, 5) * 2, exact=True),
    # slicing
    Case("slice_cols", ((7, 6),), lambda x: x[:, 1:4] * 2, exact=True, fallback_ok=True),
    Case("slice_rows_step", ((7, 6),), lambda x: x[1::2] * 2, exact=True),
    Case("slice_cols_step", ((7, 6),), lambda x: x[:, ::3] * 2, exact=True),
    Case("slice_rows_step_stop", ((7, 6),), lambda x: x[2:6:3] * 2, exact=True),
    Case("narrow", ((7, 6),), lambda x: x.narrow(0, 2, 4) * 2, exact=True, fallback_ok=True),
    Case("select", ((7, 6),), lambda x: x[3] * 2, exact=True),
    Case("select_col", ((7, 6),), lambda x: x[:, -2] * 2, exact=True),
    # by an integer tensor: along a sharded dim a masked lookup (pending sum), else per block
    Case("index_tensor", ((7, 6),), lambda x: x[torch.tensor([0, 5, 2])] * 2, exact=True),
    Case("index_repeats", ((7, 6),), lambda x: x[torch.tensor([6, -1, 0, 6])] * 2, exact=True),
    Case("index_cols", ((7, 6),), lambda x: x[:, torch.tensor([5, 0, 5, 2])] * 2, exact=True),
    Case("index_2d", ((7, 6),), lambda x: x[torch.tensor([[1, 2], [6, 1]])] * 2, exact=True),
    Case(
        "index_select",
        ((5, 3, 4),),
        lambda x: x.index_select(1, torch.tensor([2, 0, 2])) * 2,
        exact=True,
    ),
    Case(
        "index_select_rows",
        ((7, 6),),
        lambda x: torch.index_select(x, 0, torch.tensor([3, 3, 0])) * 2,
        exact=True,
    ),
    # along a dim every block spans ("rows": dim 1 whole), forward and backward (`scatter`,
    # `gather`, `flip`): per block, no fallback
    Case("sort_dim1", ((7, 6),), lambda x: x.sort(dim=1).values * 2, exact=True, layouts=_SPANS1),
    Case("argsort_dim1", ((7, 6),), lambda x: x * x.argsort(dim=1), exact=True, layouts=_SPANS1),
    Case(
        "topk_dim1", ((7, 6),), lambda x: x.topk(3, dim=1).values * 2, exact=True, layouts=_SPANS1
    ),
    Case(
        "max_dim1_rows", ((7, 6),), lambda x: x.max(dim=1).values * 2, exact=True, layouts=_SPANS1
    ),
    Case("cummax_dim1", ((7, 6),), lambda x: x.cummax(1).values * 2, exact=True, layouts=_SPANS1),
    Case("cumprod_dim1", ((7, 6),), lambda x: x.cumprod(1), layouts=_SPANS1),
    Case(
        "gather_dim1",
        ((7, 6),),
        lambda x: torch.gather(x, 1, x.argsort(1)) * 2,
        exact=True,
        layouts=_SPANS1,
    ),
    Case(
        "scatter_dim1",
        ((7, 6),),
        lambda x: torch.zeros_like(x).scatter(1, x.argsort(1), x * 2),
        exact=True,
        layouts=_SPANS1,
    ),
    Case(
        "scatter_add_dim1",
        ((7, 6),),
        lambda x: torch.ones_like(x).scatter_add(1, x.argsort(1)[:, :3], x[:, :3] * 2),
        exact=True,
        layouts=_SPANS1,
    ),
    Case(
        "scatter_value",
        ((7, 6),),
        lambda x: x.scatter(1, x.argsort(1)[:, :2], 5.0) * 2,
        exact=True,
        layouts=_SPANS1,
    ),
    Case("flip", ((7, 6),), lambda x: x.flip(0, 1) * 2, exact=True),
    # a flipped layout's empty blocks still span dim 1: cumsum per block
    Case("flip_cumsum", ((7, 6),), lambda x: x.flip(0).cumsum(1), layouts=_SPANS1),
    # a sharded operand smaller than the result: its blocks seen through its shape
    Case("bcast_scale", ((7, 6), (7,)), lambda x, s: x * s[:, None], sharded=(0, 1)),  # grads: sums
    Case(
        "bcast_up",
        ((7,),),
        lambda s: s[:, None] + torch.arange(6.0, dtype=torch.float64),
        exact=True,
    ),
    Case(
        "bcast_mask_mul",
        ((7, 6), (7,)),
        lambda x, s: (s[:, None] > 0) * x + s[:, None],
        sharded=(0, 1),
    ),
    Case("flip_rows", ((7, 6),), lambda x: x.flip(0) * 2, exact=True),
    # nll_loss (cross_entropy) on inputs whose blocks span the classes: per block, the
    # loss a pending sum (the mean: each part over the targets' total weight)
    Case("cross_entropy", ((7, 6),), lambda x: F.cross_entropy(x, _T7), layouts=_SPANS1),
    Case(
        "cross_entropy_weight_ignore_sum",
        ((7, 6),),
        lambda x: F.cross_entropy(x, _T7, weight=_W6, ignore_index=2, reduction="sum"),
        layouts=_SPANS1,
    ),
    Case(
        "nll_loss_weight_mean",
        ((7, 6),),
        lambda x: F.nll_loss(F.log_softmax(x, 1), _T7, weight=_W6, ignore_index=5),
        layouts=_SPANS1,
    ),
    Case(
        "nll_loss_none",
        ((7, 6),),
        lambda x: F.nll_loss(x, _T7, reduction="none") * 2,
        exact=True,
        layouts=_SPANS1,
    ),
    Case("cross_entropy_2d", ((2, 3, 4, 5),), lambda x: F.cross_entropy(x, _T2D)),
    # per block along the leading dims (batch, channels / heads): pooling, upsampling,
    # attention, group norm ("rows" and "blocks" shard the batch)
    # ("cols" splits the last spatial dim: a halo exchange, as a convolution's; `.mT`
    # turns that into a split of the first)
    Case(
        "max_pool2d", ((4, 2, 6, 6),), lambda x: F.max_pool2d(x, 2) * 2, exact=True, layouts=_HALO
    ),
    Case(
        "max_pool2d_pad",
        ((4, 2, 6, 6),),
        lambda x: F.max_pool2d(x, 3, 2, 1) * 2,
        exact=True,
        layouts=_HALO,
    ),
    Case(
        "max_pool2d_rows_split",
        ((2, 2, 5, 7),),
        lambda x: F.max_pool2d(x.mT, (3, 2), (2, 1), (1, 0), dilation=(2, 1), ceil_mode=True),
        layouts=_HALO,
    ),  # (overlapping windows: an element's gradient is added up in another order)
    Case(
        "max_pool3d_ceil",
        ((2, 2, 3, 4, 7),),
        lambda x: F.max_pool3d(x, (1, 2, 3), (1, 2, 2), (0, 1, 1), ceil_mode=True) * 2,
        exact=True,
        layouts=_HALO,
    ),
    Case(
        "avg_pool2d", ((4, 2, 6, 6),), lambda x: F.avg_pool2d(x, 2) * 2, exact=True, layouts=_HALO
    ),
    Case(
        "avg_pool2d_pad_ceil",
        ((2, 2, 5, 7),),
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
        layouts=_HALO,
    ),
    Case(
        "avg_pool2d_no_pad_counted",
        ((2, 2, 5, 7),),
        lambda x: F.avg_pool2d(x.mT, (3, 2), 2, 1, ceil_mode=True, count_include_pad=False),
        layouts=_HALO,
    ),
    Case(
        "avg_pool2d_divisor",
        ((2, 2, 5, 7),),
        lambda x: F.avg_pool2d(x, 3, 1, 1, divisor_override=4),
        layouts=_HALO,
    ),
    Case(
        "avg_pool3d",
        ((2, 2, 3, 4, 7),),
        lambda x: F.avg_pool3d(x, (2, 2, 3), (1, 1, 2), (1, 0, 1), count_include_pad=False),
        layouts=_HALO,
    ),
    Case(
        "adaptive_avg_pool2d",
        ((4, 2, 6, 6),),
        lambda x: F.adaptive_avg_pool2d(x, (2, 3)),
        exact=True,
        layouts=_SPANS1,
    ),
    # ("cols": split along the last spatial dim, each block upsampling its own rows, a
    # linear mode's with its neighbours' edge rows)
    Case(
        "upsample_nearest",
        ((4, 2, 3, 3),),
        lambda x: F.interpolate(x, scale_factor=2) * 2,
        exact=True,
    ),
    Case(
        "upsample_nearest_rows",
        ((2, 2, 3, 7),),
        lambda x: F.interpolate(x.mT, size=(28, 6)) * 2,
        exact=True,
    ),
    Case("upsample_nearest3d", ((2, 1, 2, 3, 5),), lambda x: F.interpolate(x, scale_factor=2) * 2),
    Case(
        "upsample_linear1d", ((4, 2, 7),), lambda x: F.interpolate(x, scale_factor=3, mode="linear")
    ),
    Case(
        "upsample_bilinear_x2",
        ((2, 2, 4, 7),),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    ),
    Case(
        "upsample_bilinear_rows",
        ((2, 2, 4, 7),),
        lambda x: F.interpolate(x.mT, scale_factor=(3, 2), mode="bilinear"),
    ),
    Case(
        "upsample_bicubic",
        ((2, 2, 4, 7),),
        lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"),
    ),
    Case(
        "upsample_trilinear",
        ((2, 1, 2, 3, 5),),
        lambda x: F.interpolate(x, scale_factor=(1, 2, 2), mode="trilinear"),
    ),
    Case(
        "upsample_bilinear",
        ((4, 2, 3, 3),),
        lambda x: F.interpolate(x, size=(5, 4), mode="bilinear", align_corners=False),
        exact=True,
        layouts=_SPANS1,
    ),
    Case(
        "sdpa",
        ((4, 3, 5, 4),),
        lambda x: F.scaled_dot_product_attention(x, x * 0.5, x.flip(-1)),
        layouts=_SPANS1,
    ),
    Case(
        "sdpa_causal",
        ((4, 3, 5, 4),),
        lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
        layouts=_SPANS1,
    ),
    Case(
        "group_norm",
        ((4, 4, 5), (4,), (4,)),
        lambda x, w, b: F.group_norm(x, 2, w, b),
    ),
    # split along a spatial dim ("cols") or the channels ("rows" of the transpose):
    # the statistics reduced across ranks
    Case(
        "group_norm_2d",
        ((2, 4, 3, 5), (4,), (4,)),
        lambda x, w, b: F.group_norm(x, 2, w, b, eps=1e-3),
    ),
    # (a transposed input: strided blocks; "blocks" cuts a group of channels, whose view
    # then gathers)
    Case(
        "group_norm_channels_split",
        ((6, 2, 3),),
        lambda x: F.group_norm(x.transpose(0, 1), 3),
        fallback_ok=True,
    ),
    Case(
        "batch_norm_eval",
        ((4, 3, 5), (3,), (3,)),
        lambda x, w, b: F.batch_norm(x, _RM3, _RV3, w, b, training=False, eps=1e-3),
    ),
    # after a slice leaves a rank an empty block: every rank's value right (rules that
    # need a block to span a dim fall back for it)
    Case("slice_then_sum", ((7, 6),), lambda x: x[4:].sum() * 2, fallback_ok=True),
    Case(
        "slice_then_max_dim1",
        ((7, 6),),
        lambda x: x[4:].max(dim=1).values,
        exact=True,
        fallback_ok=True,
    ),
    Case(
        "slice_then_topk",
        ((7, 6),),
        lambda x: x[4:].topk(2, 1).values,
        exact=True,
        fallback_ok=True,
    ),
    Case("mask_then_sum", ((7,),), lambda x: x[_MASK7].sum() * 2, fallback_ok=True),
    Case(
        "slice_gather_scale",
        ((7, 6), (7,)),
        lambda x, s: torch.gather(x[4:], 1, x[4:].argsort(1)) * s[4:, None],
        sharded=(0, 1),
        fallback_ok=True,
    ),
    # losses and statistics made of the ops that have rules
    Case(
        "smooth_l1", ((7, 6), (7, 6)), lambda x, t: F.smooth_l1_loss(x, t, beta=0.5), sharded=(0, 1)
    ),
    Case(
        "smooth_l1_sum_beta0",
        ((7, 6), (7, 6)),
        lambda x, t: F.smooth_l1_loss(x, t, reduction="sum", beta=0.0),
        sharded=(0, 1),
    ),
    Case(
        "huber_none",
        ((7, 6), (7, 6)),
        lambda x, t: F.huber_loss(x, t, reduction="none", delta=0.7),
        sharded=(0, 1),
    ),
    Case("std_mean_dim1", ((7, 6),), lambda x: torch.std_mean(x, 1)[0] + torch.std_mean(x, 1)[1]),
    Case("var_mean_all", ((7, 6),), lambda x: torch.var_mean(x)[0] * torch.var_mean(x)[1]),
    # roll, pad, repeat in any layout: along a dim a block spans the shard changes; along
    # another the block moves (cut where a roll wraps, extended at a padded edge, copied
    # per tile). The backward: the opposite roll, a crop, a sum over the tiles.
    Case("roll_dim1", ((7, 6),), lambda x: x.roll(2, 1) * 2, exact=True),
    Case("roll_dim0_back", ((7, 6),), lambda x: x.roll(-3, 0) * 2, exact=True),
    Case("roll_two_dims", ((7, 6),), lambda x: x.roll((1, -2), (0, 1)) * 2, exact=True),
    Case("roll_same_dim_twice", ((7, 6),), lambda x: x.roll((4, 5), (0, 0)) * 2, exact=True),
    Case("roll_then_sum_dim0", ((7, 6),), lambda x: x.roll(3, 0).sum(0)),
    Case("roll_3d", ((4, 3, 6),), lambda x: x.roll((5, 1), (2, 0)) * 2, exact=True),
    Case("pad_last", ((7, 6),), lambda x: F.pad(x, (1, 2), value=0.5) * 2, exact=True),
    Case("pad_rows", ((7, 6),), lambda x: F.pad(x, (0, 0, 2, 1), value=-1.0) * 2, exact=True),
    Case("pad_crop_rows", ((7, 6),), lambda x: F.pad(x, (1, -1, -2, 3)) * 2, exact=True),
    Case("pad_crop", ((4, 3, 6),), lambda x: F.pad(x, (-1, 2, 1, 0)) * 2, exact=True),
    Case("pad_crop_most", ((7, 6),), lambda x: F.pad(x, (0, 0, -5, -1)) * 2, exact=True),
    # one side cropped away whole, the other padded: the edge blocks take the new elements
    Case("pad_crop_all_left", ((7, 6),), lambda x: F.pad(x, (-6, 2), value=1.5), exact=True),
    Case("pad_crop_all_bottom", ((7, 6),), lambda x: F.pad(x, (0, 0, 3, -7)) + 1, exact=True),
    # (the backward sums the tiles, in another order: close, not exact)
    Case("repeat", ((7, 6),), lambda x: x.repeat(2, 3) * 2),
    Case("repeat_lead", ((7, 6),), lambda x: x.repeat(2, 1, 2) * 2),
    Case("repeat_then_sum", ((7, 6),), lambda x: x.repeat(3, 1).sum(0)),
    Case(
        "batch_norm_train",
        ((4, 3, 5), (3,), (3,)),
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True, eps=1e-3),
    ),
    Case(
        "batch_norm_train_2d",
        ((4, 3, 2, 3),),
        lambda x: F.batch_norm(x, None, None, training=True) * 2,
    ),
    # a block's part of the triangle, its diagonal shifted by where it starts
    Case("tril", ((7, 6),), lambda x: x.tril() * 2, exact=True),
    Case("triu_k", ((7, 6),), lambda x: x.triu(-2) * 2, exact=True),
    Case("tril_batched", ((3, 5, 4),), lambda x: torch.tril(x, 1) * 2, exact=True),
    # a boolean mask every rank holds, along either dim: per block, placed by its count
    Case("mask_rows", ((7, 6),), lambda x: x[_MASK7] * 2, exact=True),
    Case("mask_cols", ((7, 6),), lambda x: x[:, _MASK6] * 2, exact=True),
    Case("mask_none", ((7, 6),), lambda x: x[torch.zeros(7, dtype=torch.bool)] * 2, exact=True),
    Case("split", ((7, 6),), lambda x: x.split(3, dim=1)[1] * 2, exact=True),
    Case(
        "chunk",
        ((7, 6),),
        lambda x: torch.cat(x.chunk(2, dim=0)[::-1]) * 2,
        exact=True,
    ),
    # joining
    Case("cat_self", ((7, 6),), lambda x: torch.cat([x, x * 2], dim=0), exact=True),
    Case("cat_dim1", ((7, 6),), lambda x: torch.cat([x, x + 1], dim=1), exact=True),
    Case("cat_plain", ((7, 6), (2, 6)), lambda x, p: torch.cat([x, p], dim=0), exact=True),
    Case("stack", ((7, 6),), lambda x: torch.stack([x, x * 3], dim=1), exact=True),
    # products
    Case("linear", ((7, 6), (4, 6), (4,)), lambda x, w, b: F.linear(x, w, b)),
    Case("linear_nobias", ((7, 6), (4, 6)), lambda x, w: F.linear(x, w)),
    Case("matmul_xxT", ((7, 6),), lambda x: x @ x.T),
    Case("matmul_xTx", ((7, 6),), lambda x: x.T @ x),
    Case("bmm", ((3, 5, 4), (3, 4, 2)), lambda x, w: torch.bmm(x, w)),
    Case(
        "einsum", ((7, 6), (6, 3)), lambda x, w: torch.einsum("ij,jk->ik", x, w), fallback_ok=True
    ),
    Case("linear_3d", ((1, 7, 6), (4, 6)), lambda x, w: F.linear(x, w)),
    Case("attention", ((1, 7, 6), (6, 6), (6, 6)), _attention),
    # "rows"/"blocks": split along the batch; "cols": along the last spatial dimension,
    # through the halo exchange (uneven pieces, an empty rank, padding, stride, dilation)
    Case("conv1d", ((5, 2, 6), (3, 2, 3), (3,)), lambda x, w, b: F.conv1d(x, w, b, padding=1)),
    Case(
        "conv1d_stride_dilation",
        ((2, 2, 13), (3, 2, 3)),
        lambda x, w: F.conv1d(x, w, stride=2, dilation=2, padding=3),
    ),
    Case("conv1d_no_padding", ((2, 2, 9), (2, 2, 4)), lambda x, w: F.conv1d(x, w)),
    Case(
        "conv2d",
        ((4, 2, 5, 5), (3, 2, 3, 3)),
        lambda x, w: F.conv2d(x, w, padding=(1, 2)),
        layouts=_HALO,
    ),
    Case("conv3d", ((3, 1, 3, 4, 4), (2, 1, 2, 2, 2)), lambda x, w: F.conv3d(x, w), layouts=_HALO),
    Case(
        "conv2d_stride_dilation",
        ((2, 2, 9, 8), (3, 2, 3, 2)),
        lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(2, 1), dilation=(2, 3)),
        layouts=_HALO,
    ),
    # losses made of the above
    Case("mse_sum", ((7, 6),), lambda x: ((x - 0.5) ** 2).sum()),
    Case(
        "mse_loss",
        ((7, 6),),
        lambda x: F.mse_loss(x, torch.zeros(7, 6, dtype=x.dtype)),
    ),
    Case("gelu_mean", ((7, 6),), lambda x: F.gelu(x).mean()),
    # `cat`'s result is new memory: an in-place op on it leaves the operands alone (the
    # narrows' backward along a split dim: the gradient padded back)
    Case("cat_then_in_place_dim1", ((7, 6),), lambda x: _cat_in_place(x, 1), exact=True),
    Case("cat_then_in_place_dim0", ((7, 6),), lambda x: _cat_in_place(x, 0), exact=True),
    # along a split dim: each block's sums carried over from the blocks before it
    Case("cumsum_dim0", ((7, 6),), lambda x: x.cumsum(0)),
    Case("cumsum_dim1", ((7, 6),), lambda x: torch.cumsum(x, 1)),
    Case("cumsum_3d", ((3, 7, 2),), lambda x: x.transpose(0, 1).cumsum(0)),
    # its backward, as torch composes it for a tensor subclass (argmax, gather and
    # scatter_ along the dim, for zeros), falls back along a split dim
    Case("cumprod_dim0", ((7, 6),), lambda x: (x * 0.5 + 1).cumprod(0), fallback_ok=True),
    Case("cumprod_dim1", ((7, 6),), lambda x: torch.cumprod(x + 1.5, 1), fallback_ok=True),
    Case("logcumsumexp_dim0", ((7, 6),), lambda x: x.logcumsumexp(0)),
    Case("logcumsumexp_3d", ((3, 7, 2),), lambda x: x.transpose(0, 1).logcumsumexp(0)),
    Case("max_dim0", ((7, 6),), lambda x: x.max(0)[0]),
    Case("min_dim1_keepdim", ((7, 6),), lambda x: x.min(1, keepdim=True).values),
    Case("argmax_dim0", ((7, 6),), lambda x: x + x.argmax(0)),
    Case("argmin_dim1_keepdim", ((7, 6),), lambda x: x * torch.argmin(x, 1, keepdim=True)),
    Case("topk_dim0", ((7, 6),), lambda x: x.topk(3, 0).values),
    Case("topk_smallest_dim1", ((7, 6),), lambda x: x.topk(2, 1, largest=False)[0] * 2),
    Case("logsumexp_dim0", ((7, 6),), lambda x: torch.logsumexp(x, 0)),
    Case("logsumexp_all_keepdim", ((7, 6),), lambda x: x.logsumexp((0, 1), keepdim=True)),
]


def layout_for(kind: str, shape: tuple[int, ...], world: int) -> Layout:
    """Uneven layouts with an empty rank, several blocks per rank, or replicas."""
    if kind == "replicated":
        return Layout.replicated(shape, world)
    rows = shape[0]
    if kind == "rows":
        sizes = _uneven(rows, world)
        return Layout.row_wise(shape, sizes) if len(shape) == 2 else Layout.along(shape, 0, sizes)
    if kind == "cols":
        sizes = _uneven(shape[-1], world)
        return Layout.along(shape, len(shape) - 1, sizes)
    if kind == "spatial":  # a 2 x 2 grid over the last two dims, uneven, dealt round-robin
        h, w = shape[-2], shape[-1]
        cuts = ([0, h // 3, h], [0, w - w // 3, w])
        quads: dict[int, list[Block]] = {r: [] for r in range(world)}
        lead = (0,) * (len(shape) - 2)
        for i, (a, b) in enumerate(itertools.product(range(2), range(2))):
            offsets = (*lead, cuts[0][a], cuts[1][b])
            sizes = (*shape[:-2], cuts[0][a + 1] - cuts[0][a], cuts[1][b + 1] - cuts[1][b])
            quads[i % world].append(Block(offsets, sizes))
        return Layout(shape, quads, world)
    if kind == "blocks":  # two blocks per rank where possible, dealt round-robin, rows
        pieces = _uneven(rows, 2 * world)
        blocks: dict[int, list[Block]] = {r: [] for r in range(world)}
        start = 0
        for i, size in enumerate(pieces):
            if size:
                offsets = (start,) + (0,) * (len(shape) - 1)
                blocks[i % world].append(Block(offsets, (size, *shape[1:])))
            start += size
        return Layout(shape, blocks, world)
    raise ValueError(kind)


def _uneven(n: int, world: int) -> list[int]:
    """Uneven sizes adding up to n, with rank 1 empty when world > 1."""
    if world == 1:
        return [n]
    weights = [k + 1 for k in range(world)]
    weights[1] = 0
    total = sum(weights)
    sizes = [n * w // total for w in weights]
    sizes[-1] += n - sum(sizes)
    return sizes

"""Port of PyTorch's test/distributed/checkpoint/test_dtensor_resharding.py (torch 2.13 era).

DTensor checkpoints saved in one placement / mesh and loaded into another, plus
uneven shards (a checkpointable tensor subclass and `LocalShardsWrapper`), on 4
CPU ranks (gloo) instead of 4 GPUs, with DCP's FileSystemWriter/Reader swapped
for `shardwise.checkpoint.Writer` / `Reader` (same constructor arguments,
`_extensions` / `_extension_registry` included) and, where noted, through
`swc.save` / `swc.load`. Like upstream, the loops save again and again into the
same folder with the writer's default `overwrite`. Every upstream assertion is
kept; the few checks marked "(added)" are not upstream's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

from .harness import (  # the storage under test
    FORMS,
    Check,
    Reader,
    Writer,
    bind,
    by_form,
    load_as,
    save_as,
    scenario_results,
    verdict,
)

pytestmark = pytest.mark.spawned

WORLD_SIZE = 4

ONE_D_PLACEMENTS = [[Shard(0)], [Replicate()]]
ONE_D_TO_ONE_D_PLACEMENTS = [([Replicate()], [Shard(0)]), ([Shard(0)], [Replicate()])]
TWO_D_PLACEMENTS = [
    [Replicate(), Replicate()],
    [Replicate(), Shard(0)],
    [Shard(0), Replicate()],
    [Shard(0), Shard(0)],
]
TWO_D_TO_TWO_D_PLACEMENTS = [(a, b) for a in TWO_D_PLACEMENTS for b in TWO_D_PLACEMENTS if a != b]


def _global() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float).view(4, 4)


def _mesh(ndim: int):
    """The 1-d mesh of all ranks, or the 2-d one of 2 x (world / 2)."""
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,) if ndim == 1 else (2, world // 2))


# -- TestDTensorReshardPlacementChange ----------------------------------------------

EXTENSIONS: dict[str | None, Callable[[], Any]] = {
    None: lambda: None,
    "Rot13Example": lambda: [Rot13Example()],
    "ZStandard": lambda: [ZStandard()],
}


def _placement_change(
    path: Path,
    check: Check,
    ndim: int,
    placement_pairs: list[tuple[list, list]],
    form: str = "storage",
    writer_kwargs: Callable[[], dict[str, Any]] = dict,
    reader_kwargs: Callable[[], dict[str, Any]] = dict,
) -> None:
    """Upstream's two placement-change tests: saved in one placement, loaded into another on
    the same `ndim`-d mesh, compared whole and back in the original placement."""
    for original_placement, new_placement in placement_pairs:
        global_tensor = _global()
        device_mesh = _mesh(ndim)
        dtensor = distribute_tensor(global_tensor, device_mesh, placements=original_placement)
        state_dict_to_save = {"dtensor": dtensor}
        save_as(form, state_dict_to_save, path, writer_kwargs(), planner=DefaultSavePlanner())

        state_dict_to_load = {
            "dtensor": dtensor_zeros([4, 4], device_mesh=device_mesh, placements=new_placement)
        }
        load_as(form, state_dict_to_load, path, reader_kwargs(), planner=DefaultLoadPlanner())

        what = f"{original_placement}->{new_placement}"
        # materialise the whole tensor to compare with the original global tensor
        state_dict_to_load["dtensor"] = state_dict_to_load["dtensor"].redistribute(
            device_mesh, placements=[Replicate()] * ndim
        )
        check.equal(global_tensor, state_dict_to_load["dtensor"].to_local(), f"{what} full tensor")
        # back to the original placement for comparison
        state_dict_to_load["dtensor"] = state_dict_to_load["dtensor"].redistribute(
            device_mesh, placements=original_placement
        )
        check.equal(
            state_dict_to_save["dtensor"].to_local(),
            state_dict_to_load["dtensor"].to_local(),
            f"{what} local shard",
        )


def reshard_1d_to_1d(
    path: Path, check: Check, extensions: str | None, form: str = "storage"
) -> None:
    # upstream: test_dtensor_resharding.py :: test_1d_to_1d_reshard_placement_change
    _placement_change(
        path,
        check,
        1,
        ONE_D_TO_ONE_D_PLACEMENTS,
        form,
        writer_kwargs=lambda: {"_extensions": EXTENSIONS[extensions]()},
        reader_kwargs=lambda: {"_extension_registry": get_test_extension_registry()},
    )


def reshard_2d_to_2d(path: Path, check: Check) -> None:
    # upstream: test_dtensor_resharding.py :: test_2d_to_2d_reshard_placement_change
    _placement_change(path, check, 2, TWO_D_TO_TWO_D_PLACEMENTS)


# -- TestDTensorReshardMeshChange --------------------------------------------------


def _mesh_change(path: Path, check: Check, save: tuple[int, list], load: tuple[int, list]) -> None:
    """Upstream's two mesh-change tests: saved on the `save` mesh (ndim, placements) in each of
    its placements, loaded on the `load` mesh in each of its placements, compared whole."""
    (save_ndim, save_placements), (load_ndim, load_placements) = save, load
    for save_placement in save_placements:
        global_tensor = _global()
        save_mesh = _mesh(save_ndim)
        dtensor = distribute_tensor(global_tensor, save_mesh, placements=save_placement)
        save_as("storage", {"dtensor": dtensor}, path, planner=DefaultSavePlanner())
        for load_placement in load_placements:
            load_mesh = _mesh(load_ndim)
            state_dict_to_load = {
                "dtensor": dtensor_zeros([4, 4], device_mesh=load_mesh, placements=load_placement)
            }
            load_as("storage", state_dict_to_load, path, planner=DefaultLoadPlanner())
            state_dict_to_load["dtensor"] = state_dict_to_load["dtensor"].redistribute(
                load_mesh, placements=[Replicate()] * load_ndim
            )
            check.equal(
                global_tensor,
                state_dict_to_load["dtensor"].to_local(),
                f"{save_placement}->{load_placement}",
            )


def reshard_1d_to_2d_mesh(path: Path, check: Check) -> None:
    # upstream: test_dtensor_resharding.py :: test_1d_to_2d_reshard_mesh_change
    _mesh_change(path, check, (1, ONE_D_PLACEMENTS), (2, TWO_D_PLACEMENTS))


def reshard_2d_to_1d_mesh(path: Path, check: Check) -> None:
    # upstream: test_dtensor_resharding.py :: test_2d_to_1d_reshard_mesh_change
    _mesh_change(path, check, (2, TWO_D_PLACEMENTS), (1, ONE_D_PLACEMENTS))


def resharding_with_empty_shard(path: Path, check: Check) -> None:
    # upstream: test_dtensor_resharding.py :: test_dtensor_checkpoint_resharding_with_empty_shard
    # A 1-element tensor sharded over 4 ranks (3 empty shards) loads into a 2x2 mesh; upstream
    # asserts only that save and load succeed.
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    dtensor = distribute_tensor(torch.rand(1), mesh, [Shard(0)])
    dcp.save(state_dict={"dtensor": dtensor}, storage_writer=Writer(path=path))
    mesh_2 = init_device_mesh("cpu", (2, world // 2))
    state_dict = {"dtensor": distribute_tensor(torch.rand(1), mesh_2, [Shard(0), Shard(0)])}
    dcp.load(state_dict=state_dict, storage_reader=Reader(path))


def checkpoint_with_uneven_shards(path: Path, check: Check) -> None:
    # upstream: test_dtensor_resharding.py :: test_dtensor_checkpoint_with_uneven_shards
    # rank 0 -> rows 0-3, rank 1 -> 4-7, rank 2 -> 8-11, rank 3 -> 12-13 (the last shard uneven)
    world = dist.get_world_size()
    mesh_1 = init_device_mesh("cpu", (world,))
    my_rank = dist.get_rank()
    if my_rank == world - 1:
        local_tensor = torch.arange(my_rank * 4, my_rank * 4 + 2, dtype=torch.float).view(2, 1)
    else:
        local_tensor = torch.arange(my_rank * 4, (my_rank + 1) * 4, dtype=torch.float).view(4, 1)
    dtensor = DTensor.from_local(
        local_tensor,
        mesh_1,
        [Shard(0)],
        run_check=True,
        shape=torch.Size([14, 1]),
        stride=torch.Size([1, 1]),
    )
    dcp.save(
        state_dict={"uneven_sharded_dtensor": dtensor},
        storage_writer=Writer(path=path),
        planner=DefaultSavePlanner(),
    )
    loading_full_tensor = torch.rand([14, 1], dtype=torch.float)
    state_dict_to_load = {
        "uneven_sharded_dtensor": loading_full_tensor
    }  # re-sharding load into a plain tensor
    dcp.load(state_dict=state_dict_to_load, storage_reader=Reader(path))
    # (added) upstream only checks that the load succeeds; the values are known:
    check.equal(
        torch.arange(14, dtype=torch.float).view(14, 1),
        state_dict_to_load["uneven_sharded_dtensor"],
        "(added) loaded values",
    )


# -- TestCheckpointableReshard -------------------------------------------------------


class CheckpointableDistTensor(torch.Tensor):
    """One block of a 1-d/2-d tensor per rank, at any offset: checkpointable
    through DCP's tensor protocol only (every other op is refused)."""

    _local_tensor: torch.Tensor
    _shard_offsets: torch.Size
    _overall_size: torch.Size

    @staticmethod
    def __new__(
        cls, fqn: str, local_tensor: torch.Tensor, shard_offsets: list[int], overall_size: list[int]
    ):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            overall_size,
            dtype=local_tensor.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
        )
        r._fqn = fqn
        r._local_tensor = local_tensor
        r._shard_offsets = torch.Size(shard_offsets)
        r._overall_size = torch.Size(overall_size)
        return r

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise NotImplementedError(f"{func} is not supported for CheckpointableDistTensor")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self._shard_offsets, sizes=self._local_tensor.size())]

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn=self._fqn, offset=self._shard_offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=self._shard_offsets, sizes=self._local_tensor.size()
                    ),
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self._overall_size,
                ),
            )
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if not (self._fqn == index.fqn and self._shard_offsets == index.offset):
            raise AssertionError(
                f"fqn/offset mismatch: {self._fqn} vs {index.fqn}, "
                f"{self._shard_offsets} vs {index.offset}"
            )
        return self._local_tensor

    def __repr__(self) -> str:
        return (
            f"CheckpointableDistTensor(fqn={self._fqn}, offsets={tuple(self._shard_offsets)}, "
            f"size={tuple(self._overall_size)})"
        )


SAVING_1D_SHARD_PLAN = [(0, 4), (4, 3), (7, 4), (11, 5)]  # (offset, length) by rank: uneven


def _uneven_reshard(
    path: Path,
    check: Check,
    form: str,
    loading_1d_shard_plan: list[tuple[int, int]],
    shard: Callable[[torch.Tensor, int], torch.Tensor],
) -> None:
    """Upstream's two uneven-reshard tests: each rank saves rows SAVING_1D_SHARD_PLAN[rank] of a
    [16, 1] tensor and loads rows `loading_1d_shard_plan[rank]`, each block made a checkpointable
    tensor by `shard(local_tensor, row_offset)`."""
    my_rank = dist.get_rank()
    offset, length = SAVING_1D_SHARD_PLAN[my_rank]
    saving = shard(torch.arange(offset, offset + length, dtype=torch.float).view(length, 1), offset)
    save_as(form, {"checkpointable_tensor": saving}, path, planner=DefaultSavePlanner())

    offset, length = loading_1d_shard_plan[my_rank]
    loading_local_tensor = torch.rand([length, 1], dtype=torch.float)
    expected = torch.arange(offset, offset + length, dtype=torch.float).view(length, 1)
    loading = shard(loading_local_tensor, offset)
    load_as(form, {"checkpointable_tensor": loading}, path)
    check.true(
        torch.equal(loading_local_tensor, expected),
        "loading_local_tensor equals the expected values",
    )


def uneven_reshard_checkpointable(path: Path, check: Check, form: str) -> None:
    # upstream: test_dtensor_resharding.py :: test_uneven_reshard_with_checkpointable_api
    def shard(local_tensor: torch.Tensor, offset: int) -> torch.Tensor:
        return CheckpointableDistTensor(
            fqn="checkpointable_tensor",
            local_tensor=local_tensor,
            shard_offsets=[offset, 0],
            overall_size=[16, 1],
        )

    _uneven_reshard(path, check, form, [(0, 2), (2, 4), (6, 6), (12, 4)], shard)


def uneven_reshard_shards_wrapper(path: Path, check: Check, form: str) -> None:
    # upstream: test_dtensor_resharding.py :: test_uneven_reshard_with_dtensor_shards_wrapper_api
    device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(local_tensor: torch.Tensor, offset: int) -> torch.Tensor:
        # uneven shards have to be wrapped in LocalShardsWrapper
        wrapper = LocalShardsWrapper(local_shards=[local_tensor], local_offsets=[(offset, 0)])
        return DTensor.from_local(
            local_tensor=wrapper,
            device_mesh=device_mesh,
            placements=[Shard(0)],
            shape=torch.Size([16, 1]),
            stride=torch.Size([1, 1]),
        )

    _uneven_reshard(path, check, form, [(0, 6), (6, 2), (8, 1), (9, 7)], shard)
    dist.barrier()


ZSTD_MISSING = "ZStandard extension needs the zstandard or pyzstd package, not installed"

SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    "1d_to_1d[None]": bind(reshard_1d_to_1d, None),
    "1d_to_1d[Rot13Example]": bind(reshard_1d_to_1d, "Rot13Example"),
    **(
        {"1d_to_1d[ZStandard]": bind(reshard_1d_to_1d, "ZStandard")}
        if ZStandard.is_available()
        else {}
    ),
    "1d_to_1d[swc.save/load]": bind(reshard_1d_to_1d, None, form="swc"),
    "2d_to_2d": reshard_2d_to_2d,
    "1d_to_2d_mesh": reshard_1d_to_2d_mesh,
    "2d_to_1d_mesh": reshard_2d_to_1d_mesh,
    "empty_shard": resharding_with_empty_shard,
    "uneven_shards": checkpoint_with_uneven_shards,
    **{f"checkpointable[{form}]": bind(uneven_reshard_checkpointable, form) for form in FORMS},
    **{f"shards_wrapper[{form}]": bind(uneven_reshard_shards_wrapper, form) for form in FORMS},
}


results = scenario_results("dtensor_resharding", __name__, WORLD_SIZE, timeout=180)


@pytest.mark.parametrize("extensions", [None, "Rot13Example", "ZStandard"])
def test_1d_to_1d_reshard_placement_change(results, extensions) -> None:
    # upstream: test_dtensor_resharding.py :: test_1d_to_1d_reshard_placement_change
    # (parametrized on extensions: None, [Rot13Example()], [ZStandard()])
    if extensions == "ZStandard" and not ZStandard.is_available():
        pytest.skip(ZSTD_MISSING)
    verdict(results, f"1d_to_1d[{extensions}]")


def test_1d_to_1d_reshard_placement_change_swc_save_load(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_1d_to_1d_reshard_placement_change
    # (through swc.save / swc.load)
    verdict(results, "1d_to_1d[swc.save/load]")


def test_2d_to_2d_reshard_placement_change(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_2d_to_2d_reshard_placement_change
    verdict(results, "2d_to_2d")


def test_1d_to_2d_reshard_mesh_change(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_1d_to_2d_reshard_mesh_change
    verdict(results, "1d_to_2d_mesh")


def test_2d_to_1d_reshard_mesh_change(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_2d_to_1d_reshard_mesh_change
    verdict(results, "2d_to_1d_mesh")


def test_dtensor_checkpoint_resharding_with_empty_shard(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_dtensor_checkpoint_resharding_with_empty_shard
    verdict(results, "empty_shard")


def test_dtensor_checkpoint_with_uneven_shards(results) -> None:
    # upstream: test_dtensor_resharding.py :: test_dtensor_checkpoint_with_uneven_shards
    verdict(results, "uneven_shards")


@by_form
def test_uneven_reshard_with_checkpointable_api(results, form) -> None:
    # upstream: test_dtensor_resharding.py :: test_uneven_reshard_with_checkpointable_api
    verdict(results, f"checkpointable[{form}]")


@by_form
def test_uneven_reshard_with_dtensor_shards_wrapper_api(results, form) -> None:
    # upstream: test_dtensor_resharding.py :: test_uneven_reshard_with_dtensor_shards_wrapper_api
    verdict(results, f"shards_wrapper[{form}]")

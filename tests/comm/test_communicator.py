"""`communicator`: the gloo groups shardwise makes for itself are destroyed at exit,
before torch's teardown, and a group the script destroyed is left alone."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from shardwise.comm import communicator
from shardwise.comm.communicator import gloo_group


def test_groups_made_are_destroyed_at_exit_and_the_default_group_kept():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made, gone = gloo_group([0]), gloo_group([0])
        dist.destroy_process_group(gone)  # the script destroyed one itself
        assert made in _world.pg_map and gone not in _world.pg_map
        communicator._destroy_made()
        assert made not in _world.pg_map
        assert dist.is_initialized() and communicator._MADE == []
        communicator._destroy_made()  # nothing left: nothing done
    finally:
        dist.destroy_process_group()


def test_after_the_script_destroyed_the_default_group_nothing_is_done():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gloo_group([0])
    dist.destroy_process_group()
    communicator._destroy_made()
    assert communicator._MADE == [] and not dist.is_initialized()


def test_a_gloo_group_carries_host_tensors_only():
    """gloo lists CUDA among its devices but stages a CUDA tensor through host memory: a
    load sends CUDA values over a group only where NCCL is bound to CUDA."""
    from shardwise.comm.communicator import ProcessGroupCommunicator

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = ProcessGroupCommunicator(None)
        assert [comm.carries(d) for d in ("cpu", "cuda", "meta")] == [True, False, False]
    finally:
        dist.destroy_process_group()

"""Several ranks as threads of one process, over an in-memory Communicator.

Lets transfer planning, packing and the agreement rule run with real
ShardedTensors and no process group. Each collective is two barriers: post,
then read; a rank that never arrives fails the others after `timeout` seconds
(threading.BrokenBarrierError) instead of hanging the test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shardwise.comm.communicator import Communicator, Waitable


class _Done:
    def wait(self) -> None:
        return None


class ThreadedWorld:
    """The shared state of `world_size` in-process ranks."""

    def __init__(self, world_size: int, timeout: float = 10.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size
        self.calls: list[str] = []  # collectives called, as seen by rank 0

    def rank(self, rank: int) -> ThreadedRank:
        return ThreadedRank(self, rank)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(comm, *args) on every rank; each rank's result or the exception it raised."""

        def one(rank: int) -> Any:
            try:
                return fn(self.rank(rank), *args)
            except Exception as e:  # reported per rank, as the spawned harness does
                return e

        with ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(one, range(self.world_size)))


class ThreadedRank(Communicator):
    def __init__(self, world: ThreadedWorld, rank: int) -> None:
        self.world, self._rank = world, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def _post_and_read(self, mine: Any) -> list[Any]:
        self.world.slots[self._rank] = mine
        self.world.barrier.wait()
        everyone = list(self.world.slots)
        self.world.barrier.wait()  # nobody posts the next call before all have read
        return everyone

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._rank == 0:
            self.world.calls.append("all_gather_object")
        return self._post_and_read(obj)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Waitable:
        if self._rank == 0:
            self.world.calls.append("all_to_all_single")
        self.world.slots[self._rank] = (input, list(input_split_sizes))
        self.world.barrier.wait()
        offset = 0
        for src, (their_input, their_splits) in enumerate(self.world.slots):
            start = sum(their_splits[: self._rank])
            n = their_splits[self._rank]
            assert n == output_split_sizes[src], "split sizes disagree"
            output[offset : offset + n].copy_(their_input[start : start + n])
            offset += n
        self.world.barrier.wait()
        return _Done()

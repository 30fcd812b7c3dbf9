"""Several ranks as threads of one process, over an in-memory `Communicator`.

The engine's collective code runs unchanged with W ranks as W threads: tests
check planning, packing and the agreement rule without spawning processes,
and `shardwise bench scale` measures each rank's work and traffic at W = 1,024
on one machine. Each collective is two barriers (post, then read); a rank that
never arrives fails the others after `timeout` seconds
(`threading.BrokenBarrierError`) instead of hanging. Every rank's received bytes
are counted as a process group would carry them (objects pickled).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .communicator import Communicator, Waitable

__all__ = ["ThreadedRank", "ThreadedWorld"]


class _Done:
    def wait(self) -> None:
        return None


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class ThreadedWorld:
    """The shared state of `world_size` in-process ranks. `received[r]`: the bytes rank
    r has received so far (payloads of other ranks only, as sent on a wire)."""

    def __init__(self, world_size: int, timeout: float = 10.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[Any] = [None] * world_size
        self.calls: list[str] = []  # collectives called, as seen by rank 0
        self.received = [0] * world_size
        self._ranks = [ThreadedRank(self, r) for r in range(world_size)]

    def rank(self, rank: int) -> ThreadedRank:
        """Rank `rank`'s end: the same object every time (per-group caches key on it)."""
        return self._ranks[rank]

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

    @property
    def key(self) -> Hashable:
        return ("threaded world", id(self.world), self._rank)  # a rank: a process of its own

    def _post_and_read(self, name: str, mine: Any) -> list[Any]:
        if self._rank == 0:
            self.world.calls.append(name)
        self.world.slots[self._rank] = mine
        self.world.barrier.wait()
        everyone = list(self.world.slots)
        self.world.barrier.wait()  # nobody posts the next call before all have read
        return everyone

    def _count(self, nbytes: int) -> None:
        self.world.received[self._rank] += nbytes  # only this rank's thread writes its slot

    def all_gather_object(self, obj: Any) -> list[Any]:
        everyone = self._post_and_read("all_gather_object", (obj, _size(obj)))
        self._count(sum(n for r, (_o, n) in enumerate(everyone) if r != self._rank))
        return [o for o, _n in everyone]

    def all_to_all_object(self, objs: list[Any]) -> list[Any]:
        assert len(objs) == self.world_size, "one object per rank"
        everyone = self._post_and_read("all_to_all_object", objs)
        mine = [theirs[self._rank] for theirs in everyone]
        self._count(sum(_size(o) for r, o in enumerate(mine) if r != self._rank))
        return mine

    def all_reduce_max(self, values: list[int]) -> list[int]:
        everyone = self._post_and_read("all_reduce", list(values))
        self._count(8 * len(values))  # a reduction delivers one vector, whatever the world
        return [max(column) for column in zip(*everyone)]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self._rank == 0:
            self.world.calls.append("broadcast")
        self.world.slots[self._rank] = tensor
        self.world.barrier.wait()
        if self._rank != src:  # copied before the sender goes on and reuses its tensor
            theirs = self.world.slots[src]
            assert (theirs.shape, theirs.dtype) == (tensor.shape, tensor.dtype), "unlike tensors"
            tensor.copy_(theirs)
            self._count(tensor.numel() * tensor.element_size())
        self.world.barrier.wait()

    def send_recv(
        self,
        recvs: list[tuple[int, torch.Tensor]],
        sends: Callable[[], list[tuple[int, torch.Tensor]]],
    ) -> None:
        if self._rank == 0:
            self.world.calls.append("send_recv")
        self.world.slots[self._rank] = list(sends())
        self.world.barrier.wait()
        taken: dict[int, int] = {}
        for src, tensor in recvs:
            theirs = [t for dst, t in self.world.slots[src] if dst == self._rank]
            i = taken.get(src, 0)
            taken[src] = i + 1
            assert i < len(theirs), f"rank {src} sent rank {self._rank} fewer messages"
            assert (theirs[i].shape, theirs[i].dtype) == (tensor.shape, tensor.dtype), "unlike"
            tensor.copy_(theirs[i])
            self._count(tensor.numel() * tensor.element_size())
        for src, theirs in enumerate(self.world.slots):
            sent = sum(dst == self._rank for dst, _t in theirs)
            assert sent == taken.get(src, 0), f"rank {src} sent rank {self._rank} more messages"
        self.world.barrier.wait()

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
            if src != self._rank:
                self._count(n * input.element_size())
            offset += n
        self.world.barrier.wait()
        return _Done()

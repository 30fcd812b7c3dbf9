"""The two collectives the engine needs, behind one small interface.

Transfers need `all_to_all_single` and the agreement rule needs
`all_gather_object`; `communicator(group)` gives them over a torch.distributed
process group (None: the default group). The interface also lets tests run
several ranks as threads of one process (`tests/comm/threaded_world.py`), so
planning, packing and agreement are checked without spawning processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Communicator",
    "ProcessGroupCommunicator",
    "SingleProcess",
    "Waitable",
    "communicator",
]


class Waitable(Protocol):
    def wait(self) -> Any: ...


class Communicator(ABC):
    """One rank's end of a group. Every method is collective: all ranks call it."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    def key(self) -> Hashable:
        """Equal for the ends of one group held by one rank (keys per-group caches)."""
        return id(self)

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""

    @abstractmethod
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Waitable:
        """Start sending `input`'s pieces to each rank and filling `output` from
        each rank (sizes in elements, pieces in rank order); wait() finishes it."""


class ProcessGroupCommunicator(Communicator):
    """A torch.distributed process group (gloo, NCCL, ...)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def key(self) -> Hashable:
        return ("process group", id(self.group))

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Waitable:
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=self.group, async_op=True
        )
        assert work is not None  # async_op=True always returns a handle
        return work


class SingleProcess(Communicator):
    """The world of one process with no process group: collectives return at once."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Waitable:
        output.copy_(input)
        return _Done()


class _Done:
    def wait(self) -> None:
        return None


def communicator(group: Any) -> Communicator:
    """`group` itself when it is a Communicator, else its process group's."""
    return group if isinstance(group, Communicator) else ProcessGroupCommunicator(group)

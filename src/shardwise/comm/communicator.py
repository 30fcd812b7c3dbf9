"""The collectives the engine needs, behind one small interface.

Transfers need `all_to_all_single`, the agreement rule `all_gather_object`;
checkpoint planning, whose cost per rank must not grow with the world size,
routes objects to the ranks that need them (`all_to_all_object`) and agrees
on fixed-size verdicts (`all_reduce_max`); a load sends values every rank
loads whole from the one rank that read them (`broadcast`). `communicator(group)` gives them over
a torch.distributed process group (None: the default group). The interface also lets tests run
several ranks as threads of one process (`tests/comm/threaded_world.py`), so
planning, packing and agreement are checked without spawning processes.

Object collectives carry only metadata, so on a group without a CPU backend
(NCCL) they run over a gloo group of the same ranks instead of pickling into
GPU memory and synchronising the device; tensors keep the group's backend.
"""

from __future__ import annotations

import atexit
import itertools
import pickle
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Communicator",
    "ProcessGroupCommunicator",
    "SingleProcess",
    "Waitable",
    "communicator",
    "default_store",
    "gloo_group",
    "object_group",
    "timeout_of",
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

    @abstractmethod
    def all_to_all_object(self, objs: list[Any]) -> list[Any]:
        """`objs[r]` sent to rank r; what every rank sent this one, in rank order."""

    @abstractmethod
    def all_reduce_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's `values` (int64, the same length on
        every rank): a fixed-size agreement, whatever the world size."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Rank `src`'s `tensor` into every rank's `tensor` (the same size everywhere)."""

    def carries(self, device_type: str) -> bool:
        """Whether tensors on devices of `device_type` ("cpu", "cuda") travel over this
        group as they are (a host tensor always does: over a side group if need be)."""
        return device_type == "cpu"

    def send_recv(
        self,
        recvs: list[tuple[int, torch.Tensor]],
        sends: Callable[[], list[tuple[int, torch.Tensor]]],
    ) -> None:
        """Point to point: each `(rank, tensor)` of `recvs` filled from that rank, each of
        what `sends()` returns sent to that rank; the i-th tensor a rank sends a peer is
        the i-th that peer receives from it (contiguous, the same size). The receives
        are posted first and `sends()` called after, so what this rank is sent arrives
        while it makes what it sends (reads it). Every rank calls it, with or without
        messages; it returns when this rank's are done."""
        if recvs or sends():
            raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")


class ProcessGroupCommunicator(Communicator):
    """A torch.distributed process group (gloo, NCCL, ...)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        _settle_workers_at_exit()

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
        dist.all_gather_object(gathered, obj, group=object_group(self.group))
        return gathered

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Waitable:
        # host tensors on a device-only group (NCCL) go over its gloo side group
        group = object_group(self.group) if input.device.type == "cpu" else self.group
        work = dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=True
        )
        assert work is not None  # async_op=True always returns a handle
        return work

    def all_to_all_object(self, objs: list[Any]) -> list[Any]:
        # One buffer each way, no copies of it: a planning route carries megabytes
        # (a rank's entries at 100,000 tensors), and each copy of a transient that
        # large stays in a process's RSS (glibc raises its mmap threshold on a free).
        group = object_group(self.group)
        buffer, lengths = bytearray(), []
        for o in objs:
            data = pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)
            buffer += data
            lengths.append(len(data))
            del data
        sizes = torch.tensor(lengths, dtype=torch.int64)
        theirs = torch.empty_like(sizes)
        dist.all_to_all_single(theirs, sizes, group=group)
        received = torch.empty(int(theirs.sum()), dtype=torch.uint8)
        sent = torch.frombuffer(buffer, dtype=torch.uint8)
        counts = theirs.tolist()
        dist.all_to_all_single(received, sent, counts, lengths, group=group)
        del sent, buffer
        view, out, at = memoryview(received.numpy().data), [], 0
        for n in counts:
            out.append(pickle.loads(view[at : at + n]))
            at += n
        return out

    def all_reduce_max(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=object_group(self.group))
        return t.tolist()

    def carries(self, device_type: str) -> bool:
        # "cuda": NCCL bound to it ("nccl", "cpu:gloo,cuda:nccl"); gloo also lists CUDA
        # among its devices, but stages a CUDA tensor through host memory on every rank
        if device_type == "cpu":
            return True
        pg: Any = self.group if self.group is not None else dist.group.WORLD
        if device_type != "cuda" or torch.device("cuda") not in pg._device_types:
            return False
        return "nccl" in str(dist.get_backend(pg)).lower()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        # a host tensor on a device-only group (NCCL) goes over its gloo side group
        group = object_group(self.group) if tensor.device.type == "cpu" else self.group
        pg: Any = group if group is not None else dist.group.WORLD
        dist.broadcast(tensor, src=dist.get_global_rank(pg, src), group=group)

    def send_recv(
        self,
        recvs: list[tuple[int, torch.Tensor]],
        sends: Callable[[], list[tuple[int, torch.Tensor]]],
    ) -> None:
        # the i-th message of a pair carries tag i: matched by tag, whatever the backend's order
        works = [self._post(dist.irecv, recvs)]
        works.append(self._post(dist.isend, sends()))
        for work in itertools.chain.from_iterable(works):
            assert work is not None  # isend / irecv always return a handle
            work.wait()

    def _post(self, start: Callable[..., Any], ops: list[tuple[int, torch.Tensor]]) -> list[Any]:
        seen: dict[int, int] = defaultdict(int)
        works = []
        for peer, tensor in ops:
            # host tensors on a device-only group (NCCL) go over its gloo side group
            group = object_group(self.group) if tensor.device.type == "cpu" else self.group
            pg: Any = group if group is not None else dist.group.WORLD
            tag = seen[peer]
            seen[peer] += 1
            works.append(start(tensor, dist.get_global_rank(pg, peer), group=group, tag=tag))
        return works


# How long the interpreter's exit hands the GIL to torch's collective workers.
SETTLE_S = 0.05
_SETTLING = False


def _settle_workers_at_exit() -> None:
    """Once per process: at exit, hand the GIL to gloo's worker threads before the
    interpreter finalizes.

    A gloo worker frees a finished collective's tensors after `wait()` has returned,
    and freeing a tensor Python has seen takes the GIL (torch 2.13). A worker that
    asks for it once the interpreter is finalizing is ended by `pthread_exit`, whose
    unwinding through that destructor calls `std::terminate`: a job whose last
    collective comes just before it exits aborts with SIGABRT ("terminate called
    without an active exception"), after its work is done, on about one run in four
    with 3 ranks on 2 cores. atexit functions run while threads may still take the GIL,
    so this one sleeps for a moment, and a worker still waiting for the GIL gets it."""
    global _SETTLING
    if not _SETTLING:
        _SETTLING = True
        atexit.register(time.sleep, SETTLE_S)


# (the default group they were made under, the gloo group) by global ranks.
_SIDE_GROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}
# Every gloo group shardwise made, destroyed at the interpreter's exit (`_destroy_made`).
_MADE: list[Any] = []
_MADE_LOCK = threading.Lock()


def gloo_group(ranks: list[int] | None, **options: Any) -> Any:
    """`dist.new_group(ranks, backend="gloo", **options)` for shardwise's own use
    (collective as that call is), destroyed at the interpreter's exit unless the
    script destroyed the default group first.

    A script that ends without `destroy_process_group()` then leaves torch's
    teardown only the groups it made itself, as stock DCP does: the interpreter's
    finalization never tears down a gloo group of ours in whatever order it
    happens to free objects."""
    group = dist.new_group(ranks, backend="gloo", **options)
    with _MADE_LOCK:
        if not _MADE:
            atexit.register(_destroy_made)
        _MADE.append(group)
    return group


def _destroy_made() -> None:
    """At exit (after the interpreter joined its threads: no save of ours runs), the
    groups `gloo_group` made, while the default group they came from is alive.
    Local to each rank: destroying a gloo group exchanges nothing."""
    with _MADE_LOCK:
        made = list(_MADE)
        _MADE.clear()
    _SIDE_GROUPS.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return  # the script destroyed the default group, and every group with it
    for group in made:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # destroyed already, by the script
            pass


def object_group(group: Any) -> Any:
    """The group object collectives on `group` (None: the default) run over.

    `group` itself when it has a CPU backend ("gloo", "cpu:gloo,cuda:nccl": torch
    then pickles on the CPU already), else one gloo group per set of ranks,
    made on first use and kept (groups of the same ranks share it: object
    collectives block, so each rank still calls them in one order). Making it
    is collective over those ranks, and safe here: every rank of `group`
    reaches its first object collective together. A whole-world group is made
    as every rank's next group (all ranks are members); a smaller one with
    `use_local_synchronization`, so ranks outside it need not take part.
    """
    pg: Any = group if group is not None else dist.group.WORLD
    if not _needs_side_group(pg):
        return group
    ranks = tuple(dist.get_process_group_ranks(pg))
    world = dist.group.WORLD
    cached = _SIDE_GROUPS.get(ranks)
    if cached is None or cached[0] is not world:  # none yet, or made before a re-init
        whole = len(ranks) == dist.get_world_size()
        # a group made with sort_ranks=False keeps its order (rank i is ranks[i])
        order: dict[str, Any] = {} if list(ranks) == sorted(ranks) else {"sort_ranks": False}
        side = gloo_group(
            list(ranks), timeout=timeout_of(pg), use_local_synchronization=not whole, **order
        )
        cached = _SIDE_GROUPS[ranks] = (world, side)
    return cached[1]


def _needs_side_group(pg: Any) -> bool:
    """No CPU backend on `pg`: torch would pickle objects into device memory."""
    devices = pg._device_types
    return bool(devices) and torch.device("cpu") not in devices and dist.is_gloo_available()


def default_store() -> Any:
    """The default process group's key-value store (a `TCPStore` under `torchrun` and
    `init_process_group`), or None where there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def timeout_of(pg: Any) -> timedelta:
    """`pg`'s collective timeout, which its side group keeps."""
    return pg._get_backend(pg._device_types[0]).options._timeout


class SingleProcess(Communicator):
    """The world of one process with no process group: collectives return at once."""

    @property
    def key(self) -> Hashable:
        return ("single process",)  # every one is the same world

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

    def all_to_all_object(self, objs: list[Any]) -> list[Any]:
        return list(objs)

    def all_reduce_max(self, values: list[int]) -> list[int]:
        return list(values)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        return None  # the only rank's tensor is already every rank's

    def send_recv(
        self,
        recvs: list[tuple[int, torch.Tensor]],
        sends: Callable[[], list[tuple[int, torch.Tensor]]],
    ) -> None:
        assert not recvs and not sends(), "one rank sends itself nothing"


class _Done:
    def wait(self) -> None:
        return None


def communicator(group: Any) -> Communicator:
    """`group` itself when it is a Communicator, else its process group's."""
    return group if isinstance(group, Communicator) else ProcessGroupCommunicator(group)

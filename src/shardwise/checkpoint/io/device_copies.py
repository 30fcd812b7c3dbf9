"""Copies between device memory and host slabs, on side streams, marked by events.

A save's device→host copies and a load's host→device copies run on one side
stream per device, so they overlap the caller's compute and the file I/O of
other slabs. The side stream first waits for the caller's work (`after`: an
event recorded on the caller's stream when the save was called, or the
caller's current stream): a copy never reads a tensor before the kernels that
produce it have run. Each batch of copies ends with a `Mark` (an event per
device used) that the host waits on before it touches the slab.

Small device tensors are packed on the device first (one `torch.cat` into a
bounded device buffer, then one copy), so 10,000 of them cost a few hundred
kernel launches, not 10,000 copies.

`HostCopier` is the same interface over CPU tensors, copying at once: the
pipelines that use these (`staged_writer`, `read_executor`) are tested on
machines without a GPU through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

__all__ = ["Copier", "DeviceCopier", "HostCopier", "Mark", "PACK_BYTES", "device_bytes"]

PACK_BYTES = 32 << 20  # the device buffer small tensors are packed into, per device


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in C order as a flat uint8 tensor where `t` lives: a view when its
    memory already is that, else a copy made there (a pending conjugation or
    negation applied, as the record stores values)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class Mark:
    """The end of a batch of copies: `wait` returns once they are done."""

    __slots__ = ("_events",)

    def __init__(self, events: Sequence[torch.cuda.Event] = ()) -> None:
        self._events = list(events)

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()

    def done(self) -> bool:
        return all(e.query() for e in self._events)


class Copier(ABC):
    """Copies into and out of host slabs; `mark()` closes a batch."""

    @abstractmethod
    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        """`device_bytes(t)`, any copy it needs made in the copies' order (after what
        they wait for)."""

    @abstractmethod
    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst` (host bytes) takes `src`'s bytes (a flat uint8 view of the same size)."""

    @abstractmethod
    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        """`dst` takes the flat uint8 views `srcs`, back to back."""

    @abstractmethod
    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst` (device bytes) takes host bytes `src`."""

    @abstractmethod
    def mark(self) -> Mark:
        """Close the batch of copies issued since the last mark."""

    def mark_all(self) -> Mark:
        """A mark after every copy issued so far, on every device."""
        return self.mark()

    @abstractmethod
    def join(self) -> None:
        """Order the caller's later work after every copy made so far."""

    @abstractmethod
    def close(self) -> None:
        """Free what the copies kept between batches."""


class HostCopier(Copier):
    """Copies made at once, marks already done: the pipelines' CPU form."""

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        return device_bytes(t)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        torch.cat(list(srcs), out=dst)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self) -> Mark:
        return Mark()

    def join(self) -> None:
        return None

    def close(self) -> None:
        return None


class DeviceCopier(Copier):
    """Non-blocking copies on a side stream per CUDA device.

    `after`: per device index, an event on the caller's stream the copies must
    follow (an asynchronous save records it when called); a device without one
    follows the caller's current stream as it is now."""

    def __init__(self, after: dict[int, torch.cuda.Event] | None = None) -> None:
        self._after = dict(after or {})
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._used: set[int] = set()
        self._pack: dict[int, torch.Tensor] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._used.add(index)
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
            event = self._after.get(index)
            if event is not None:
                stream.wait_event(event)
            else:
                stream.wait_stream(torch.cuda.current_stream(index))
        return stream

    def bytes_of(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):  # a view: no kernel
            return t.detach().reshape(-1).view(torch.uint8)
        with torch.cuda.stream(self._stream(t.device)):  # its copy follows `after`
            return device_bytes(t)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(src.device)):
            dst.copy_(src, non_blocking=True)

    def pack_to_host(self, dst: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        device = srcs[0].device
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            index = stream.device_index
            pack = self._pack.get(index)
            if pack is None:  # allocated on the side stream: reused in its order only
                pack = self._pack[index] = torch.empty(PACK_BYTES, dtype=torch.uint8, device=device)
            n = dst.numel()
            torch.cat(list(srcs), out=pack[:n])
            dst.copy_(pack[:n], non_blocking=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(dst.device)):
            dst.copy_(src, non_blocking=True)

    def mark(self) -> Mark:
        events = []
        for index in sorted(self._used):
            event = torch.cuda.Event()
            event.record(self._streams[index])
            events.append(event)
        self._used.clear()
        return Mark(events)

    def mark_all(self) -> Mark:
        self._used.update(self._streams)
        return self.mark()

    def join(self) -> None:
        """Make this thread's current streams wait for every copy: a load's targets are
        then ready for the caller's next kernel."""
        for index, stream in self._streams.items():
            torch.cuda.current_stream(index).wait_stream(stream)

    def close(self) -> None:
        """Drop the packing buffers (call once every mark was waited on)."""
        self._pack.clear()

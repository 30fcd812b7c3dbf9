"""`io.write.write_archives`: records from device memory through bounded host slabs.

On CPU the pipeline runs through `HostCopier` (CPU tensors staged as device
tensors would be), so its logic — waves, cut and packed records, order, the
staged signal, a failure mid-way — is checked here; the CUDA form in
tests/checkpoint/api/test_gpu_save_load.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.checkpoint.format.archive import tensor_archive
from shardwise.checkpoint.io import write as staged_writer
from shardwise.checkpoint.io.device import HostCopier, HostSlabs
from shardwise.checkpoint.io.write import DataFile

SID = "7" * 40


def _records() -> list:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(700, 700, generator=g),  # 1.9 MiB: cut across 1 MiB slabs
        b"an object's bytes",
        torch.arange(10, dtype=torch.int16),  # packed
        torch.randn(3, 5, generator=g).t(),  # not contiguous
        torch.randn(50_000, generator=g).to(torch.bfloat16),  # packed, 100 KB
        torch.zeros(0, 4),  # empty: nothing to stage
        torch.randn(2, 600_000, generator=g),  # 4.6 MiB: more than the whole budget
        torch.randn(4, 4, dtype=torch.complex64).conj(),
    ]


def _expected(records: list) -> bytes:
    out = b""
    for r in records:
        if isinstance(r, torch.Tensor):
            head, payload, tail = tensor_archive(r.resolve_conj().contiguous(), SID)
            out += head + bytes(payload) + tail
        else:
            out += r
    return out


def _direct(tmp_path: Path, records: list, name: str = "direct") -> list:
    with DataFile(tmp_path, name) as f:
        written = [
            f.write_tensor(r, SID) if isinstance(r, torch.Tensor) else f.write_object(r)
            for r in records
        ]
        f.finish()
    return [w._replace(file="") for w in written]


def _write(f: DataFile, records: list, slabs: HostSlabs, stage, on_staged=None) -> list:
    """`write_archives` of `records` into the one file `f`, through `HostCopier`."""
    one_file = (records, [0] * len(records))
    return staged_writer.write_archives(
        [f], one_file, SID, slabs, HostCopier(), stage=stage, on_staged=on_staged
    )


def test_staged_records_are_the_bytes_and_checksums_of_direct_writes(tmp_path: Path) -> None:
    records = _records()
    slabs = HostSlabs(4 << 20, pin=False)  # four 1 MiB slabs for 8 MiB of tensors: waves
    calls: list[str] = []
    with slabs.lease(), DataFile(tmp_path, "staged") as f:
        written = _write(f, records, slabs, lambda t: True, lambda: calls.append("staged"))
        f.finish()
    assert (tmp_path / "staged").read_bytes() == _expected(records)
    assert [w._replace(file="") for w in written] == _direct(tmp_path, records)
    assert calls == ["staged"]
    assert slabs.free == 4 and slabs.allocated == 4 << 20


def test_host_tensors_not_picked_are_written_from_their_memory(tmp_path: Path) -> None:
    records = _records()
    slabs = HostSlabs(4 << 20, pin=False)
    calls: list[str] = []
    with slabs.lease(), DataFile(tmp_path, "f") as f:
        _write(f, records, slabs, lambda t: False, lambda: calls.append("x"))
        f.finish()
    assert (tmp_path / "f").read_bytes() == _expected(records)
    assert calls == ["x"]  # nothing to stage: staged at once
    assert slabs.allocated == 0  # no slab was needed


def test_a_slab_is_refilled_only_after_its_bytes_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of events: at most `count` slabs in flight, each given back only after
    every write that took its bytes has ended. The writes run where the pipeline puts them
    (the writer threads) and are slow, as on a busy disk; the stand-in only delays and logs
    them, so the order seen is the one the pipeline itself enforces."""
    records = [torch.full((300_000,), float(i)) for i in range(6)]  # 1.14 MiB each
    slabs = HostSlabs(2 << 20, pin=False)  # two 1 MiB slabs (the minimum slab)
    assert (slabs.size, slabs.count) == (1 << 20, 2)
    events: list[tuple] = []  # ("take", slab), ("give", slab), ("written", slab, fill)
    fills = [0] * slabs.count  # times each slab was taken: its current fill
    take, give = slabs.take, slabs.give

    def spy_take() -> int | None:
        got = take()
        if got is not None:
            fills[got] += 1
            events.append(("take", got))
        return got

    def spy_give(i: int) -> None:
        events.append(("give", i))
        give(i)

    def fills_in(buffers: tuple) -> list[tuple[int, int]]:
        """(slab, fill) of every slab some buffer lies in, as the write starts."""
        found = set()
        for b in buffers:
            at = np.frombuffer(b, dtype=np.uint8).ctypes.data if len(b) else -1
            for i, slab in enumerate(slabs._buffers):
                if slab is not None and slab.data_ptr() <= at < slab.data_ptr() + slab.numel():
                    found.add((i, fills[i]))
        return sorted(found)

    monkeypatch.setattr(slabs, "take", spy_take)
    monkeypatch.setattr(slabs, "give", spy_give)
    with slabs.lease(), DataFile(tmp_path, "f") as f:
        write_at = f._sink.write_at

        def slow_write_at(buffers: tuple, at: int) -> None:
            held = fills_in(buffers)
            time.sleep(0.1)  # a give that does not wait for the write comes first
            write_at(buffers, at)
            events.extend(("written", i, n) for i, n in held)

        monkeypatch.setattr(f._sink, "write_at", slow_write_at)
        _write(f, records, slabs, lambda t: True)
        f.finish()
    assert (tmp_path / "f").read_bytes() == _expected(records)
    in_flight = 0
    for e in events:
        in_flight += e[0] == "take"
        in_flight -= e[0] == "give"
        assert 0 <= in_flight <= 2
    # 6.9 MiB through 1 MiB slabs: 7 fills, each written; a slab is given back only after
    # the writes of its bytes (the last ones, if still writing, with the lease)
    assert [e[0] for e in events].count("take") == 7
    assert len({e[1:] for e in events if e[0] == "written"}) == 7
    gives = [k for k, e in enumerate(events) if e[0] == "give"]
    assert 5 <= len(gives) <= 7
    for k in gives:
        i = events[k][1]
        fill = sum(e == ("take", i) for e in events[:k])
        assert ("written", i, fill) in events[:k], (k, events)
        assert ("written", i, fill) not in events[k:], (k, events)


def test_a_failure_mid_way_leaves_no_slab_out_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [torch.full((300_000,), float(i)) for i in range(6)]
    slabs = HostSlabs(2 << 20, pin=False)
    staged: list[str] = []
    with pytest.raises(OSError, match="disk full"):
        with slabs.lease(), DataFile(tmp_path, "f") as f:
            writes = 0
            write_at = f._sink.write_at

            def failing_write_at(buffers, at):
                nonlocal writes
                writes += 1
                if writes == 3:
                    raise OSError("disk full")
                write_at(buffers, at)

            monkeypatch.setattr(f._sink, "write_at", failing_write_at)
            _write(f, records, slabs, lambda t: True, lambda: staged.append("s"))
    assert not (tmp_path / "f").exists()  # the DataFile's block removed it
    assert slabs.free == 2  # the lease gave every slab back
    assert staged == []  # the last copy was never issued: the caller signals it


def test_budget_rules() -> None:
    from shardwise.checkpoint.io.device import staging_bytes

    assert [
        (HostSlabs(b, False).size, HostSlabs(b, False).count) for b in (1 << 30, 8 << 30, 5 << 20)
    ] == [
        (64 << 20, 16),
        (64 << 20, 128),
        (1 << 20, 5),
    ]
    assert staging_bytes(3 << 20) == 3 << 20
    with pytest.raises(ValueError, match="at least"):
        staging_bytes(1000)


def test_records_spread_over_files_keep_each_files_order(tmp_path: Path) -> None:
    """Records interleaved over two files (as `engine.plan.place_archives` spreads a large
    share): each file holds its records, in order, as direct writes would."""
    records = _records()
    which = [k % 2 for k in range(len(records))]
    slabs = HostSlabs(4 << 20, pin=False)
    with slabs.lease(), DataFile(tmp_path, "a") as a, DataFile(tmp_path, "b") as b:
        written = staged_writer.write_archives(
            [a, b], (records, which), SID, slabs, HostCopier(), stage=lambda t: True
        )
        a.finish()
        b.finish()
    for name, k in (("a", 0), ("b", 1)):
        mine = [r for r, w in zip(records, which) if w == k]
        assert (tmp_path / name).read_bytes() == _expected(mine)
        assert [w.file for w, x in zip(written, which) if x == k] == [name] * len(mine)
        assert [w._replace(file="") for w, x in zip(written, which) if x == k] == _direct(
            tmp_path, mine, f"direct-{name}"
        )

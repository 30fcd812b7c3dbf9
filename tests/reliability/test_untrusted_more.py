"""More attacks on issue 20's defences, tried as an attacker and as an unlucky user would:
each crafted input is refused (or handled correctly) by every entry point, and no victim
file is read, changed or removed. Kept as regressions; each runs in well under a second."""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
import tracemalloc
import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.checks import check_coverage, name_problem
from shardwise.checkpoint.io.commit import (
    RecordNames,
    collect,
    leftover_data,
    per_rank_records,
    replaced_files,
)
from shardwise.checkpoint.io.lease import LOCK, Holder, Lease, live_scopes, stale_reason
from shardwise.cli import main
from shardwise.errors import (
    CheckpointBusyError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    UnsafeMetadataError,
)
from shardwise.storage import open_folder

from . import crafted
from .crafted import SECRET, Place
from .test_untrusted import _refused_everywhere, _replaceable, place  # noqa: F401 - a fixture

# -- 1. confinement: paths that look harmless -----------------------------------------------


def test_a_name_through_a_symlinked_folder_is_refused(tmp_path, capsys):
    """A name with a separator never reaches the OS, even when the folder it goes through
    is a link planted in the checkpoint folder."""
    p = Place(tmp_path)
    p.save()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.distcp").write_bytes(p.folder.read(p.data_file()))
    os.symlink(tmp_path / "outside", tmp_path / "ckpt" / "sub")
    crafted.stock_path(p, "sub/x.distcp")
    _refused_everywhere(p, capsys, CorruptCheckpointError, "'w'", "'sub/x.distcp'")


@pytest.mark.parametrize(
    "name",
    [
        ".metadata\n",  # a trailing newline: not the record, and not in the folder either
        "\u2024metadata",  # ONE DOT LEADER for the dot
        "..%2Fsecret.distcp",  # a URL-escaped separator is a plain (absent) name
        "%2E%2E/secret.distcp",
        "secret.distcp\0",
    ],
)
def test_lookalike_and_escaped_names_read_nothing_outside(place, capsys, name):  # noqa: F811
    crafted.stock_path(place, name)
    needle = "missing" if name.isprintable() and "/" not in name else "'w'"
    _refused_everywhere(place, capsys, CorruptCheckpointError, needle)


def test_a_manifest_name_with_a_trailing_newline_is_not_ours(place, capsys):  # noqa: F811
    m = place.manifest()
    name = m.tensors["w"].chunks[0].file
    m.tensors["w"].chunks[0].file = name + "\n"
    place.write_manifest(m)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", "non-printable")


def test_unicode_digits_are_not_our_data_names(tmp_path):
    """`\\d` matches any Unicode digit: a record naming `__٣_0.distcp` must neither pass as
    a shardwise data file nor get a user's file of that name collected."""
    arabic = "__\u0663_0.sw0123456789ab.distcp"
    assert name_problem(arabic, shardwise=True) is not None
    victim = "__\u0663_0.distcp"
    (tmp_path / victim).write_bytes(crafted.NOTES)
    assert leftover_data(tmp_path) == []
    assert collect(tmp_path, set(), {victim}) == []
    (tmp_path / arabic).write_bytes(crafted.NOTES)
    assert collect(tmp_path, set(), set()) == []
    assert per_rank_records(tmp_path) == []
    (tmp_path / "__\u0663.metadata").write_bytes(b"x")
    assert per_rank_records(tmp_path) == []
    assert (tmp_path / victim).read_bytes() == crafted.NOTES


@pytest.mark.parametrize("name", [LOCK, "__0" + LOCK, ".shardwise.lock.sw0123456789ab.tmp"])
def test_stock_metadata_naming_a_lock_is_refused(place, capsys, name):  # noqa: F811
    crafted.stock_path(place, name)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", repr(name))


def test_a_hard_link_is_the_file_itself(tmp_path):
    """A hard link in the folder is a plain file of the folder: reading it reads what the
    folder holds (making one needs access to the file anyway: `protected_hardlinks`), so it
    is accepted; collecting it unlinks the name only, never the other file's bytes."""
    p = Place(tmp_path)
    p.save()
    data = p.data_file()
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((tmp_path / "ckpt" / data).read_bytes())
    os.remove(tmp_path / "ckpt" / data)
    os.link(outside, tmp_path / "ckpt" / data)
    assert torch.equal(swc.read_tensor(p.ckpt, "w"), crafted.state()["w"])
    assert swc.verify(p.ckpt) == []
    before = outside.read_bytes()
    swc.save(crafted.state(), p.ckpt, overwrite=True)  # collects the replaced file's name
    assert not (tmp_path / "ckpt" / data).exists()
    assert outside.read_bytes() == before


def test_a_symlinked_stock_metadata_is_never_read(tmp_path, capsys):
    p = Place(tmp_path)
    p.save()
    crafted.stock_path(p, p.data_file())  # a sound stock checkpoint
    outside = tmp_path / "outside.metadata"
    outside.write_bytes((tmp_path / "ckpt" / ".metadata").read_bytes())
    os.remove(tmp_path / "ckpt" / ".metadata")
    os.symlink(outside, tmp_path / "ckpt" / ".metadata")
    _refused_everywhere(p, capsys, CorruptCheckpointError, "symbolic link")
    assert os.path.islink(tmp_path / "ckpt" / ".metadata")


def test_a_per_rank_record_naming_a_path_out_is_refused(tmp_path):
    p = Place(tmp_path)
    p.save()
    md = p.metadata()
    index = MetadataIndex("w", torch.Size([0, 0]))
    md.storage_data[index] = replace(md.storage_data[index], relative_path="../secret.distcp")
    for name in ("shardwise.json", ".shardwise", ".metadata"):
        p.folder.remove(name)
    p.folder.write_durably("__0.metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*'\.\./secret\.distcp'"):
        swc.Reader(p.ckpt).read_metadata(rank=0)


def _with_object(p: Place) -> None:
    swc.save({**crafted.state(), "step": 7}, p.ckpt, overwrite=True)


@pytest.mark.parametrize("file", ["../secret.distcp", "notes.txt", "shardwise.json"])
def test_a_manifest_object_naming_a_file_not_ours_is_refused(place, capsys, file):  # noqa: F811
    _with_object(place)
    m = place.manifest()
    m.objects["step"] = replace(m.objects["step"], file=file)
    place.write_manifest(m)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'step'", repr(file))
    _replaceable(place)


# -- 5. numbers: huge, negative, near int64 --------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("offset", 2**63 - 1),
        ("length", 2**63 - 1),
        ("offset", -1),
        ("length", -8),
        ("offset", 0.0),
        ("length", True),
    ],
)
def test_a_stock_byte_range_out_of_any_file_is_refused(place, capsys, field, value):  # noqa: F811
    md = place.metadata()
    index = MetadataIndex("w", torch.Size([0, 0]))
    md.storage_data[index] = replace(md.storage_data[index], **{field: value})
    place.make_stock(md)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'")


@pytest.mark.parametrize("value", [2**63 - 1, -1])
def test_a_manifest_byte_range_out_of_any_file_is_refused(place, capsys, value):  # noqa: F811
    _with_object(place)
    m = place.manifest()
    m.objects["step"] = replace(m.objects["step"], offset=value)
    place.write_manifest(m)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'step'")


@pytest.mark.parametrize(
    "shape, offsets",
    [
        ([-4, 4], None),
        ([4, 4], [-2, 0]),
        ([2**62, 4], None),
        ([2**61, 2**61], None),
        ([2**63 - 1], None),
    ],
)
def test_a_stock_size_or_offset_out_of_range_is_refused(place, capsys, shape, offsets):  # noqa: F811
    md = place.metadata()
    w = md.state_dict_metadata["w"]
    if len(shape) != 2:
        w.chunks[0] = replace(w.chunks[0], offsets=torch.Size([0]), sizes=torch.Size([16]))
        md.storage_data[MetadataIndex("w", torch.Size([0]))] = md.storage_data.pop(
            MetadataIndex("w", torch.Size([0, 0]))
        )
    w.size = torch.Size(shape)
    if offsets is not None:
        w.chunks[0] = replace(w.chunks[0], offsets=torch.Size(offsets))
    place.make_stock(md)
    start = time.monotonic()
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'")
    assert time.monotonic() - start < 10


def test_many_chunks_are_checked_in_n_log_n():
    """A grid of 62,500 chunks and a cut of 250,000 checked in seconds (10^6 grid chunks
    take about 10 s on a 2-core machine: linear-logarithmic, Python's constant)."""
    n = 250
    grid = [((i, j), (1, 1)) for i in range(n) for j in range(n)]
    start = time.monotonic()
    check_coverage("t", (n, n), grid, "r")
    rows = [((i,), (1,)) for i in range(4 * n * n)]
    check_coverage("t", (4 * n * n,), rows, "r")
    assert time.monotonic() - start < 5
    grid[-1] = ((n - 1, n - 1), (1, 2))
    with pytest.raises(CorruptCheckpointError, match="outside"):
        check_coverage("t", (n, n), grid, "r")
    grid[-1] = ((n - 1, n - 2), (1, 1))
    with pytest.raises(CorruptCheckpointError, match="two chunks"):
        check_coverage("t", (n, n), grid, "r", replicas=False)


def test_zero_size_chunks_and_0d_tensors_round_trip(tmp_path):
    state = {"s": torch.tensor(3.5), "e": torch.zeros(0, 4), "w": torch.ones(2, 3)}
    swc.save(state, tmp_path / "c")
    got = {"s": torch.tensor(0.0), "e": torch.ones(0, 4), "w": torch.zeros(2, 3)}
    swc.load(got, tmp_path / "c")
    assert got["s"].item() == 3.5 and torch.equal(got["w"], state["w"])
    assert swc.read_tensor(tmp_path / "c", "s").item() == 3.5
    assert swc.verify(tmp_path / "c") == []
    check_coverage("t", (), [((), ())], "r")
    check_coverage("t", (4, 4), [((0, 0), (4, 4)), ((4, 0), (0, 4))], "r")
    with pytest.raises(CorruptCheckpointError, match="outside"):
        check_coverage("t", (4, 4), [((0, 0), (4, 4)), ((5, 0), (0, 4))], "r")


# -- 2. collection ---------------------------------------------------------------------------


def test_a_replaced_record_naming_a_data_named_link_keeps_link_and_target(tmp_path):
    (tmp_path / "ckpt").mkdir()
    outside = tmp_path / "victim"
    outside.write_bytes(SECRET)
    link = "__0_0.sw0123456789ab.distcp"
    os.symlink(outside, tmp_path / "ckpt" / link)
    assert collect(tmp_path / "ckpt", set(), {link}) == []
    assert collect(tmp_path / "ckpt", set(), set()) == []  # nor as a leftover
    assert os.path.islink(tmp_path / "ckpt" / link) and outside.read_bytes() == SECRET


def test_a_replaced_stock_per_rank_record_naming_another_ranks_file_decides_nothing(tmp_path):
    p = Place(tmp_path)
    p.save()
    md = p.metadata()
    for index, info in list(md.storage_data.items()):
        md.storage_data[index] = replace(info, relative_path="__1_0.distcp")
    (tmp_path / "ckpt" / "__1_0.distcp").write_bytes(crafted.NOTES)
    p.folder.write_durably("__0.metadata", pickle.dumps(md))
    with pytest.warns(UserWarning, match="corrupt record"):
        assert replaced_files(p.folder, RecordNames(0)) == set()
    assert (tmp_path / "ckpt" / "__1_0.distcp").read_bytes() == crafted.NOTES


# -- 3. the lease ----------------------------------------------------------------------------


def test_a_lock_that_is_a_symlink_is_never_followed(tmp_path):
    p = Place(tmp_path)
    p.save()
    victim = tmp_path / "victim.json"
    victim.write_bytes(crafted.NOTES)
    os.symlink(victim, tmp_path / "ckpt" / LOCK)
    with pytest.raises(OSError, match="symbolic link"):
        swc.save(crafted.state(), p.ckpt, overwrite=True)
    assert victim.read_bytes() == crafted.NOTES and os.path.islink(tmp_path / "ckpt" / LOCK)
    got = crafted.targets()
    swc.load(got, p.ckpt)  # the last committed checkpoint is untouched
    assert torch.equal(got["w"], crafted.state()["w"])


def test_a_garbage_lock_is_busy_and_never_broken(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / LOCK).write_bytes(b"{not json")
    start = time.monotonic()
    with pytest.raises(CheckpointBusyError, match="unreadable"):
        swc.save(crafted.state(), tmp_path / "c", wait=0.2)
    assert 0.2 <= time.monotonic() - start < 3
    assert (tmp_path / "c" / LOCK).read_bytes() == b"{not json"


def test_wait_true_breaks_a_garbage_lock_that_stays_garbage(tmp_path, monkeypatch):
    """An unreadable lock never becomes stale by its own heartbeat: without a bound,
    `wait=True` would wait forever."""
    import shardwise.checkpoint.io.lease as lease_module

    monkeypatch.setattr(lease_module, "STALE_AFTER_S", 0.3)
    (tmp_path / LOCK).write_bytes(b"\x00garbage")
    got: list[Any] = []

    def take() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got.append(Lease(open_folder(tmp_path)).acquire(wait=True))
        got.extend(str(w.message) for w in caught)

    start = time.monotonic()
    taker = threading.Thread(target=take, daemon=True)  # a hang fails, it does not block
    taker.start()
    taker.join(timeout=10)
    assert got, "wait=True still waiting on a garbage lock"
    assert 0.3 <= time.monotonic() - start < 10
    assert any("unreadable for 0 s while this save waited" in m for m in got[1:]), got
    lease = got[0]
    lease.release()
    (tmp_path / LOCK).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointBusyError, match="unreadable"):  # wait=False: at once
        Lease(open_folder(tmp_path)).acquire()


@pytest.mark.parametrize("heartbeat", [float("nan"), 1e18, float("inf")])
def test_a_heartbeat_no_live_holder_could_write_is_stale(tmp_path, heartbeat):
    """Another host's record with a heartbeat in the far future (or NaN, which JSON
    admits) never ages: without this, it would block every save of the path for good.
    A far-future time a clock can show is broken at once; NaN, infinity or a time no
    clock shows make the record unreadable: held (named), broken by a waiting save."""
    now = time.time()
    holder = Holder("x" * 32, "another-host", 4242, "ns", "1", now, heartbeat)
    assert stale_reason(holder) is not None
    assert stale_reason(replace(holder, heartbeat=now + 5)) is None  # clocks a little apart
    (tmp_path / LOCK).write_bytes(replace(holder, heartbeat=now + 1e6).to_bytes())
    with pytest.warns(UserWarning, match="no time a live holder could have written"):
        Lease(open_folder(tmp_path)).acquire().release()
    (tmp_path / LOCK).write_bytes(holder.to_bytes())
    with pytest.raises(CheckpointBusyError, match=f"unreadable.*{LOCK}"):
        Lease(open_folder(tmp_path)).acquire()


def test_a_huge_sparse_lock_is_never_read_whole(tmp_path):
    (tmp_path / "c").mkdir()
    with open(tmp_path / "c" / LOCK, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of zeros, no disk used
    (tmp_path / "c" / ("__1" + LOCK)).touch()
    os.truncate(tmp_path / "c" / ("__1" + LOCK), 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointBusyError, match="unreadable"):
            Lease(open_folder(tmp_path / "c")).acquire()
        assert live_scopes(open_folder(tmp_path / "c"), [LOCK, "__1" + LOCK]) == {None, 1}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_a_lock_of_another_thread_of_this_process_is_never_taken_for_stale(tmp_path):
    """Between a thread's exclusive create and its bookkeeping, another thread of the same
    process reads the record: our pid, a save id the process does not (yet) list as held.
    It must not break it as 'left by a save of this process'."""
    folder = open_folder(tmp_path)
    first = Lease(folder)
    seen: list[str | None] = []
    create = folder.create_exclusive

    def create_then_look(name: str, data: bytes, **kw: Any) -> None:
        create(name, data, **kw)
        holder = Holder.parse(folder.read(name))
        assert holder is not None
        seen.append(stale_reason(holder, (folder.identity, name)))

    folder.create_exclusive = create_then_look  # type: ignore[method-assign]
    first.acquire()
    try:
        assert seen == [None]
    finally:
        first.release()


def test_two_threads_never_hold_one_lease(tmp_path):
    folder = open_folder(tmp_path)
    held, errors = [], []
    barrier = threading.Barrier(4)

    def take() -> None:
        barrier.wait()
        try:
            lease = Lease(folder).acquire()
        except CheckpointBusyError:
            return
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            return
        held.append(lease)
        time.sleep(0.2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # breaking a live lease as stale warns
        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        assert errors == [] and len(held) == 1
    finally:
        for lease in held:
            lease.release()


def test_the_writer_and_async_save_refuse_a_held_lease(tmp_path):
    path = tmp_path / "c"
    swc.save(crafted.state(), path)
    holder = Lease(open_folder(path)).acquire()
    try:
        with pytest.raises(CheckpointException, match="another save of it is in flight"):
            dcp.save(crafted.state(), storage_writer=swc.Writer(path, overwrite=True))
        future = swc.async_save(crafted.state(), path, overwrite=True)
        with pytest.raises(CheckpointBusyError, match="in flight"):
            future.result(timeout=30)
    finally:
        holder.release()
    # a failed background save is its future's error, not every later async_save's
    holder = Lease(open_folder(path)).acquire()
    threading.Timer(0.3, holder.release).start()
    future = swc.async_save(
        {**crafted.state(), "w": torch.ones(4, 4)}, path, overwrite=True, wait=10
    )
    future.result(timeout=30)
    assert torch.equal(swc.read_tensor(path, "w"), torch.ones(4, 4))


# -- 7 and 9: strict, objects ----------------------------------------------------------------


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def test_a_refused_global_deep_in_a_container_refuses_the_load(tmp_path, capsys):
    """Deep in a container is as refused as at the top; the offline tools never unpickle
    (docs/safety.md: `verify` checks checksums, it does not judge a pickle), and a reshard copies
    the bytes verbatim, so its output is refused the same."""
    marker = str(tmp_path / "PWNED")
    bad = {"lr": 0.1, "fn": _Payload(marker)}
    swc.save({"w": torch.ones(2), "opt": {"groups": [bad]}}, tmp_path / "c")
    target: dict[str, Any] = {"w": torch.zeros(2), "opt": {"groups": [{"lr": 0.0, "fn": None}]}}
    with pytest.raises(UnsafeMetadataError, match="refused global posix.mkdir"):
        swc.load(target, tmp_path / "c")
    assert torch.equal(target["w"], torch.zeros(2)) and not os.path.exists(marker)
    assert (
        swc.verify(tmp_path / "c") == [] and main(["verify", "--quiet", str(tmp_path / "c")]) == 0
    )
    swc.reshard(tmp_path / "c", tmp_path / "r", 2)
    with pytest.raises(CheckpointException, match="posix.mkdir"):
        dcp.load(target, storage_reader=swc.Reader(tmp_path / "r"))
    assert not os.path.exists(marker)


def test_strict_false_still_refuses_tensor_against_non_tensor(tmp_path):
    swc.save({"w": torch.ones(2), "step": 3}, tmp_path / "c")
    with pytest.raises(CheckpointMismatchError, match="'step'"):
        swc.load({"w": torch.zeros(2), "step": torch.zeros(1)}, tmp_path / "c", strict=False)
    got: dict[str, Any] = {"w": torch.zeros(2), "step": 0, "extra": 5}
    swc.load(got, tmp_path / "c", strict=False)  # a missing key is what strict=False allows
    assert got["step"] == 3 and got["extra"] == 5 and torch.equal(got["w"], torch.ones(2))


def test_cli_prints_one_line_for_a_tampered_pickle(place, capsys):  # noqa: F811
    place.make_stock(place.metadata())
    place.folder.write_durably(".metadata", b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueR.")
    capsys.readouterr()
    for argv in (["verify", place.ckpt], ["inspect", place.ckpt]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "system" in err[0], err


def test_a_key_with_a_newline_and_an_escape_stays_on_one_line(place, capsys):  # noqa: F811
    """Keys and names of a crafted record reach messages: the CLI prints them escaped."""
    md = place.metadata()
    key = "w\n\x1b[2Jfake"
    md.state_dict_metadata[key] = md.state_dict_metadata.pop("w")
    md.state_dict_metadata[key].size = torch.Size([9, 4])  # a hole: refused, naming the key
    for index in [i for i in md.storage_data if i.fqn == "w"]:
        md.storage_data[replace(index, fqn=key)] = md.storage_data.pop(index)
    place.make_stock(md)
    capsys.readouterr()
    for argv in (["verify", "--quiet", place.ckpt], ["inspect", place.ckpt]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "\x1b" not in err and "in no chunk" in err, err


def test_a_decompression_bomb_in_a_transformed_chunk_is_refused(tmp_path):
    """A stock chunk written through zstd: its record replaced by 64 MiB of zeros that
    compress to a few KiB. Undoing the transform stops at what a 4x4 chunk can need."""
    zstandard = pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "c"
    dcp.save(
        {"w": torch.ones(4, 4)}, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()])
    )
    assert torch.equal(swc.read_tensor(path, "w"), torch.ones(4, 4))  # sound, it reads
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert len(bomb) < 64 << 10
    (path / "__0_0.distcp").write_bytes(bomb)
    md = pickle.loads((path / ".metadata").read_bytes())
    index = MetadataIndex("w", torch.Size([0, 0]))
    md.storage_data[index] = replace(md.storage_data[index], offset=0, length=len(bomb))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    for read in (
        lambda: swc.read_tensor(path, "w"),
        lambda: swc.load({"w": torch.zeros(4, 4)}, path),
        lambda: dcp.load({"w": torch.zeros(4, 4)}, storage_reader=swc.Reader(path)),
    ):
        tracemalloc.start()
        try:
            with pytest.raises((CorruptCheckpointError, CheckpointException), match="a decompr"):
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, peak


def test_a_lock_that_is_a_folder_fails_promptly(tmp_path):
    p = Place(tmp_path)
    p.save()
    (tmp_path / "ckpt" / LOCK).mkdir()
    start = time.monotonic()
    with pytest.raises(OSError, match=re.escape(LOCK)):
        swc.save(crafted.state(), p.ckpt, overwrite=True)
    assert time.monotonic() - start < 5  # no spinning on a name no record answers to
    got = crafted.targets()
    swc.load(got, p.ckpt)  # the last committed checkpoint is untouched
    assert torch.equal(got["w"], crafted.state()["w"])

"""`SaveRecords`: the one builder of `shardwise.json`, its index and `.metadata`.

The records come from the same entries, so they describe the same checkpoint:
the manifest's own DCP view (its chunks read from the index) equals the pickled
`.metadata`, checksums filled in late are encoded as if they were there from the
start, and records joined from owners' parts hold what one writer's do.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import crc32c
import pytest
from torch.distributed.checkpoint.metadata import StorageMeta

from shardwise import CorruptCheckpointError
from shardwise.checkpoint.engine.plan import SaveRecords
from shardwise.checkpoint.engine.records import join_records, part_name, write_part
from shardwise.checkpoint.format.entries import ChunkEntry
from shardwise.checkpoint.format.manifest import (
    VERSION,
    IndexRef,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from shardwise.checkpoint.format.pickles import load_metadata
from shardwise.storage import open_folder

META = StorageMeta(checkpoint_id="/ck", save_id="s1")
TOKEN = "0123456789ab"
DATA = [f"__{rank}_0.sw{TOKEN}.distcp" for rank in range(2)]
INDEX = f"__0_1.sw{TOKEN}.distcp"


def _records() -> tuple[SaveRecords, ChunkEntry]:
    records = SaveRecords(2, META, {"w": ("model", "w"), "b": ("model", "b"), "step": ("step",)})
    w = records.tensors["w"] = TensorEntry("float32", (4, 2), requires_grad=True)
    late = ChunkEntry((2, 0), (2, 2), DATA[1], (0, 900), (800, 16), [], 0, None, None)
    w.chunks += [
        ChunkEntry((0, 0), (2, 2), DATA[0], (0, 900), (800, 16), [7], 9, None, (2, 2)),
        late,
    ]
    b = records.tensors["b"] = TensorEntry("int16", (3,))
    b.chunks.append(ChunkEntry((0,), (3,), DATA[1], (900, 100), (960, 6), [11], 12, None, (3,)))
    records.objects["step"] = ObjectEntry(DATA[0], 900, 30, 1234)
    return records, late


def _read(folder: Path, metadata: bytes, manifest: bytes, index: bytes, name: str) -> Manifest:
    """The checkpoint of these records (data files of zeros, long enough for every
    range) as tools read it: every chunk from the index, checked."""
    folder.mkdir()
    (folder / ".metadata").write_bytes(metadata)
    (folder / "shardwise.json").write_bytes(manifest)
    (folder / name).write_bytes(index)
    for data in DATA:
        (folder / data).write_bytes(bytes(1000))
    return Manifest.read(folder)


def test_late_checksums_are_fields_filled_before_encoding(tmp_path: Path) -> None:
    records, late = _records()
    late.tile, late.crcs, late.frame = (2, 2), [5], 6
    metadata, text, index = records.records(INDEX)
    head = Manifest.from_json(text)
    assert head.to_json().encode() == text  # canonical
    assert (head.version, head.index) == (VERSION, IndexRef(INDEX, [0]))
    assert [t.chunks for t in head.tensors.values()] == [[], []]  # in the index, not listed
    assert head.metadata_crc32c == crc32c.crc32c(metadata)
    assert head.metadata_tail == (len(metadata), crc32c.crc32c(metadata[-4096:]))
    manifest = _read(tmp_path / "ck", metadata, text, index, INDEX)
    chunk = manifest.tensors["w"].chunks[1]
    assert (chunk.tile, chunk.crcs, chunk.frame) == ((2, 2), [5], 6)
    assert manifest.tensors["w"].chunks == records.tensors["w"].chunks
    assert manifest.tensors["b"].chunks == records.tensors["b"].chunks
    assert manifest.storage_meta == {"checkpoint_id": "/ck", "save_id": "s1", "modules": []}


def test_metadata_is_what_the_manifest_describes(tmp_path: Path) -> None:
    records, late = _records()
    late.tile, late.crcs, late.frame = (2, 2), [5], 6
    data, text, index = records.records(INDEX)
    assert data == records.metadata()
    stored = pickle.loads(data)
    seen = _read(tmp_path / "ck", data, text, index, INDEX).to_metadata()
    assert stored.state_dict_metadata == seen.state_dict_metadata
    assert stored.planner_data == seen.planner_data == records.planner_data
    assert stored.storage_meta == META
    infos = {(k.fqn, tuple(k.offset or ())): v for k, v in stored.storage_data.items()}
    assert (infos[("w", (2, 0))].relative_path, infos[("w", (2, 0))].offset) == (DATA[1], 0)
    assert (infos[("step", ())].offset, infos[("step", ())].length) == (900, 30)
    assert type(infos[("step", ())]).__name__ == "_StorageInfo"  # DCP's own class: stock reads it


def _split() -> tuple[SaveRecords, list[SaveRecords]]:
    """`_records()` whole, and its entries split between four owners' records (the
    third owning nothing)."""
    whole, late = _records()
    late.tile, late.crcs, late.frame = (2, 2), [5], 6
    owners = [SaveRecords(2, META, {}) for _ in range(4)]
    owners[0].tensors["w"] = whole.tensors["w"]
    owners[1].objects["step"] = whole.objects["step"]
    owners[3].tensors["b"] = whole.tensors["b"]
    return whole, owners


PLANNER = [{"w": ("model", "w")}, {"step": ("step",)}, {}, {"b": ("model", "b")}]


def _joined(tmp_path: Path, owners: list[SaveRecords]) -> tuple[bytes, bytes, bytes]:
    """`.metadata`, the manifest and the index joined from `owners`' parts."""
    folder = open_folder(tmp_path)
    for rank, (owner, mine) in enumerate(zip(owners, PLANNER)):
        write_part(folder, TOKEN, rank, owner.part(mine, rank))
    frame = SaveRecords(2, META, {}).draft()
    frame.set_planner_data({})
    names = join_records(folder, (len(owners), INDEX), TOKEN, META, frame, sync=False)
    return (*((tmp_path / n).read_bytes() for n in names), (tmp_path / INDEX).read_bytes())


def _placeless(manifest: Manifest) -> Manifest:
    """`manifest` without where its sections sit in its index (one writer's single
    block, or each owner's)."""
    manifest.index = None
    for t in manifest.tensors.values():
        t.section = None
    return manifest


def test_records_joined_from_owners_parts_are_the_whole_records(tmp_path: Path) -> None:
    """Each owner writes its keys' part; the committing rank joins bytes
    (`engine.records`): the same `.metadata` objects, and a manifest and index holding
    the same checkpoint, as one rank encoding every entry. Only where each section sits
    differs: one block per owner."""
    whole, owners = _split()
    metadata, manifest, index = _joined(tmp_path, owners)
    assert pickle.loads(metadata) == pickle.loads(whole.metadata())
    assert load_metadata(io.BytesIO(metadata)) == pickle.loads(metadata)  # and the safe reader
    head = Manifest.from_json(manifest)
    # w's section: 2 rows of 3 * 2 + 11 int64, 2 crcs; b's: 1 row of 3 + 11, 1 crc
    assert len(index) == 280 + 116
    assert head.index == IndexRef(INDEX, [0, 280, 280, 280])
    assert [t.section[:2] for t in head.tensors.values()] == [(0, 0), (3, 0)]  # type: ignore[index]
    assert (head.metadata_crc32c, head.metadata_tail) == (
        crc32c.crc32c(metadata),
        (len(metadata), crc32c.crc32c(metadata[-4096:])),
    )
    joined = _read(tmp_path / "joined", metadata, manifest, index, INDEX)
    assert joined.tensors["w"].chunks[1].crcs == [5]
    assert {k: t.chunks for k, t in joined.tensors.items()} == {
        k: t.chunks for k, t in whole.tensors.items()
    }
    one = _read(tmp_path / "one", *whole.records(INDEX), INDEX)
    # the pickles differ in bytes (each part pickles its own objects), not in what they hold
    one.metadata_crc32c, one.metadata_tail = head.metadata_crc32c, head.metadata_tail
    assert _placeless(joined) == _placeless(one)


def test_a_part_cut_short_is_refused_naming_it(tmp_path: Path) -> None:
    _, owners = _split()
    folder = open_folder(tmp_path)
    name = part_name(TOKEN, 1)
    write_part(folder, TOKEN, 1, owners[1].part({"step": ("step",)}, 1))
    whole = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(whole[:-3])
    frame = SaveRecords(2, META, {}).draft()
    frame.set_planner_data({})
    for rank in (0, 2, 3):
        write_part(folder, TOKEN, rank, owners[rank].part({}, rank))
    with pytest.raises(CorruptCheckpointError, match=f"{name}: a record part cut short"):
        join_records(folder, (4, INDEX), TOKEN, META, frame, sync=False)
    # the trailer whole but a byte of the sections missing
    (tmp_path / name).write_bytes(whole[:10] + whole[11:])
    with pytest.raises(CorruptCheckpointError, match=f"{name}: a record part whose sections"):
        join_records(folder, (4, INDEX), TOKEN, META, frame, sync=False)

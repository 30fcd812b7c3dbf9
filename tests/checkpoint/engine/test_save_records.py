"""`SaveRecords`: the one builder of `shardwise.json` and `.metadata`.

Both records come from the same entries, so they describe the same checkpoint:
the manifest's own DCP view equals the pickled `.metadata`, checksums filled in
late are encoded as if they were there from the start, and the plan's records
(`plan_records`) match what the engine wrote.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import crc32c
import pytest
from torch.distributed.checkpoint.metadata import StorageMeta

from shardwise import CorruptCheckpointError
from shardwise.checkpoint.engine.save_records import SaveRecords
from shardwise.checkpoint.format.manifest import Manifest, ObjectEntry, TensorEntry
from shardwise.checkpoint.format.manifest_fields import ChunkEntry
from shardwise.checkpoint.format.safe_pickle import load_metadata
from shardwise.checkpoint.io.record_join import join_records, part_name, write_part
from shardwise.storage import open_folder

META = StorageMeta(checkpoint_id="/ck", save_id="s1")


def _records() -> tuple[SaveRecords, ChunkEntry]:
    records = SaveRecords(2, META, {"w": ("model", "w"), "step": ("step",)})
    w = records.tensors["w"] = TensorEntry("float32", (4, 2), requires_grad=True)
    late = ChunkEntry((2, 0), (2, 2), "__1_0.distcp", (0, 900), (800, 16), [], 0, None, None)
    w.chunks += [
        ChunkEntry((0, 0), (2, 2), "__0_0.distcp", (0, 900), (800, 16), [7], 9, None, (2, 2)),
        late,
    ]
    records.objects["step"] = ObjectEntry("__0_0.distcp", 900, 30, 1234)
    return records, late


def test_late_checksums_are_fields_filled_before_encoding() -> None:
    records, late = _records()
    SaveRecords.fill(late, ((2, 2), [5], 6))
    text = records.manifest(99)
    manifest = Manifest.from_json(text)
    assert manifest.to_json().encode() == text  # canonical
    assert manifest.metadata_crc32c == 99
    chunk = manifest.tensors["w"].chunks[1]
    assert (chunk.tile, chunk.crcs, chunk.frame) == ((2, 2), [5], 6)
    assert manifest.storage_meta == {"checkpoint_id": "/ck", "save_id": "s1", "modules": []}


def test_metadata_is_what_the_manifest_describes() -> None:
    records, late = _records()
    SaveRecords.fill(late, ((2, 2), [5], 6))
    data = records.metadata()
    stored = pickle.loads(data)
    seen = Manifest.from_json(records.manifest(crc32c.crc32c(data))).to_metadata()
    assert stored.state_dict_metadata == seen.state_dict_metadata
    assert stored.planner_data == seen.planner_data == {"w": ("model", "w"), "step": ("step",)}
    assert stored.storage_meta == META
    infos = {(k.fqn, tuple(k.offset or ())): v for k, v in stored.storage_data.items()}
    assert (infos[("w", (2, 0))].relative_path, infos[("w", (2, 0))].offset) == (
        "__1_0.distcp",
        0,
    )
    assert (infos[("step", ())].offset, infos[("step", ())].length) == (900, 30)
    assert type(infos[("step", ())]).__name__ == "_StorageInfo"  # DCP's own class: stock reads it


def _split() -> tuple[SaveRecords, list[SaveRecords]]:
    """`_records()` whole, and its entries split between three owners' records (the
    last owning nothing)."""
    whole, late = _records()
    SaveRecords.fill(late, ((2, 2), [5], 6))
    owners = [SaveRecords(2, META, {}) for _ in range(3)]
    owners[0].tensors["w"] = whole.tensors["w"]
    owners[1].objects["step"] = whole.objects["step"]
    return whole, owners


def _joined(tmp_path: Path, owners: list[SaveRecords]) -> tuple[bytes, bytes]:
    folder = open_folder(tmp_path)
    planner = [{"w": ("model", "w")}, {"step": ("step",)}, {}]
    for rank, (owner, mine) in enumerate(zip(owners, planner)):
        write_part(folder, "0123456789ab", rank, owner.part(mine))
    frame = SaveRecords(2, META, {}).draft()
    frame.set_planner_data({})
    names = join_records(folder, len(owners), "0123456789ab", META, frame, sync=False)
    return tuple((tmp_path / n).read_bytes() for n in names)  # type: ignore[return-value]


def test_records_joined_from_owners_parts_are_the_whole_records(tmp_path: Path) -> None:
    """Each owner writes its keys' part; the committing rank joins bytes
    (`io.record_join`): the same `.metadata` objects and the same manifest, byte for
    byte, as one rank encoding every entry."""
    whole, owners = _split()
    metadata, manifest = _joined(tmp_path, owners)
    assert pickle.loads(metadata) == pickle.loads(whole.metadata())
    assert load_metadata(io.BytesIO(metadata)) == pickle.loads(metadata)  # and the safe reader
    assert manifest == whole.manifest(crc32c.crc32c(metadata))
    assert Manifest.from_json(manifest).tensors["w"].chunks[1].crcs == [5]


def test_a_part_cut_short_is_refused_naming_it(tmp_path: Path) -> None:
    _, owners = _split()
    folder = open_folder(tmp_path)
    name = part_name("0123456789ab", 1)
    write_part(folder, "0123456789ab", 1, owners[1].part({"step": ("step",)})[:-3])
    frame = SaveRecords(2, META, {}).draft()
    frame.set_planner_data({})
    for rank in (0, 2):
        write_part(folder, "0123456789ab", rank, owners[rank].part({}))
    with pytest.raises(CorruptCheckpointError, match=f"{name}: a record part whose sections"):
        join_records(folder, 3, "0123456789ab", META, frame, sync=False)

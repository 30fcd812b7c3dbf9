"""Random byte flips, truncations and deletions: every case detected, nothing wrong loads."""

from __future__ import annotations

import random

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import TAIL
from shardwise.errors import CorruptCheckpointError

from . import chaos

pytestmark = pytest.mark.spawned


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "ref"
    chaos.save_reference(path)
    return path


@pytest.mark.parametrize("kind", chaos.CORRUPTIONS)
def test_damage_is_always_detected(reference, tmp_path, kind):
    rng = random.Random(kind)
    for _ in range(8):
        outcome = chaos.corrupt_and_load(reference, tmp_path / "scratch", rng, kind)
        assert outcome.ok, outcome
        assert not outcome.load.startswith("loaded WRONG"), outcome


@pytest.mark.parametrize("before", [True, False], ids=["before the tail", "in the tail"])
def test_metadata_damage_a_load_never_reads_is_for_verify(tmp_path, before):
    """A version 4 load checks `.metadata`'s size and last `TAIL` bytes (its save id), never
    all of it (every rank would read it): a flip before them leaves what shardwise reads
    intact, so the load is right and `verify`, checking the full checksum, reports it; a
    flip in them is refused by the load (and by `verify`) as damage, never followed: here
    it turns the field name `save_id` into `s`ve_id`, a `StorageMeta` that DCP never wrote
    (issue 35: refused as such, not loaded with the field missing)."""
    state = {f"t{i}": torch.full((2,), float(i)) for i in range(200)}
    swc.save(state, tmp_path)
    data = bytearray((tmp_path / ".metadata").read_bytes())
    assert len(data) > 2 * TAIL
    data[len(data) - TAIL - 100 if before else len(data) - 100] ^= 0x01
    (tmp_path / ".metadata").write_bytes(bytes(data))
    where = tmp_path / ".metadata"
    damaged = (
        f"{where} does not match the manifest beside it (a checksum mismatch) and cannot be "
        f"read: {where}: storage_meta: a StorageMeta that holds 's`ve_id', no field of DCP's "
        "(damaged or crafted, or written by a newer PyTorch than this one): refused"
    )
    got = {k: torch.zeros(2) for k in state}
    if before:
        swc.load(got, tmp_path)
        assert all(torch.equal(got[k], v) for k, v in state.items())
        assert swc.verify(tmp_path, raise_on_error=False) == [
            f"{where} does not match the manifest's checksum: damaged, or a save was "
            "interrupted between its two records; stock DCP readers see something else "
            "than shardwise readers"
        ]
    else:
        with pytest.raises(CorruptCheckpointError) as info:
            swc.load(got, tmp_path)
        assert str(info.value) == damaged
        assert swc.verify(tmp_path, raise_on_error=False) == [f"{tmp_path}: {damaged}"]

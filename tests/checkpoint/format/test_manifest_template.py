"""The manifest encoded ahead of its checksums: filled, it is `Manifest.to_json()` exactly."""

from __future__ import annotations

import random

import pytest

from shardwise.checkpoint.format.manifest import Manifest, ObjectEntry, TensorEntry
from shardwise.checkpoint.format.manifest_entries import ChunkEntry
from shardwise.checkpoint.format.manifest_template import ManifestTemplate


def _manifest(keys: list[str], transform: bool = False) -> Manifest:
    tensors = {}
    for i, key in enumerate(keys):
        chunks = [
            ChunkEntry(
                (r * 2, 0), (2, 3), f"__{r}_0.distcp", (100 * r, 90), (100 * r + 60, 24), [], 0
            )
            for r in range(2)
        ]
        if transform and i == 0:
            chunks[0] = ChunkEntry((0, 0), (2, 3), "__0_0.distcp", (0, 50), None, [7], 0, ["zstd"])
        tensors[key] = TensorEntry("float32", (4, 3), chunks, requires_grad=i % 2 == 0)
    objects = {"step": ObjectEntry("__0_0.distcp", 500, 12, 1234)}
    m = Manifest(world_size=2, tensors=tensors, objects=objects, dcp_version="1.0.0")
    m.storage_meta = {"checkpoint_id": "/c", "save_id": "s", "modules": []}
    m.set_planner_data({k: [k] for k in keys})
    return m


def _fill(m: Manifest, seed: int) -> None:
    rng = random.Random(seed)
    m.metadata_crc32c = rng.randrange(1, 2**32)
    for t in m.tensors.values():
        for c in t.chunks:
            if c.transform is None:
                c.tile, c.crcs, c.frame = (
                    (1, 3),
                    [rng.randrange(2**32) for _ in range(2)],
                    rng.randrange(2**32),
                )


@pytest.mark.parametrize(
    "keys, transform, holed",
    [
        (["a.w", "b.w", "é/x"], False, True),
        (["a.w", "b\x00late\x00w"], False, True),  # holes are whole strings only
        (["a.w", "\x00late\x00"], False, False),  # a key spelling a hole: encoded whole
        (["a.w", "b.w"], True, False),  # a transformed chunk: encoded whole
    ],
)
def test_filled_template_is_to_json_byte_for_byte(keys, transform, holed):
    m = _manifest(keys, transform)
    template = ManifestTemplate(m)
    assert (template._parts is not None) is holed
    chunks = [c for t in m.tensors.values() for c in t.chunks if c.transform is None]
    assert all(c.crcs == [] and c.tile is None for c in chunks)  # left as they were
    _fill(m, seed=len(keys))
    text = template.fill()
    assert text == m.to_json()
    assert Manifest.from_json(text).tensors == m.tensors


def test_a_zero_metadata_crc_is_encoded_whole():
    m = _manifest(["a"])
    template = ManifestTemplate(m)
    _fill(m, seed=1)
    m.metadata_crc32c = 0
    assert template.fill() == m.to_json()

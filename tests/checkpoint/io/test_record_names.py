"""The names of records and data files (`io.commit`): whose each name is, and whether a
folder already holds a checkpoint."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.checks import DATA_FILE
from shardwise.checkpoint.io.commit import (
    GLOBAL_RECORDS,
    RecordNames,
    already_exists,
    data_file_name,
    holds_checkpoint,
    in_the_way,
    leftover_data,
    new_token,
    per_rank_records,
)


def _state(seed: int) -> dict:
    return {"w": torch.full((4, 3), float(seed)), "step": seed}


def test_only_a_checkpoint_or_a_file_is_in_the_way(tmp_path):
    assert in_the_way(tmp_path / "missing") is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    assert in_the_way(tmp_path / "other") is None
    swc.save(_state(1), tmp_path / "ckpt")
    assert "pass overwrite=True" in (in_the_way(tmp_path / "ckpt") or "")
    (tmp_path / "model.pt").write_bytes(b"")
    assert in_the_way(tmp_path / "model.pt") is None
    assert "pass overwrite=True" in (in_the_way(tmp_path / "model.pt", files=True) or "")


TOKEN = "0123456789ab"


def test_data_file_names_round_trip_through_the_data_file_pattern():
    name = data_file_name("__3_", 7, TOKEN)
    assert name == "__3_7.sw0123456789ab.distcp"
    m = DATA_FILE.fullmatch(name)
    assert m is not None and m.groups() == ("3", "7", TOKEN)


def test_tokens_are_twelve_hex_digits_and_fresh():
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(len(t) == 12 and set(t) <= set("0123456789abcdef") for t in tokens)


def test_record_names_of_each_scope():
    assert (GLOBAL_RECORDS.metadata, GLOBAL_RECORDS.manifest, GLOBAL_RECORDS.lock) == (
        ".metadata",
        "shardwise.json",
        ".shardwise.lock",
    )
    two = RecordNames(2)
    assert (two.metadata, two.manifest, two.lock) == (
        "__2.metadata",
        "__2.shardwise.json",
        "__2.shardwise.lock",
    )


@pytest.mark.parametrize(
    "name, owners",
    [
        ("__2_0.sw0123456789ab.distcp", {None, 2}),
        ("__3_5.sw0123456789ab.distcp", {None, 3}),
        ("__2_0.distcp", set()),  # stock's name: no token says which save wrote it
        ("__2_0.sw0123456789AB.distcp", set()),
        ("__2_0.sw0123456789ab.distcp\n", set()),
        ("__2_0.sw0123456789a.distcp", set()),
        ("notes.sw0123456789ab.tmp", set()),
        ("__2.metadata", set()),
    ],
)
def test_a_scope_owns_only_its_token_named_data(name, owners):
    assert {r for r in (None, 2, 3) if RecordNames(r).owns(name)} == owners


def test_per_rank_records_and_leftovers_are_found_by_name(tmp_path):
    names = [
        "__0.metadata",
        "__3.shardwise.json",
        "__x.metadata",
        "__1.metadata.sw0123456789ab.tmp",
        ".metadata",
        "__1_0.sw0123456789ab.distcp",
        "__0_2.sw0123456789ab.distcp",
        "__0_0.distcp",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert per_rank_records(tmp_path) == [RecordNames(0), RecordNames(3)]
    assert leftover_data(tmp_path) == ["__0_2.sw0123456789ab.distcp", "__1_0.sw0123456789ab.distcp"]


@pytest.mark.parametrize(
    "name, holds",
    [
        (".metadata", True),
        ("shardwise.json", True),
        (".shardwise", True),  # the marker: an interrupted first save
        ("__0.metadata", True),  # a per-rank checkpoint
        ("__5.metadata", False),  # rank 0 always writes one: only its record counts
        (".shardwise.lock", False),
        ("__0_0.sw0123456789ab.distcp", False),
    ],
)
def test_what_makes_a_folder_hold_a_checkpoint(tmp_path, name, holds):
    (tmp_path / name).write_bytes(b"x")
    assert holds_checkpoint(tmp_path) == holds


def test_already_exists_names_the_fix(tmp_path):
    assert already_exists(tmp_path) == (
        f"Checkpoint already exists at {tmp_path}; pass overwrite=True to replace it"
    )
    (tmp_path / "model.pt").write_bytes(b"")
    assert already_exists(tmp_path / "model.pt") == (
        f"{tmp_path / 'model.pt'} already exists; pass overwrite=True"
    )

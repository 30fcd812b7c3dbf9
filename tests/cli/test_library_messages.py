"""What the library says where a user is lost (issue 40): a wrong key, a load that
restores nothing, DCP's `checkpoint_id=`, a `LoadInfo` read at a prompt. Here beside the
CLI tests, which print the same messages."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import InvalidArgumentError, InvalidTypeError
from shardwise.cli import main


@pytest.fixture
def ckpt(tmp_path) -> Path:
    state = {f"layer{i:02d}.weight": torch.full((2,), float(i)) for i in range(12)}
    swc.save({**state, "trainer": {"step": 3}}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


# -- a wrong key: did you mean, and what is stored -------------------------------------


def test_a_wrong_key_suggests_the_near_ones_and_lists_the_stored(ckpt):
    with pytest.raises(KeyError) as e:
        swc.read_tensor(ckpt, "layer03.wieght")
    listed = ", ".join(f"'layer{i:02d}.weight'" for i in range(10))
    assert e.value.args[0] == (
        f"no tensor 'layer03.wieght' in {ckpt}; did you mean 'layer03.weight' or "
        f"'layer10.weight' or 'layer09.weight'? its tensors: {listed}, ... and 2 more"
    )


def test_a_key_near_nothing_lists_the_stored_keys_only(tmp_path):
    swc.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(KeyError) as e:
        swc.read_tensor(tmp_path / "ckpt", "completely.different")
    assert (
        e.value.args[0]
        == f"no tensor 'completely.different' in {tmp_path / 'ckpt'}; its tensors: 'w'"
    )


def test_the_cli_prints_the_suggestion_on_one_line(ckpt, capsys, monkeypatch):
    # no command takes a key yet but reshard's --layout (its own check); a read that
    # misses inside a command reaches the user as this one line
    def read_a_wrong_key(args):
        swc.read_tensor(args.path, "trainer.stpe")

    monkeypatch.setattr("shardwise.cli.inspect.main", read_a_wrong_key)
    assert main(["inspect", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise inspect: error: no tensor 'trainer.stpe' in {ckpt}; its ")
    assert err.count("\n") == 1


# -- LoadInfo: a short repr, the details in its fields ----------------------------------


def test_load_info_repr_is_a_short_summary(ckpt):
    target = {f"layer{i:02d}.weight": torch.zeros(2) for i in range(12)}
    info = swc.load(target, ckpt)
    text = repr(info)
    assert re.fullmatch(
        rf"LoadInfo\(path={re.escape(repr(info.path))}, seconds=\d+\.\d{{3}}, "
        rf"bytes_read={info.bytes_read}, manifest=<12 tensors, 1 objects, saved by 1 ranks: "
        r"'layer00\.weight', 'layer01\.weight', 'layer02\.weight', \.\.\. and 10 more>\)",
        text,
    ), text
    assert info.manifest is not None and len(info.manifest.tensors) == 12  # details kept


def test_load_info_repr_of_a_stock_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "stock")
    info = swc.load({"w": torch.zeros(2)}, tmp_path / "stock")
    assert repr(info).endswith(", manifest=None (stock DCP .metadata))")


# -- checkpoint_id=, as DCP names the path ----------------------------------------------


def test_checkpoint_id_is_the_path_for_save_and_load(tmp_path):
    swc.save({"w": torch.arange(3.0)}, checkpoint_id=tmp_path / "ckpt")
    target = {"w": torch.zeros(3)}
    info = swc.load(target, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(target["w"], torch.arange(3.0)) and info.path == tmp_path / "ckpt"
    future = swc.async_save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "a")
    assert future.result().path == tmp_path / "a"


def test_a_path_given_twice_or_never_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"^save\(\) got both a path"):
        swc.save({"w": torch.ones(1)}, tmp_path / "a", checkpoint_id=tmp_path / "b")
    with pytest.raises(InvalidTypeError, match=r"^load\(\) needs the checkpoint's path"):
        swc.load({"w": torch.ones(1)})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- a load that restores no optimizer state says so ------------------------------------


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(steps):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.fixture
def trained(tmp_path) -> Path:
    model, optimizer = _trained(1)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    swc.save(state, tmp_path / "trained")
    return tmp_path / "trained"


def test_a_fresh_optimizer_warns_that_its_stored_state_went_unused(trained, caplog):
    model, optimizer = _trained(0)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        swc.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, trained)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "shardwise",
            logging.WARNING,
            "6 stored values went unused (e.g. 'optim.state.0.step', 'optim.state.0.exp_avg', "
            "'optim.state.0.exp_avg_sq'): the state dict holds an empty 'optim.state' where "
            "they go, as an optimizer has before its first step, so nothing was restored "
            "there. Call shardwise.checkpoint.init_optimizer_state(optimizer) before "
            "building the state dict and loading (or build it with "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), which "
            "initialises the optimizer state too)",
        )
    ]


def test_the_fix_the_warning_names_restores_the_state(trained, caplog):
    model, optimizer = _trained(0)
    swc.init_optimizer_state(optimizer)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        swc.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, trained)
    assert caplog.records == []
    _, stepped = _trained(1)
    for p, q in zip(optimizer.param_groups[0]["params"], stepped.param_groups[0]["params"]):
        mine, theirs = optimizer.state[p], stepped.state[q]
        assert sorted(mine) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_stepped_optimizer_or_a_model_alone_loads_without_a_warning(trained, caplog):
    model, optimizer = _trained(1)
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        swc.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, trained)
        swc.load({"model": model.state_dict()}, trained)  # stored keys not asked for: fine
    assert caplog.records == []

"""Each key planned by its owner (`engine.plan`): the same checks and errors on every
rank, and traffic per rank that does not grow with the world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise import InvalidArgumentError, Layout, ShardedTensor, ShardMismatchError
from shardwise.checkpoint.engine import plan as plan_cache
from shardwise.checkpoint.engine.plan import owner_of
from shardwise.checkpoint.engine.save import save_state
from shardwise.comm.agreement import Agreement
from shardwise.comm.communicator import SingleProcess

from ...comm.threaded_world import ThreadedWorld


@pytest.fixture(autouse=True)
def _fresh() -> None:
    plan_cache.forget()


def test_owners_problems_reach_every_rank_as_one_error(tmp_path: Path) -> None:
    # two keys whose ranks disagree, owned by different ranks of three
    keys = ["a", "b", "c", "d", "e", "f"]
    bad = [k for k in keys if owner_of(k, 3) == 1][:1] + [k for k in keys if owner_of(k, 3) == 2][
        :1
    ]
    assert len(bad) == 2

    def state(rank: int) -> dict:
        out = {k: torch.zeros(2) for k in keys}
        if rank == 2:  # rank 2 holds `bad` in another dtype
            out.update({k: torch.zeros(2, dtype=torch.int64) for k in bad})
        return out

    world = ThreadedWorld(3)
    errors = world.run(lambda comm: save_state(state(comm.rank), tmp_path, Agreement(comm)))
    assert all(isinstance(e, ShardMismatchError) for e in errors)
    assert len({str(e) for e in errors}) == 1  # the same message on every rank
    message = str(errors[0])
    for key in bad:  # in owner order, each naming the key and both dtypes
        assert f"'{key}': rank 0 holds a tensor of dtype float32" in message
        assert message.count(f"'{key}'") == 1
    assert message.index(f"'{bad[0]}'") < message.index(f"'{bad[1]}'")
    assert not list(tmp_path.glob("*.distcp"))  # nothing written


def _planning_bytes(world_size: int, tensors: int, folder: Path) -> int:
    """The bytes a rank received on average while saving `tensors` FSDP-style tensors
    (row-sharded over every rank) with `world_size` thread ranks. (The most any rank
    receives varies with how many keys the hash gives it.)"""
    world = ThreadedWorld(world_size)

    def save(comm) -> None:
        layout = Layout.chunked((4 * world_size, 8), 0, world_size)
        state = {
            f"layer{i}.w": ShardedTensor.from_layout(
                layout, [torch.full((4, 8), float(i))], rank=comm.rank
            )
            for i in range(tensors)
        }
        save_state(state, folder, Agreement(comm))

    assert world.run(save) == [None] * world_size
    return sum(world.received[1:]) // (world_size - 1)  # rank 0 also gets the records


def test_the_traffic_of_a_rank_does_not_grow_with_the_world(tmp_path: Path) -> None:
    """With every inventory sent to every rank, 16 ranks would each receive four times
    what 4 ranks do; through key owners each receives about one inventory's worth, plus
    a few dozen bytes per rank and route (each message's own pickle)."""
    small = _planning_bytes(4, 256, tmp_path / "4")
    large = _planning_bytes(16, 256, tmp_path / "16")
    assert large < 1.5 * small, (small, large)


def test_a_key_no_codec_can_encode_has_an_owner(tmp_path: Path) -> None:
    """A lone surrogate (a file name decoded with `surrogateescape`) is a valid key:
    hashing it never raises on one rank while the others wait in a collective."""
    odd = "b\udc80"

    def state(rank: int) -> dict:
        return {"a": torch.ones(2), **({odd: torch.full((3,), 5.0)} if rank == 1 else {})}

    world = ThreadedWorld(2)
    assert world.run(lambda comm: save_state(state(comm.rank), tmp_path, Agreement(comm))) == [
        None,
        None,
    ]
    got = dcp_load({"a": torch.zeros(2), odd: torch.zeros(3)}, tmp_path)
    assert torch.equal(got[odd], torch.full((3,), 5.0))


def test_a_state_keyed_tuple_saves_unless_its_planner_data_would_read_back_wrong(
    tmp_path: Path,
) -> None:
    both = {"__tuple__": torch.ones(2), "b": torch.zeros(1)}
    save_state(both, tmp_path / "both", Agreement(SingleProcess()))
    assert torch.equal(
        dcp_load({"__tuple__": torch.zeros(2)}, tmp_path / "both")["__tuple__"], torch.ones(2)
    )
    with pytest.raises(InvalidArgumentError, match="whose only key is '__tuple__'"):
        save_state({"__tuple__": torch.ones(2)}, tmp_path / "one", Agreement(SingleProcess()))
    assert not (tmp_path / "one" / "shardwise.json").exists()


def dcp_load(target: dict, path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target

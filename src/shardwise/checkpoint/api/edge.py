"""What every entry point does at the API edge, before the engine runs: the folder
opened, the caller's `Stateful` values read, and one exchange (`agree_route`)
that raises any rank's problem so far on every rank and puts every rank on the
same route (by Megatron key or by dict path, the same adapted values).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ...comm.agreement import Agreement, digest, require_same
from ...comm.communicator import Communicator, SingleProcess, communicator
from ...errors import (
    ShardwiseError,
)
from ...storage import Folder, open_folder
from ..clients.megatron_returned import holds_megatron
from ..engine.adapters import held_adapted, require_same_adapted


@dataclass(frozen=True)
class SaveInfo:
    """What `save` returns: where the checkpoint is (a `Path`, or the URL) and how
    long the save took."""

    path: Path | str
    seconds: float


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_stateful(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and isinstance(value, Stateful)


def _state_dicts_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level `Stateful` values (a model, an optimizer wrapper) replaced by
    their `state_dict()`, as `dcp.save` does, before anything looks inside."""
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state_dict.items()}


def _user_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], BaseException | None]:
    """`_state_dicts_of`, with a failure of the caller's `state_dict()` returned, not
    raised: it rides on the first exchange, so every rank raises it together (a rank
    raising alone would leave the others waiting in a collective)."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if not _is_stateful(value):
            out[key] = value
            continue
        try:
            out[key] = value.state_dict()
        except Exception as e:  # noqa: BLE001 - the caller's own code: raised on every rank
            return {}, e
    return out, None


def _comm(process_group: Any) -> Communicator:
    return communicator(process_group) if _distributed(process_group) else SingleProcess()


def open_target(
    path: str | Path | Folder, storage_options: dict[str, Any] | None
) -> tuple[Folder | None, BaseException | None]:
    """`open_folder`, its refusal (an unknown scheme, a missing backend) returned for
    `agree_route` to raise on every rank."""
    try:
        return open_folder(path, storage_options), None
    except ShardwiseError as e:
        return None, e


def agreement(group: Any, arguments: tuple[str, Any]) -> Agreement:
    """The agreement of one collective call, made at its edge and carried through the
    engine: `arguments` (what they are, this rank's value) must be the same on every
    rank, checked at the first exchange."""
    return Agreement(_comm(group), arguments)


def agree_route(
    state_dict: Any,
    megatron: bool,
    agreement: Agreement,
    problem: BaseException | None,
    statefuls: tuple[str, ...] = (),
) -> bool:
    """The edge's one exchange (one fixed-size `all_reduce`; the values gathered only
    when they differ, to name the ranks): whether this save or load goes by Megatron key
    (`megatron=True`, or a Megatron value on any rank), checked so that every rank
    takes the same route. On it the ranks' top-level `Stateful` keys must agree; off
    it, their adapted values too (`engine.adapters`). `problem` (this rank's failure
    so far: the folder, a `state_dict()`) is raised on every rank by the exchange,
    and the call's arguments are compared there (`agreement`)."""
    by_key = megatron or holds_megatron(state_dict)
    agreement.defer(problem)
    if agreement.world_size == 1:
        agreement.exchange()  # raises `problem`; nothing to compare with another rank
        return by_key
    held = None if by_key or problem is not None else held_adapted(state_dict, statefuls)
    mine = digest((statefuls, held))
    agreed = agreement.agree([int(by_key), mine, -mine])
    if agreed[1] == -agreed[2]:  # every rank holds the same: one all_reduce said so
        return bool(agreed[0])
    everyone = agreement.exchange((by_key, statefuls, held))  # to name what differs
    if any(b for b, _s, _h in everyone):
        require_same(
            [s for _b, s, _h in everyone],
            "their Stateful values",
            shown=str,
            verb="hold",
            fix="every rank must pass the same Stateful keys",
        )
        return True
    require_same_adapted([h for _b, _s, h in everyone])
    return False

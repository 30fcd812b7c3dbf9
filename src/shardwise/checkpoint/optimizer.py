"""An optimizer's state made before a load, so the load has targets to fill.

A torch optimizer creates its state (Adam's moments and step counters, SGD's
momentum buffers) in its first `step()`. Before that, `optimizer.state_dict()["state"]`
is empty and a load restores nothing into it (`swc.load` warns). DCP's
`get_state_dict(model, optimizer)` works around this by stepping once with zero
gradients, which leaves the step counters at 1 and, with weight decay, moves the
moments. `init_optimizer_state` does the same step at a learning rate of zero, for
the parameters without state only, and then zeroes the state it made: for the
optimizers it accepts, exactly the state their first step starts from, in each
parameter's own layout (a `ShardedTensor` parameter gets `ShardedTensor` state).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UsageError

__all__ = ["init_optimizer_state"]

# Optimizers whose first step starts from all-zero state (tensors and step counters),
# so "step at lr 0, then zero what it made" is their fresh state. Others derive state
# from the learning rate or start it elsewhere (Rprop's step sizes, ASGD's eta and mu,
# NAdam's mu_product): refused rather than given wrong state.
_ZERO_START = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    torch.optim.Adagrad,
    torch.optim.SGD,
)


def _check(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if not isinstance(optimizer, _ZERO_START):
        accepted = ", ".join(c.__name__ for c in _ZERO_START)
        raise UsageError(
            f"init_optimizer_state: {name}'s first step does not start from zero state "
            f"(accepted: {accepted}); build the state dict with torch.distributed.checkpoint."
            "state_dict.get_state_dict(model, optimizer) instead"
        )
    for i, group in enumerate(optimizer.param_groups):
        if "lr" not in group:
            raise UsageError(f"init_optimizer_state: {name}'s param group {i} has no 'lr'")
        if isinstance(optimizer, torch.optim.SGD) and group.get("momentum") and group["dampening"]:
            raise UsageError(
                f"init_optimizer_state: SGD with dampening (param group {i}) starts its "
                "momentum buffer from the first gradient, not from zero"
            )


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state `optimizer`'s first `step()` would start from, for the
    parameters that have none, so that `swc.load` (or `dcp.load`) can fill it in
    place. Parameters, gradients, learning rates and any state already there are left
    as they were, so a resume path may call it before or after a load, or on a fresh
    start. Local: no collective for shardwise's tensors.

    Accepts Adam, AdamW, Adamax, RAdam, Adadelta, Adagrad and SGD (without dampening),
    and their subclasses: their fresh state is all zeros. Raises `UsageError` for
    another optimizer, a param group without a learning rate, or a parameter without
    state that already has a gradient (a step now would apply it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    todo = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not todo:
        return
    _check(optimizer)
    held = [i for i, p in enumerate(params) if p.grad is not None and not optimizer.state.get(p)]
    if held:
        raise UsageError(
            f"init_optimizer_state: parameters {held[:5]} have gradients but no state yet; "
            "call it before the first backward (or zero_grad(set_to_none=True) first)"
        )
    grads = [p.grad for p in params]
    fresh = {id(p) for p in todo}
    rates = [group["lr"] for group in optimizer.param_groups]
    made: list[Any] = []
    try:
        for group in optimizer.param_groups:  # a tensor rate stays a tensor (capturable)
            lr = group["lr"]
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        for p in params:  # only parameters without state step: the others keep theirs
            p.grad = torch.zeros_like(p) if id(p) in fresh else None
        made = todo
        with torch.no_grad():
            optimizer.step()
        for p in made:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif key == "step" and isinstance(value, (int, float)):
                    state[key] = type(value)(0)
    except BaseException:
        for p in made:  # half-made state would turn the next call into a no-op
            optimizer.state.pop(p, None)
        raise
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad

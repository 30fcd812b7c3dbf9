"""An optimizer's state made before a load, so the load has targets to fill.

A torch optimizer creates its state (Adam's moments and step counters, SGD's
momentum buffers) in its first `step()`. Before that, `optimizer.state_dict()["state"]`
is empty and a load restores nothing into it (`swc.load` warns). DCP's
`get_state_dict(model, optimizer)` works around this by stepping once with zero
gradients, which leaves the step counters at 1 and, with weight decay, moves the
moments. `init_optimizer_state` does the same step at a learning rate of zero and then
zeroes every state tensor: the state a fresh optimizer's first step would start from,
in each parameter's own layout (a `ShardedTensor` parameter gets `ShardedTensor` state).
"""

from __future__ import annotations

import torch

from ..errors import UsageError

__all__ = ["init_optimizer_state"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create `optimizer`'s state as its first `step()` would, zeroed, so that
    `swc.load` (or `dcp.load`) can fill it in place. Parameters, gradients and
    learning rates are left as they were. Local: no collective, unless a parameter's
    own `zeros_like` or the optimizer's `step` is one (not for shardwise's tensors).

    Does nothing when every trainable parameter has state already (the optimizer has
    stepped, was loaded, or makes its state at construction, as Adagrad does), so a
    resume path may call it unconditionally. Raises `UsageError` when a parameter
    without state has a gradient: a step now would apply it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params if p.requires_grad):
        return
    held = [i for i, p in enumerate(params) if p.grad is not None]
    if held:
        raise UsageError(
            f"init_optimizer_state: parameters {held[:5]} already have gradients; call it "
            "before the first backward (or zero them with zero_grad(set_to_none=True))"
        )
    rates = [group.get("lr") for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if "lr" in group:  # a tensor learning rate stays a tensor (capturable optimizers)
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            optimizer.step()
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None

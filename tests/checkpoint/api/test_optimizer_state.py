"""`swc.init_optimizer_state`: an optimizer's state made before a load, zeroed, in each
parameter's own layout; parameters, gradients and learning rates untouched (issue 40, 4)."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor, UsageError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))


@pytest.mark.parametrize(
    "make, keys",
    [
        (
            lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.5),
            ["exp_avg", "exp_avg_sq", "step"],
        ),
        (
            lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
            ["exp_avg", "exp_avg_sq", "step"],
        ),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
            ["momentum_buffer"],
        ),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), ["step", "sum"]),
    ],
    ids=["adam", "adamw", "sgd", "adagrad"],
)
def test_state_made_zeroed_and_nothing_else_moves(make, keys):
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make(model.parameters())
    swc.init_optimizer_state(optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
        state = optimizer.state[p]
        assert sorted(state) == keys
        if "sum" in state:  # Adagrad's accumulator starts at initial_accumulator_value (0)
            assert not state["sum"].any()
        assert all(not v.any() for v in state.values() if isinstance(v, torch.Tensor))


def test_a_fresh_step_after_it_equals_a_fresh_optimizers_first_step():
    made, fresh = _model(), _model()
    a = torch.optim.Adam(made.parameters(), lr=0.1)
    b = torch.optim.Adam(fresh.parameters(), lr=0.1)
    swc.init_optimizer_state(a)
    for model, opt in ((made, a), (fresh, b)):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    for p, q in zip(made.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(a.state[p][k], b.state[q][k]) for k in b.state[q])


def test_sharded_parameters_get_sharded_state_that_a_load_fills(tmp_path):
    layout = Layout.row_wise((6, 2), [6])
    values = torch.arange(12.0).reshape(6, 2)

    def table() -> torch.nn.Parameter:
        return torch.nn.Parameter(ShardedTensor.from_layout(layout, [values.clone()]))

    trained = table()
    opt = torch.optim.Adam([trained], lr=0.1, foreach=False)
    (trained * 3).sum().backward()
    opt.step()
    swc.save({"optim": opt.state_dict()}, tmp_path / "c")

    fresh = table()
    target = torch.optim.Adam([fresh], lr=0.1, foreach=False)
    swc.init_optimizer_state(target)
    assert isinstance(target.state[fresh]["exp_avg"], ShardedTensor)
    swc.load({"optim": target.state_dict()}, tmp_path / "c")
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(
            target.state[fresh][k].full_tensor(), opt.state[trained][k].full_tensor()
        )
    assert float(target.state[fresh]["step"]) == 1.0


def test_refused_with_a_gradient_and_a_no_op_once_there_is_state():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(UsageError, match=r"parameters \[0, 1, 2, 3\] have gradients but no state"):
        swc.init_optimizer_state(optimizer)
    optimizer.step()
    stepped = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    swc.init_optimizer_state(optimizer)  # the state is there: nothing to create, nothing zeroed
    for p, state in optimizer.state.items():
        assert all(torch.equal(v, stepped[id(p)][k]) for k, v in state.items())
    assert all(p.grad is not None for p in model.parameters())


def test_state_already_there_is_kept_when_other_parameters_get_theirs():
    """A parameter group added after training (or a parameter that never had a gradient
    in the run that saved) gets fresh state; the trained state beside it is untouched."""
    a = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([a], lr=0.1)
    (a * 2).sum().backward()
    optimizer.step()
    trained = {k: v.clone() for k, v in optimizer.state[a].items()}
    a_before = a.detach().clone()
    b = torch.nn.Parameter(torch.full((2,), 5.0))
    optimizer.add_param_group({"params": [b], "lr": 0.5})
    swc.init_optimizer_state(optimizer)
    assert all(torch.equal(optimizer.state[a][k], trained[k]) for k in trained)
    assert float(trained["step"]) == 1.0 and trained["exp_avg"].any()
    assert torch.equal(a, a_before) and torch.equal(b, torch.full((2,), 5.0))
    assert sorted(optimizer.state[b]) == ["exp_avg", "exp_avg_sq", "step"]
    assert not any(v.any() for v in optimizer.state[b].values())
    assert a.grad is not None and b.grad is None  # a's gradient from before, as it was
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5]


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda ps: torch.optim.Rprop(ps), "Rprop's first step does not start from zero state"),
        (lambda ps: torch.optim.NAdam(ps), "NAdam's first step does not start from zero state"),
        (lambda ps: torch.optim.ASGD(ps), "ASGD's first step does not start from zero state"),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
            r"SGD with dampening \(param group 0\)",
        ),
    ],
    ids=["rprop", "nadam", "asgd", "sgd-dampening"],
)
def test_optimizers_whose_fresh_state_is_not_zero_are_refused(make, why):
    model = _model()
    optimizer = make(model.parameters())
    with pytest.raises(UsageError, match=why):
        swc.init_optimizer_state(optimizer)
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_a_failed_step_leaves_no_half_made_state_and_restores_rates():
    model = _model()
    rate = torch.tensor(0.25)
    optimizer = torch.optim.Adam(model.parameters(), lr=rate)

    def broken(*args, **kwargs):
        for p in model.parameters():
            optimizer.state[p]["step"] = torch.tensor(1.0)  # made, then the step fails
        raise RuntimeError("step failed")

    optimizer.step = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="step failed"):
        swc.init_optimizer_state(optimizer)
    assert not optimizer.state
    assert optimizer.param_groups[0]["lr"] is rate
    assert all(p.grad is None for p in model.parameters())

"""The training-loop pattern for `async_save(staging="background")` in docs/gpu.md
runs as written (on the GPU when there is one) and its last checkpoint holds the
final parameters, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import shardwise.checkpoint as swc

PAGE = Path(__file__).resolve().parents[3] / "docs" / "gpu.md"


def _pattern() -> str:
    text = PAGE.read_text()
    return re.search(r"The training loop:\n\n```python\n(.*?)```", text, re.S).group(1)


def test_the_documented_training_loop_saves_what_the_model_holds(tmp_path: Path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [torch.randn(8, 64, device=device) for _ in range(201)]
    state_dict = {"model": model.state_dict()}
    code = _pattern().replace('f"ckpt/step_{step}"', f'f"{tmp_path}/step_{{step}}"')
    scope = {"model": model, "optimizer": optimizer, "loader": loader, "state_dict": state_dict}
    exec(compile(code, "docs/gpu.md training loop", "exec"), scope)
    scope["pending"].result()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0", "step_100", "step_200"]
    got = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    swc.load(got, tmp_path / "step_200")
    assert all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items())
    first = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    swc.load(first, tmp_path / "step_0")
    assert not torch.equal(first["model"]["weight"], model.weight.detach())  # trained since

"""A real Megatron-Core `GPTModel` + Adam through `swc.save` / `swc.load`, against
Megatron's own `dist_checkpointing.save` / `.load` of the same state, on CPU gloo ranks.

The state is what Megatron's training checkpoints (`megatron_gpt.state_dict`):
`model` (or `model0`, `model1`), the optimizer's sharded state, `iteration`,
`args`, ... A checkpoint saved at one layout (by swc or by Megatron) is loaded at
another by both, into freshly built models; three things are checked, so that
neither side can be wrong unnoticed, nor both wrong the same way:

- Megatron's load returns the global values (`wrong_values`: the harness is sound);
- swc's load filled the state dict in place with the global values, the model's
  parameters included;
- `unwrapped(state after swc.load)` equals Megatron's return, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tests.clients.conftest import require

require("megatron.core.dist_checkpointing")

import pytest  # noqa: E402

import shardwise.checkpoint as swc  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402
from tests.clients.megatron_gpt import (  # noqa: E402
    Setup,
    args_of,
    build,
    differences,
    global_shapes,
    global_value,
    model_state,
    padded_vocab_size,
    rng_state,
    setup_parallel,
    sharded_leaves,
    state_dict,
    unwrapped,
    wrong_values,
)

pytestmark = pytest.mark.spawned

ITERATION = 7
TIMEOUT = 120
SHOWN = 8  # differences listed per check


def _quiet() -> None:
    """Megatron warns about Apex / Transformer Engine / deprecations on every import."""
    warnings.simplefilter("ignore")


def _mdc() -> Any:
    import megatron.core.dist_checkpointing as mdc

    return mdc


def _short(found: list[str]) -> list[str]:
    return found[:SHOWN] + ([f"... {len(found) - SHOWN} more"] if len(found) > SHOWN else [])


# -- rank bodies ---------------------------------------------------------------------------


def _save(rank: int, ws: int, path: str, s: Setup, how: str) -> dict[str, tuple[int, ...]]:
    """Save the trained state at layout `s` by `how`; return each key's global shape."""
    _quiet()
    setup_parallel(s)
    chunks, optimizer = build(s)
    state = state_dict(s, chunks, optimizer, ITERATION)
    kinds = {type(v).__name__ for v in sharded_leaves(state).values()}
    assert ("ShardedTensorFactory" in kinds) == s.swiglu  # SwiGLU's fc1, its Adam state
    assert ("model0" in state) == bool(s.vpp)
    if how == "megatron":
        _mdc().save(state, path)
    elif how == "swc":
        swc.save(state, path)
    elif how == "swc_async":
        future = swc.async_save(state, path)
        # returned once staged: the state may change now, the checkpoint must not
        for chunk in chunks:
            with torch.no_grad():
                for p in chunk.parameters():
                    p.fill_(-3.0)
        future.result()
    else:
        raise ValueError(how)
    return global_shapes(state)


def _load_both(
    rank: int, ws: int, path: str, s: Setup, saved: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Load `path` at layout `s` into fresh models, by Megatron and by swc (no RNG
    state: the layout changed, as `--no-load-rng`)."""
    _quiet()
    setup_parallel(s)
    chunks, optimizer = build(s, trained=False)
    target = state_dict(s, chunks, optimizer, None, loading=True, rng=False)
    reference = _mdc().load(target, path)
    result = {"megatron vs global": _short(wrong_values(target, reference, saved))}

    chunks, optimizer = build(s, trained=False)
    state = state_dict(s, chunks, optimizer, None, loading=True, rng=False)
    swc.load(state, path)
    got = unwrapped(state)
    params = model_state(chunks)  # the parameters themselves, filled in place
    result["swc vs global"] = _short(wrong_values(state, got, saved))
    result["swc params vs global"] = _short(wrong_values(params, unwrapped(params), saved))
    result["swc vs megatron"] = _short(differences(got, reference))
    if rank == 0 and "model" in state:  # one tensor the parent checks itself
        result["word_embeddings"] = state["model"]["embedding.word_embeddings.weight"].data.clone()
    return result


def _load_common(rank: int, ws: int, path: str, s: Setup) -> dict[str, Any]:
    """Load at the saved layout (a) without the common values (Megatron adds them from
    the checkpoint) and (b) with stale ones (Megatron's return has the stored ones)."""
    _quiet()
    setup_parallel(s)
    result: dict[str, Any] = {}
    for case in ("absent", "stale"):
        states = []
        for _ in range(2):
            chunks, optimizer = build(s, trained=False)
            state = state_dict(s, chunks, optimizer, None, loading=True, rng=False)
            for key in ("args", "checkpoint_version", "opt_param_scheduler"):
                del state[key]
            if case == "stale":
                state.update(iteration=-1, args=None, num_floating_point_operations_so_far=-1)
            else:
                del state["num_floating_point_operations_so_far"]
            states.append(state)
        reference = _mdc().load(states[0], path)
        swc.load(states[1], path)
        got = unwrapped(states[1])
        result[case] = {
            "swc vs megatron": _short(differences(got, reference)),
            "common": {k: got.get(k) for k in _COMMON},
        }
    return result


def _load_rng(rank: int, ws: int, path: str, s: Setup) -> dict[str, Any]:
    """Load only Megatron's `rng_state` ShardedObject, by Megatron and by swc."""
    _quiet()
    setup_parallel(s)
    reference = _mdc().load({"rng_state": rng_state()}, path)
    state = {"rng_state": rng_state()}
    swc.load(state, path)
    got = unwrapped(state)
    return {"swc vs megatron": _short(differences(got, reference)), "rng_state": got["rng_state"]}


_COMMON = (
    "iteration",
    "args",
    "checkpoint_version",
    "opt_param_scheduler",
    "num_floating_point_operations_so_far",
)


# -- helpers of the tests ------------------------------------------------------------------


def _saved(results: list[dict[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for r in results:
        shapes.update(r)
    return shapes


def _save_then_load(tmp_path: Any, how: str, save: Setup, load: Setup) -> list[dict[str, Any]]:
    (tmp_path / "ckpt").mkdir()  # Megatron's save wants it there (its training makes it first)
    path = str(tmp_path / "ckpt")
    saved = _saved(run_ranks(_save, 2, path, save, how, timeout=TIMEOUT))
    return run_ranks(_load_both, 2, path, load, saved, timeout=TIMEOUT)


def _check(results: list[dict[str, Any]]) -> None:
    """Megatron's load right (the harness), then swc's against the global values and
    the model's parameters, then swc's return against Megatron's."""
    for check in ("megatron vs global", "swc vs global", "swc params vs global", "swc vs megatron"):
        for rank, r in enumerate(results):
            assert r[check] == [], f"rank {rank}, {check}"


def _check_word_embeddings(got: torch.Tensor, save: Setup, load: Setup) -> None:
    """Rank 0's word embeddings (TP rank 0 of the load) against the saved global value,
    computed here: the overlap of the two padded vocabularies, zeros beyond."""
    saved_rows = padded_vocab_size(save.vocab, save.divisible_by, save.tp)
    rows = padded_vocab_size(load.vocab, load.divisible_by, load.tp) // load.tp
    key = "embedding.word_embeddings.weight"
    whole = global_value(key, (saved_rows, save.hidden), torch.float32)
    want = torch.zeros(rows, save.hidden)
    n = min(rows, saved_rows)
    want[:n] = whole[:n]
    assert got.dtype == torch.float32 and torch.equal(got, want)


# -- tests ---------------------------------------------------------------------------------

TP2 = Setup(tp=2)
TP1_PP2 = Setup(tp=1, pp=2)


@pytest.mark.parametrize("how", ["swc", "megatron"])
def test_gpt_adam_saved_at_tp2_loads_at_tp1_pp2(tmp_path: Any, how: str) -> None:
    """4 layers (2 per stage at PP 2), Adam state; saved by swc (Megatron's format,
    without megatron=True) or by Megatron, loaded by both at TP 1 / PP 2."""
    results = _save_then_load(tmp_path, how, TP2, TP1_PP2)
    _check(results)
    _check_word_embeddings(results[0]["word_embeddings"], TP2, TP1_PP2)


@pytest.mark.parametrize("how", ["swc", "megatron"])
def test_swiglu_saved_at_tp2_loads_at_tp1_pp2(tmp_path: Any, how: str) -> None:
    """gated_linear_unit=True: fc1 (and its Adam state) is a ShardedTensorFactory whose
    two halves are stored as separate pieces of one key."""
    save, load = Setup(tp=2, swiglu=True), Setup(tp=1, pp=2, swiglu=True)
    results = _save_then_load(tmp_path, how, save, load)
    _check(results)


@pytest.mark.parametrize(
    "save, load",
    [(Setup(tp=2), Setup(tp=1)), (Setup(tp=1), Setup(tp=2))],
    ids=["tp2-to-tp1-dp2", "tp1-dp2-to-tp2"],
)
def test_padded_vocabulary_changes_with_tp(tmp_path: Any, save: Setup, load: Setup) -> None:
    """Vocabulary 50 padded to 64 at TP 2 and to 56 at TP 1 (`allow_shape_mismatch`):
    the overlap is loaded, the rest zeros, as Megatron's load does. TP 1 on 2 ranks is
    data parallel: every piece saved twice, as replicas."""
    assert padded_vocab_size(50, 8, 2) == 64 and padded_vocab_size(50, 8, 1) == 56
    results = _save_then_load(tmp_path, "swc", save, load)
    _check(results)
    _check_word_embeddings(results[0]["word_embeddings"], save, load)


@pytest.mark.parametrize("how", ["swc", "megatron"])
def test_virtual_pipeline_saved_loads_at_pp1(tmp_path: Any, how: str) -> None:
    """PP 2 x VPP 2 (8 layers, 2 per virtual stage: `{"model0": ..., "model1": ...}`),
    loaded at TP 2 / PP 1 into `{"model": ...}`."""
    save, load = Setup(pp=2, vpp=2, layers=8), Setup(tp=2, layers=8)
    results = _save_then_load(tmp_path, how, save, load)
    _check(results)
    _check_word_embeddings(results[0]["word_embeddings"], save, load)


@pytest.fixture(scope="module")
def swc_tp2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The trained state (RNG state included) saved by swc.save at TP 2."""
    path = str(tmp_path_factory.mktemp("gpt"))
    run_ranks(_save, 2, path, TP2, "swc", timeout=TIMEOUT)
    return path


def test_common_state_is_added_and_replaced_as_megatron_returns_it(
    swc_tp2: str,
) -> None:
    """After swc.load, `iteration`, `args`, ... are the saved ones, whether the state
    passed lacked them (added) or held other values (replaced), as in Megatron's return."""
    results = run_ranks(_load_common, 2, swc_tp2, TP2, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        for case in ("absent", "stale"):
            assert r[case]["swc vs megatron"] == [], (rank, case)
            common = r[case]["common"]
            assert common["iteration"] == ITERATION, (rank, case)
            assert common["args"] == args_of(TP2), (rank, case)
            assert common["checkpoint_version"] == 3.0, (rank, case)
            assert common["num_floating_point_operations_so_far"] == 12345, (rank, case)
            assert common["opt_param_scheduler"]["num_steps"] == 2, (rank, case)


def test_rng_state_sharded_object_round_trips(swc_tp2: str) -> None:
    """Megatron's `rng_state` ShardedObject (Python, NumPy and torch RNG states, one
    per (PP, TP) rank) comes back as Megatron's load returns it."""
    results = run_ranks(_load_rng, 2, swc_tp2, TP2, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["swc vs megatron"] == [], rank
        (rng,) = r["rng_state"]
        assert set(rng) == {
            "random_rng_state",
            "np_rng_state",
            "torch_rng_state",
            "rng_tracker_states",
        }, rank
        assert rng["torch_rng_state"].dtype == torch.uint8, rank


def test_async_save_opens_in_megatron(tmp_path: Any) -> None:
    """`swc.async_save` of the GPT + Adam state at TP 2 (the parameters overwritten as
    soon as it returns), then Megatron's load and swc's at TP 1 / PP 2."""
    results = _save_then_load(tmp_path, "swc_async", TP2, TP1_PP2)
    _check(results)
    _check_word_embeddings(results[0]["word_embeddings"], TP2, TP1_PP2)

"""Per-op cost of shardwise's `ShardedTensor` against DTensor and PhysicsNeMo's ShardTensor.

Run: `shardwise bench ops [--world-size 4] [--sizes 4096x1024,256x64] [--repeat 5]
[--ops "NAME;NAME"] [--json out.json] [--profile OP] [--quick]`. `--quick` (a smoke
run, under a minute on 2 cores): one size, 256x64, one 2 ms batch per cell.

On W real gloo processes (CPU, one thread each), a float32 tensor `x` of each
size in `--sizes`, the same values in every system, is sharded along dim 0:

* even layout: DTensor `Shard(0)` against shardwise
  `ShardedTensor.from_local(local, mesh, [Shard(0)])` (= `Layout.chunked`),
  the same torch.chunk pieces;
* uneven layout (rows W : W-1 : ... : 1): PhysicsNeMo 2.2.2's
  `ShardTensor.from_local(..., sharding_shapes=...)` against shardwise's
  `from_local` with the same `sharding_shapes`. The PhysicsNeMo columns are
  left out when `physicsnemo.domain_parallel` does not import;
* the physical limit of a Python tensor subclass: "Python floor", a wrapper
  whose `__torch_dispatch__` only unwraps the even local piece, runs the op on
  it and wraps the result (no layout, no communication: its values are local
  and not checked). DTensor dispatches in C++ and can run below it; shardwise
  cannot.

Every op runs forward (inputs without grad) and, where differentiable, forward
+ backward (`op(x).backward(g)`, `g = ones_like` of the op's result, built
once; gradients cleared between calls). A figure is the median over
`--repeat` timed batches of the slowest rank's time per call, in
microseconds; a batch holds as many calls as fit in `--batch-ms` (at least
one, the same count on every rank). Ratios are shardwise / the other system
(target for the even layout: <= 1.2x). Every system's forward result is
checked against plain torch on the whole tensor first; a wrong one is marked
`WRONG`. An op that raises in a system prints its error in that cell; one that
kills the rank processes (PhysicsNeMo's uneven `cat` aborts gloo with a size
mismatch) is marked, with the other pass of that op, and the run resumes
after the rows already measured. "DTensor result" gives DTensor's output
placements: `P(sum)` is a Partial result whose all-reduce DTensor defers, as
shardwise does (`pending_reduce`); the `.full_tensor()` rows force it.

`F.linear(x, W)` takes a replicated weight (out features = the columns / 4):
`Replicate()` for all three systems (DTensor and ShardTensor refuse to mix
plain tensors in). Its gradient is a pending sum in DTensor and shardwise
(`Partial`, combined when read); the calls clear it unread, as a step that
only accumulates would.

"shardwise sent / rank" is what the busiest rank hands to torch.distributed's
collectives in one shardwise call (untimed, counted by wrapping
`torch.distributed`): the payload of each collective — `all_reduce` of N bytes
counts N (a ring all-reduce moves about 2(W-1)/W N on the wire),
`all_to_all_single` the bytes for the other ranks, `broadcast` N at the
source, `all_gather` the rank's own piece; object exchanges count their
pickled size. "-" is nothing sent; "(fallback: op)" names ops that ran through
shardwise's gather fallback (`shardwise.ops.FALLBACK_OPS`). DTensor and
ShardTensor go through functional collectives and are not counted.

`--profile OP` runs OP's even-layout shardwise calls (each size, each pass) under
cProfile on rank 0 and prints the top functions.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SYSTEMS = ("DTensor", "shardwise even", "PhysicsNeMo", "shardwise uneven", "Python floor")


class _Floor(torch.Tensor):
    """The least a tensor subclass written in Python pays per op: `__torch_dispatch__`
    unwraps this rank's tensor, runs the op on it and wraps the result; no layout, no
    communication (so its values are the local op's, not the global one's, and are not
    checked), `__torch_function__` disabled as DTensor's. DTensor's own dispatch runs in
    C++ (`dispatchDTensorOp`), below this floor."""

    _local: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor) -> _Floor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            local.shape,
            dtype=local.dtype,
            device=local.device,
            requires_grad=local.requires_grad,
        )
        out._local = local
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        from torch.utils._pytree import tree_map

        def unwrap(x: Any) -> Any:
            return x._local if isinstance(x, _Floor) else x

        def wrap(x: Any) -> Any:
            return _Floor(x) if isinstance(x, torch.Tensor) else x

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


PASSES = ("fwd", "fwd+bwd")


def _linear(x: Any, w: Any) -> Any:
    return F.linear(x, w)


def _full(y: Any) -> Any:
    """DTensor leaves a reduction Partial (the all-reduce deferred); this row forces it."""
    return y.full_tensor() if hasattr(y, "full_tensor") else y


# name -> (function of (x, weight), differentiable)
OPS: dict[str, tuple[Callable[[Any, Any], Any], bool]] = {
    "x * 2 + 1": (lambda x, w: x * 2 + 1, True),
    "x.sum()": (lambda x, w: x.sum(), True),
    "x.sum(dim=0)": (lambda x, w: x.sum(dim=0), True),
    "x.sum().full_tensor()": (lambda x, w: _full(x.sum()), True),
    "x.sum(dim=0).full_tensor()": (lambda x, w: _full(x.sum(dim=0)), True),
    "x.sum(dim=1)": (lambda x, w: x.sum(dim=1), True),
    "softmax(dim=1)": (lambda x, w: torch.softmax(x, dim=1), True),
    "layer_norm(last dim)": (lambda x, w: F.layer_norm(x, x.shape[-1:]), True),
    "transpose(0,1)": (lambda x, w: x.transpose(0, 1), True),
    "x[:, 1:3]": (lambda x, w: x[:, 1:3], True),
    "cat([x, x])": (lambda x, w: torch.cat([x, x]), True),
    "x.cumsum(dim=0)": (lambda x, w: x.cumsum(dim=0), True),
    "x.argmax(dim=0)": (lambda x, w: x.argmax(dim=0), False),
    "x.topk(4, dim=0).values": (lambda x, w: x.topk(4, dim=0).values, True),
    "F.linear(x, W)": (_linear, True),
    "x @ x.T": (lambda x, w: x @ x.T, True),
}


def _parse_size(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def uneven_rows(rows: int, world: int) -> list[int]:
    """Rows split W : W-1 : ... : 1 (rank 0 holds the most), every rank at least one."""
    weights = list(range(world, 0, -1))
    sizes = [max(1, rows * w // sum(weights)) for w in weights]
    sizes[0] += rows - sum(sizes)
    return sizes


# -- counting what shardwise hands to torch.distributed ------------------------------------


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Counter:
    """Wraps torch.distributed's collectives while active; records (name, payload bytes)."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_to_all_single",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "reduce_scatter_tensor",
        "send",
        "isend",
    )

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.calls: list[tuple[str, int]] = []
        self.saved: dict[str, Any] = {}

    def _payload(self, name: str, args: tuple, kwargs: dict) -> int:
        dist = self.dist
        group = kwargs.get("group")
        if name in ("all_reduce", "send", "isend"):
            return _nbytes(args[0] if args else kwargs.get("tensor"))
        if name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            return _nbytes(args[0]) if dist.get_rank() == src else 0
        if name == "all_to_all_single":
            inp = args[1]
            splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
            world = dist.get_world_size(group)
            me = dist.get_rank(group)
            if not splits:
                return _nbytes(inp) * (world - 1) // world
            row = _nbytes(inp) // inp.shape[0] if inp.shape[0] else 0
            return sum(s for r, s in enumerate(splits) if r != me) * row
        if name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):
            return _nbytes(args[1])
        if name == "reduce_scatter_tensor":
            return _nbytes(args[1])
        if name == "all_gather_object":
            return len(pickle.dumps(args[1]))
        return 0

    def __enter__(self) -> _Counter:
        for name in self.NAMES:
            original = getattr(self.dist, name, None)
            if original is None:  # all_gather_single: torch 2.13 and later
                continue
            self.saved[name] = original

            def wrapped(*args: Any, _n: str = name, _f: Any = original, **kwargs: Any) -> Any:
                self.calls.append((_n, self._payload(_n, args, kwargs)))
                return _f(*args, **kwargs)

            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n_f = n / 1024
        if n_f < 1024 or unit == "GiB":
            return f"{n_f:.1f} {unit}" if n_f < 100 else f"{n_f:.0f} {unit}"
        n //= 1024
    return f"{n} B"


def describe_sent(calls: list[tuple[str, int]]) -> str:
    """`all_reduce 4 B + all_to_all_single 3.0 MiB`, the payload per collective kind."""
    totals: dict[str, int] = {}
    for name, n in calls:
        totals[name] = totals.get(name, 0) + n
    parts = [f"{name} {_human(n)}" for name, n in totals.items() if n]
    return " + ".join(parts) if parts else "-"


# -- one rank --------------------------------------------------------------------------------


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return text[:300]


def _whole(y: Any) -> torch.Tensor:
    """The whole value of a result of any system (collective for sharded ones)."""
    if hasattr(y, "full_tensor"):
        return y.full_tensor()
    return y


def _row_key(size: tuple[int, int] | list[int], op: str, pass_: str) -> str:
    return f"{size[0]}x{size[1]} | {op} | {pass_}"


def _rank(rank: int, world: int, work: dict[str, Any]) -> bool:
    """Measure every row of `work` not in `work["done"]`; rank 0 appends each finished row
    to `rows.jsonl` in `work["folder"]` and names the cell it is in in `progress`, so that
    a cell that kills the processes (a collective mismatch aborts gloo) can be skipped on
    a rerun. Returns whether PhysicsNeMo imported."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import shardwise as sw
    from shardwise.ops import FALLBACK_OPS
    from shardwise.testing import seconds_across_ranks

    folder = Path(work["folder"])
    err = os.open(folder / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(err, 2)  # an abort's message (gloo's) lands where the parent can read it
    os.close(err)
    warnings.simplefilter("ignore")  # PhysicsNeMo's funcol deprecation notes
    torch.set_num_threads(1)
    try:
        from physicsnemo.domain_parallel import ShardTensor
    except Exception:  # not installed, or broken: its columns are left out
        ShardTensor = None
    mesh = init_device_mesh("cpu", (world,))
    batch_s, max_calls, repeat = work["batch_s"], work["max_calls"], work["repeat"]

    def agree_failed(failed: bool) -> int:
        """-1 when no rank failed, else the lowest failing rank. Collective."""
        flag = torch.tensor([rank if failed else world], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return -1 if int(flag) == world else int(flag)

    def build(full: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
        """Per system: (x, w) without grad and with grad; or the error building it."""
        rows, cols = full.shape
        even = torch.chunk(full, world, 0)[rank].clone()
        counts = uneven_rows(rows, world)
        uneven = full.split(counts)[rank].clone()
        shapes: dict[int, Sequence[Any]] = {0: [(n, cols) for n in counts]}
        makers: dict[str, Callable[[torch.Tensor], Any]] = {
            "DTensor": lambda t: DTensor.from_local(t, mesh, [Shard(0)], run_check=False),
            "shardwise even": lambda t: sw.ShardedTensor.from_local(t, mesh, [Shard(0)]),
            "shardwise uneven": lambda t: sw.ShardedTensor.from_local(
                t, mesh, [Shard(0)], sharding_shapes=shapes
            ),
            "Python floor": _Floor,
        }
        weights: dict[str, Callable[[torch.Tensor], Any]] = {
            "DTensor": lambda w: DTensor.from_local(w, mesh, [Replicate()], run_check=False),
            "shardwise even": lambda w: sw.ShardedTensor.from_local(w, mesh, [Replicate()]),
            "shardwise uneven": lambda w: sw.ShardedTensor.from_local(w, mesh, [Replicate()]),
            "Python floor": _Floor,
        }
        if ShardTensor is not None:
            makers["PhysicsNeMo"] = lambda t: ShardTensor.from_local(
                t, mesh, (Shard(0),), sharding_shapes=shapes
            )
            weights["PhysicsNeMo"] = lambda w: ShardTensor.from_local(
                w, mesh, (Replicate(),), sharding_shapes="infer"
            )
        local = {"DTensor": even, "shardwise even": even, "shardwise uneven": uneven}
        local["Python floor"] = even
        local["PhysicsNeMo"] = uneven
        out: dict[str, Any] = {}
        for name, make in makers.items():
            try:
                x = make(local[name])
                xg = make(local[name].clone()).detach().requires_grad_()
                w = weights[name](weight)
                wg = weights[name](weight.clone()).detach().requires_grad_()
                out[name] = (x, w, xg, wg)
            except Exception as e:
                out[name] = _error(e)
        return out

    def calls_per_batch(call: Callable[[], Any]) -> int:
        start = time.perf_counter()
        call()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return max(1, min(max_calls, int(batch_s / max(float(t), 1e-7))))

    def measure(
        name: str, built: Any, fn: Callable[..., Any], pass_: str, expected: Any, key: str
    ) -> dict[str, Any]:
        cell: dict[str, Any] = {}
        if built is None:
            return {"skipped": "physicsnemo.domain_parallel does not import"}
        if isinstance(built, str):
            return {"error": f"building the input: {built}"}
        if key in work["crashed"]:
            return {"error": work["crashed"][key]}
        x, w, xg, wg = built
        error = None
        call: Callable[[], Any]
        try:
            if pass_ == "fwd":
                y = fn(x, w)

                def call(x: Any = x, w: Any = w) -> Any:
                    return fn(x, w)

            else:
                y = fn(xg, wg)
                g = torch.ones_like(y)

                def call(xg: Any = xg, wg: Any = wg, g: Any = g) -> Any:
                    xg.grad = None
                    wg.grad = None
                    fn(xg, wg).backward(g)

                call()
        except Exception as e:
            error = _error(e)
        failed = agree_failed(error is not None)
        if failed >= 0:
            return {"error": error or f"failed on rank {failed}"}
        if pass_ == "fwd" and name != "Python floor":  # the value, against plain torch
            if isinstance(y, sw.ShardedTensor):
                cell["layout"] = repr(y.layout_spec)
            elif isinstance(y, DTensor):
                cell["placements"] = [str(p) for p in y.placements]
            try:
                got: torch.Tensor | None = _whole(y)
            except Exception as e:
                got, cell["check error"] = None, _error(e)
            ok = True
            if rank == 0 and got is not None and expected is not None:
                ok = got.shape == expected.shape and torch.allclose(
                    got.float(), expected.float(), rtol=1e-4, atol=1e-3
                )
            right = agree_failed(not ok) < 0
            if got is not None:
                cell["right"] = right
            del got
        del y
        if name.startswith("shardwise"):
            before = dict(FALLBACK_OPS)
            with _Counter() as counter:
                call()
            cell["sent"] = counter.calls
            cell["fallback"] = sorted(
                str(op) for op, k in FALLBACK_OPS.items() if k > before.get(op, 0)
            )
        n = calls_per_batch(call)

        def batch() -> None:
            for _ in range(n):
                call()

        seconds = seconds_across_ranks(batch, repeat, warmup=False)
        cell["us"] = seconds / n * 1e6
        cell["calls"] = n
        if work["profile"] == key.split(" | ")[1] and name == "shardwise even":
            text = _profile(call, n, rank)
            if text is not None:
                with open(folder / "profile.txt", "a") as f:
                    f.write(f"\n== cProfile, rank 0, shardwise even, {key}\n\n{text}")
        return cell

    shardwise_names = [n for n in SYSTEMS if n.startswith("shardwise")]
    for size in work["sizes"]:
        rows_needed = [
            (op, pass_)
            for op in work["ops"]
            for pass_ in (PASSES if OPS[op][1] else PASSES[:1])
            if _row_key(size, op, pass_) not in work["done"]
        ]
        if not rows_needed:
            continue
        gen = torch.Generator().manual_seed(1234)
        full = torch.randn(size, generator=gen)
        weight = torch.randn((max(1, size[1] // 4), size[1]), generator=gen)
        systems = build(full, weight)
        expected: dict[str, torch.Tensor | None] = {}
        for op, pass_ in rows_needed:
            fn = OPS[op][0]
            if rank == 0 and op not in expected:
                try:
                    expected[op] = fn(full, weight)
                except Exception:
                    expected[op] = None
            row_key = _row_key(size, op, pass_)
            row: dict[str, Any] = {"size": list(size), "op": op, "pass": pass_}
            for name in SYSTEMS:
                key = f"{row_key} | {name}"
                if rank == 0:
                    (folder / "progress").write_text(key)
                if work["verbose"]:
                    print(f"rank {rank}: {key}", flush=True)
                row[name] = measure(name, systems.get(name), fn, pass_, expected.get(op), key)
            # the busiest rank's bytes, per shardwise cell
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, [row[n].get("sent") for n in shardwise_names])
            if rank == 0:
                for j, name in enumerate(shardwise_names):
                    per_rank = [everyone[r][j] for r in range(world)]
                    if per_rank[0] is None:
                        continue
                    totals = [sum(b for _, b in calls) for calls in per_rank]
                    busiest = max(range(world), key=lambda r: totals[r])
                    row[name]["sent"] = describe_sent(per_rank[busiest])
                    row[name]["sent bytes per rank"] = totals
                with open(folder / "rows.jsonl", "a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
        del systems
    if rank == 0:
        (folder / "progress").write_text("")
    return ShardTensor is not None


def _profile(call: Callable[[], Any], n: int, rank: int) -> str | None:
    """cProfile of `n` calls on rank 0 (the others run the same calls unprofiled)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile() if rank == 0 else None
    if profiler is not None:
        profiler.enable()
    for _ in range(max(n, 20)):
        call()
    if profiler is None:
        return None
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(30)
    return text.getvalue()


# -- the report ------------------------------------------------------------------------------


def _cell(c: dict[str, Any]) -> str:
    if "skipped" in c:
        return "n/a"
    if "error" in c:
        return "error: " + c["error"].replace("|", "/")[:80]
    mark = "" if c.get("right", True) else " WRONG"
    return f"{c['us']:.1f}{mark}"


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    if "us" in ours and "us" in theirs and theirs["us"] > 0:
        return f"{ours['us'] / theirs['us']:.2f}x"
    return "-"


def _placements(c: dict[str, Any]) -> str:
    short = {"Shard(dim=0)": "S(0)", "Shard(dim=1)": "S(1)", "Replicate()": "R"}
    if "placements" not in c:
        return ""
    return ",".join(short.get(p, "P" if p.startswith("Partial") else p) for p in c["placements"])


def _sent(c: dict[str, Any]) -> str:
    text = c.get("sent", "-")
    if c.get("fallback"):
        ops = ", ".join(op.removeprefix("aten.") for op in c["fallback"])
        text += f" (fallback: {ops})"
    return text


HEADER = (
    "| size | op | pass | DTensor µs | shardwise µs | sw/DTensor | PhysicsNeMo µs "
    "| shardwise uneven µs | sw/PhysicsNeMo | DTensor result | shardwise sent / rank "
    "(even; uneven) | Python floor µs | sw/floor |"
)


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        dt, se, pn, su, fl = (r.get(name, {"skipped": True}) for name in SYSTEMS)
        size = "x".join(str(s) for s in r["size"])
        sent = f"{_sent(se)}; {_sent(su)}"
        lines.append(
            f"| {size} | `{r['op']}` | {r['pass']} | {_cell(dt)} | {_cell(se)} | {_ratio(se, dt)} "
            f"| {_cell(pn)} | {_cell(su)} | {_ratio(su, pn)} | {_placements(dt)} | {sent} "
            f"| {_cell(fl)} | {_ratio(se, fl)} |"
        )
    return lines


def _crash_message(folder: Path, error: BaseException) -> str:
    """What killed the ranks: an abort's `what():` line from a rank's stderr, else `error`."""
    for path in sorted(folder.glob("rank*.err")):
        lines = path.read_text(errors="replace").splitlines()
        for line in reversed(lines):
            if "what():" in line:
                return line.split("what():", 1)[1].strip()[:300]
    return str(error).splitlines()[0][:300]


def measure_all(
    world: int,
    sizes: list[tuple[int, int]],
    ops: list[str],
    repeat: int,
    batch_s: float,
    max_calls: int,
    *,
    profile: str | None = None,
    verbose: bool = False,
    timeout: float = 1800,
) -> tuple[list[dict[str, Any]], str | None, bool]:
    """Every row (size, op, pass) measured on `world` ranks: (rows, profile text, whether
    PhysicsNeMo imported). A cell that kills the ranks is marked and the run resumed."""
    import tempfile

    from shardwise.errors import RankFailureError
    from shardwise.testing import run_ranks

    with tempfile.TemporaryDirectory(prefix="shardwise-bench-ops-") as tmp:
        folder = Path(tmp)
        work: dict[str, Any] = {
            "folder": tmp,
            "sizes": sizes,
            "ops": ops,
            "repeat": repeat,
            "batch_s": batch_s,
            "max_calls": max_calls,
            "profile": profile,
            "verbose": verbose,
            "crashed": {},
            "done": set(),
        }
        while True:
            try:
                physicsnemo = run_ranks(_rank, world, work, timeout=timeout)[0]
                break
            except RankFailureError as e:
                progress = folder / "progress"
                key = progress.read_text() if progress.exists() else ""
                if not key or key in work["crashed"] or len(work["crashed"]) >= 40:
                    raise
                message = _crash_message(folder, e)
                work["crashed"][key] = f"crashed the ranks: {message}"
                crashed_pass = key.split(" | ")[2]
                for pass_ in PASSES:  # the other pass runs the same forward: not run
                    other = key.replace(f" | {crashed_pass} | ", f" | {pass_} | ")
                    work["crashed"].setdefault(
                        other, f"not run, its {crashed_pass} crashed the ranks: {message}"
                    )
                print(f"{key}: {message}; resuming without it", file=sys.stderr)
                rows_file = folder / "rows.jsonl"
                if rows_file.exists():
                    done = [json.loads(line) for line in rows_file.read_text().splitlines()]
                    work["done"] = {_row_key(r["size"], r["op"], r["pass"]) for r in done}
                for path in folder.glob("rank*.err"):
                    path.unlink()
        rows_text = (folder / "rows.jsonl").read_text()
        rows = [json.loads(line) for line in rows_text.splitlines()]
        profile_file = folder / "profile.txt"
        profiled = profile_file.read_text() if profile_file.exists() else None
    order = {_row_key(s, o, p): i for i, (s, o, p) in enumerate(
        (s, o, p) for s in sizes for o in ops for p in PASSES
    )}  # fmt: skip
    rows.sort(key=lambda r: order[_row_key(r["size"], r["op"], r["pass"])])
    return rows, profiled, physicsnemo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument(
        "--sizes", default="4096x1024,256x64", help="ROWSxCOLS,... (default 4096x1024,256x64)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed batches; the median")
    parser.add_argument("--batch-ms", type=float, default=20.0, help="time per batch (default 20)")
    parser.add_argument("--max-calls", type=int, default=200, help="calls per batch at most")
    parser.add_argument("--ops", help="op names separated by ; (default: all)")
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--profile", metavar="OP", help="cProfile OP's shardwise calls, rank 0")
    parser.add_argument("--verbose", action="store_true", help="each rank names each cell")
    parser.add_argument(
        "--quick", action="store_true", help="size 256x64, 1 repeat, 2 ms batches: a smoke run"
    )
    args = parser.parse_args(argv)
    if args.quick:
        if args.sizes == parser.get_default("sizes"):
            args.sizes = "256x64"
        args.repeat, args.batch_ms, args.max_calls = 1, 2.0, 20
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s]
    ops = list(OPS) if not args.ops else [o.strip() for o in args.ops.split(";")]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; known: {list(OPS)}")
    if args.profile is not None and args.profile not in ops:
        parser.error(f"--profile {args.profile!r} is not among the ops run")
    start = time.perf_counter()
    rows, profiled, physicsnemo = measure_all(
        args.world_size,
        sizes,
        ops,
        args.repeat,
        args.batch_ms / 1000,
        args.max_calls,
        profile=args.profile,
        verbose=args.verbose,
    )
    elapsed = time.perf_counter() - start
    print(
        f"shardwise bench ops: {args.world_size} gloo ranks (CPU, 1 thread each), float32, "
        f"dim 0 sharded; median of {args.repeat} batches, slowest rank, µs per call; "
        f"PhysicsNeMo {'on' if physicsnemo else 'not importable: n/a'} "
        f"(uneven rows {' : '.join(str(w) for w in range(args.world_size, 0, -1))}); "
        f"{elapsed:.0f} s\n"
    )
    for line in table(rows):
        print(line)
    wrong = [
        f"{r['op']} {r['pass']} {'x'.join(map(str, r['size']))}: {name}"
        for r in rows
        for name in SYSTEMS
        if r[name].get("right") is False
    ]
    ratios = [
        r["shardwise even"]["us"] / r["DTensor"]["us"]
        for r in rows
        if "us" in r["shardwise even"] and "us" in r["DTensor"]
    ]
    if ratios:
        met = sum(q <= 1.2 for q in ratios)
        print(
            f"\nsw/DTensor <= 1.2x in {met} of {len(ratios)} rows; geometric mean "
            f"{math.exp(statistics.fmean(math.log(q) for q in ratios)):.2f}x"
        )
    if wrong:
        print("WRONG results (against plain torch): " + "; ".join(wrong))
    if profiled:
        print(profiled)
    if args.json:
        record = {
            "world_size": args.world_size,
            "sizes": sizes,
            "repeat": args.repeat,
            "batch_ms": args.batch_ms,
            "seconds": elapsed,
            "physicsnemo": physicsnemo,
            "rows": rows,
            "profile": profiled,
        }
        Path(args.json).write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()

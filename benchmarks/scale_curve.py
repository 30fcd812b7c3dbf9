"""The curve `scale_threads` measures, printed: one row per run and phase."""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.cli.sizes import format_size

__all__ = ["coordinator", "print_curve"]

_HEADER = (
    "kind W x N",
    "phase",
    *("plan max", "cpu max", "cpu med", "cpu r0", "join r0", "recv max", "recv med", "recv r0"),
    "calls",
    "wall",
    *("proc/rank", "rss/rank", "|stk local", "stk coord", "stk r0", "stk recv"),
)
_LEGEND = (
    "plan: a save's planning share of a rank's CPU (`plan_clock`), cpu: a rank's own thread "
    "CPU seconds; join r0: rank 0's join of the records, CPU on its own thread beside its "
    "writes; proc/rank: process CPU / W; recv: bytes a rank "
    "received; stk local: stock create_local_plan (save) or create_default_local_load_plan "
    "(load), slowest rank; stk coord: stock create_global_plan; stk r0 / recv: pickled "
    "plans rank 0 gathers / a rank receives (load: the whole .metadata)"
)


def coordinator(save: dict[str, float]) -> float:
    """Rank 0's CPU in a save: its own thread's and its join's."""
    return save["cpu_rank0_s"] + save["join_s"]


def _row(cells: Sequence[str]) -> str:
    return f"{cells[0]:<18} {cells[1]:<12} " + " ".join(f"{c:>10}" for c in cells[2:])


def _cells(phase: str, sw: dict[str, float], st: dict[str, float]) -> list[str]:
    keys = ("cpu_max_s", "cpu_median_s", "cpu_rank0_s")
    plan = f"{sw['plan_max_s']:.3f}" if phase.startswith("save") else "-"  # a load writes nothing
    join = f"{sw['join_s']:.3f}" if phase.startswith("save") else "-"
    seconds = [plan, *(f"{sw[k]:.3f}" for k in keys), join]
    received = [format_size(sw[k]) for k in ("recv_max", "recv_median", "recv_rank0")]
    stock = [
        f"{st['local_max_s']:.3f}" if st else "-",
        f"{st['global_s']:.3f}" if "global_s" in st else "-",
        format_size(st["recv_rank0"]) if "recv_rank0" in st else "-",
        format_size(st["recv_max"]) if st else "-",
    ]
    return [
        *seconds,
        *received,
        str(sw["collectives"]),
        f"{sw['wall_s']:.1f}",
        f"{sw['process_cpu_per_rank_s']:.3f}",
        format_size(sw["rss_per_rank"]),
        *stock,
    ]


def print_curve(results: list[dict]) -> None:
    """One row per run and phase: shardwise's per-rank figures, then stock's planning."""
    print(_row(_HEADER))
    for res in results:
        name = f"{res['kind']} {res['world']}x{res['tensors']}"
        for phase in res["phases"]:
            sw = res["phases"][phase]
            cells = (
                [sw["error"]] if "error" in sw else _cells(phase, sw, res["stock"].get(phase, {}))
            )
            print(_row([name, phase, *cells]))
        slowest = {p: f.get("cpu_max_rank") for p, f in res["phases"].items()}
        print(f"  {name}: slowest rank per phase {slowest}")
        coord = res["stock"]["save"]["global_s"] / max(coordinator(res["phases"]["save"]), 1e-9)
        index = format_size(sum(res["index_files"].values()))
        print(
            f"  {name}: stock create_global_plan / shardwise rank 0's CPU with its join, first save: "
            f"{coord:.1f}x; index files {index} ({', '.join(sorted(res['index_files']))})"
        )
    print(_LEGEND)

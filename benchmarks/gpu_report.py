"""The names, rows and targets of `shardwise bench gpu` (benchmarks/bench_gpu.py):
each case's row as it finishes, and issue 23's targets as ratios with met/missed."""

from __future__ import annotations

MiB = 2**20
STOCK_SAVE, STOCK_ASYNC, STOCK_LOAD = (
    "stock dcp.save",
    "stock dcp.async_save DefaultStager",
    "stock dcp.load",
)
OUR_SAVE, OUR_ASYNC = "shardwise save", "shardwise async_save background"
OUR_ASYNC_BIG, OUR_LOAD = "shardwise async_save background, staging_bytes>=state", "shardwise load"
CASES = (STOCK_SAVE, STOCK_LOAD, STOCK_ASYNC, OUR_SAVE, OUR_LOAD, OUR_ASYNC, OUR_ASYNC_BIG)
PROBES = (
    ("d2h", "probe: device->host copy"),
    ("write", "probe: write+fsync"),
    ("read", "probe: read"),
    ("h2d", "probe: host->device copy"),
)
TARGETS = (
    "async save blocking <= 20 ms",
    "async save blocking <= 1/10 of stock DefaultStager's",
    "step time while staging <= 1.05 x without a save",
    "sync save >= 0.9 x save limit",
    "sync save >= 1.5 x stock dcp.save",
    "load into CUDA >= 0.9 x load limit",
    "load >= 1.5 x stock dcp.load",
    "host memory during save <= staging budget + 128 MiB",
)


def _fmt(v: float | None, spec: str) -> str:
    """`v` formatted, or "-" as wide."""
    return format(v, spec) if v is not None else format("-", f">{spec.split('.')[0]}")


def print_case(name: str, r: dict | None) -> None:
    if r is None or "error" in r:
        print(f"  {name:56} {'not available' if r is None else 'FAILED ' + r['error']}", flush=True)
        return
    exact = "" if "exact" not in r else "  bit-exact" if r["exact"] else "  NOT BIT-EXACT"
    print(
        f"  {name:56}{_fmt(r['blocking_s'], '9.4f')}{_fmt(r['staged_s'], '9.3f')}"
        f"{_fmt(r['total_s'], '9.3f')}{r['GBps']:8.2f}{_fmt(r.get('of_limit'), '7.2f')}"
        f"{r['rss'] / MiB:10.0f}{_fmt(r.get('step_ratio'), '7.3f')}"
        f"{_fmt(r.get('first_blocking_s'), '9.4f')}{exact}",
        flush=True,
    )


def targets(res: dict, budget: int) -> list[dict]:
    """The issue's targets on one state's results: ratio, bound, met, and the two
    figures compared (None where a case is missing or failed)."""
    c, lim = res["cases"], res["limits"]

    def get(case: str, key: str) -> float | None:
        r = c.get(case)
        return None if r is None else r.get(key)

    def ms(case: str, key: str = "blocking_s") -> float | None:
        v = get(case, key)
        return None if v is None else v * 1e3

    rss = [r for r in (get(OUR_SAVE, "rss"), get(OUR_ASYNC, "rss")) if r is not None]
    pairs = [  # (measured, compared with, unit, need, bound): ratio = measured / compared with
        (ms(OUR_ASYNC), 20.0, "ms", "<=", 1.0),
        (ms(OUR_ASYNC), ms(STOCK_ASYNC), "ms", "<=", 0.1),
        (ms(OUR_ASYNC, "step_s"), ms(OUR_ASYNC, "step_baseline_s"), "ms", "<=", 1.05),
        (get(OUR_SAVE, "GBps"), lim["save GBps"], "GB/s", ">=", 0.9),
        (get(STOCK_SAVE, "total_s"), get(OUR_SAVE, "total_s"), "s", ">=", 1.5),
        (get(OUR_LOAD, "GBps"), lim["load GBps"], "GB/s", ">=", 0.9),
        (get(STOCK_LOAD, "total_s"), get(OUR_LOAD, "total_s"), "s", ">=", 1.5),
        (max(rss) / MiB if rss else None, budget / MiB + 128, "MiB", "<=", 1.0),
    ]
    out = []
    for label, (a, b, unit, op, bound) in zip(TARGETS, pairs):
        r = None if a is None or b is None or b == 0 else a / b
        out.append(
            {
                "target": label,
                "ratio": r,
                "need": f"{op} {bound}",
                "met": None if r is None else (r <= bound if op == "<=" else r >= bound),
                "figures": None if r is None else f"{a:.4g} {unit} / {b:.4g} {unit}",
            }
        )
    return out


def print_targets(results: dict) -> None:
    print(f"\n== targets (issue 23), {results['device']}")
    for kind, res in results["states"].items():
        for t in res["targets"]:
            verdict = {True: "met", False: "missed", None: "n/a"}[t["met"]]
            print(
                f"  [{kind}] {t['target']:56}{_fmt(t['ratio'], '9.3f')}  need {t['need']:7}"
                f" {verdict:6}  {t['figures'] or ''}"
            )

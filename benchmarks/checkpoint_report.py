"""The final table of `shardwise bench checkpoint`: one row per target of the
checkpoint issue, every figure computed from the run's measurements.

Columns: case | stock | shardwise | peer (ByteCheckpoint) | ratio(s) | target | met?
A ratio is the other engine's seconds over shardwise's (> 1: shardwise is faster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bytecheckpoint_peer import INSTALL

MiB = 2**20
RSS_LIMIT_MIB = 128  # peak RSS growth allowed beyond the rank's own state
CURVE_TOP = 100_000  # the count the "under 10 s" target is set for


@dataclass
class Check:
    shown: str  # the measured figure, e.g. "stock/shardwise 12.1x"
    target: str = "-"  # e.g. ">= 10x"; "-" when the row is information only
    ok: bool | None = None  # None: not evaluated

    @property
    def met(self) -> str:
        return {True: "yes", False: "NO", None: "-" if self.target == "-" else "n/a"}[self.ok]


@dataclass
class Row:
    case: str
    stock: str = "-"
    ours: str = "-"
    peer: str = "-"
    checks: list[Check] = field(default_factory=list)


def secs(s: float) -> str:
    if s is None or math.isnan(s):
        return "n/a"
    return f"{s:.3f} s" if s < 10 else f"{s:.1f} s"


def mib(b: float | None) -> str:
    if b is None:
        return "-"
    if math.isnan(b):
        return "n/a"
    return f"{b / MiB:.1f} MiB" if abs(b) < 10 * MiB else f"{b / MiB:.0f} MiB"


def _bad(*values: float | None) -> bool:
    return any(v is None or math.isnan(v) for v in values)


def at_least(label: str, value: float, threshold: float) -> Check:
    if _bad(value):
        return Check(f"{label} n/a", f">= {threshold:g}x", None)
    return Check(f"{label} {value:.2f}x", f">= {threshold:g}x", value >= threshold)


def at_most(label: str, value: float, threshold: float, unit: str = "") -> Check:
    if _bad(value):
        return Check(f"{label} n/a", f"<= {threshold:g}{unit}", None)
    return Check(f"{label} {value:.2f}{unit}", f"<= {threshold:g}{unit}", value <= threshold)


def ratio(a: float | None, b: float | None) -> float:
    return math.nan if _bad(a, b) or b == 0 else a / b


def info(label: str, value: float) -> Check:
    return Check(f"{label} " + ("n/a" if _bad(value) else f"{value:.2f}x"))


def _peer(res: dict, key: str) -> tuple[str, float]:
    """The peer's column text and seconds: how to install it when it did not run."""
    if res.get("peer"):
        return f"n/a ({INSTALL})", math.nan
    value = res.get(key, math.nan)
    return secs(value), value


def small_rows(count: int, res: dict, kind: str) -> list[Row]:
    rows = []
    for op in ("save", "load"):
        stock, ours = res["stock " + op], res["shardwise " + op]
        peer_text, peer = _peer(res, "peer " + op)
        rows.append(
            Row(
                f"{count:,} x 4 KiB {kind}, 2 ranks: {op}",
                secs(stock),
                secs(ours),
                peer_text,
                [
                    at_least("stock/sw", ratio(stock, ours), 10),
                    at_least("BCP/sw", ratio(peer, ours), 5),
                ],
            )
        )
    return rows


def curve_rows(points: list[tuple[int, dict]]) -> list[Row]:
    """points: (count, result) from smallest to largest; stock absent at the largest."""
    rows = []
    (mid_count, mid), (top_count, top) = points[-2], points[-1]
    for op in ("save", "load"):
        for count, res in points:
            ours = res["shardwise " + op]
            per = ours / count * 1e6
            row = Row(f"curve {count:,} sharded: {op}", ours=f"{secs(ours)} ({per:.0f} us/t)")
            if "stock " + op in res:
                row.stock = secs(res["stock " + op])
                row.checks.append(info("stock/sw", ratio(res["stock " + op], ours)))
            if "peer " + op in res:
                row.peer = secs(res["peer " + op])
            if res is top:
                mid_per = mid["shardwise " + op] / mid_count * 1e6
                if top_count >= CURVE_TOP:
                    row.checks.append(at_most("sw", ours, 10, " s"))
                else:
                    row.checks.append(Check(f"ran {top_count:,}", f"< 10 s at {CURVE_TOP:,}", None))
                row.checks.append(at_most(f"us/t vs {mid_count:,}", per / mid_per, 1.5, "x"))
            rows.append(row)
    return rows


def reshard_rows(rs: dict) -> list[Row]:
    stock = rs["stock load"]
    rows = [
        Row(
            "row->col load, 4 ranks, verify on",
            secs(stock),
            secs(rs["shardwise load"]),
            checks=[at_least("stock/sw", ratio(stock, rs["shardwise load"]), 3)],
        ),
        Row(
            "row->col load, 4 ranks, verify=False",
            secs(stock),
            secs(rs["shardwise verify=False load"]),
            checks=[info("stock/sw", ratio(stock, rs["shardwise verify=False load"]))],
        ),
    ]
    for name, label in (("shardwise", "verify on"), ("shardwise verify=False", "verify=False")):
        rows.append(
            Row(
                f"row->col bytes read/needed, worst rank, {label}",
                f"{rs['stock read/needed rchar']:.2f} (rchar)",
                f"{rs[name + ' read/needed']:.2f} (rchar {rs[name + ' read/needed rchar']:.2f})",
                checks=[at_most("sw", rs[name + " read/needed"], 1.1)],
            )
        )
    band = rs["read_tensor read/needed rchar"]
    check = at_most("sw", band, 1.1)
    if band < 0.99:  # fewer bytes than the band holds went through read(): mmap, say
        check = Check(f"sw {band:.2f}: rchar missed reads (mmap?)", check.target, None)
    rows.append(
        Row(
            "read_tensor column band: bytes read/needed",
            ours=f"{band:.2f} (rchar), {secs(rs['read_tensor seconds'])}",
            checks=[check],
        )
    )
    return rows


def large_rows(r: dict) -> list[Row]:
    ours_save, ours_load = r["shardwise save"], r["shardwise load"]
    threads = min((2, 4), key=lambda t: r[f"stock save {t} threads"])
    best_stock = min(r["stock save"], r[f"stock save {threads} threads"])
    gib = r["state bytes"] / 2**30
    return [
        Row(
            f"large save ({gib:.2f} GiB/rank) vs stock",
            secs(r["stock save"]),
            secs(ours_save),
            checks=[at_least("stock/sw", ratio(r["stock save"], ours_save), 1.5)],
        ),
        Row(
            f"large save vs stock's best thread_count ({threads})",
            secs(best_stock),
            secs(ours_save),
            checks=[at_least("stock/sw", ratio(best_stock, ours_save), 1.5)],
        ),
        Row(
            "large save vs raw write probe (fsync)",
            f"raw {secs(r['raw write'])}",
            secs(ours_save),
            checks=[at_least("raw/sw", ratio(r["raw write"], ours_save), 0.85)],
        ),
        Row(
            "large load, same layout",
            secs(r["stock load"]),
            secs(ours_load),
            checks=[
                at_least("stock/sw", ratio(r["stock load"], ours_load), 1.5),
                info("raw read/sw", ratio(r["raw read"], ours_load)),
            ],
        ),
        Row(
            "large async save: blocking part, 2nd call",
            secs(r["stock async blocking"]),
            secs(r["shardwise async blocking"]),
            checks=[
                at_least(
                    "stock/sw", ratio(r["stock async blocking"], r["shardwise async blocking"]), 10
                )
            ],
        ),
    ]


def rss_row(label: str, res: dict, key: str, allow_state: bool = False) -> Row:
    """Peak RSS growth of `key` (e.g. "save") for every engine; the target is shardwise's."""
    state = res["state bytes"]
    limit = RSS_LIMIT_MIB + (state / MiB if allow_state else 0)
    grew = res.get(f"shardwise {key} rss", math.nan)
    return Row(
        f"peak RSS growth: {label} {key}",
        mib(res.get(f"stock {key} rss")),
        mib(grew),
        mib(res.get(f"peer {key} rss")),
        [
            Check(
                f"state {mib(state)}/rank",
                f"sw <= {'state + ' if allow_state else ''}{RSS_LIMIT_MIB} MiB",
                None if math.isnan(grew) else grew / MiB <= limit,
            )
        ],
    )


def rss_rows(cases: list[tuple[str, dict]], large: dict, reshard: dict) -> list[Row]:
    rows = []
    for label, res in cases:
        rows += [rss_row(label, res, "save"), rss_row(label, res, "load")]
    rows += [
        rss_row("row->col 4 ranks", reshard, "save"),
        rss_row("row->col 4 ranks", reshard, "load"),
        rss_row("row->col 4 ranks", reshard, "verify=False load"),
        rss_row("large", large, "save"),
        rss_row("large", large, "load"),
        rss_row("large", large, "async", allow_state=True),
    ]
    return rows


def print_table(
    title: str, rows: list[Row], peer_note: str | None, peer: str = "peer (ByteCheckpoint)"
) -> None:
    header = ("case", "stock", "shardwise", peer, "ratio(s)", "target", "met?")
    cells = [header] + [
        (
            r.case,
            r.stock,
            r.ours,
            r.peer,
            "; ".join(c.shown for c in r.checks) or "-",
            "; ".join(c.target for c in r.checks) or "-",
            "/".join(c.met for c in r.checks) or "-",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n== {title}")
    for i, row in enumerate(cells):
        print(" | ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    checks = [c for r in rows for c in r.checks if c.ok is not None]
    print(f"targets met: {sum(c.ok for c in checks)} of {len(checks)} evaluated")
    if peer_note:
        print(
            f"ByteCheckpoint did not run ({peer_note}); to install it see benchmarks/bytecheckpoint_peer.py"
        )

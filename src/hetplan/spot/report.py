"""The replay's table, its picture, and the ratios of hetplan against each other policy."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from hetplan.spot.simulate import Result


def _hours(s: float | None) -> str:
    return "-" if s is None else f"{s / 3600:.2f} h"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def ratios(result: Result) -> dict[str, dict[str, float | None]]:
    """Returns, per other policy, hetplan's tokens per dollar over its, and its time to the
    target over hetplan's (both > 1 where hetplan is better; None where undefined)."""
    by = {p["name"]: p for p in result.policies}
    ours = by["hetplan"]
    out: dict[str, dict[str, float | None]] = {}
    for name, p in by.items():
        if name == "hetplan":
            continue
        tpd = None
        if ours["tokens_per_dollar"] and p["tokens_per_dollar"]:
            tpd = ours["tokens_per_dollar"] / p["tokens_per_dollar"]
        time = None
        if ours["time_to_target_s"] and p["time_to_target_s"]:
            time = p["time_to_target_s"] / ours["time_to_target_s"]
        elif ours["time_to_target_s"] and not p["time_to_target_s"]:
            time = math.inf  # the other policy never reaches the target in the trace
        tokens = ours["tokens"] / p["tokens"] if p["tokens"] > 0 else None
        out[name] = {"tokens_per_dollar": tpd, "time_to_target": time, "tokens": tokens}
    return out


def policies_table(result: Result, title: str) -> Table:
    """Returns the rich table of every policy's run."""
    table = Table(title=title, title_justify="left")
    for col in (
        "policy",
        "tokens",
        "to target",
        "GPU-hours",
        "dollars",
        "$/M tokens",
        "recovery",
        "redone",
        "waiting",
        "checkpoints",
        "preempted",
        "replans",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p in result.policies:
        table.add_row(
            p["name"],
            f"{p['tokens']:.4g}",
            _hours(p["time_to_target_s"]) if p["reached_target"] else "not reached",
            f"{p['gpu_hours']:.1f}",
            f"{p['dollars']:,.2f}",
            _num(p["usd_per_million_tokens"], ".4f"),
            _hours(p["recovery_s"]),
            _hours(p["redone_s"]),
            _hours(p["waiting_s"]),
            _hours(p["checkpoint_write_s"]),
            str(p["preemptions"]),
            str(p["replans"]),
        )
    return table


def summary_lines(result: Result) -> list[str]:
    """Returns the lines printed under the table: the checkpoint rule and the measured
    replan and recovery figures."""
    if math.isinf(result.interval_s):
        ckpt = "checkpoints: none (no preemption in the trace)"
    elif result.interval_source == "given":
        ckpt = f"checkpoints: every {result.interval_s:.0f} s of training (given)"
    else:
        ckpt = (
            f"checkpoints: every {result.interval_s:.0f} s of training (Young's optimum "
            f"sqrt(2 C M), C = {result.checkpoint_s:.1f} s to write the largest node's shards, "
            f"M = {result.mtbf_s:.0f} s between preemptions)"
        )
    lines = [
        f"first plan: {result.first_plan} at {result.first_tokens_per_s:,.0f} tokens/s",
        ckpt,
        f"trace: {result.changes} changes, {result.preemption_points} with a preemption; "
        f"arrivals are used when they pay off over {result.horizon_s:.0f} s "
        "(the mean time between changes)",
    ]
    if result.replan_times_s:
        rt = result.replan_times_s
        lines.append(
            f"replans measured: {len(rt)} distinct, {1e3 * sum(rt) / len(rt):.1f} ms mean, "
            f"{1e3 * max(rt):.1f} ms max"
        )
    if result.recovery_times_s:
        rc = result.recovery_times_s
        lines.append(
            f"hetplan recoveries (recovery MILP, peers first): {sum(rc) / len(rc):.2f} s mean, "
            f"{max(rc):.2f} s max"
        )
    for name, r in ratios(result).items():
        parts = []
        if r["tokens_per_dollar"] is not None:
            parts.append(f"{r['tokens_per_dollar']:.2f}x the tokens per dollar")
        if r["time_to_target"] is not None:
            t = r["time_to_target"]
            parts.append(
                "reaches the target where it does not"
                if math.isinf(t)
                else f"time to target {name} / hetplan = {t:.2f}"
            )
        if parts:
            lines.append(f"hetplan against {name}: {', '.join(parts)}")
    return lines + [f"note: {n}" for n in result.notes]


def write_plot(path: Path, result: Result) -> None:
    """Writes throughput and GPUs held over time, one line per policy, as a PNG (atomic)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetplan.report import save_figure

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    styles = ["-", "--", "-.", ":"]
    for k, p in enumerate(result.policies):
        line: list[Any] = p["timeline"]
        if not line:
            continue
        end = p["elapsed_s"] + line[0][0]
        xs = [t / 3600 for t, _, _ in line] + [end / 3600]
        style = {"where": "post", "label": p["name"], "ls": styles[k % 4], "lw": 1.4}
        top.step(xs, [r for _, r, _ in line] + [line[-1][1]], **style)
        bottom.step(xs, [g for _, _, g in line] + [line[-1][2]], **style)
    top.set_ylabel("tokens/s training")
    bottom.set_ylabel("GPUs held")
    bottom.set_xlabel("time (hours)")
    top.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    save_figure(fig, path, "--plot")

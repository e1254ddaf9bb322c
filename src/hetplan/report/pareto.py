"""Provisioning output: the Pareto front as a table, JSON, and a matplotlib picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from hetplan.search.provision import Constraints, Point, ProvisionResult


def point_json(p: Point) -> dict[str, Any]:
    """Returns a point as the JSON object of `provision --json`."""
    return {
        "gpus": p.gpus,
        "spot": p.spot,
        "time_to_train_s": p.time_to_train_s,
        "total_cost_usd": p.total_cost_usd,
        "usd_per_hour": p.usd_per_hour,
        "plan": None if p.plan is None else p.plan.to_dict(),
        "iteration_time_s": None if p.estimate is None else p.estimate.iteration_time_s,
        "mfu": None if p.estimate is None else p.estimate.mfu,
    }


def result_json(res: ProvisionResult) -> dict[str, Any]:
    """Returns the JSON object of `provision --json`."""
    rec = None
    if res.recommended is not None:
        rec = point_json(res.recommended) | {"reason": res.reason}
    return {
        "front": [point_json(p) for p in res.front],
        "recommended": rec,
        "reason": res.reason,
        "search_time_s": res.search_time_s,
        "configurations_planned": res.planned,
        "configurations_pruned": res.pruned,
    }


def _gpus(p: Point) -> str:
    return " + ".join(f"{n} x {t}" for t, n in p.gpus.items()) + (" (spot)" if p.spot else "")


def front_table(res: ProvisionResult, title: str) -> Table:
    """Returns the front as a table, the recommended point marked."""
    table = Table(title=title, header_style="bold")
    for col in ("", "GPUs", "days", "total $", "$/hour", "MFU", "plan"):
        table.add_column(col, justify="left" if col in ("GPUs", "plan") else "right")
    for p in res.front:
        mark = "*" if p is res.recommended else ""
        plan = ""
        if p.plan is not None:
            first = p.plan.pipelines[0]
            plan = (
                f"tp{first.stages[0].tp} pp{len(first.stages)} dp{p.plan.dp} "
                f"mb{p.plan.micro_batch_size} {p.plan.recompute} z{p.plan.zero_stage}"
            )
        table.add_row(
            mark,
            _gpus(p),
            f"{p.time_to_train_s / 86400:,.2f}",
            f"{p.total_cost_usd:,.0f}",
            f"{p.usd_per_hour:,.2f}",
            "" if p.estimate is None else f"{p.estimate.mfu:.1%}",
            plan,
        )
    return table


def write_pareto_plot(path: Path, res: ProvisionResult, constraints: Constraints) -> None:
    """Writes the front (and every planned point) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter(
        [p.time_to_train_s / 86400 for p in res.points],
        [p.total_cost_usd for p in res.points],
        s=6,
        c="lightgray",
        label="planned",
    )
    xs = [p.time_to_train_s / 86400 for p in res.front]
    ys = [p.total_cost_usd for p in res.front]
    ax.plot(xs, ys, "o-", color="tab:blue", label="Pareto front")
    # label the ends of the front and a few points between, not every point
    step = max(1, len(res.front) // 6)
    labelled = {0, len(res.front) - 1, *range(0, len(res.front), step)}
    for i, p in enumerate(res.front):
        if i in labelled:
            ax.annotate(
                _gpus(p),
                (p.time_to_train_s / 86400, p.total_cost_usd),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
    if res.recommended is not None:
        r = res.recommended
        ax.plot(
            [r.time_to_train_s / 86400],
            [r.total_cost_usd],
            "*",
            color="tab:red",
            markersize=16,
            label="recommended",
        )
    if constraints.deadline_s is not None:
        ax.axvline(constraints.deadline_s / 86400, color="tab:orange", ls="--", label="deadline")
    if constraints.budget_usd is not None:
        ax.axhline(constraints.budget_usd, color="tab:green", ls="--", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel("time to train (days)")
    ax.set_ylabel("total cost (USD)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

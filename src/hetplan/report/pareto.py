"""Provisioning output: the Pareto front as a table, JSON, and a matplotlib picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from hetplan.cluster import Cluster
from hetplan.plan import Plan
from hetplan.search.provision import Constraints, ProvisionResult
from hetplan.search.provision_points import Point, gpus_label
from hetplan.units import duration_unit


def point_json(p: Point) -> dict[str, Any]:
    """Returns a point as the JSON object of `provision --json`."""
    return {
        "gpus": p.gpus,
        "owned_gpus": p.owned,
        "spot": p.spot,
        "pricing": p.pricing,
        "time_to_train_s": p.time_to_train_s,
        "total_cost_usd": p.total_cost_usd,
        "usd_per_hour": p.usd_per_hour,
        "plan": None if p.plan is None else p.plan.to_dict(compact=True),
        "iteration_time_s": None if p.estimate is None else p.estimate.iteration_time_s,
        "mfu": None if p.estimate is None else p.estimate.mfu,
        "cost_parts_usd_per_hour": None
        if p.estimate is None or p.estimate.cost_parts is None
        else p.estimate.cost_parts.to_json(),
        "plan_label": None if p.plan is None else plan_label(p.plan, p.cluster),
    }


def result_json(res: ProvisionResult, constraints: Constraints | None = None) -> dict[str, Any]:
    """Returns the JSON object of `provision --json` (each front point with the limits it
    misses: "past deadline", "over budget", "over hourly cap")."""
    rec = None
    if res.recommended is not None:
        rec = point_json(res.recommended) | {"reason": res.reason}
    return {
        "front": [
            point_json(p) | {"misses": [m for m in _missed(p, constraints).split(", ") if m]}
            for p in res.front
        ],
        "recommended": rec,
        "reason": res.reason,
        "search_time_s": res.search_time_s,
        "configurations_planned": res.planned,
        "configurations_pruned": res.pruned,
        "configurations_impossible": res.impossible,
        "configurations_dominated": res.dominated,
        "dominated_offers": [{"offer": name, "by": by} for name, by in res.dominated_by.items()],
        "pricing": res.pricing,
        "left_out": [{"offer": name, "reason": f"no {res.pricing} price"} for name in res.left_out],
        "owned_choice": res.owned_choice,
    }


def _gpus(p: Point) -> str:
    owned = [f"{n} x {g} (owned)" for g, n in p.owned.items()]
    kind = "" if p.pricing == "on-demand" else f" ({p.pricing})"
    rented = [gpus_label(p.gpus) + kind] if p.gpus else []
    return " + ".join(owned + rented)


def _degrees(values: set[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def plan_label(plan: Plan, cluster: Cluster | None) -> str:
    """Returns a plan's shape as a person reads it: ``tp2 pp4 dp8`` for a symmetric plan;
    for a mixed or asymmetric one, the pipelines and, per GPU type, its GPUs, tensor-parallel
    degrees and stages; then the micro-batch, recomputation, ZeRO stage and idle GPUs."""
    gpu_of = {} if cluster is None else {n.name: n.gpu.name for n in cluster.nodes}
    per: dict[str, tuple[int, set[int], int]] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            gpu = gpu_of.get(st.devices[0].rsplit(":", 1)[0], "?")
            n, tps, stages = per.get(gpu, (0, set(), 0))
            per[gpu] = (n + len(st.devices), tps | {st.tp}, stages + 1)
    knobs = f"mb{plan.micro_batch_size} {plan.recompute} z{plan.zero_stage}"
    if plan.virtual_stages > 1:
        knobs += f" v{plan.virtual_stages}"
    used = len(plan.devices())
    if cluster is not None and cluster.num_gpus > used:
        knobs += f", {cluster.num_gpus - used} GPUs idle"
    first = plan.pipelines[0]
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    if len(per) == 1 and len(tps) == 1 and len({len(p.stages) for p in plan.pipelines}) == 1:
        # one GPU type, one shape: the degrees, and what differs between the replicas
        label = f"tp{first.stages[0].tp} pp{len(first.stages)} dp{plan.dp}"
        shares = [p.batch_size for p in plan.pipelines]
        if len(set(shares)) > 1:
            label += f" (batch shares {_degrees(set(shares))})"
        if len({tuple(s.layers for s in p.stages) for p in plan.pipelines}) > 1:
            label += " (layer splits differ)"
        return f"{label} {knobs}"
    depth = _degrees({len(p.stages) for p in plan.pipelines})
    parts = [
        f"{gpu}: {n} GPUs, tp{_degrees(tps)}, {stages} stage{'s' if stages > 1 else ''}"
        for gpu, (n, tps, stages) in per.items()
    ]
    noun = "stage" if depth == "1" else "stages"
    return f"{plan.dp} pipelines of {depth} {noun}; " + "; ".join(parts) + f"; {knobs}"


def _missed(p: Point, c: Constraints | None) -> str:
    """Returns which of the user's limits a point misses, or an empty string."""
    if c is None:
        return ""
    out = []
    if c.deadline_s is not None and p.time_to_train_s > c.deadline_s:
        out.append("past deadline")
    if c.budget_usd is not None and p.total_cost_usd > c.budget_usd:
        out.append("over budget")
    if c.max_usd_per_hour is not None and p.usd_per_hour > c.max_usd_per_hour:
        out.append("over hourly cap")
    return ", ".join(out)


def front_table(res: ProvisionResult, title: str, constraints: Constraints | None = None) -> Table:
    """Returns the front as a table, the recommended point marked with *, points that miss
    a deadline, budget or hourly cap marked with what they miss."""
    table = Table(title=title, header_style="bold")
    unit, length = duration_unit(max((p.time_to_train_s for p in res.front), default=0.0))
    cols = ["", "GPUs", unit, "total $", "$/hour", "MFU", "plan"]
    if constraints is not None and constraints != Constraints():
        cols.append("misses")
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPUs", "plan", "misses") else "right")
    for p in res.front:
        mark = "*" if p is res.recommended else ""
        plan = "" if p.plan is None else plan_label(p.plan, p.cluster)
        missed = [_missed(p, constraints)] if len(cols) == 8 else []
        table.add_row(
            mark,
            _gpus(p),
            f"{p.time_to_train_s / length:,.2f}",
            f"{p.total_cost_usd:,.0f}",
            f"{p.usd_per_hour:,.2f}",
            "" if p.estimate is None else f"{p.estimate.mfu:.1%}",
            plan,
            *missed,
        )
    return table


def write_pareto_plot(path: Path, res: ProvisionResult, constraints: Constraints) -> None:
    """Writes the front (and every planned point) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetplan.report import save_figure

    unit, length = duration_unit(max((p.time_to_train_s for p in res.points), default=0.0))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter(
        [p.time_to_train_s / length for p in res.points],
        [p.total_cost_usd for p in res.points],
        s=6,
        c="lightgray",
        label="planned",
    )
    xs = [p.time_to_train_s / length for p in res.front]
    ys = [p.total_cost_usd for p in res.front]
    ax.plot(xs, ys, "o-", color="tab:blue", label="Pareto front")
    # label the ends of the front and a few points between, not every point
    step = max(1, len(res.front) // 6)
    labelled = {0, len(res.front) - 1, *range(0, len(res.front), step)}
    for i, p in enumerate(res.front):
        if i in labelled:
            ax.annotate(
                _gpus(p),
                (p.time_to_train_s / length, p.total_cost_usd),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
    if res.recommended is not None:
        r = res.recommended
        ax.plot(
            [r.time_to_train_s / length],
            [r.total_cost_usd],
            "*",
            color="tab:red",
            markersize=16,
            label="recommended",
        )
    if constraints.deadline_s is not None:
        ax.axvline(constraints.deadline_s / length, color="tab:orange", ls="--", label="deadline")
    if constraints.budget_usd is not None:
        ax.axhline(constraints.budget_usd, color="tab:green", ls="--", label="budget")
    ax.set_xscale("log")
    ax.set_xlabel(f"time to train ({unit})")
    ax.set_ylabel("total cost (USD)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, "--plot")

"""Rich tables of plans and estimates, and the JSON objects the CLI prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from hetplan.cost.estimate_result import ITERATION_TERMS, Estimate
from hetplan.plan import Plan


def plan_summary(plan: Plan) -> dict[str, Any]:
    """Returns the degrees of a plan: TP per stage type, stages per pipeline, DP."""
    tps = sorted({s.tp for p in plan.pipelines for s in p.stages})
    pps = sorted({len(p.stages) for p in plan.pipelines})
    return {
        "tp": tps[0] if len(tps) == 1 else tps,
        "pp": pps[0] if len(pps) == 1 else pps,
        "dp": plan.dp,
        "uniform": plan.is_uniform(),
    }


def plan_label(plan: Plan) -> str:
    """Returns a short human label of a plan, e.g. ``tp 8, pp 4, dp 2, micro-batch 1,
    1F1B, ZeRO 1, recompute none`` (per-stage degrees joined by / when they differ)."""
    deg = plan_summary(plan)
    sched = plan.schedule + (f" x{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (
        f"tp {_degree(deg['tp'])}, pp {_degree(deg['pp'])}, dp {deg['dp']}, micro-batch "
        f"{plan.micro_batch_size}, {sched}, ZeRO {plan.zero_stage}, recompute {plan.recompute}"
    )


def _groups(plan: Plan) -> str:
    """Returns ', groups of g' where an interleaved plan's pipelines run their micro-batches
    through each chunk in groups other than their stages (``interleave_group``), else ''."""
    from hetplan.cost.schedule import interleave_group

    groups = {
        interleave_group(len(p.stages), plan.num_micro_batches(p))
        for p in plan.pipelines
        if len(p.stages) > 1 and plan.num_micro_batches(p) % len(p.stages)
    }
    return f", groups of {'/'.join(map(str, sorted(groups)))}" if groups else ""


def _degree(value: Any) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def peak_caption(ests: list[Estimate]) -> str:
    """Returns which datasheet peak the compute model and the MFU use, per GPU type."""
    seen: dict[str, list[str]] = {}
    for est in ests:
        for gpu, label in est.peak_used.items():
            if label not in seen.setdefault(gpu, []):
                seen[gpu].append(label)
    if not seen:
        return ""
    return "peak: " + "; ".join(f"{g} {' | '.join(labels)}" for g, labels in seen.items())


def plans_table(ranked: list[tuple[Plan, Estimate]], title: str) -> Table:
    """Returns a table of ranked plans: degrees, knobs, time, throughput, MFU, memory, price,
    where the compute times came from; the caption names the peak the MFU is against."""
    caption = peak_caption([e for _, e in ranked])
    table = Table(title=title, caption=caption or None, header_style="bold")
    for col in (
        "#",
        "TP",
        "PP",
        "DP",
        "mb",
        "recompute",
        "ZeRO",
        "schedule",
        "SP",
        "iter s",
        "tokens/s",
        "MFU",
        "TFLOP/s/GPU",
        "peak GB",
        "$/hour",
        "compute",
    ):
        justify = "left" if col in ("recompute", "schedule", "compute") else "right"
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, (plan, est) in enumerate(ranked, 1):
        deg = plan_summary(plan)
        sched = plan.schedule + (f"(v={plan.virtual_stages}{_groups(plan)})"
                                 if plan.virtual_stages > 1 else "")  # fmt: skip
        if deg["pp"] == 1:
            sched = "-"
        table.add_row(
            str(i),
            _degree(deg["tp"]),
            _degree(deg["pp"]),
            str(deg["dp"]),
            str(plan.micro_batch_size),
            plan.recompute,
            str(plan.zero_stage),
            sched,
            "yes" if plan.sequence_parallel else "no",
            f"{est.iteration_time_s:.3f}",
            f"{est.tokens_per_s:,.0f}",
            f"{est.mfu:.1%}",
            f"{est.tflops_per_gpu:.0f}",
            _gb(est.max_memory_bytes),
            "-" if est.cost_usd_per_hour is None else f"{est.cost_usd_per_hour:,.2f}",
            est.compute_source,
        )
    return table


def term_label(key: str) -> str:
    """Returns a breakdown key as a table shows it: ``pipeline_send_s_per_micro_batch`` is
    'pipeline send per micro batch'."""
    return key.removesuffix("_s").replace("_s_", "_").replace("_", " ")


def breakdown_table(est: Estimate) -> Table:
    """Returns the iteration-time breakdown of the critical stage; the caption names it,
    where its compute times came from and the peak they are measured against."""
    crit = max(est.distinct_stages, key=lambda s: s.end_s) if est.distinct_stages else None
    lines = [f"critical: {est.bottleneck}"]
    if crit is not None:
        lines.append(f"compute: {crit.compute_source} (plan: {est.compute_source})")
        if crit.gpu in est.peak_used:
            lines.append(f"peak: {crit.gpu} {est.peak_used[crit.gpu]}")
    money = est.cost_parts  # rental, amortisation, energy (cost/money.py)
    if money is not None and money.total > 0:
        per_m = money.scaled(1e6 / (est.tokens_per_s * 3600))
        for unit, m in (("$/hour", money), ("$ per million tokens", per_m)):
            lines.append(f"{unit}: {m.total:,.4g} = rental {m.rental:,.4g} + amortisation "
                         f"{m.amortisation:,.4g} + energy {m.energy:,.4g}")  # fmt: skip
    table = Table(
        title="Iteration breakdown",
        caption="\n".join(lines),
        caption_justify="left",
        header_style="bold",
        min_width=max(map(len, lines)),  # the caption lines unwrapped
    )
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for key in ITERATION_TERMS:
        value = est.breakdown[key]
        table.add_row(
            term_label(key),
            f"{value:.4f}",
            f"{value / est.iteration_time_s:.1%}",
        )
    table.add_row("iteration", f"{est.iteration_time_s:.4f}", "100%", style="bold")
    return table


def estimate_json(plan: Plan, est: Estimate, expand: bool = False) -> dict[str, Any]:
    """Returns the estimate's JSON object (with its per-stage compute sources, the peaks
    used and the warnings) with the plan attached, repeated pipelines compact; ``expand``:
    the plan's every device and each device's peak memory."""
    out = est.to_json(expand)
    out["warnings"] = list(est.warnings)
    out["peak_used"] = dict(est.peak_used)
    out["compute_source"] = est.compute_source
    out["plan"] = plan.to_dict(compact=not expand)
    out["degrees"] = plan_summary(plan)
    return out

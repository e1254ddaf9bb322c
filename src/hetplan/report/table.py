"""Rich tables of plans and estimates, and the JSON objects the CLI prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from hetplan.cost.estimate import Estimate
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


def _degree(value: Any) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def plans_table(ranked: list[tuple[Plan, Estimate]], title: str) -> Table:
    """Returns a table of ranked plans: degrees, knobs, time, throughput, MFU, memory, price."""
    table = Table(title=title, header_style="bold")
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
    ):
        justify = "left" if col in ("recompute", "schedule") else "right"
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, (plan, est) in enumerate(ranked, 1):
        deg = plan_summary(plan)
        sched = plan.schedule + (f"(v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
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
            _gb(max(est.peak_memory_bytes.values())),
            "-" if est.cost_usd_per_hour is None else f"{est.cost_usd_per_hour:,.2f}",
        )
    return table


def breakdown_table(est: Estimate) -> Table:
    """Returns the iteration-time breakdown of the critical stage."""
    table = Table(
        title="Iteration breakdown", caption=f"critical: {est.bottleneck}", header_style="bold"
    )
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for key in (
        "forward_s",
        "backward_s",
        "recompute_s",
        "tensor_parallel_comm_s",
        "pipeline_bubble_s",
        "data_parallel_sync_s",
        "optimizer_s",
    ):
        value = est.breakdown[key]
        table.add_row(
            key.removesuffix("_s").replace("_", " "),
            f"{value:.4f}",
            f"{value / est.iteration_time_s:.1%}",
        )
    table.add_row("iteration", f"{est.iteration_time_s:.4f}", "100%", style="bold")
    return table


def estimate_json(plan: Plan, est: Estimate) -> dict[str, Any]:
    """Returns the estimate's JSON object with the plan attached."""
    out = est.to_json()
    out["plan"] = plan.to_dict()
    out["degrees"] = plan_summary(plan)
    return out

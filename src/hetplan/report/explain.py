"""Why a plan is as fast as it is: per stage and per replica figures, and the bottleneck."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import ITERATION_TERMS
from hetplan.cost.params import CostParams, default_params
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.report.table import term_label


def explain(
    plan: Plan,
    model: ModelSpec,
    cluster: Cluster,
    params: CostParams | None = None,
    expand: bool = False,
) -> dict[str, Any]:
    """Returns a JSON-ready explanation: stages (with where their compute times came from),
    replicas, the bottleneck, the estimate's warnings and peaks, and the fitted terms of the
    GPU types the plan uses (when the parameters carry them).

    Pipelines the estimate costs as one (same stages on the same hardware) are listed once,
    with ``count`` saying how many pipelines repeat them, so 2,048 identical pipelines read
    as one entry; ``expand`` lists every pipeline and stage."""
    params = params or default_params()
    est = estimate(plan, model, cluster, params)
    counts = est.replicas if est.pipeline_class else {r: 1 for r in range(plan.dp)}
    listed = est.stages if expand else est.distinct_stages
    stages = []
    for st in listed:
        pipe = plan.pipelines[st.pipeline]
        start, end = pipe.layer_ranges()[st.stage]
        stages.append(
            {
                "pipeline": st.pipeline,
                "count": 1 if expand else counts.get(st.pipeline, 1),
                "stage": st.stage,
                "gpu": st.gpu,
                "devices": list(st.devices),
                "tp": len(st.devices),
                "layers": st.layers,
                "layer_range": [start, end],
                "compute_source": st.compute_source,
                "time_per_micro_batch_s": st.per_micro_batch_s,
                "overhead_s": st.overhead_s,
                "send_s": st.send_s,
                "memory_gb": st.memory.total / 1e9,
                "capacity_gb": st.capacity_bytes / 1e9,
                "headroom_gb": st.headroom_bytes / 1e9,
                "busy_s": st.busy_s,
                "grad_sync_s": st.grad_sync_s,
                "end_s": st.end_s,
            }
        )
    by_pipe: dict[int, list[Any]] = {}
    for st in listed:
        by_pipe.setdefault(st.pipeline, []).append(st)
    replicas = []
    for r, own in by_pipe.items():
        pipe = plan.pipelines[r]
        slow = max(own, key=lambda s: s.per_micro_batch_s)
        replicas.append(
            {
                "pipeline": r,
                "count": 1 if expand else counts.get(r, 1),
                "batch_size": pipe.batch_size,
                "batch_share": pipe.batch_size / plan.global_batch_size,
                "micro_batches": plan.num_micro_batches(pipe),
                "stages": len(pipe.stages),
                "gpus": sorted({s.gpu for s in own}),
                "pipeline_time_s": est.pipeline_times_s[r],
                "end_s": max(s.end_s for s in own),
                "slowest_stage": slow.stage,
            }
        )
    crit = max(est.distinct_stages, key=lambda s: s.end_s)
    ends = [rep["end_s"] for rep in replicas]
    used = sorted({st.gpu for st in est.distinct_stages})
    all_terms = params.fit_report.get("terms", {})
    terms = {g: all_terms[g] for g in used if isinstance(all_terms.get(g), dict)}
    return {
        "iteration_time_s": est.iteration_time_s,
        "fits": est.fits,
        "memory_shortfall": est.memory_shortfall(),
        "compute_source": est.compute_source,
        "peak_used": est.peak_used,
        "warnings": est.warnings,
        "fitted_terms": terms,
        "pipelines": plan.dp,
        "stages": stages,
        "replicas": replicas,
        "bottleneck": {
            "pipeline": crit.pipeline,
            "stage": crit.stage,
            "gpu": crit.gpu,
            "description": est.bottleneck,
            "breakdown": est.breakdown,
            "replica_spread_s": max(ends) - min(ends),
        },
    }


def explain_table(explanation: dict[str, Any]) -> list[Table]:
    """Returns rich tables for an explanation: stages, then replicas and the bottleneck
    (the fitted terms are ``fitted_terms_table``'s)."""
    peaks = explanation.get("peak_used", {})
    caption = "; ".join(f"{g}: {label}" for g, label in peaks.items())
    stages = Table(title="Stages", caption=f"peak: {caption}" if caption else None)
    for col in (
        "pipe",
        "copies",
        "stage",
        "GPU",
        "devices",
        "layers",
        "compute",
        "ms/micro-batch",
        "mem GB",
        "free GB",
    ):
        left = col in ("GPU", "devices", "compute")
        stages.add_column(col, justify="left" if left else "right")
    crit = explanation["bottleneck"]
    for st in explanation["stages"]:
        devs = st["devices"]
        shown = devs[0] if len(devs) == 1 else f"{devs[0]} (+{len(devs) - 1})"
        mark = " *" if (st["pipeline"], st["stage"]) == (crit["pipeline"], crit["stage"]) else ""
        stages.add_row(
            str(st["pipeline"]),
            str(st.get("count", 1)),
            f"{st['stage']}{mark}",
            st["gpu"],
            shown,
            f"{st['layers']} [{st['layer_range'][0]}-{st['layer_range'][1]})",
            st.get("compute_source", "analytical"),
            f"{st['time_per_micro_batch_s'] * 1e3:.2f}",
            f"{st['memory_gb']:.1f}/{st['capacity_gb']:.0f}",
            f"{st['headroom_gb']:.1f}",
        )
    reps = Table(title="Replicas")
    cols = (
        "pipe",
        "copies",
        "batch",
        "share",
        "micro-batches",
        "stages",
        "GPUs",
        "time s",
        "ends s",
    )
    for col in cols:
        reps.add_column(col, justify="left" if col == "GPUs" else "right")
    for rep in explanation["replicas"]:
        reps.add_row(
            str(rep["pipeline"]),
            str(rep.get("count", 1)),
            str(rep["batch_size"]),
            f"{rep['batch_share']:.1%}",
            str(rep["micro_batches"]),
            str(rep["stages"]),
            ", ".join(rep["gpus"]),
            f"{rep['pipeline_time_s']:.3f}",
            f"{rep['end_s']:.3f}",
        )
    bott = Table(title=f"Bottleneck: {crit['description']}")
    bott.add_column("term")
    bott.add_column("seconds", justify="right")
    terms = crit["breakdown"]
    for key in ITERATION_TERMS:  # these add up to the iteration
        bott.add_row(term_label(key), f"{terms[key]:.4f}")
    total = sum(terms[key] for key in ITERATION_TERMS)
    bott.add_row("iteration (the sum)", f"{total:.4f}", style="bold")
    for key, value in terms.items():  # parts of the terms above, shown apart
        if key not in ITERATION_TERMS:
            bott.add_row(f"{term_label(key)} (inside the above)", f"{value:.4f}", style="dim")
    bott.add_row(
        "replica spread (how long the fastest replica idles; not in the sum)",
        f"{crit['replica_spread_s']:.4f}",
        style="dim",
    )
    return [stages, reps, bott]


def fitted_terms_table(explanation: dict[str, Any]) -> Table | None:
    """Returns the fitted cost-model terms of the plan's GPU types (value, unit, whether the
    fit left them on a bound), or None when the parameters carry no fit report."""
    terms: dict[str, dict[str, Any]] = explanation.get("fitted_terms", {})
    if not terms:
        return None
    table = Table(title="fitted terms", header_style="bold")
    for col in ("GPU", "term", "value", "unit", "at bound"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for gpu, by_term in terms.items():
        for name, term in by_term.items():
            if not isinstance(term, dict):
                continue
            value = term.get("value")
            bound = term.get("at_bound")
            table.add_row(
                gpu,
                name,
                "-" if value is None else f"{value:.4g}",
                str(term.get("unit", "")),
                str(bound) if bound else "-",
                style="yellow" if bound else None,
            )
    return table

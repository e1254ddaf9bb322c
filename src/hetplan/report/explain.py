"""Why a plan is as fast as it is: per stage and per replica figures, and the bottleneck."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams
from hetplan.model import ModelSpec
from hetplan.plan import Plan


def explain(
    plan: Plan, model: ModelSpec, cluster: Cluster, params: CostParams | None = None
) -> dict[str, Any]:
    """Returns a JSON-ready explanation: stages, replicas, and the bottleneck."""
    est = estimate(plan, model, cluster, params)
    stages = []
    for st in est.stages:
        pipe = plan.pipelines[st.pipeline]
        start, end = pipe.layer_ranges()[st.stage]
        stages.append(
            {
                "pipeline": st.pipeline,
                "stage": st.stage,
                "gpu": st.gpu,
                "devices": list(st.devices),
                "tp": len(st.devices),
                "layers": st.layers,
                "layer_range": [start, end],
                "time_per_micro_batch_s": st.per_micro_batch_s,
                "send_s": st.send_s,
                "memory_gb": st.memory.total / 1e9,
                "capacity_gb": st.capacity_bytes / 1e9,
                "headroom_gb": st.headroom_bytes / 1e9,
                "busy_s": st.busy_s,
                "grad_sync_s": st.grad_sync_s,
                "end_s": st.end_s,
            }
        )
    replicas = []
    for r, pipe in enumerate(plan.pipelines):
        own = [s for s in est.stages if s.pipeline == r]
        slow = max(own, key=lambda s: s.per_micro_batch_s)
        replicas.append(
            {
                "pipeline": r,
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
    crit = max(est.stages, key=lambda s: s.end_s)
    ends = [max(s.end_s for s in est.stages if s.pipeline == r) for r in range(plan.dp)]
    return {
        "iteration_time_s": est.iteration_time_s,
        "fits": est.fits,
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
    """Returns rich tables for an explanation: stages, then replicas and the bottleneck."""
    stages = Table(title="Stages")
    for col in ("pipe", "stage", "GPU", "devices", "layers", "ms/micro-batch", "mem GB", "free GB"):
        stages.add_column(col, justify="right" if col not in ("GPU", "devices") else "left")
    crit = explanation["bottleneck"]
    for st in explanation["stages"]:
        devs = st["devices"]
        shown = devs[0] if len(devs) == 1 else f"{devs[0]} (+{len(devs) - 1})"
        mark = " *" if (st["pipeline"], st["stage"]) == (crit["pipeline"], crit["stage"]) else ""
        stages.add_row(
            str(st["pipeline"]),
            f"{st['stage']}{mark}",
            st["gpu"],
            shown,
            f"{st['layers']} [{st['layer_range'][0]}-{st['layer_range'][1]})",
            f"{st['time_per_micro_batch_s'] * 1e3:.2f}",
            f"{st['memory_gb']:.1f}/{st['capacity_gb']:.0f}",
            f"{st['headroom_gb']:.1f}",
        )
    reps = Table(title="Replicas")
    for col in ("pipe", "batch", "share", "micro-batches", "stages", "GPUs", "time s", "ends s"):
        reps.add_column(col, justify="left" if col == "GPUs" else "right")
    for rep in explanation["replicas"]:
        reps.add_row(
            str(rep["pipeline"]),
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
    for key, value in crit["breakdown"].items():
        bott.add_row(key, f"{value:.4f}")
    bott.add_row("replica spread (fastest replica idles)", f"{crit['replica_spread_s']:.4f}")
    return [stages, reps, bott]

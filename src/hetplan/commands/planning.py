"""``plan`` (search the best plans) and ``explain`` (a plan stage by stage); ``register``
adds them with ``predict`` (its own module) between them, as --help lists them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from hetplan.cluster import Cluster, load_cluster
from hetplan.commands.common import (
    load_cost,
    no_fit_message,
    out,
    print_json,
    print_warnings,
    resolve_batch,
    resolve_precision,
    tf32_note,
    write_pictures,
)
from hetplan.commands.options import (
    BatchOpt,
    ClusterOpt,
    DpLimit,
    FlashLimit,
    GpuTypesLimit,
    HeadroomLimit,
    JsonOpt,
    MaxGpusLimit,
    MbLimit,
    ModelOpt,
    OverlapTpOpt,
    ParamsOpt,
    PlanArg,
    PlanOpt,
    PpLimit,
    PrecOpt,
    ProfileOpt,
    RecomputeLimit,
    ScheduleLimit,
    SeqOpt,
    SpLimit,
    TimelineOpt,
    TpLimit,
    TraceOpt,
    VsLimit,
    ZeroLimit,
    plan_file,
)
from hetplan.commands.predict import predict
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams
from hetplan.errors import InputError
from hetplan.model import ModelSpec, load_model
from hetplan.outputs import check_output
from hetplan.plan import Plan, load_plan, model_for_plan
from hetplan.report import require_matplotlib
from hetplan.report.table import breakdown_table, estimate_json, plan_label, plans_table


def register(app: typer.Typer) -> None:
    """Adds ``plan``, ``predict`` and ``explain`` to ``app`` (in the order --help lists)."""
    app.command()(plan)
    app.command()(predict)
    app.command()(explain)


def plan(
    model: ModelOpt,
    cluster: ClusterOpt,
    global_batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    precision: PrecOpt = None,
    top: Annotated[int, typer.Option("--top", "-k", help="How many plans to show")] = 5,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Write best plan")] = None,
    as_json: JsonOpt = False,
    expand: Annotated[
        bool,
        typer.Option(
            "--expand",
            help="Write plans with every device listed (and --json: each device's peak "
            "memory) instead of repeated pipelines as one entry",
        ),
    ] = False,
    trace: TraceOpt = None,
    timeline: TimelineOpt = None,
    heterogeneous: Annotated[
        bool, typer.Option("--heterogeneous", help="Asymmetric search on one GPU type too")
    ] = False,
    explain_best: Annotated[bool, typer.Option("--explain", help="Explain the best plan")] = False,
    tp: TpLimit = None,
    pp: PpLimit = None,
    dp: DpLimit = None,
    micro_batch_size: MbLimit = None,
    virtual_stages: VsLimit = None,
    zero_stage: ZeroLimit = None,
    recompute: RecomputeLimit = None,
    schedule: ScheduleLimit = None,
    sequence_parallel: SpLimit = None,
    flash_attention: FlashLimit = None,
    gpu_types: GpuTypesLimit = None,
    memory_headroom: HeadroomLimit = None,
    max_gpus: MaxGpusLimit = None,
    overlap_tp_comm: OverlapTpOpt = False,
    params_path: ParamsOpt = None,
    profile_path: ProfileOpt = None,
) -> None:
    """Search the best parallel plans for a model on a cluster.

    The plan options (--tp, --pp, --dp, --micro-batch-size, --virtual-stages, --zero-stage,
    --recompute, --schedule, --sequence-parallel, --flash-attention, --gpu-types,
    --memory-headroom, --max-gpus) constrain the search: a value pins, a list or range
    limits. --overlap-tp-comm searches plans that overlap TP collectives (as for predict)."""
    require_matplotlib("--timeline", timeline)
    check_output(trace, "--trace")
    check_output(out_path, "--out")
    from hetplan.search.constraints import constraints_from_options

    limits = constraints_from_options(
        tp, pp, dp, micro_batch_size, virtual_stages, zero_stage, recompute, schedule,
        sequence_parallel, flash_attention, gpu_types, memory_headroom, max_gpus,
        overlap_tp_comm,
    )  # fmt: skip
    spec = load_model(model, seq_len)
    whole = load_cluster(cluster)
    cl = limits.apply_to_cluster(whole)
    prec = resolve_precision(cl, precision)
    batch = resolve_batch(spec, global_batch_size)
    params = load_cost(params_path, profile_path)
    tf32_note(cl.gpu_types_used(), prec, as_json)
    if top <= 0:
        raise InputError("--top", "must be positive")
    start = time.perf_counter()
    search = _plan_search(spec, whole, batch, prec, params, heterogeneous)
    from hetplan.report.progress import ProgressBar

    with ProgressBar.for_cli(as_json) as bar:  # after a second, on a terminal, not --json
        ranked, no_fit, result, baselines = search(limits, top, bar)
    elapsed = time.perf_counter() - start
    if not ranked:
        if limits.active:
            field, reason = _infeasible(search, limits, spec, limits.apply_to_cluster(whole), batch)
            raise InputError(field, reason)
        raise InputError("plan", no_fit)
    ranked = [(dataclasses.replace(p, model=spec), e) for p, e in ranked]  # files state it
    best_plan, best_est = ranked[0]
    if out_path is not None:
        best_plan.save(out_path, compact=not expand)
    write_pictures(best_plan, spec, cl, params, trace, timeline)
    if as_json:
        result.update(
            {
                "model": spec.name,
                "global_batch_size": batch,
                "precision": prec,
                "constraints": limits.described(),
                "plans": [estimate_json(p, e, expand) for p, e in ranked],
                "search_time_s": elapsed,
                "warnings": best_est.warnings,
            }
        )
        if baselines is not None:
            result["baselines"] = baselines
        print_json(result)
        return
    within = f", within {' '.join(limits.described())}" if limits.active else ""
    title = (
        f"{spec.name} on {cl.num_gpus} GPUs ({', '.join(g.name for g in cl.gpu_types_used())})"
        f", batch {batch} x {spec.seq} tokens, {prec}{within}: best plans "
        f"(searched in {elapsed:.2f} s)"
    )
    out.print(plans_table(ranked, title))
    print_warnings(best_est.warnings)
    if baselines is not None:
        _print_baselines(best_est, baselines)
    out.print(breakdown_table(best_est))
    if explain_best:
        _print_explain(best_plan, spec, cl, params)
    if out_path is not None:
        out.print(f"best plan written to {out_path}")


SearchOutcome = tuple[list[tuple[Plan, Estimate]], str, dict[str, Any], dict[str, Any] | None]


def _plan_search(
    spec: ModelSpec, cl: Cluster, batch: int, prec: str, params: CostParams, heterogeneous: bool
) -> Any:
    """Returns a function (constraints, top) -> (ranked plans, why none fits where none
    does, extra JSON fields, baselines) running the search a cluster calls for; each call
    cuts the cluster to its own constraints (GPU types, headroom, GPU count), so a relaxed
    one sees it whole."""
    from hetplan.search.constraints import PlanConstraints, homogeneous_space

    whole = cl

    def run(limits: PlanConstraints, top: int, progress: Any = None) -> SearchOutcome:
        cl = limits.apply_to_cluster(whole)
        flash = True if limits.flash_attention is None else limits.flash_attention
        if cl.is_homogeneous() and not heterogeneous:
            from hetplan.search.homogeneous import search_homogeneous

            res = search_homogeneous(spec, cl, batch, prec, top, params,
                                     space=homogeneous_space(limits),
                                     flash_attention=flash, progress=progress)  # fmt: skip
            from hetplan.search.homogeneous_candidates import no_layout_reason

            extra = {"candidates": res.candidates, "fitting": res.fitting}
            why = ""
            if not res.candidates:
                why = no_layout_reason(spec, cl.num_gpus, cl.nodes[0].gpus, batch)
            return res.ranked, no_fit_message(res.min_memory_bytes, cl, no_layout=why), extra, None
        from hetplan.search.heterogeneous import search_heterogeneous

        hres = search_heterogeneous(spec, cl, batch, prec, top, params, flash, limits, progress)
        baselines = {
            k: (None if v is None else estimate_json(*v)) for k, v in hres.baselines.items()
        }
        no_fit = no_fit_message(hres.min_memory_bytes, cl, hres.state_floor_bytes)
        return hres.ranked, no_fit, {"notes": hres.notes}, baselines

    return run


def _infeasible(
    search: Any, limits: Any, spec: ModelSpec, cl: Cluster, batch: int
) -> tuple[str, str]:
    """Returns (option, reason) for a constrained search that found no plan: the first
    constraint without which a plan exists (each tried alone), with why none of its tensor-
    parallel degrees can be where that is plain from the model and cluster; else all."""
    for text, option, relaxed in limits.relaxations():
        ranked = search(relaxed, 1)[0]
        if ranked:
            why = limits.obstacle(option, spec, max(n.gpus for n in cl.nodes), cl.num_gpus,
                                  batch)  # fmt: skip
            return option, (
                f"no plan satisfies {text} with the other constraints"
                + (f": {why}" if why else "")
                + f"; without it the best plan is {plan_label(ranked[0][0])}"
            )
    given = " ".join(limits.described())
    return "plan", f"no plan satisfies {given}, nor any of them relaxed alone"


def _print_baselines(best: Estimate, baselines: dict[str, Any]) -> None:
    for name, label in (
        ("single_type", "best single GPU type"),
        ("uniform", "Megatron-style uniform plan"),
    ):
        base = baselines.get(name)
        if base is None:
            out.print(f"baseline {label}: no plan fits")
        else:
            speedup = base["iteration_time_s"] / best.iteration_time_s
            out.print(
                f"baseline {label}: {base['iteration_time_s']:.3f} s/iteration, "
                f"chosen plan is {speedup:.2f}x faster"
            )


def _print_explain(plan_: Plan, spec: ModelSpec, cl: Cluster, params: CostParams) -> None:
    from hetplan.report.explain import explain as explain_plan
    from hetplan.report.explain import explain_table, fitted_terms_table

    # the warnings were printed under the plans table
    info = explain_plan(plan_, spec, cl, params)
    for table in explain_table(info):
        out.print(table)
    terms = fitted_terms_table(info)
    if terms is not None:
        out.print(terms)


def explain(
    plan_arg: PlanArg = None,
    *,
    model: ModelOpt,
    cluster: ClusterOpt,
    plan_opt: PlanOpt = None,
    seq_len: SeqOpt = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="Override the plan's precision")
    ] = None,
    as_json: JsonOpt = False,
    params_path: ParamsOpt = None,
    profile_path: ProfileOpt = None,
    expand: Annotated[
        bool,
        typer.Option(
            "--expand",
            help="List every pipeline and stage instead of identical pipelines once, "
            "with their count",
        ),
    ] = False,
) -> None:
    """Explain a plan: per stage and replica times, memory headroom, the bottleneck."""
    from hetplan.report.explain import explain as explain_plan
    from hetplan.report.explain import explain_table, fitted_terms_table

    plan_path, named = plan_file(plan_arg, plan_opt)
    assert plan_path is not None
    spec = load_model(model, seq_len)
    cl = load_cluster(cluster)
    the_plan = load_plan(plan_path, cl, option=named)
    spec = model_for_plan(the_plan, spec, seq_len)
    if precision is not None:
        the_plan = dataclasses.replace(the_plan, precision=resolve_precision(cl, precision))
    info = explain_plan(the_plan, spec, cl, load_cost(params_path, profile_path), expand)
    if as_json:
        print_json(info)
    else:
        for table in explain_table(info):
            out.print(table)
        terms = fitted_terms_table(info)
        if terms is not None:
            out.print(terms)
        print_warnings(info["warnings"])
    if info["memory_shortfall"] is not None:  # explained, then refused: it cannot run
        raise InputError(named, f"does not fit in memory: {info['memory_shortfall']}")

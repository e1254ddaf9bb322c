"""The hetplan command line: plan, predict, calibrate, explain (and runtime commands)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from hetplan.cluster import Cluster, load_cluster
from hetplan.cost.estimate import Estimate, estimate
from hetplan.cost.params import CostParams, load_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec, load_model
from hetplan.plan import PRECISIONS, Plan, load_plan
from hetplan.report import require_matplotlib
from hetplan.report.table import breakdown_table, estimate_json, plan_label, plans_table

app = typer.Typer(
    name="hetplan",
    help="Plan and run large-model training on clusters of mixed GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# a pipe gets wide lines rather than rich's 80-column default, so tables stay readable
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Catalog name or config.json")]
ClusterOpt = Annotated[
    str, typer.Option("--cluster", "-c", help="Cluster YAML, or inline 'A100-80GB:4x8,T4:1x4'")
]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="Override the sequence length")]
PrecOpt = Annotated[
    str | None,
    typer.Option("--precision", help="fp32, tf32, bf16 or fp16 (default: bf16 where supported)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object")]
BatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch-size", "-b", help="Sequences per iteration (default: the model's)"
    ),
]
TraceOpt = Annotated[Path | None, typer.Option("--trace", help="Write a Chrome-trace JSON")]
TimelineOpt = Annotated[Path | None, typer.Option("--timeline", help="Write a timeline PNG")]
ParamsOpt = Annotated[
    Path | None, typer.Option("--params", help="Cost-model parameters (hetplan calibrate)")
]
PROFILE_ENV = "HETPLAN_PROFILE"
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help=f"Measured profile database (SQLite): its times replace modelled ones wherever "
        f"it has them (default: ${PROFILE_ENV}, else none)",
        show_default=False,
    ),
]
LIMIT = "a value pins, a list (1,2,4) or a range (2..16) limits"
TpLimit = Annotated[str | None, typer.Option("--tp", help=f"Tensor-parallel degrees: {LIMIT}")]
PpLimit = Annotated[str | None, typer.Option("--pp", help=f"Pipeline stages: {LIMIT}")]
DpLimit = Annotated[str | None, typer.Option("--dp", help=f"Data-parallel replicas: {LIMIT}")]
MbLimit = Annotated[
    str | None, typer.Option("--micro-batch-size", help=f"Micro-batch sizes: {LIMIT}")
]
VsLimit = Annotated[
    str | None, typer.Option("--virtual-stages", help=f"Model chunks per stage: {LIMIT}")
]
ZeroLimit = Annotated[str | None, typer.Option("--zero-stage", help=f"ZeRO stages: {LIMIT}")]
RecomputeLimit = Annotated[
    str | None, typer.Option("--recompute", help="none, selective, full, or a list of them")
]
ScheduleLimit = Annotated[
    str | None,
    typer.Option("--schedule", help="1F1B, Interleaved1F1B, GPipe, or a list of them"),
]
SpLimit = Annotated[
    bool | None,
    typer.Option(
        "--sequence-parallel/--no-sequence-parallel",
        help="Sequence parallelism (default: searched)",
    ),
]
FlashLimit = Annotated[
    bool | None,
    typer.Option("--flash-attention/--no-flash-attention", help="Flash attention (default: on)"),
]
GpuTypesLimit = Annotated[
    str | None, typer.Option("--gpu-types", help="Use only these GPU types, e.g. A100-80GB,T4")
]
HeadroomLimit = Annotated[
    float | None,
    typer.Option("--memory-headroom", help="Share of each GPU's memory to leave free, e.g. 0.1"),
]
MaxGpusLimit = Annotated[
    int | None,
    typer.Option("--max-gpus", help="At most this many GPUs (plan: the cluster's first nodes)"),
]
OverlapTpOpt = Annotated[
    bool,
    typer.Option(
        "--overlap-tp-comm/--no-overlap-tp-comm",
        help="Plans overlap TP collectives with the matmuls, as predict's option: a fitted "
        "share hidden, with sequence parallelism only (default: off)",
    ),
]
TF32_NOTE = (
    "note: fp32 uses the FP32 CUDA-core peak; PyTorch with TF32 enabled (NGC containers, "
    "torch.backends.cuda.matmul.allow_tf32=True) runs fp32 matmuls on TF32 tensor cores: "
    "--precision tf32"
)


def open_profile(profile_path: Path | None) -> Any:
    """Returns the ProfileDB at ``profile_path`` (else at $HETPLAN_PROFILE), or None.

    The path must name an existing SQLite file: opening a profile never creates one."""
    origin = ""
    if profile_path is None:
        env = os.environ.get(PROFILE_ENV, "").strip()
        if not env:
            return None
        profile_path, origin = Path(env), f" (from ${PROFILE_ENV})"
    if not profile_path.is_file():
        raise InputError("--profile", f"no such file: {profile_path}{origin}")
    try:
        with profile_path.open("rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise InputError(
            "--profile", f"cannot read {profile_path}{origin}: {exc.strerror}"
        ) from None
    if not head.startswith(b"SQLite format 3"):
        raise InputError("--profile", f"{profile_path}{origin} is not an SQLite profile database")
    import importlib
    import sqlite3

    try:  # the profile database moved from runtime/ to measured/
        module = importlib.import_module("hetplan.measured.profile_db")
    except ModuleNotFoundError:
        module = importlib.import_module("hetplan.runtime.profile_db")
    try:
        return module.ProfileDB(profile_path)
    except sqlite3.Error as exc:
        raise InputError("--profile", f"cannot open {profile_path}{origin}: {exc}") from None


def load_cost(params_path: Path | None, profile_path: Path | None) -> CostParams:
    """Returns the cost-model parameters of ``--params`` (else the shipped ones), reading
    compute times from the measured profile of ``--profile`` (else $HETPLAN_PROFILE) first."""
    params = load_params(params_path)
    db = open_profile(profile_path)
    return params if db is None else params.with_profile(db)


def print_json(obj: Any) -> None:
    """Writes one JSON object to stdout with the standard library (no highlighting: a
    large plan prints in milliseconds, not through rich)."""
    sys.stdout.write(json.dumps(obj))
    sys.stdout.write("\n")
    sys.stdout.flush()


def _tf32_note(gpus: Any, precision: str, as_json: bool) -> None:
    """Prints, once, that fp32 means CUDA cores when a GPU has TF32 tensor cores."""
    if precision == "fp32" and not as_json and any(g.has_tf32 for g in gpus):
        err.print(TF32_NOTE, highlight=False, soft_wrap=True)


def _print_warnings(warnings: list[str]) -> None:
    for line in warnings:
        out.print(f"[bold yellow]warning:[/] {line}", highlight=False, soft_wrap=True)


def _precision(cluster: Cluster, precision: str | None) -> str:
    if precision is None:
        return "bf16" if all(g.supports("bf16") for g in cluster.gpu_types_used()) else "fp16"
    if precision not in PRECISIONS:
        raise InputError("--precision", f"'{precision}' is not fp32, tf32, bf16 or fp16")
    for gpu in cluster.gpu_types_used():
        if not gpu.supports(precision):
            raise InputError("--precision", f"{gpu.name} has no {precision} support")
    return precision


def _batch(model: ModelSpec, global_batch: int | None) -> int:
    if global_batch is None:
        return model.default_global_batch
    if global_batch <= 0:
        raise InputError("--global-batch-size", "must be positive")
    return global_batch


def _write_pictures(
    plan: Plan,
    model: ModelSpec,
    cluster: Cluster,
    params: CostParams,
    trace: Path | None,
    timeline: Path | None,
) -> None:
    if trace is None and timeline is None:
        return
    recorded = estimate(plan, model, cluster, params, record=True)
    if trace is not None:
        from hetplan.report.trace import write_trace

        write_trace(trace, plan, recorded)
    if timeline is not None:
        from hetplan.report.timeline import write_timeline

        write_timeline(timeline, plan, recorded)


def _no_fit_message(min_bytes: float, cluster: Cluster) -> str:
    capacity = max(g.memory_bytes for g in cluster.gpu_types_used())
    if min_bytes == float("inf"):
        return "no plan: no parallel layout divides this model, batch and cluster"
    return (
        f"no plan fits in memory: the smallest per-GPU need of any plan is "
        f"{min_bytes / 1e9:.1f} GB, the largest GPU has {capacity / 1e9:.1f} GB"
    )


@app.command()
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
    from hetplan.search.constraints import constraints_from_options

    limits = constraints_from_options(
        tp, pp, dp, micro_batch_size, virtual_stages, zero_stage, recompute, schedule,
        sequence_parallel, flash_attention, gpu_types, memory_headroom, max_gpus,
        overlap_tp_comm,
    )  # fmt: skip
    spec = load_model(model, seq_len)
    cl = limits.apply_to_cluster(load_cluster(cluster))
    prec = _precision(cl, precision)
    batch = _batch(spec, global_batch_size)
    params = load_cost(params_path, profile_path)
    _tf32_note(cl.gpu_types_used(), prec, as_json)
    if top <= 0:
        raise InputError("--top", "must be positive")
    start = time.perf_counter()
    search = _plan_search(spec, cl, batch, prec, params, heterogeneous)
    from hetplan.report.progress import ProgressBar

    with ProgressBar.for_cli(as_json) as bar:  # after a second, on a terminal, not --json
        ranked, min_mem, result, baselines = search(limits, top, bar)
    elapsed = time.perf_counter() - start
    if not ranked:
        if limits.active:
            field, reason = _infeasible(search, limits)
            raise InputError(field, reason)
        raise InputError("plan", _no_fit_message(min_mem, cl))
    best_plan, best_est = ranked[0]
    if out_path is not None:
        best_plan.save(out_path, compact=not expand)
    _write_pictures(best_plan, spec, cl, params, trace, timeline)
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
    _print_warnings(best_est.warnings)
    if baselines is not None:
        _print_baselines(best_est, baselines)
    out.print(breakdown_table(best_est))
    if explain_best:
        _print_explain(best_plan, spec, cl, params)
    if out_path is not None:
        out.print(f"best plan written to {out_path}")


SearchOutcome = tuple[list[tuple[Plan, Estimate]], float, dict[str, Any], dict[str, Any] | None]


def _plan_search(
    spec: ModelSpec, cl: Cluster, batch: int, prec: str, params: CostParams, heterogeneous: bool
) -> Any:
    """Returns a function (constraints, top) -> (ranked plans, least memory need, extra JSON
    fields, baselines) running the search a cluster calls for."""
    from hetplan.search.constraints import PlanConstraints, homogeneous_space

    def run(limits: PlanConstraints, top: int, progress: Any = None) -> SearchOutcome:
        flash = True if limits.flash_attention is None else limits.flash_attention
        if cl.is_homogeneous() and not heterogeneous:
            from hetplan.search.homogeneous import search_homogeneous

            res = search_homogeneous(spec, cl, batch, prec, top, params,
                                     space=homogeneous_space(limits),
                                     flash_attention=flash, progress=progress)  # fmt: skip
            extra = {"candidates": res.candidates, "fitting": res.fitting}
            return res.ranked, res.min_memory_bytes, extra, None
        from hetplan.search.heterogeneous import search_heterogeneous

        hres = search_heterogeneous(spec, cl, batch, prec, top, params, flash, limits, progress)
        baselines = {
            k: (None if v is None else estimate_json(*v)) for k, v in hres.baselines.items()
        }
        return hres.ranked, hres.min_memory_bytes, {"notes": hres.notes}, baselines

    return run


def _infeasible(search: Any, limits: Any) -> tuple[str, str]:
    """Returns (option, reason) for a constrained search that found no plan: the first
    constraint without which a plan exists (each tried alone), else all of them."""
    for text, option, relaxed in limits.relaxations():
        ranked = search(relaxed, 1)[0]
        if ranked:
            return option, (
                f"no plan satisfies {text} with the other constraints; without it the best "
                f"plan is {plan_label(ranked[0][0])}"
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


@app.command()
def predict(
    model: ModelOpt,
    cluster: ClusterOpt,
    plan_path: Annotated[Path | None, typer.Option("--plan", help="Plan JSON file")] = None,
    tp: Annotated[
        int | None, typer.Option("--tp", help="Tensor-parallel degree (without --plan)")
    ] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline stages (without --plan)")] = None,
    dp: Annotated[
        int | None, typer.Option("--dp", help="Data-parallel replicas (without --plan)")
    ] = None,
    micro_batch_size: Annotated[
        int | None, typer.Option("--micro-batch-size", help="Sequences per micro-batch")
    ] = None,
    global_batch_size: BatchOpt = None,
    recompute: Annotated[
        str | None, typer.Option("--recompute", help="none, selective or full (default: none)")
    ] = None,
    schedule: Annotated[
        str | None, typer.Option("--schedule", help="Pipeline schedule (default: 1F1B)")
    ] = None,
    virtual_stages: Annotated[
        int | None, typer.Option("--virtual-stages", help="Model chunks per stage (default: 1)")
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            help="Layers per stage and chunk, with --tp/--pp/--dp: a Megatron-Core layout "
            "string such as 'Et*3|(t*4|)*30,t*3L' or a JSON list per stage such as "
            "'[[3,4],[4,4],[4,3]]' (default: even)",
        ),
    ] = None,
    zero_stage: Annotated[
        int | None, typer.Option("--zero-stage", help="0, 1, 2 or 3 (default: 0)")
    ] = None,
    sequence_parallel: Annotated[
        bool | None,
        typer.Option(
            "--sequence-parallel/--no-sequence-parallel", help="Sequence parallelism (default: off)"
        ),
    ] = None,
    flash_attention: FlashLimit = None,
    overlap_tp_comm: Annotated[
        bool | None,
        typer.Option(
            "--overlap-tp-comm/--no-overlap-tp-comm",
            help="Overlap TP collectives with the matmuls (default: off)",
        ),
    ] = None,
    overlap_grad_reduce: Annotated[
        bool | None,
        typer.Option(
            "--overlap-grad-reduce/--no-overlap-grad-reduce",
            help="Overlap the DP gradient reduction with the backward (default: on)",
        ),
    ] = None,
    seq_len: SeqOpt = None,
    precision: PrecOpt = None,
    as_json: JsonOpt = False,
    trace: TraceOpt = None,
    timeline: TimelineOpt = None,
    params_path: ParamsOpt = None,
    profile_path: ProfileOpt = None,
) -> None:
    """Predict iteration time, memory, throughput and price of one plan.

    With --plan, the plan options given explicitly override the file's fields:
    --precision, --recompute, --schedule, --virtual-stages, --zero-stage and the
    --sequence-parallel, --flash-attention, --overlap-tp-comm, --overlap-grad-reduce
    switches (and their --no- forms)."""
    require_matplotlib("--timeline", timeline)
    spec = load_model(model, seq_len)
    cl = load_cluster(cluster)
    params = load_cost(params_path, profile_path)
    knobs: dict[str, Any] = {
        k: v
        for k, v in (
            ("recompute", recompute),
            ("schedule", schedule),
            ("virtual_stages", virtual_stages),
            ("zero_stage", zero_stage),
            ("sequence_parallel", sequence_parallel),
            ("flash_attention", flash_attention),
            ("overlap_tp_comm", overlap_tp_comm),
            ("overlap_grad_reduce", overlap_grad_reduce),
        )
        if v is not None
    }
    if plan_path is not None:
        if layout is not None:
            raise InputError("--layout", "applies to --tp/--pp/--dp; a plan file states 'chunks'")
        the_plan = load_plan(plan_path, cl)
        if precision is not None:
            knobs["precision"] = _precision(cl, precision)
        if knobs:  # validate_plan (in estimate) checks the values
            the_plan = dataclasses.replace(the_plan, **knobs)
    else:
        missing = [
            n
            for n, v in (
                ("--tp", tp),
                ("--pp", pp),
                ("--dp", dp),
                ("--micro-batch-size", micro_batch_size),
            )
            if v is None
        ]
        if missing:
            raise InputError(missing[0], "required without --plan")
        assert tp is not None and pp is not None and dp is not None
        assert micro_batch_size is not None
        for name, value in (
            ("--tp", tp),
            ("--pp", pp),
            ("--dp", dp),
            ("--micro-batch-size", micro_batch_size),
        ):
            if value <= 0:
                raise InputError(name, "must be positive")
        gpn = {n.gpus for n in cl.nodes}
        if any(tp > g for g in gpn):
            raise InputError("--tp", f"{tp} exceeds the GPUs of a node ({min(gpn)})")
        from hetplan.search.layout import uniform_plan

        batch = _batch(spec, global_batch_size)
        if (batch // dp) % micro_batch_size if batch % dp == 0 else False:
            raise InputError(
                "--micro-batch-size",
                f"{micro_batch_size} does not divide the per-replica batch {batch // dp}",
            )
        the_plan = uniform_plan(
            cl,
            spec.layers,
            tp,
            pp,
            dp,
            micro_batch_size,
            batch,
            precision=_precision(cl, precision),
            **knobs,
        )
        if layout is not None:
            the_plan = _with_layout(the_plan, layout, spec.layers, virtual_stages)
    if precision is not None:
        _tf32_note(cl.gpu_types_used(), the_plan.precision, as_json)
    est = estimate(the_plan, spec, cl, params)
    _write_pictures(the_plan, spec, cl, params, trace, timeline)
    if as_json:
        print_json(estimate_json(the_plan, est))
        return
    out.print(plans_table([(the_plan, est)], f"{spec.name}: predicted"))
    _print_warnings(est.warnings)
    out.print(breakdown_table(est))
    if not est.fits:
        worst = max(est.distinct_stages, key=lambda s: s.memory.total - s.capacity_bytes)
        out.print(
            f"[bold red]does not fit[/]: {worst.devices[0]} needs "
            f"{worst.memory.total / 1e9:.1f} GB of {worst.capacity_bytes / 1e9:.1f} GB"
        )


def _with_layout(plan: Plan, text: str, layers: int, virtual_stages: int | None) -> Plan:
    """Returns ``plan`` with the stages and chunks of ``predict --layout``."""
    from hetplan.chunk_layout import apply_layout, parse_layout

    stages = parse_layout(text, len(plan.pipelines[0].stages))
    v, total = len(stages[0]), sum(sum(ch) for ch in stages)
    if virtual_stages is not None and virtual_stages != v:
        raise InputError(
            "--layout", f"has {v} chunks per stage, but --virtual-stages is {virtual_stages}"
        )
    if total != layers:
        raise InputError("--layout", f"places {total} layers, the model has {layers}")
    return apply_layout(plan, stages)


@app.command()
def explain(
    plan_path: Annotated[Path, typer.Argument(help="Plan JSON file")],
    model: ModelOpt,
    cluster: ClusterOpt,
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

    spec = load_model(model, seq_len)
    cl = load_cluster(cluster)
    the_plan = load_plan(plan_path, cl)
    if precision is not None:
        the_plan = dataclasses.replace(the_plan, precision=_precision(cl, precision))
    info = explain_plan(the_plan, spec, cl, load_cost(params_path, profile_path), expand)
    if as_json:
        print_json(info)
    else:
        for table in explain_table(info):
            out.print(table)
        terms = fitted_terms_table(info)
        if terms is not None:
            out.print(terms)
        _print_warnings(info["warnings"])


@app.command()
def calibrate(
    runs: Annotated[
        Path,
        typer.Option(
            "--runs",
            help="Measured runs: a CSV (Megatron, AMP, Sailor or generic format) or a YAML "
            "manifest of plan files with measured iteration times",
        ),
    ],
    out_path: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write fitted parameters")
    ] = None,
    as_json: JsonOpt = False,
    profile_path: ProfileOpt = None,
    loo: Annotated[
        bool, typer.Option("--loo/--no-loo", help="Cold leave-one-out error (one fit per row)")
    ] = True,
) -> None:
    """Fit the cost model's physical terms to measured runs; report terms, bounds and error.

    With a profile, the runs are predicted with its measured compute times, so the fit
    learns only what the profile does not cover (use the same --profile when predicting)."""
    from hetplan.cost.calibrate_fit import fit
    from hetplan.cost.calibrate_report import in_sample, leave_one_out
    from hetplan.cost.runs import load_runs

    db = open_profile(profile_path)
    start = CostParams() if db is None else CostParams().with_profile(db)
    measured_runs = load_runs(runs)
    fitted = fit(measured_runs, start)
    by_file = (leave_one_out(measured_runs, fitted, None, start) if loo
               else in_sample(measured_runs, fitted))  # fmt: skip
    report = by_file.get(runs.name, {})
    summary = {k: v for k, v in report.items() if k != "rows"}
    if out_path is not None:
        key = "loo" if loo else "in_sample"
        report_out = {**fitted.fit_report, key: {runs.name: summary}}
        fitted = dataclasses.replace(fitted, fit_report=report_out)
        fitted.save(out_path)
    if as_json:
        print_json({**report, "terms": fitted.fit_report.get("terms", {})})
        return
    from rich.table import Table

    from hetplan.report.explain import fitted_terms_table

    kind = "cold leave-one-out" if loo else "in-sample"
    table = Table(title=f"{runs.name}: {kind} predictions", header_style="bold")
    for col in ("run", "metric", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col in ("run", "metric") else "right")
    for row in report.get("rows", []):
        measured = row.get("measured")
        table.add_row(
            str(row.get("label", "")),
            str(row.get("metric", "")),
            f"{row['predicted']:.3f}" if row.get("predicted") is not None else "-",
            "OOM" if measured is None else f"{measured:.3f}",
            "-" if row.get("error_pct") is None else f"{row['error_pct']:+.1f}%",
        )
    out.print(table)
    terms = fitted_terms_table({"fitted_terms": fitted.fit_report.get("terms", {})})
    if terms is not None:
        out.print(terms)
    out.print(", ".join(f"{k}: {_readable(v)}" for k, v in summary.items()), highlight=False)
    if out_path is not None:
        out.print(f"parameters written to {out_path}")


def _readable(value: Any) -> str:
    """Returns a value as a person writes it: numbers to 3 figures, mappings as 'key value'
    pairs and lists as comma-separated items (never a Python repr)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k} {_readable(v)}" for k, v in value.items()) + ")"
    if isinstance(value, list | tuple):
        return ", ".join(_readable(v) for v in value)
    return str(value)


MIX_TIME_LIMIT_S = 300.0
"""How long ``provision --mixes`` plans mixes unless ``--time-limit`` says otherwise."""


@app.command()
def provision(
    model: ModelOpt,
    tokens: Annotated[str, typer.Option("--tokens", help="Tokens to train on, e.g. 300e9")],
    market: Annotated[
        str | None, typer.Option("--market", help="Market YAML (default: the shipped one)")
    ] = None,
    deadline: Annotated[str | None, typer.Option("--deadline", help="e.g. 30d, 12h")] = None,
    budget_usd: Annotated[str | None, typer.Option("--budget-usd", help="e.g. 2e6")] = None,
    max_usd_per_hour: Annotated[
        str | None, typer.Option("--max-usd-per-hour", help="Price cap per hour, e.g. 500")
    ] = None,
    objective: Annotated[
        str,
        typer.Option("--objective", help="time, cost (= tokens-per-dollar) or balanced"),
    ] = "balanced",
    spot: Annotated[
        bool, typer.Option("--spot", help="Rent spot instances (= --pricing spot)")
    ] = False,
    pricing: Annotated[
        str | None,
        typer.Option(
            "--pricing",
            help="on-demand, reserved (offers' reserved_usd_per_gpu_hour; offers without one "
            "are left out and named) or spot (preemptions priced in)  [default: on-demand]",
        ),
    ] = None,
    mixes: Annotated[
        bool, typer.Option("--mixes", help="Also search two-type mixes (heterogeneous planner)")
    ] = False,
    owned_path: Annotated[
        str | None,
        typer.Option(
            "--cluster",
            help="Nodes you own (cluster file, nodes marked owned: true): every configuration "
            "trains on them and the market only adds",
        ),
    ] = None,
    compare_buy: Annotated[
        bool,
        typer.Option(
            "--compare-buy",
            help="Per GPU type: the utilisation above which buying beats renting (--plot: "
            "cumulative cost against runs)",
        ),
    ] = False,
    runs_per_year: Annotated[
        float, typer.Option("--runs-per-year", help="--compare-buy: runs of this size a year")
    ] = 1.0,
    checkpoint_interval: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-interval",
            help="Spot: training time between checkpoints (work lost is half of it); default: "
            "Young's optimum sqrt(2 C M) per configuration",
        ),
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time-limit",
            help="Stop planning mixes after this long (e.g. 30s, 5m) and list the mixes left "
            "with their bounds; 'none' plans every mix  [default: 5m]",
        ),
    ] = None,
    global_batch_size: BatchOpt = None,
    seq_len: SeqOpt = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision",
            help="fp32, tf32, bf16 or fp16 (default: bf16 if every GPU type of the market "
            "supports it, else fp16)",
        ),
    ] = None,
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the front as PNG")] = None,
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
    """Choose which GPUs to rent: the time-versus-dollars front and a recommendation.

    The plan options (--tp ... --max-gpus, as for plan) constrain every configuration's
    plan, the GPU types rented and how many GPUs."""
    require_matplotlib("--plot", plot)
    from hetplan.market import load_market
    from hetplan.report.pareto import front_table, result_json, write_pareto_plot
    from hetplan.search.constraints import constraints_from_options
    from hetplan.search.provision import Constraints
    from hetplan.search.provision import provision as run_provision
    from hetplan.search.spot import SpotTerms
    from hetplan.units import parse_count, parse_duration_s

    if objective == "tokens-per-dollar":  # the most tokens per dollar is the least cost
        objective = "cost"
    if objective not in ("time", "cost", "balanced"):
        raise InputError(
            "--objective", f"'{objective}' is not time, cost, tokens-per-dollar or balanced"
        )
    limits = constraints_from_options(
        tp, pp, dp, micro_batch_size, virtual_stages, zero_stage, recompute, schedule,
        sequence_parallel, flash_attention, gpu_types, memory_headroom, max_gpus,
        overlap_tp_comm,
    )  # fmt: skip
    if precision is not None and precision not in PRECISIONS:
        raise InputError("--precision", f"'{precision}' is not fp32, tf32, bf16 or fp16")
    spec = load_model(model, seq_len)
    mk = load_market(market)
    allowed = None if limits.gpu_types is None else {t.lower() for t in limits.gpu_types}
    gpus = {
        o.gpu.name: o.gpu for o in mk.offers if allowed is None or o.gpu.name.lower() in allowed
    }.values()
    if precision is None:  # plan's rule, over the market's GPU types
        precision = "bf16" if all(g.supports("bf16") for g in gpus) else "fp16"
    _tf32_note(gpus, precision, as_json)
    params = load_cost(params_path, profile_path)
    n_tokens = parse_count(tokens, "--tokens")
    constraints = Constraints(
        deadline_s=None if deadline is None else parse_duration_s(deadline, "--deadline"),
        budget_usd=None if budget_usd is None else parse_count(budget_usd, "--budget-usd"),
        max_usd_per_hour=None
        if max_usd_per_hour is None
        else parse_count(max_usd_per_hour, "--max-usd-per-hour"),
    )
    interval = (
        None
        if checkpoint_interval is None
        else parse_duration_s(checkpoint_interval, "--checkpoint-interval")
    )
    terms = SpotTerms(interval)
    if time_limit is not None and not mixes:
        raise InputError("--time-limit", "it limits the search of mixes: add --mixes")
    # a market's mixes can take hours to plan: by default the search stops after
    # MIX_TIME_LIMIT_S and lists every mix left with its proven bounds; 'none' plans them all
    limit_s: float | None = MIX_TIME_LIMIT_S
    if time_limit is not None:
        exhaustive = time_limit.strip().lower() == "none"
        limit_s = None if exhaustive else parse_duration_s(time_limit, "--time-limit")
    if pricing is not None and pricing not in ("on-demand", "reserved", "spot"):
        raise InputError("--pricing", f"'{pricing}' is not on-demand, reserved or spot")
    if spot and pricing not in (None, "spot"):
        raise InputError("--spot", f"spot rental contradicts --pricing {pricing}")
    rate = "spot" if spot else pricing or "on-demand"
    if compare_buy and rate != "on-demand":
        raise InputError("--spot" if spot else "--pricing", "--compare-buy compares buying "
                         "with renting on demand")  # fmt: skip
    if compare_buy and (owned_path is not None or mixes):
        used = "--cluster" if owned_path is not None else "--mixes"
        raise InputError(used, "--compare-buy compares one GPU type bought or rented on demand")
    if owned_path is not None and mixes:
        raise InputError("--mixes", "with --cluster, each offer is added to the owned nodes alone")
    if compare_buy:
        _compare_buy(spec, mk, n_tokens, _batch(spec, global_batch_size), precision,
                     runs_per_year, params, limits, plot, as_json)  # fmt: skip
        return
    owned = None
    if owned_path is not None:
        owned = load_cluster(owned_path)
        for node in owned.nodes:
            if node.owned is None:
                raise InputError("--cluster", f"node {node.name} is not marked owned: true")
    from hetplan.report.progress import ProgressBar

    with ProgressBar.for_cli(as_json) as bar:  # after a second, on a terminal, not --json
        res = run_provision(
            spec,
            mk,
            n_tokens,
            _batch(spec, global_batch_size),
            precision,
            spot,
            objective,
            constraints,
            params,
            terms,
            mixes=mixes,
            limits=limits,
            owned=owned,
            progress=bar,
            time_limit_s=limit_s,
            pricing=rate,
        )
    if plot is not None:
        write_pareto_plot(plot, res, constraints)
    if as_json:
        left = [u.to_json() for u in res.unexplored]
        print_json(
            result_json(res, constraints)
            | {
                "precision": precision,
                "unexplored": left,
                "constraints": limits.described(),
                "impossible_by_reason": res.impossible_by_reason,
            }
        )
        return
    within = f", within {' '.join(limits.described())}" if limits.active else ""
    title = (
        f"{spec.name}, {n_tokens:.3g} tokens, {precision}, {res.pricing} prices{within}: "
        f"time-versus-cost front "
        f"({res.planned} configurations planned, {res.pruned} pruned by proven bounds, "
        f"{res.impossible} with no possible plan, {_unexplored_note(res)}; "
        f"{res.search_time_s:.1f} s)"
    )
    out.print(front_table(res, title, constraints))
    if res.left_out:
        out.print(f"left out (no {res.pricing} price): {', '.join(res.left_out)}", highlight=False)
    if res.impossible_by_reason:
        from hetplan.search.provision import IMPOSSIBLE_REASONS

        why = "; ".join(
            f"{n:,} {IMPOSSIBLE_REASONS[k]}" for k, n in res.impossible_by_reason.items()
        )
        out.print(f"no possible plan: {why}", highlight=False)
    if res.unexplored:
        out.print("unexplored mixes (time limit; each by name in --json):", highlight=False)
        for line in _unexplored_lines(res.unexplored):
            out.print("  " + line, highlight=False)
    if res.recommended is None:
        out.print(f"[bold red]no recommendation[/]: {res.reason}")
    else:
        out.print(f"recommended (*): {res.reason}")


def _unexplored_note(res: Any) -> str:
    """Returns how many mixes the time limit left unplanned and the best they could reach."""
    left = res.unexplored
    if not left:
        return "none unexplored"
    fast = min(u.time_bound_s for u in left)
    cheap = min(u.cost_bound_usd for u in left)
    return (
        f"{len(left)} mixes unexplored at the time limit, which could at best train in "
        f"{fast / 86400:.2f} days or for ${cheap:,.0f} (listed below)"
    )


def _unexplored_lines(left: list[Any]) -> list[str]:
    """Returns one line per pair of GPU types: how many mixes the time limit left, their GPU
    counts' ranges and the best time and cost any of them could reach (proven bounds)."""
    groups: dict[tuple[str, ...], list[Any]] = {}
    for u in left:
        groups.setdefault(tuple(u.gpus), []).append(u)
    lines = []
    for names, us in sorted(groups.items(), key=lambda kv: min(u.time_bound_s for u in kv[1])):
        ranges = " + ".join(
            f"{min(u.gpus[n] for u in us)}-{max(u.gpus[n] for u in us)} x {n}" for n in names
        )
        lines.append(
            f"{ranges}: {len(us)} mixes, at best {min(u.time_bound_s for u in us) / 86400:.2f} "
            f"days or ${min(u.cost_bound_usd for u in us):,.0f}"
        )
    return lines


def _compare_buy(
    spec: ModelSpec,
    mk: Any,
    tokens: float,
    batch: int,
    precision: str,
    runs_per_year: float,
    params: Any,
    limits: Any,
    plot: Path | None,
    as_json: bool,
) -> None:
    """Prints, per GPU type of the market, the break-even utilisation of buying."""
    from rich.table import Table

    from hetplan.search.buy import compare_buy, write_buy_plot

    rows, notes = compare_buy(spec, mk, tokens, batch, precision, runs_per_year, params, limits)
    if plot is not None and rows:
        write_buy_plot(plot, rows)
    if as_json:
        left = [{"gpu": g, "reason": r} for g, r in notes]
        print_json({"rows": [r.to_json() for r in rows], "left_out": left})
        return
    table = Table(
        title=f"{spec.name}, {tokens:.3g} tokens x {runs_per_year:g} runs a year: buy or rent?",
        header_style="bold",
    )
    cols = ("GPUs", "hours/run", "rent $/GPU-h", "own $/GPU-h at yours", "break-even",
            "your utilisation", "verdict")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPUs", "verdict") else "right")
    for r in rows:
        at_yours = dataclasses.replace(r.own, utilisation=min(1.0, r.utilisation))
        own = at_yours.parts().total
        table.add_row(
            f"{r.gpus} x {r.gpu}",
            f"{r.hours_per_run:,.1f}",
            f"{r.rental_usd_per_gpu_hour:.2f}",
            f"{own:.2f}",
            "never" if r.break_even == float("inf") else f"{r.break_even:.1%}",
            f"{r.utilisation:.1%}",
            r.verdict,
        )
    out.print(table)
    by_reason: dict[str, list[str]] = {}
    for gpu, reason in notes:
        by_reason.setdefault(reason, []).append(gpu)
    for reason, gpus in by_reason.items():
        out.print(f"left out ({reason}): {', '.join(gpus)}", highlight=False)


@app.command()
def export(
    plan_path: Annotated[Path, typer.Argument(help="Plan JSON file")],
    model: ModelOpt,
    fmt: Annotated[str, typer.Option("--format", help="megatron or deepspeed")] = "megatron",
    seq_len: SeqOpt = None,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file")] = None,
) -> None:
    """Export a plan to Megatron-LM arguments or a DeepSpeed configuration.

    The DeepSpeed configuration holds only keys DeepSpeed documents; the parallel sizes
    DeepSpeed takes from its launcher are printed on stderr as Megatron-DeepSpeed arguments."""
    from hetplan.report.export import deepspeed_config, deepspeed_launch_args, megatron_args

    spec = load_model(model, seq_len)
    the_plan = load_plan(plan_path)
    if fmt == "megatron":
        text = " \\\n  ".join(shlex.quote(a) for a in megatron_args(the_plan, spec)) + "\n"
    elif fmt == "deepspeed":
        text = json.dumps(deepspeed_config(the_plan, spec), indent=2) + "\n"
    else:
        raise InputError("--format", f"'{fmt}' is not megatron or deepspeed")
    if out_path is None:
        out.print(text, end="", highlight=False, soft_wrap=True)
    else:
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out_path)
    if fmt == "deepspeed":  # DeepSpeed takes the parallel sizes from the launcher
        launch = deepspeed_launch_args(the_plan, str(out_path or "ds_config.json"))
        err.print(f"Megatron-DeepSpeed arguments: {shlex.join(launch)}", highlight=False,
                  soft_wrap=True, markup=False)  # fmt: skip


def _show_version(value: bool) -> None:
    if value:
        from hetplan import __version__

        out.print(f"hetplan {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit", is_eager=True, callback=_show_version
        ),
    ] = False,
) -> None:
    """Plan and run large-model training on clusters of mixed GPUs."""


def _mount_subcommands() -> None:
    """Adds the runtime, elastic and SPMD commands; their modules import torch only when a
    command runs, so the planner works without it."""
    from hetplan.elastic.cli import register as register_elastic
    from hetplan.runtime.cli import register as register_runtime
    from hetplan.spmd.cli import app as spmd_app

    register_runtime(app)
    register_elastic(app)
    app.add_typer(spmd_app, name="spmd", help="SPMD program synthesis (HAP-style)")
    from hetplan.spot.cli import app as spot_app

    app.add_typer(spot_app, name="spot", help="Replay GPU availability traces (spot market)")


_mount_subcommands()


def main() -> None:
    """Runs the CLI; bad input ends with one line naming the field and exit code 2."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        # without standalone mode click returns a command's typer.Exit code instead of
        # exiting with it: a failed run must not end with 0
        code = app(standalone_mode=False)
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except InputError as exc:
        err.print(f"[bold red]error[/]: {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click's usage errors arrive here with standalone_mode off
        # typer >= 0.20 raises its vendored click's exceptions, even where a separate click
        # is installed (huggingface_hub brings one): check against typer's own first
        try:
            from typer._click import exceptions as click_exc
        except ModuleNotFoundError:  # an older typer that depends on click
            from click import exceptions as click_exc  # type: ignore[no-redef]

        if isinstance(exc, click_exc.NoArgsIsHelpError):
            exc.show()  # a bare command group prints its help
            sys.exit(2)
        if isinstance(exc, click_exc.ClickException):
            # one line: the command, then click's message, which names the option
            ctx = getattr(exc, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            message = " ".join(exc.format_message().split())
            err.print(f"[bold red]error[/]: {where}{message} (see --help)", highlight=False,
                      soft_wrap=True, markup=True)  # fmt: skip
            sys.exit(2)
        if isinstance(exc, typer.Exit):
            sys.exit(exc.exit_code)
        raise

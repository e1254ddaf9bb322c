"""``predict``: one plan's iteration time, memory, throughput and price, from a plan file or
from --tp/--pp/--dp (optionally with an uneven --layout)."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any

import typer

from hetplan.cluster import load_cluster
from hetplan.commands.common import (
    load_cost,
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
    FlashLimit,
    JsonOpt,
    ModelOpt,
    ParamsOpt,
    PlanArg,
    PlanOpt,
    PrecOpt,
    ProfileOpt,
    SeqOpt,
    TimelineOpt,
    TraceOpt,
    plan_file,
)
from hetplan.cost.estimate import estimate
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.outputs import check_output
from hetplan.plan import Plan, load_plan, model_for_plan
from hetplan.report import require_matplotlib
from hetplan.report.table import breakdown_table, estimate_json, plans_table


def predict(
    plan_arg: PlanArg = None,
    *,
    model: ModelOpt,
    cluster: ClusterOpt,
    plan_opt: PlanOpt = None,
    tp: Annotated[
        int | None, typer.Option("--tp", help="Tensor-parallel degree (without --plan)")
    ] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Pipeline stages (without --plan)")] = None,
    dp: Annotated[
        int | None,
        typer.Option(
            "--dp",
            help="Data-parallel replicas (without --plan; one of --tp, --pp, --dp left out "
            "fills the cluster)",
        ),
    ] = None,
    micro_batch_size: Annotated[
        int | None,
        typer.Option(
            "--micro-batch-size", help="Sequences per micro-batch (without --plan: default 1)"
        ),
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
    --precision, --micro-batch-size, --recompute, --schedule, --virtual-stages, --zero-stage
    and the --sequence-parallel, --flash-attention, --overlap-tp-comm, --overlap-grad-reduce
    switches (and their --no- forms); --tp, --pp, --dp and --global-batch-size are the file's
    devices and batch shares, refused beside it."""
    plan_path, named = plan_file(plan_arg, plan_opt, required=False)
    require_matplotlib("--timeline", timeline)
    check_output(trace, "--trace")
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
        for name, value in (("--tp", tp), ("--pp", pp), ("--dp", dp),
                            ("--global-batch-size", global_batch_size)):  # fmt: skip
            if value is not None:
                raise InputError(name, "the plan file (--plan) fixes it: give the degrees "
                                 "without --plan, or edit the file")  # fmt: skip
        the_plan = load_plan(plan_path, cl, option=named)
        spec = model_for_plan(the_plan, spec, seq_len)
        if micro_batch_size is not None:
            for i, pipe in enumerate(the_plan.pipelines):
                if micro_batch_size <= 0 or pipe.batch_size % micro_batch_size:
                    raise InputError("--micro-batch-size", f"{micro_batch_size} does not divide "
                                     f"pipeline {i}'s batch of {pipe.batch_size}")  # fmt: skip
            knobs["micro_batch_size"] = micro_batch_size
        if precision is not None:
            knobs["precision"] = resolve_precision(cl, precision)
        if knobs:  # validate_plan (in estimate) checks the values
            the_plan = dataclasses.replace(the_plan, **knobs)
    else:
        tp, pp, dp = _fill_degree(tp, pp, dp, cl.num_gpus)
        micro_batch_size = 1 if micro_batch_size is None else micro_batch_size
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

        batch = resolve_batch(spec, global_batch_size)
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
            precision=resolve_precision(cl, precision),
            **knobs,
        )
        if layout is not None:
            the_plan = _with_layout(the_plan, layout, spec.layers, virtual_stages)
    if precision is not None:
        tf32_note(cl.gpu_types_used(), the_plan.precision, as_json)
    est = estimate(the_plan, spec, cl, params)
    if est.fits:  # pictures of a plan that cannot run are not written
        write_pictures(the_plan, spec, cl, params, trace, timeline)
    if as_json:
        print_json(estimate_json(the_plan, est))
    else:
        out.print(plans_table([(the_plan, est)], f"{spec.name}: predicted"))
        print_warnings(est.warnings)
        out.print(breakdown_table(est))
    est.require_fit(named if plan_path is not None else "plan")


def _fill_degree(tp: int | None, pp: int | None, dp: int | None, gpus: int) -> tuple[int, int, int]:
    """Returns the three degrees of a plan given by options: one left out fills the
    cluster's ``gpus`` with the other two (``--tp 8 --pp 4`` on 32 GPUs: DP 1)."""
    given = {"--tp": tp, "--pp": pp, "--dp": dp}
    missing = [name for name, v in given.items() if v is None]
    if not missing:
        return tp, pp, dp  # type: ignore[return-value]
    if len(missing) > 1:
        raise InputError(
            missing[0],
            "required without --plan (give two of --tp, --pp and --dp; the third "
            "fills the cluster)",
        )
    for name, value in given.items():
        if value is not None and value <= 0:
            raise InputError(name, "must be positive")
    others = math.prod(v for v in given.values() if v is not None)
    if gpus % others:
        shown_ = " x ".join(f"{n} {v}" for n, v in given.items() if v is not None)
        raise InputError(
            missing[0], f"required here: {shown_} = {others} does not divide the {gpus} GPUs"
        )
    fill = {**given, missing[0]: gpus // others}
    return fill["--tp"], fill["--pp"], fill["--dp"]  # type: ignore[return-value]


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

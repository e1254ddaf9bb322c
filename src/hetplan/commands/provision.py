"""``provision``: which GPUs to rent (or buy), the time-versus-dollars front."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from hetplan.cluster import load_cluster
from hetplan.commands.common import load_cost, out, print_json, resolve_batch, tf32_note
from hetplan.commands.options import (
    BatchOpt,
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
    PpLimit,
    ProfileOpt,
    RecomputeLimit,
    ScheduleLimit,
    SeqOpt,
    SpLimit,
    TpLimit,
    VsLimit,
    ZeroLimit,
)
from hetplan.errors import InputError
from hetplan.model import ModelSpec, load_model
from hetplan.plan import PRECISIONS
from hetplan.report import require_matplotlib
from hetplan.units import duration_text


def register(app: typer.Typer) -> None:
    """Adds ``provision`` to ``app``."""
    app.command()(provision)


MIX_TIME_LIMIT_S = 300.0
"""How long ``provision --mixes`` plans mixes unless ``--time-limit`` says otherwise."""


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
    tf32_note(gpus, precision, as_json)
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
    if interval is not None and not (spot or pricing == "spot"):
        raise InputError("--checkpoint-interval", "it prices spot preemptions: add --spot")
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
        _compare_buy(spec, mk, n_tokens, resolve_batch(spec, global_batch_size), precision,
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
            resolve_batch(spec, global_batch_size),
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
    for point in res.points:  # the plans state the model they were made for
        if point.plan is not None:
            point.plan = dataclasses.replace(point.plan, model=spec)
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
        f"{res.impossible} with no possible plan, {_dominated_note(res)}"
        f"{_unexplored_note(res)}; "
        f"{res.search_time_s:.1f} s)"
    )
    out.print(front_table(res, title, constraints))
    if res.left_out:
        out.print(f"left out (no {res.pricing} price): {', '.join(res.left_out)}", highlight=False)
    if res.dominated_by:
        pairs = ", ".join(f"{name} by {by}" for name, by in res.dominated_by.items())
        out.print(f"dominated offers (another is at least as good in every figure and no "
                  f"dearer, so it stands in for them): {pairs}", highlight=False)  # fmt: skip
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


def _dominated_note(res: Any) -> str:
    """Returns how many configurations a dominating offer stood in for ('' if none)."""
    if not res.dominated:
        return ""
    return f"{res.dominated} left out as dominated by a better, no dearer offer, "


def _unexplored_note(res: Any) -> str:
    """Returns how many mixes the time limit left unplanned and the best they could reach."""
    left = res.unexplored
    if not left:
        return "none unexplored"
    fast = min(u.time_bound_s for u in left)
    cheap = min(u.cost_bound_usd for u in left)
    return (
        f"{len(left)} mixes unexplored at the time limit, which could at best train in "
        f"{duration_text(fast)} or for ${cheap:,.0f} (listed below)"
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
            f"{ranges}: {len(us)} mixes, at best {duration_text(min(u.time_bound_s for u in us))}"
            f" or ${min(u.cost_bound_usd for u in us):,.0f}"
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
    if rows:
        out.print(table)
    else:  # an empty table says nothing the lines below do not
        out.print(f"{spec.name}, buy or rent: no GPU type of the market can be compared",
                  highlight=False)  # fmt: skip
    by_reason: dict[str, list[str]] = {}
    for gpu, reason in notes:
        by_reason.setdefault(reason, []).append(gpu)
    for reason, gpus in by_reason.items():
        out.print(f"left out ({reason}): {', '.join(gpus)}", highlight=False)

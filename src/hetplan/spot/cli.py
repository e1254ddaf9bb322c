"""``hetplan spot simulate`` and ``hetplan spot synth`` (mounted by the main CLI)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from hetplan.commands.options import ProfileOpt
from hetplan.errors import InputError, shown
from hetplan.outputs import write_text

app = typer.Typer(help="Replay GPU availability traces: tokens and dollars per policy.")


def _replan_mode(value: str) -> bool:
    if value not in ("search", "repair"):
        raise InputError("--replan", f"{shown(value)} is not search or repair")
    return value == "search"


@app.command()
def simulate(
    trace: Annotated[
        str,
        typer.Option(
            "--trace", help="Availability trace (JSON or CSV; a shipped trace by its file name)"
        ),
    ],
    model: Annotated[str, typer.Option("--model", "-m", help="Catalog name or config.json")],
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", "-c", help="The largest pool the trace may reach (YAML/inline)"),
    ] = None,
    market: Annotated[
        str | None,
        typer.Option(
            "--market",
            help="Market YAML: node shapes, ceilings, prices (default without --cluster: the "
            "built-in market)",
        ),
    ] = None,
    tokens: Annotated[
        str | None, typer.Option("--tokens", help="Token target, e.g. 2e9 (default: none)")
    ] = None,
    checkpoint_interval: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-interval", help="e.g. 10m (default: Young's optimum from the trace)"
        ),
    ] = None,
    restart_time: Annotated[
        str, typer.Option("--restart-time", help="Relaunching workers after a change")
    ] = "30s",
    storage_bandwidth: Annotated[
        str | None,
        typer.Option(
            "--storage-bandwidth",
            help="Storage read bandwidth for recoveries (default: the cluster file's, else "
            "10 Gbit/s)",
        ),
    ] = None,
    replan_mode: Annotated[
        str,
        typer.Option(
            "--replan",
            help="repair (warm start, as launch --elastic) or search (repair and the "
            "heterogeneous search, the faster plan wins; slower to replay)",
        ),
    ] = "repair",
    global_batch_size: Annotated[
        int | None,
        typer.Option(
            "--global-batch-size", "-b", help="Sequences per iteration (default: the model's)"
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Override the sequence length")
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision", help="fp32, tf32, bf16 or fp16 (default: bf16 where supported)"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write throughput and GPUs over time (PNG)")
    ] = None,
    params_path: Annotated[
        Path | None, typer.Option("--params", help="Cost-model parameters (hetplan calibrate)")
    ] = None,
    profile_path: ProfileOpt = None,
) -> None:
    """Replay an availability trace under four policies, side by side.

    hetplan (replan and peer-first recovery), restart from storage, wait for the lost nodes,
    and on-demand: tokens, time to the token target, GPU-hours and dollars of each."""
    from hetplan.cluster import load_cluster
    from hetplan.commands.common import load_cost, print_json, resolve_batch, resolve_precision
    from hetplan.elastic.cli import storage_bandwidth_bytes_per_s
    from hetplan.market import load_market
    from hetplan.model import load_model
    from hetplan.report import require_matplotlib
    from hetplan.spot.planner import Planner
    from hetplan.spot.pool import layout, pool_from_cluster, pool_from_market
    from hetplan.spot.report import policies_table, summary_lines, write_plot
    from hetplan.spot.simulate import Settings
    from hetplan.spot.simulate import simulate as run
    from hetplan.spot.traces import ANY_TYPE, load_trace
    from hetplan.units import parse_count, parse_duration_s

    require_matplotlib("--plot", plot)
    if cluster is not None and market is not None:
        raise InputError("--market", "give --cluster or --market, not both")
    search = _replan_mode(replan_mode)
    spec = load_model(model, seq_len)
    if cluster is not None:
        cl = load_cluster(cluster)
        tr = load_trace(trace, dict(cl.gpu_types))
        if tr.types == [ANY_TYPE]:
            kinds = [g.name for g in cl.gpu_types_used()]
            if len(kinds) != 1:
                raise InputError(
                    "--cluster",
                    f"the trace counts GPUs of one type; the cluster has {', '.join(kinds)}",
                )
            tr = tr.bind(kinds[0])
        pool = pool_from_cluster(cl)
        storage = storage_bandwidth_bytes_per_s(cluster, storage_bandwidth)
    else:
        tr = load_trace(trace)
        if tr.types == [ANY_TYPE]:
            raise InputError("--trace", "it counts GPUs of no named type: use --cluster")
        pool = pool_from_market(load_market(market), tr.types)  # None: the built-in market
        storage = storage_bandwidth_bytes_per_s("", storage_bandwidth)
    pool.check(tr.types)
    first = layout(pool, tr.points[0].counts)
    if not first:
        raise InputError("--trace", "its first change point has no GPUs available")
    prec = resolve_precision(pool.cluster(first), precision)
    planner = Planner(
        spec, pool, prec, resolve_batch(spec, global_batch_size),
        load_cost(params_path, profile_path), storage, replan_search=search,
    )  # fmt: skip
    settings = Settings(
        restart_s=parse_duration_s(restart_time, "--restart-time"),
        target_tokens=None if tokens is None else parse_count(tokens, "--tokens"),
        interval_s=None
        if checkpoint_interval is None
        else parse_duration_s(checkpoint_interval, "--checkpoint-interval"),
    )
    if settings.interval_s is not None and settings.interval_s <= 0:
        raise InputError("--checkpoint-interval", "must be positive")
    result = run(tr, planner, settings)
    if plot is not None:
        write_plot(plot, result)
    if as_json:
        print_json({"model": spec.name, "trace": tr.source, "precision": prec, **result.to_json()})
        return
    out = Console(width=None if sys.stdout.isatty() else 200)
    target = "" if settings.target_tokens is None else f", target {settings.target_tokens:.3g}"
    title = (
        f"{spec.name} on {tr.source} ({tr.duration_s / 3600:.2f} h{target}, {prec}): "
        "four policies on the same trace"
    )
    out.print(policies_table(result, title))
    for line in summary_lines(result):
        out.print(line, highlight=False, soft_wrap=True)
    if plot is not None:
        out.print(f"picture written to {plot}", highlight=False)


@app.command()
def synth(
    cluster: Annotated[
        str, typer.Option("--cluster", "-c", help="The pool: node shapes and counts per type")
    ],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Trace CSV to write")],
    preemption_rate: Annotated[
        float, typer.Option("--preemption-rate", help="Preemptions per node-hour (Poisson)")
    ] = 0.1,
    mean_outage: Annotated[
        str, typer.Option("--mean-outage", help="Mean time a preempted node stays away")
    ] = "30m",
    duration: Annotated[str, typer.Option("--duration", help="Trace length, e.g. 24h")] = "24h",
    seed: Annotated[int, typer.Option("--seed", help="Random seed")] = 0,
) -> None:
    """Write a synthetic trace: per node, Poisson preemptions and exponential outages."""
    from hetplan.cluster import load_cluster
    from hetplan.spot.pool import pool_from_cluster
    from hetplan.spot.traces import PoolType, synthesize, trace_csv
    from hetplan.units import parse_duration_s

    if not (math.isfinite(preemption_rate) and preemption_rate >= 0):
        raise InputError("--preemption-rate", f"must be a finite rate >= 0, got {preemption_rate}")
    pool = pool_from_cluster(load_cluster(cluster))
    outage = parse_duration_s(mean_outage, "--mean-outage")
    types = [
        PoolType(
            gpu,
            t.template.gpus,
            t.max_gpus // t.template.gpus,
            preemption_rate,
            outage,
        )
        for gpu, t in pool.types.items()
    ]
    trace = synthesize(types, parse_duration_s(duration, "--duration"), seed)
    write_text(out_path, trace_csv(trace), "--out")
    Console().print(
        f"{trace.changes()} changes over {trace.duration_s / 3600:.1f} h written to {out_path}",
        highlight=False,
    )

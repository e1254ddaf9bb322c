"""The ``replan`` command; the main CLI adds it with ``register(app)``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from hetplan.commands.options import PlanArg, PlanOpt, plan_file
from hetplan.errors import InputError
from hetplan.outputs import json_text
from hetplan.units import parse_bandwidth_bytes_per_s

DEFAULT_STORAGE_BANDWIDTH = "10 Gbit/s"
"""An assumption, not a measurement: set ``storage_bandwidth`` in the cluster file."""


def storage_bandwidth_bytes_per_s(cluster_spec: str, override: str | None) -> float:
    """Returns the storage bandwidth: the option, else the cluster file's key, else a default."""
    if override is not None:
        return parse_bandwidth_bytes_per_s(override, "--storage-bandwidth")
    path = Path(cluster_spec)
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            data = None  # load_cluster reports a bad file with its own message
        if isinstance(data, dict) and "storage_bandwidth" in data:
            return parse_bandwidth_bytes_per_s(data["storage_bandwidth"], "storage_bandwidth")
    return parse_bandwidth_bytes_per_s(DEFAULT_STORAGE_BANDWIDTH, "--storage-bandwidth")


def _names(text: str) -> list[str]:
    out = [n.strip() for n in text.split(",") if n.strip()]
    if not out:
        raise InputError("--lost", "name at least one node (NODE[,NODE...])")
    return out


def replan_report(
    plan_path: Path,
    model_spec: str,
    cluster_spec: str,
    lost: list[str],
    joined_spec: str | None,
    storage_bw: str | None,
    search: bool,
    profile: Path | None = None,
    seq_len: int | None = None,
    params_path: Path | None = None,
    precision: str | None = None,
) -> tuple[dict[str, Any], Any]:
    """Returns the JSON report of a replan (new plan, times, changes, recovery) and the plan;
    compute times come from the measured ``profile`` (else $HETPLAN_PROFILE) first."""
    from hetplan.cluster import load_cluster
    from hetplan.commands.common import load_cost
    from hetplan.elastic.recovery import plan_recovery, problem_from_plans
    from hetplan.elastic.replan import replan
    from hetplan.model import load_model
    from hetplan.plan import load_plan, model_for_plan, validate_plan

    model = load_model(model_spec, seq_len)
    cluster = load_cluster(cluster_spec)
    params = load_cost(params_path, profile)
    plan = load_plan(plan_path)
    model = model_for_plan(plan, model, seq_len)
    joined = load_cluster(joined_spec, "--joined") if joined_spec else None
    if precision is not None:  # every GPU the new plan may use must run it
        from hetplan.commands.common import resolve_precision

        for nodes in (cluster, joined):
            if nodes is not None:
                resolve_precision(nodes, precision)
        plan = replace(plan, precision=precision)
    validate_plan(plan, model, cluster)
    storage = storage_bandwidth_bytes_per_s(cluster_spec, storage_bw)
    res = replan(plan, model, cluster, lost, joined, params=params, search=search)
    if not res.estimate.fits:  # a plan that cannot run is no answer: nothing is written
        from hetplan.commands.common import no_fit_message

        where = f"without {', '.join(lost)}" if lost else "with the joined nodes"
        raise InputError(
            "--lost" if lost else "--joined",
            f"{where}, {no_fit_message(res.min_memory_bytes, res.cluster)}",
        )
    rec = plan_recovery(problem_from_plans(plan, res.plan, model, cluster, res.cluster, storage))
    new_plan = replace(res.plan, model=model)  # the file states the model it was made for
    report = {
        "plan": json.loads(json.dumps(new_plan.to_dict())),
        "replan_time_s": res.replan_time_s,
        "method": res.method,
        "old_iteration_time_s": res.old_estimate.iteration_time_s,
        "new_iteration_time_s": res.estimate.iteration_time_s,
        "fits": res.estimate.fits,
        "changes": res.changes,
        "notes": res.notes,
        "storage_bytes_per_s": storage,
        "recovery": rec.to_json(),
    }
    return report, new_plan


def replan_cmd(
    plan_arg: PlanArg = None,
    *,
    plan_opt: PlanOpt = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Catalog name or config.json.")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster file or inline spec.")],
    lost: Annotated[str, typer.Option("--lost", help="Lost nodes: NODE[,NODE...].")],
    joined: Annotated[
        str | None, typer.Option("--joined", help="Cluster file of nodes that joined.")
    ] = None,
    storage_bandwidth: Annotated[
        str | None,
        typer.Option(help="Storage bandwidth (default: the cluster file's, else 10 Gbit/s)."),
    ] = None,
    search: Annotated[bool, typer.Option(help="Also run the full heterogeneous search.")] = False,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write the new plan here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    profile: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            help="Measured profile database (default: $HETPLAN_PROFILE, else none).",
            show_default=False,
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Override the sequence length.")
    ] = None,
    params_path: Annotated[
        Path | None, typer.Option("--params", help="Cost-model parameters (hetplan calibrate).")
    ] = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="Override the plan's precision")
    ] = None,
) -> None:
    """Replan on the nodes that remain after a preemption and plan the state's recovery."""
    names = _names(lost)
    plan, _ = plan_file(plan_arg, plan_opt)
    assert plan is not None
    report, new_plan = replan_report(
        plan, model, cluster, names, joined, storage_bandwidth, search, profile, seq_len,
        params_path, precision,
    )  # fmt: skip
    if out is not None:
        new_plan.save(out)
    if as_json:
        typer.echo(json_text(report))
        return
    console = Console()
    console.print(
        f"replanned by {report['method']} in {report['replan_time_s']:.3f} s: iteration "
        f"{report['old_iteration_time_s']:.3f} s -> {report['new_iteration_time_s']:.3f} s",
        highlight=False,
    )
    for line in report["changes"] + report["notes"]:
        console.print(f"  {line}", highlight=False)
    rec = report["recovery"]
    table = Table(title="recovery plan")
    for col in ("source", "GB"):
        table.add_column(col, justify="right")
    for key in ("bytes_local", "bytes_from_peers", "bytes_from_storage"):
        table.add_row(key.removeprefix("bytes_").replace("_", " "), f"{rec[key] / 1e9:.3f}")
    console.print(table)
    if rec["bytes_from_peers"] + rec["bytes_from_storage"] == 0:
        console.print(
            "nothing to move: every shard the new plan needs is already local "
            f"(downloading everything from storage would take "
            f"{rec['baseline_recovery_s']:.2f} s)",
            highlight=False,
        )
        return
    console.print(
        f"predicted recovery {rec['predicted_recovery_s']:.2f} s vs "
        f"{rec['baseline_recovery_s']:.2f} s downloading everything from storage "
        f"({rec['speedup']:.2f}x)",
        highlight=False,
    )
    if out is not None:
        console.print(f"new plan written to {out}", highlight=False)


def register(app: typer.Typer) -> None:
    """Adds the ``replan`` command to ``app``."""
    app.command("replan")(replan_cmd)

"""``calibrate``: fit the cost model's physical terms to measured runs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from hetplan.commands.common import open_profile, out, print_json
from hetplan.commands.options import JsonOpt, ProfileOpt
from hetplan.cost.params import CostParams
from hetplan.outputs import check_output


def register(app: typer.Typer) -> None:
    """Adds ``calibrate`` to ``app``."""
    app.command()(calibrate)


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

    check_output(out_path, "--out")
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
    out.print(summary_text(summary, kind), highlight=False)
    if out_path is not None:
        out.print(f"parameters written to {out_path}")


def summary_text(summary: dict[str, Any], kind: str) -> str:
    """Returns the error summary of a calibration (``calibrate_report._summary``) as
    sentences a person reads: errors in percent, the rank correlation where there are runs
    to rank, which plan each group of comparable runs would pick, and the runs that ran
    out of memory against what the model said."""
    n = summary.get("n", 0)
    if not n:
        return f"{kind}: no measured run to compare"
    parts = [f"{kind} over {n} run{'s' * (n != 1)}: mean error {summary['mae_pct']:.1f}%, "
             f"worst {summary['max_pct']:.1f}%"]  # fmt: skip
    rho = summary.get("spearman", math.nan)
    parts.append("rank correlation " + ("n/a (fewer than 3 runs)" if math.isnan(rho)
                                        else f"{rho:.3f}"))  # fmt: skip
    pick = summary.get("first_pick") or {}
    groups = pick.get("groups", 0)
    if groups:
        text = f"first pick: the best in {pick['best_picked']} of {groups} groups"
        if pick["worst_ratio"] > 1.0 + 1e-12:
            text += (f" (worst {pick['worst_ratio']:.3f}x the best: picked "
                     f"{pick['worst_pick']}, best {pick['worst_best']})")  # fmt: skip
        parts.append(text)
    else:
        parts.append("first pick: no group of comparable runs")
    oom = summary.get("oom_rows", 0)
    if oom:
        parts.append(f"{oom} ran out of memory, {summary['oom_rows_flagged']} of them "
                     "predicted not to fit")  # fmt: skip
    flagged = summary.get("measured_rows_flagged", 0)
    if flagged:
        parts.append(f"{flagged} measured run{'s' * (flagged != 1)} predicted not to fit")
    return "; ".join(parts)

"""Honest error reports of fitted parameters: in-sample and cold leave-one-out (each held-out
row predicted by terms fitted from scratch without it), per source file: mean and largest
error, rank correlation, whether the plan ranked first of each job is the measured best,
and which out-of-memory rows the memory model flags."""

from __future__ import annotations

import math
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from hetplan.cost.calibrate_data import components, group_key, resolve
from hetplan.cost.calibrate_fit import fit, fit_reserve_bytes, memory_slack_bytes
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams
from hetplan.cost.runs import Run


def first_pick(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Returns, over groups of alternative runs (same job), how the plan the model ranks
    first measured against the measured best: worst ratio and how many picks were best."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        if r["measured"] is not None:
            groups.setdefault(r["group"], []).append(r)
    ratios = []
    for members in groups.values():
        if len(members) < 2:
            continue
        faster = members[0]["metric"] == "iter_time_s"
        sign = 1.0 if faster else -1.0
        pick = min(members, key=lambda r: sign * r["predicted"])
        best = min(members, key=lambda r: sign * r["measured"])
        ratio = pick["measured"] / best["measured"] if faster else best["measured"] / pick[
            "measured"]  # fmt: skip
        ratios.append((ratio, pick["label"], best["label"]))
    if not ratios:
        return {"groups": 0}
    worst = max(ratios)
    return {
        "groups": len(ratios),
        "best_picked": sum(r[0] <= 1.0 + 1e-12 for r in ratios),
        "worst_ratio": worst[0],
        "worst_pick": worst[1],
        "worst_best": worst[2],
    }


def _summary(rows: list[dict[str, Any]], loo: bool) -> dict[str, Any]:
    done = [r for r in rows if r["measured"] is not None]
    errs = [abs(r["error_pct"]) for r in done]
    rho = spearmanr([r["predicted"] for r in done], [r["measured"] for r in done])[0]
    oom = [r for r in rows if r["measured"] is None]
    return {
        "n": len(done),
        "mae_pct": float(np.mean(errs)) if errs else math.nan,
        "max_pct": float(np.max(errs)) if errs else math.nan,
        "spearman": float(rho) if len(done) > 2 else math.nan,
        "loo": loo,
        "first_pick": first_pick(rows),
        "oom_rows": len(oom),
        "oom_rows_flagged": sum(not r["fits"] for r in oom),
        "measured_rows_flagged": sum(not r["fits"] for r in done),
    }


def _row(run: Run, params: CostParams, fits: bool | None = None) -> dict[str, Any]:
    resolved = resolve(run, params)
    assert resolved.plan is not None
    est = estimate(resolved.plan, run.model, run.cluster, params, validate=False)
    pred = run.predict(est)
    plan = resolved.plan
    return {
        "label": run.label,
        "metric": run.metric,
        "group": group_key(run),
        "predicted": pred,
        "measured": run.measured,
        "error_pct": (pred / run.measured - 1) * 100 if run.measured else None,
        "fits": est.fits if fits is None else fits,
        "micro_batch": plan.micro_batch_size,
        "virtual_stages": plan.virtual_stages,
        "recompute": plan.recompute,
        "searched": run.knobs is not None,
        "compute_source": est.compute_source,
    }


def _cold_fold(i: int, runs: list[Run], start: CostParams) -> dict[str, Any] | None:
    """Returns row ``i`` predicted by terms fitted from their priors on the other measured
    rows of its GPU type (knobs chosen with those terms), or None for an OOM row."""
    run = runs[i]
    if run.measured is None:
        return None
    others = [r for j, r in enumerate(runs) if j != i and r.measured is not None]
    linked = next((g for gpus, g in components([run, *others]) if run in g), [])
    group = [r for r in linked if r is not run]
    held = fit(group, start) if group else start
    return _row(run, held)


def in_sample(runs: list[Run], params: CostParams) -> dict[str, Any]:
    """Returns, per source file, the error of ``params`` on every row (rows in the fit)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        rows.setdefault(run.source, []).append(_row(run, params))
    return {src: {**_summary(r, loo=False), "rows": r} for src, r in rows.items()}


def leave_one_out(
    runs: list[Run],
    params: CostParams | None = None,
    workers: int | None = None,
    start: CostParams | None = None,
) -> dict[str, Any]:
    """Returns, per source file, the cold leave-one-out error: each measured row predicted
    by terms fitted from scratch without it (``start`` brings the profile, if any); the
    folds run in ``workers`` processes (default: one per CPU). ``params`` (the fit on all
    rows) classifies memory: the reserve refitted without the row flags it or not."""
    start = start or CostParams()
    params = params or fit(runs, start)
    n = len(runs)
    workers = workers or os.cpu_count() or 1
    if workers > 1 and n > 4:
        with ProcessPoolExecutor(workers) as pool:
            folds = list(pool.map(_cold_fold, range(n), [runs] * n, [start] * n))
    else:
        folds = [_cold_fold(i, runs, start) for i in range(n)]
    slack = {i: memory_slack_bytes(r, params) for i, r in enumerate(runs) if r.plan}
    held_reserve = {
        i: fit_reserve_bytes(
            [(v, runs[j].measured is not None) for j, v in slack.items() if j != i],
            start.memory_reserve_bytes,  # the prior, as ``fit`` starts from
        )
        for i in slack
    }
    rows: dict[str, list[dict[str, Any]]] = {}
    for i, (run, row) in enumerate(zip(runs, folds, strict=True)):
        if row is None:  # OOM row: nothing to predict, only whether it is flagged
            row = _row(run, params)
        if i in slack:
            row["fits"] = held_reserve[i] <= slack[i]
        rows.setdefault(run.source, []).append(row)
    return {src: {**_summary(r, loo=True), "rows": r} for src, r in rows.items()}

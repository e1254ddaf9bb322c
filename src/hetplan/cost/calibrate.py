"""Fitting the cost model's efficiency parameters to measured runs, and its honest error.

Three CSV formats are read (the format is recognised from the header):

- ``megatron``: the columns of ``megatron_homogeneous.csv`` (published Megatron runs);
- ``amp``: the columns of ``amp_t4_homogeneous.csv`` (AMP's timed T4 trials, with the
  30-unit ``layer_partition``; blank ``measured_iter_s`` = the plan ran out of memory);
- ``generic`` (for users): ``layers, hidden, heads, ffn, vocab, seq, gpu, nodes,
  gpus_per_node, tp, pp, dp, micro_batch, global_batch`` and one measured column,
  ``iter_time_s`` or ``tflops_per_gpu`` (model FLOPs); optional ``kv_heads`` (= heads),
  ``family`` (gpt), ``precision`` (bf16), ``recompute`` (none), ``schedule`` (1F1B),
  ``virtual_stages`` (1), ``flash_attention`` (true), ``sequence_parallel`` (false),
  ``zero_stage`` (0), ``network_gbit_s`` (the GPU type's default), ``label``.

Each row becomes a :class:`Run`: model, cluster, a plan (or the knobs the search must
choose, when the source leaves them out) and the measured value. Parameters are fitted
with bounded ``scipy.optimize.least_squares`` on log(predicted / measured), with a weak
pull towards physically plausible priors so that few rows cannot drive them to a bound.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.runs import METRICS, Knobs, Run, load_runs
from hetplan.errors import InputError

__all__ = [
    "METRICS",
    "Knobs",
    "Run",
    "calibrate_file",
    "calibrate_runs",
    "fit",
    "fit_reserve_bytes",
    "leave_one_out",
    "load_runs",
    "memory_slack_bytes",
    "predict",
    "resolve",
    "shipped_files",
]


def resolve(run: Run, params: CostParams) -> Run:
    """Returns ``run`` with its plan completed by the homogeneous search (if it had knobs)."""
    if run.knobs is None:
        return run
    from hetplan.search.homogeneous import SearchSpace, search_homogeneous

    k = run.knobs
    space = SearchSpace(
        recompute=k.recompute, zero_stages=k.zero_stages, sequence_parallel=(k.sequence_parallel,),
        tp=(k.tp,), pp=(k.pp,), dp=(k.dp,), schedules=k.schedules,
    )  # fmt: skip
    found = search_homogeneous(run.model, run.cluster, k.global_batch, k.precision, top_k=1,
                               params=params, space=space, flash_attention=k.flash_attention,
                               finalists=4)  # fmt: skip
    if not found.ranked:
        raise InputError("tp", f"{run.label}: no plan with tp={k.tp} pp={k.pp} dp={k.dp} fits")
    plan = replace(
        found.ranked[0][0],
        overlap_grad_reduce=k.overlap_grad_reduce,
        overlap_tp_comm=k.overlap_grad_reduce,
    )  # Megatron-Core overlaps both
    return replace(run, plan=plan, knobs=None)


def predict(run: Run, params: CostParams) -> tuple[float, bool]:
    """Returns the predicted value of the run's metric and whether the plan fits in memory."""
    run = resolve(run, params)
    assert run.plan is not None
    est = estimate(run.plan, run.model, run.cluster, params, validate=False)
    return run.predict(est), est.fits


# ---- fitting ---------------------------------------------------------------------------

# (name, lower, upper, prior, log-scale) of the parameters fitted per GPU type
_FIELDS = (
    ("gemm_max", 0.05, 1.0, 0.7, False),
    ("gemm_half_dim", 4.0, 4096.0, 128.0, True),
    ("mem_efficiency", 0.1, 1.0, 0.7, False),
    ("kernel_overhead_s", 1e-6, 3e-4, 1e-5, True),
    ("link_efficiency", 0.1, 1.0, 0.7, False),
)
PRIOR_WEIGHT = 0.05
"""Weight of the (log-)distance of each parameter from its prior: a weak pull that keeps
few rows from driving poorly determined parameters to a bound."""


def _pack(eff: GPUEfficiency, base: CostParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, lo, hi = [], [], []
    for name, a, b, _, log in _FIELDS:
        value = getattr(eff, name)
        value = base.link_efficiency if value is None else value
        f = math.log if log else float
        x.append(f(min(max(value, a), b)))
        lo.append(f(a))
        hi.append(f(b))
    return np.array(x), np.array(lo), np.array(hi)


def _unpack(x: np.ndarray) -> GPUEfficiency:
    return GPUEfficiency(
        **{f[0]: math.exp(float(v)) if f[4] else float(v) for v, f in zip(x, _FIELDS, strict=True)}
    )


def _gpu_of(run: Run) -> str:
    return run.cluster.nodes[0].gpu.name


def _residuals(x: np.ndarray, runs: list[Run], base: CostParams, gpu: str) -> np.ndarray:
    params = base.with_gpu(gpu, _unpack(x))
    out = []
    for run in runs:
        assert run.plan is not None and run.measured is not None
        est = estimate(run.plan, run.model, run.cluster, params, validate=False)
        out.append(math.log(run.predict(est) / run.measured))
    for xi, (_, _, _, prior, log) in zip(x, _FIELDS, strict=True):
        out.append(PRIOR_WEIGHT * ((xi - math.log(prior)) if log else (xi / prior - 1.0)))
    return np.array(out)


def _fit_gpu(runs: list[Run], base: CostParams, gpu: str, max_nfev: int) -> GPUEfficiency:
    x0, lo, hi = _pack(base.gpu(gpu), base)
    # a tolerance of 1e-4 on log errors is far below the data's own noise (~1%)
    sol = least_squares(_residuals, x0, bounds=(lo, hi), args=(runs, base, gpu), x_scale="jac",
                        ftol=1e-4, xtol=1e-4, gtol=1e-4, max_nfev=max_nfev)  # fmt: skip
    return _unpack(sol.x)


def _with_default(params: CostParams) -> CostParams:
    """Returns ``params`` whose ``default`` (for GPU types without data) is the geometric
    mean of the fitted types, and whose global link efficiency is their mean."""
    effs = list(params.gpus.values())
    if not effs:
        return params
    mean = {
        name: float(np.exp(np.mean([math.log(getattr(e, name)) for e in effs])))
        for name, *_ in _FIELDS
        if name != "link_efficiency"
    }
    links = [e.link_efficiency for e in effs if e.link_efficiency is not None]
    link = float(np.mean(links)) if links else params.link_efficiency
    return replace(params, default=GPUEfficiency(**mean), link_efficiency=link)


def fit(runs: Iterable[Run], start: CostParams | None = None, max_nfev: int = 200) -> CostParams:
    """Returns parameters fitted, per GPU type, to that type's measured runs (OOM rows
    are ignored); types without runs keep ``start``'s values."""
    params = start or CostParams()
    runs = list(runs)
    measured = [r for r in runs if r.measured is not None]
    if not measured:
        raise InputError("--runs", "no row has a measured value to fit")
    # knobs the search chooses are fixed with the starting parameters, then chosen again
    # with the fitted ones and the fit repeated
    rounds = 2 if any(r.knobs for r in measured) else 1
    for _ in range(rounds):
        fixed = [resolve(r, params) for r in measured]
        for gpu in sorted({_gpu_of(r) for r in fixed}):
            group = [r for r in fixed if _gpu_of(r) == gpu]
            params = params.with_gpu(gpu, _fit_gpu(group, params, gpu, max_nfev))
    params = _with_default(params)
    reserve = fit_reserve_bytes(_memory_rows(list(runs), params), params.memory_reserve_bytes)
    return replace(params, memory_reserve_bytes=reserve)


# ---- memory: the per-device reserve, fitted as a classification ------------------------

RESERVE_GUARD_BYTES = 2**20
"""Kept below the tightest measured row's slack so float rounding cannot flip it."""


def memory_slack_bytes(run: Run, params: CostParams) -> float:
    """Returns the smallest (capacity - modelled bytes without the reserve) over its stages."""
    assert run.plan is not None
    est = estimate(run.plan, run.model, run.cluster, params, validate=False)
    return min(s.capacity_bytes - (s.memory.total - s.memory.reserve) for s in est.stages)


def fit_reserve_bytes(slacks: list[tuple[float, bool]], prior_bytes: float) -> float:
    """Returns the largest reserve with which every measured (slack, True) row still fits."""
    # The reserve holds what the tensor accounting leaves out: the CUDA context, library
    # workspaces, the caching allocator's fragmentation (PyTorch "CUDA memory management":
    # reserved >= allocated), and the gap between the datasheet and the visible memory.
    # Every row that ran must fit; the largest such reserve flags the most OOM rows.
    ran = [s for s, measured in slacks if measured]
    if not ran:
        return prior_bytes
    return max(0.0, min(ran) - RESERVE_GUARD_BYTES)


def _memory_rows(runs: list[Run], params: CostParams) -> list[tuple[float, bool]]:
    """Returns (slack, ran) of every row with a fixed plan (searched plans fit by design)."""
    return [(memory_slack_bytes(r, params), r.measured is not None) for r in runs if r.plan]


# ---- leave-one-out error ---------------------------------------------------------------


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r["measured"] is not None]
    errs = [abs(r["error_pct"]) for r in done]
    rho = spearmanr([r["predicted"] for r in done], [r["measured"] for r in done])[0]
    oom = [r for r in rows if r["measured"] is None]
    return {
        "n": len(done),
        "mae_pct": float(np.mean(errs)) if errs else math.nan,
        "max_pct": float(np.max(errs)) if errs else math.nan,
        "spearman": float(rho) if len(done) > 2 else math.nan,
        "loo": True,
        "oom_rows": len(oom),
        "oom_rows_flagged": sum(not r["fits"] for r in oom),
        "measured_rows_flagged": sum(not r["fits"] for r in done),
    }


LOO_MAX_EVALUATIONS = 30
"""Refits of the leave-one-out folds start from the all-rows fit; they are capped."""


def _fold(i: int, runs: list[Run], fixed: list[Run], params: CostParams) -> CostParams:
    """Returns ``params`` refitted without row ``i`` (only its GPU type's parameters)."""
    run = runs[i]
    if run.measured is None:
        return params
    gpu = _gpu_of(run)
    group = [r for j, r in enumerate(fixed) if j != i and r.measured is not None
             and _gpu_of(r) == gpu]  # fmt: skip
    if not group:
        return params
    return params.with_gpu(gpu, _fit_gpu(group, params, gpu, LOO_MAX_EVALUATIONS))


def leave_one_out(
    runs: list[Run], params: CostParams | None = None, workers: int | None = None
) -> dict[str, Any]:
    """Returns, per source file, the leave-one-out error: each measured row is predicted by
    parameters refitted without it (warm-started from the fit on all rows, ``params``);
    the folds run in ``workers`` processes (default: one per CPU)."""
    params = params or fit(runs)
    fixed = [resolve(r, params) if r.measured is not None else r for r in runs]
    n = len(runs)
    workers = workers or os.cpu_count() or 1
    if workers > 1 and n > 4:
        with ProcessPoolExecutor(workers) as pool:
            folds = list(pool.map(_fold, range(n), [runs] * n, [fixed] * n, [params] * n))
    else:
        folds = [_fold(i, runs, fixed, params) for i in range(n)]
    # memory leave-one-out: the reserve refitted without the row classifies it
    slack = {i: memory_slack_bytes(r, params) for i, r in enumerate(runs) if r.plan}
    held_reserve = {
        i: fit_reserve_bytes(
            [(v, runs[j].measured is not None) for j, v in slack.items() if j != i],
            params.memory_reserve_bytes,
        )
        for i in slack
    }
    rows: dict[str, list[dict[str, Any]]] = {}
    for i, (run, held) in enumerate(zip(runs, folds, strict=True)):
        resolved = resolve(run, held)
        assert resolved.plan is not None
        est = estimate(resolved.plan, run.model, run.cluster, held, validate=False)
        pred = run.predict(est)
        plan = resolved.plan
        rows.setdefault(run.source, []).append({
            "label": run.label,
            "metric": run.metric,
            "predicted": pred,
            "measured": run.measured,
            "error_pct": (pred / run.measured - 1) * 100 if run.measured else None,
            "fits": held_reserve[i] <= slack[i] if i in slack else est.fits,
            "micro_batch": plan.micro_batch_size,
            "virtual_stages": plan.virtual_stages,
            "recompute": plan.recompute,
            "searched": run.knobs is not None,
        })  # fmt: skip
    return {src: {**_summary(r), "rows": r} for src, r in rows.items()}


def calibrate_file(path: Path, out_path: Path | None = None) -> tuple[CostParams, dict[str, Any]]:
    """Returns parameters fitted to the runs of ``path`` and their leave-one-out report;
    writes the parameters (with the report's summary) to ``out_path`` if given."""
    params, report = calibrate_runs(load_runs(path))
    if out_path is not None:
        params.save(out_path)
    return params, report.get(path.name, {})


def shipped_files() -> list[Path]:
    """Returns the paths of the calibration CSVs shipped with the package."""
    root = Path(str(resources.files("hetplan.data").joinpath("calibration")))
    return [root / "megatron_homogeneous.csv", root / "amp_t4_homogeneous.csv"]


def calibrate_runs(runs: list[Run]) -> tuple[CostParams, dict[str, Any]]:
    """Returns parameters fitted to ``runs`` (their ``fit_report`` set) and the LOO report."""
    params = fit(runs)
    report = leave_one_out(runs, params)
    summary = {src: {k: v for k, v in r.items() if k != "rows"} for src, r in report.items()}
    return replace(params, fit_report=summary), report

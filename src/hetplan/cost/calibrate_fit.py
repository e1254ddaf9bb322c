"""The fit: per GPU type (jointly for types mixed-cluster runs link), bounded
``scipy.optimize.least_squares`` on log(predicted / measured) from the terms' priors, with a
weak pull towards them and an ordering hinge (the measured best run of each job predicted
ahead of every alternative measured slower); then the per-device memory reserve, fitted as
a classification (every measured run must fit)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from hetplan.cost.calibrate_data import components, gpus_of, group_key, resolve
from hetplan.cost.calibrate_terms import (
    TERMS,
    pack_terms,
    prior_eff,
    term_prior,
    terms_report,
    with_default,
    with_terms,
)
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams
from hetplan.cost.runs import Run
from hetplan.cost.trust import add_coverage
from hetplan.errors import InputError

PICK_WEIGHT = 5.0
"""Weight of a wrongly ordered pair (the measured best of a job predicted slower than an
alternative) against the log errors: a model tuned for mean error alone can pick a plan
measured 2-20% slower than the best one while every error stays small."""
PICK_MARGIN = 0.01
"""Log margin the measured best should be predicted ahead by (capped at half the measured
gap): a tie on paper is a coin toss on the hardware."""
MAX_EVALUATIONS = 120
"""Cap on residual evaluations per GPU type and fit (a fit converges in far fewer)."""


def _pick_pairs(runs: list[Run]) -> list[tuple[int, int, float, float]]:
    """Returns (best, other, measured log gap, margin) index pairs: in each group of
    alternative runs (one job), the measured best against every other run measured slower
    by more than 0.5%, with the log margin the prediction should keep between them (half
    the measured gap, at most PICK_MARGIN)."""
    groups: dict[Any, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(group_key(run), []).append(i)
    pairs = []
    for members in groups.values():
        if len(members) < 2:
            continue
        sign = 1.0 if runs[members[0]].metric == "iter_time_s" else -1.0
        value = {i: float(runs[i].measured or 0.0) for i in members}
        best = min(members, key=lambda i: sign * value[i])
        for i in members:
            gap = sign * math.log(value[i] / value[best])
            if i != best and gap > 0.005:
                pairs.append((best, i, gap, min(PICK_MARGIN, gap / 2)))
    return pairs


def _residuals(
    x: np.ndarray,
    runs: list[Run],
    base: CostParams,
    gpus: tuple[str, ...],
    pairs: list[tuple[int, int, float, float]],
) -> np.ndarray:
    params = with_terms(base, gpus, x)
    out = []
    for run in runs:
        assert run.plan is not None and run.measured is not None
        est = estimate(run.plan, run.model, run.cluster, params, validate=False)
        out.append(math.log(run.predict(est) / run.measured))
    # the measured best of each job must also be predicted best: a hinge on every pair the
    # prediction orders wrongly (out[i] - out[j] is the predicted log ratio minus the
    # measured one, so the predicted log gap is that plus the measured gap)
    for best, other, measured_gap, margin in pairs:
        sign = 1.0 if runs[best].metric == "iter_time_s" else -1.0
        predicted_gap = measured_gap + sign * (out[other] - out[best])
        out.append(PICK_WEIGHT * max(0.0, margin - predicted_gap))
    priors = [term_prior(t, gpu) for gpu in gpus for t in TERMS]
    for xi, t, prior in zip(x, TERMS * len(gpus), priors, strict=True):
        out.append(t.prior_residual(xi, prior))
    return np.array(out)


def _fit_group(
    runs: list[Run], base: CostParams, gpus: tuple[str, ...], max_nfev: int
) -> CostParams:
    """Returns ``base`` with the terms of ``gpus`` fitted jointly, from their priors."""
    packed = [pack_terms(prior_eff(gpu), gpu) for gpu in gpus]
    x0, lo, hi = (np.concatenate([p[i] for p in packed]) for i in range(3))
    # a tolerance of 1e-4 on log errors is far below the data's own noise (~1%)
    args = (runs, base, gpus, _pick_pairs(runs))  # the pairs depend on the runs alone
    sol = least_squares(_residuals, x0, bounds=(lo, hi), args=args, x_scale="jac",
                        ftol=1e-4, xtol=1e-4, gtol=1e-4,
                        max_nfev=max_nfev * len(gpus))  # fmt: skip
    return with_terms(base, gpus, sol.x)


def fit(runs: Iterable[Run], start: CostParams | None = None, max_nfev: int = MAX_EVALUATIONS
        ) -> CostParams:  # fmt: skip
    """Returns parameters fitted from their priors to the measured runs (OOM rows are
    ignored): per GPU type, or jointly for GPU types that mixed-cluster runs link; types
    without runs keep ``start``'s values. ``start`` also brings the profile (measured
    compute) the runs are predicted with."""
    params = start or CostParams()
    runs = list(runs)
    measured = [r for r in runs if r.measured is not None]
    if not measured:
        raise InputError("--runs", "no row has a measured value to fit")
    # knobs the search chooses are fixed with the prior terms, then chosen again with the
    # fitted ones and the fit repeated
    rounds = 2 if any(r.knobs for r in measured) else 1
    for gpu in sorted(set().union(*(gpus_of(r) for r in measured))):
        params = params.with_gpu(gpu, prior_eff(gpu))
    for _ in range(rounds):
        fixed = [resolve(r, params) for r in measured]
        for gpus, group in components(fixed):
            params = _fit_group(group, params, gpus, max_nfev)
    params = with_default(params)
    reserve = fit_reserve_bytes(_memory_rows(list(runs), params), params.memory_reserve_bytes)
    report = {gpu: terms_report(eff, gpu) for gpu, eff in params.gpus.items()}
    coverage: dict[str, Any] = dict(params.fit_report.get("coverage", {}))
    for run in fixed:
        assert run.plan is not None and run.measured is not None
        est = estimate(run.plan, run.model, run.cluster, params, validate=False)
        pred = run.predict(est)
        ratio = pred / run.measured if run.metric == "iter_time_s" else run.measured / pred
        for gpu in gpus_of(run):
            coverage[gpu] = add_coverage(coverage.get(gpu, {}), run.plan, est.mfu * ratio)
    return replace(params, memory_reserve_bytes=reserve,
                   fit_report={**params.fit_report, "terms": report,
                               "coverage": coverage})  # fmt: skip


# ---- memory: the per-device reserve, fitted as a classification ------------------------

RESERVE_GUARD_BYTES = 2**20
"""Kept below the tightest measured row's slack so float rounding cannot flip it."""


def memory_slack_bytes(run: Run, params: CostParams) -> float:
    """Returns the smallest (capacity - modelled bytes without the reserve) over its stages."""
    assert run.plan is not None
    est = estimate(run.plan, run.model, run.cluster, params, validate=False)
    return min(s.capacity_bytes - (s.memory.total - s.memory.reserve) for s in est.stages)


def fit_reserve_bytes(slacks: list[tuple[float, bool]], prior_bytes: float) -> float:
    """Returns the reserve the measured rows call for: the prior, moved only as far as the
    rows demand. Every row that ran must fit (the reserve at most the tightest such row's
    slack); every row that ran out of memory (slack, False) should not (the reserve above
    its slack). Where no reserve does both, the largest with which every row that ran
    fits: it flags the most rows that ran out."""
    # The reserve holds what the tensor accounting leaves out: the CUDA context, library
    # workspaces, the caching allocator's fragmentation (PyTorch "CUDA memory management":
    # reserved >= allocated), and the gap between the datasheet and the visible memory. A
    # row that ran says only that the reserve is no larger than its slack (a small model on
    # a 96 GB GPU leaves ~89 GB), so rows that ran bound it from above, never set it.
    ran = [s for s, measured in slacks if measured]
    oom = [s for s, measured in slacks if not measured]
    hi = max(0.0, min(ran) - RESERVE_GUARD_BYTES) if ran else float("inf")
    lo = max(oom) + RESERVE_GUARD_BYTES if oom else 0.0
    if lo > hi:
        return hi
    return min(max(prior_bytes, lo, 0.0), hi)


def _memory_rows(runs: list[Run], params: CostParams) -> list[tuple[float, bool]]:
    """Returns (slack, ran) of every row with a fixed plan (searched plans fit by design)."""
    return [(memory_slack_bytes(r, params), r.measured is not None) for r in runs if r.plan]

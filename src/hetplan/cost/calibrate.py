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
  ``zero_stage`` (0), ``network_gbit_s`` (the GPU type's default), ``label``. A blank
  ``micro_batch`` leaves it to the search (and, with a blank ``schedule``, plain or
  interleaved 1F1B), for sources that do not state them.

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
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import spearmanr

from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.runs import METRICS, Knobs, Run, load_runs
from hetplan.cost.trust import add_coverage
from hetplan.errors import InputError

__all__ = [
    "METRICS",
    "Knobs",
    "Run",
    "calibrate_runs",
    "first_pick",
    "fit",
    "fit_reserve_bytes",
    "in_sample",
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
        # Megatron-Core overlaps both the gradient reduction and the TP collectives
        overlap_grad_reduce=k.overlap_grad_reduce, overlap_tp_comm=k.overlap_grad_reduce,
    )  # fmt: skip
    found = search_homogeneous(run.model, run.cluster, k.global_batch, k.precision, top_k=1,
                               params=params, space=space,
                               flash_attention=k.flash_attention)  # fmt: skip
    if not found.ranked:
        raise InputError("tp", f"{run.label}: no plan with tp={k.tp} pp={k.pp} dp={k.dp} fits")
    return replace(run, plan=found.ranked[0][0], knobs=None)


def predict(run: Run, params: CostParams) -> tuple[float, bool]:
    """Returns the predicted value of the run's metric and whether the plan fits in memory."""
    run = resolve(run, params)
    assert run.plan is not None
    est = estimate(run.plan, run.model, run.cluster, params, validate=False)
    return run.predict(est), est.fits


# ---- fitting ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One fitted term of the cost model: a physical quantity with a unit and bounds."""

    name: str
    unit: str
    lower: float
    upper: float
    prior: float
    log: bool
    meaning: str
    scale: float = 0.0
    """Linear terms: the distance from the prior that costs as much as doubling a log term
    (0: the prior itself, for terms whose prior is not 0)."""

    def prior_residual(self, x: float, prior: float | None = None) -> float:
        """Returns the weighted distance of the packed value ``x`` from the prior (the
        term's own, or ``prior``)."""
        p = self.prior if prior is None else prior
        if self.log:
            return PRIOR_WEIGHT * (x - math.log(p))
        return PRIOR_WEIGHT * (x - p) / (self.scale or self.prior)


TERMS = (
    Term("gemm_max", "fraction of peak", 0.05, 0.95, 0.7, False,
         "large matmuls' share of the datasheet peak"),
    Term("gemm_half_dim", "elements", 4.0, 4096.0, 128.0, True,
         "smallest matmul dimension at which matmuls reach half of gemm_max (small "
         "micro-batches and narrow TP shards run far below peak)"),
    Term("mem_efficiency", "fraction of HBM bandwidth", 0.3, 0.95, 0.75, False,
         "elementwise kernels' share of the memory bandwidth"),
    Term("kernel_overhead_s", "s per kernel", 1e-6, 1e-4, 8e-6, True,
         "launch and framework cost of one kernel"),
    Term("microbatch_overhead_s", "s per micro-batch per stage", 1e-5, 0.05, 1e-3, True,
         "fixed cost of each micro-batch on each stage (pipeline engine, p2p handshakes)"),
    Term("link_efficiency", "fraction of intra-node bandwidth", 0.2, 0.95, 0.7, False,
         "collectives' and sends' share of the NVLink/PCIe bandwidth"),
    Term("network_efficiency", "fraction of network bandwidth", 0.1, 0.95, 0.6, False,
         "collectives' and sends' share of the inter-node network bandwidth"),
    Term("profile_sync_s", "s per profiled pass", 0.0, 2e-3, 0.0, False,
         "profiler synchronisation in each measured forward/backward pass, absent in a run "
         "(0 unless runs with a profile say otherwise)", scale=1e-4),
    Term("p2p_exposed", "fraction", 0.0, 1.0, 0.5, False,
         "share of each pipeline transfer the sending and receiving stages wait for"),
    Term("grad_overlap", "fraction", 0.0, 1.0, 0.7, False,
         "share of data-parallel traffic (gradient buckets, ZeRO-3 gathers and reduce-scatters) "
         "that runs concurrently with compute without slowing it"),
    Term("intra_latency_s", "s per collective step", 1e-6, 2e-4, 10e-6, True,
         "latency of one step of a collective or a send inside a node"),
    Term("inter_latency_s", "s per collective step", 2e-6, 1e-3, 30e-6, True,
         "latency of one step of a collective or a send between nodes"),
    Term("tp_overlap", "fraction", 0.0, 1.0, 0.5, False,
         "share of the tensor-parallel collectives hidden under the TP matmuls when overlapped"),
)  # fmt: skip
NVLINK4 = (0.75, 0.82, 0.95)
NVLINK3 = (0.65, 0.75, 0.85)
NVSWITCH_STEP = (1e-6, 1e-5, 2e-5)
MEASURED_BOUNDS: dict[str, dict[str, tuple[float, float, float]]] = {
    # NVLink/NVSwitch collectives as NCCL measures them (busbw / line rate per direction).
    # H100 (NVLink4, 450 GB/s): "with the protocol overhead (~20%) NCCL can get an effective
    # NVLink bandwidth of 370GB/s" for ring, all-gather and reduce-scatter; all-reduce over
    # NVLink SHARP peaks at ~480 GB/s busbw (NCCL maintainer, NVIDIA/nccl-tests#212), so
    # 0.82, and up to 1.07 for a plain all-reduce. A100 (NVLink3, 300 GB/s): 8 x A100 SXM4
    # measure ~200 GB/s (NVIDIA/nccl-tests#149) to 230-250 GB/s busbw, 0.67-0.83. A fit
    # left free put H100 at 0.28 and A100-80GB on the 0.95 bound, which no measurement of
    # these links supports; without runs that time TP collectives alone, the data cannot
    # separate link speed from the other terms.
    # Per-step latency inside an NVSwitch node: a whole small all-reduce takes ~6 us on 2
    # H100s over NVLink SHARP (NVIDIA/nccl#1259) and ~3.5 us on 4 H800s by ring
    # (NVIDIA/nccl#1984), under 2 us a step; 20 us a step (280 us for an 8-GPU ring) is
    # a generous ceiling. Left free, the fit used this term as a per-collective framework
    # cost (118 us a step on H100).
    "H100-80GB": {"link_efficiency": NVLINK4, "intra_latency_s": NVSWITCH_STEP},
    "A100-80GB": {"link_efficiency": NVLINK3, "intra_latency_s": NVSWITCH_STEP},
    "A100-40GB": {"link_efficiency": NVLINK3, "intra_latency_s": NVSWITCH_STEP},
}
"""(lower, prior, upper) set by measurements of the hardware itself (not by end-to-end
runs), per GPU type, in place of ``TERMS``' bounds and prior for the fit."""
PRIOR_WEIGHT = 0.05
"""Weight of the (log-)distance of each term from its prior: a weak pull that keeps
terms the data says nothing about at their prior, and few rows from driving a term to a
bound."""
PICK_WEIGHT = 5.0
"""Weight of a wrongly ordered pair (the measured best of a job predicted slower than an
alternative) against the log errors: a model tuned for mean error alone can pick a plan
measured 2-20% slower than the best one while every error stays small."""
PICK_MARGIN = 0.01
"""Log margin the measured best should be predicted ahead by (capped at half the measured
gap): a tie on paper is a coin toss on the hardware."""
MAX_EVALUATIONS = 120
"""Cap on residual evaluations per GPU type and fit (a fit converges in far fewer)."""


def term_bounds(t: Term, gpu: str | None = None) -> tuple[float, float]:
    """Returns the fit's bounds of term ``t`` for GPU type ``gpu`` (``MEASURED_BOUNDS``
    where the hardware was measured, else the term's own)."""
    lower, _, upper = MEASURED_BOUNDS.get(gpu or "", {}).get(t.name, (t.lower, 0.0, t.upper))
    return lower, upper


def term_prior(t: Term, gpu: str | None = None) -> float:
    """Returns the fit's prior of term ``t`` for GPU type ``gpu``."""
    return MEASURED_BOUNDS.get(gpu or "", {}).get(t.name, (0.0, t.prior, 0.0))[1]


def _pack(eff: GPUEfficiency, gpu: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, lo, hi = [], [], []
    for t in TERMS:
        lower, upper = term_bounds(t, gpu)
        value = getattr(eff, t.name)
        value = t.prior if value is None else value
        f = math.log if t.log else float
        x.append(f(min(max(value, lower), upper)))
        lo.append(f(lower))
        hi.append(f(upper))
    return np.array(x), np.array(lo), np.array(hi)


def _unpack(x: np.ndarray) -> GPUEfficiency:
    return GPUEfficiency(
        **{t.name: math.exp(float(v)) if t.log else float(v) for v, t in zip(x, TERMS, strict=True)}
    )


def _gpus_of(run: Run) -> frozenset[str]:
    """Returns the GPU types a run uses (its plan's devices; its cluster's without a plan)."""
    if run.plan is not None:
        return frozenset(run.cluster.device_node(d).gpu.name for d in run.plan.devices())
    return frozenset(n.gpu.name for n in run.cluster.nodes)


def _components(runs: list[Run]) -> list[tuple[tuple[str, ...], list[Run]]]:
    """Returns groups of GPU types linked by runs that use several of them (a mixed
    cluster's run constrains every type it uses), each with the runs touching it."""
    groups: list[set[str]] = []
    for run in runs:
        gpus = set(_gpus_of(run))
        linked = [g for g in groups if g & gpus]
        for g in linked:
            groups.remove(g)
            gpus |= g
        groups.append(gpus)
    out = []
    for g in sorted(groups, key=sorted):
        out.append((tuple(sorted(g)), [r for r in runs if _gpus_of(r) & g]))
    return out


def _with_terms(base: CostParams, gpus: tuple[str, ...], x: np.ndarray) -> CostParams:
    n = len(TERMS)
    params = base
    for i, gpu in enumerate(gpus):
        params = params.with_gpu(gpu, _unpack(x[i * n : (i + 1) * n]))
    return params


def _pick_pairs(runs: list[Run]) -> list[tuple[int, int, float, float]]:
    """Returns (best, other, measured log gap, margin) index pairs: in each group of
    alternative runs (one job), the measured best against every other run measured slower
    by more than 0.5%, with the log margin the prediction should keep between them (half
    the measured gap, at most PICK_MARGIN)."""
    groups: dict[Any, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(_group_key(run), []).append(i)
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
    params = _with_terms(base, gpus, x)
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


def _prior_eff(gpu: str | None = None) -> GPUEfficiency:
    return GPUEfficiency(**{t.name: term_prior(t, gpu) for t in TERMS})


def _fit_group(
    runs: list[Run], base: CostParams, gpus: tuple[str, ...], max_nfev: int
) -> CostParams:
    """Returns ``base`` with the terms of ``gpus`` fitted jointly, from their priors."""
    packed = [_pack(_prior_eff(gpu), gpu) for gpu in gpus]
    x0, lo, hi = (np.concatenate([p[i] for p in packed]) for i in range(3))
    # a tolerance of 1e-4 on log errors is far below the data's own noise (~1%)
    args = (runs, base, gpus, _pick_pairs(runs))  # the pairs depend on the runs alone
    sol = least_squares(_residuals, x0, bounds=(lo, hi), args=args, x_scale="jac",
                        ftol=1e-4, xtol=1e-4, gtol=1e-4,
                        max_nfev=max_nfev * len(gpus))  # fmt: skip
    return _with_terms(base, gpus, sol.x)


def terms_report(eff: GPUEfficiency, gpu: str | None = None) -> dict[str, dict[str, Any]]:
    """Returns each fitted term's value, unit, meaning and whether it sits on a bound (the
    GPU type's measured bounds where it has them)."""
    out = {}
    for t in TERMS:
        lower, upper = term_bounds(t, gpu)
        value = getattr(eff, t.name)
        value = t.prior if value is None else value
        clamped = min(max(value, lower), upper)
        span = (math.log(upper) - math.log(lower)) if t.log else (upper - lower)
        pos = (math.log(clamped) - math.log(lower)) if t.log else (clamped - lower)
        bound = "lower" if pos <= 1e-3 * span else "upper" if pos >= span * (1 - 1e-3) else None
        out[t.name] = {"value": value, "unit": t.unit, "meaning": t.meaning,
                       "bounds": [lower, upper], "at_bound": bound}  # fmt: skip
    return out


def _with_default(params: CostParams) -> CostParams:
    """Returns ``params`` whose ``default`` (for GPU types without data) is the geometric
    mean of the fitted types, and whose global link efficiency is their mean."""
    effs = list(params.gpus.values())
    if not effs:
        return params
    mean: dict[str, float] = {}
    for t in TERMS:
        values = [getattr(e, t.name) for e in effs]
        if t.log:
            mean[t.name] = float(np.exp(np.mean(np.log(values))))
        else:
            mean[t.name] = float(np.mean(values))
    link = mean.pop("link_efficiency")
    mean.pop("network_efficiency")
    return replace(params, default=GPUEfficiency(**mean), link_efficiency=link)


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
    for gpu in sorted(set().union(*(_gpus_of(r) for r in measured))):
        params = params.with_gpu(gpu, _prior_eff(gpu))
    for _ in range(rounds):
        fixed = [resolve(r, params) for r in measured]
        for gpus, group in _components(fixed):
            params = _fit_group(group, params, gpus, max_nfev)
    params = _with_default(params)
    reserve = fit_reserve_bytes(_memory_rows(list(runs), params), params.memory_reserve_bytes)
    report = {gpu: terms_report(eff, gpu) for gpu, eff in params.gpus.items()}
    coverage: dict[str, Any] = dict(params.fit_report.get("coverage", {}))
    for run in fixed:
        assert run.plan is not None and run.measured is not None
        est = estimate(run.plan, run.model, run.cluster, params, validate=False)
        pred = run.predict(est)
        ratio = pred / run.measured if run.metric == "iter_time_s" else run.measured / pred
        for gpu in _gpus_of(run):
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


# ---- error reports: in sample and cold leave-one-out ------------------------------------


def _group_key(run: Run) -> tuple[Any, ...]:
    """Runs that are alternatives for one job: same model, GPUs, batch and metric."""
    k = run.knobs
    batch = run.plan.global_batch_size if run.plan is not None else k.global_batch if k else 0
    return (run.model.name, run.cluster.num_gpus, batch, run.metric)


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
        "group": _group_key(run),
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
    linked = next((g for gpus, g in _components([run, *others]) if run in g), [])
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
            params.memory_reserve_bytes,
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


def shipped_files() -> list[Path]:
    """Returns the paths of the calibration CSVs shipped with the package."""
    root = Path(str(resources.files("hetplan.data").joinpath("calibration")))
    names = (
        "megatron_homogeneous.csv",
        "megatron_selective_published.csv",
        "amp_t4_homogeneous.csv",
        "sharded_dp_published.csv",
        "bloom_published.csv",
        "nemo_gpt3_175b_published.csv",
    )
    return [root / name for name in names]


def calibrate_runs(
    runs: list[Run], start: CostParams | None = None, workers: int | None = None
) -> tuple[CostParams, dict[str, Any]]:
    """Returns parameters fitted to ``runs`` (their ``fit_report`` set: fitted terms and the
    cold leave-one-out summary per file) and the LOO report."""
    params = fit(runs, start)
    report = leave_one_out(runs, params, workers, start)
    summary = {src: {k: v for k, v in r.items() if k != "rows"} for src, r in report.items()}
    return replace(params, fit_report={**params.fit_report, "loo": summary}), report

"""Provisioning: which GPUs to rent and how many, as a time-versus-dollars Pareto front.

Single-type configurations: every node count of every offer, each with its best homogeneous
plan. Mixes of two types go through the heterogeneous planner. A configuration is skipped
without planning when lower bounds on its time (all FLOPs at the best compute efficiency
the cost tables allow for its GPUs) and on its cost (that time at its exact hourly price)
are already beaten by a point found: it cannot reach the front.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.hardware import GPUType
from hetplan.market import Market, Offer
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints, homogeneous_space
from hetplan.search.homogeneous import (
    SearchMemo,
    SearchSpace,
    divisors,
    search_homogeneous,
)
from hetplan.search.spot import SpotTerms, spot_slowdown

PROVISION_SPACE = SearchSpace(zero_stages=(1, 2, 3), max_virtual_stages=4)
"""ZeRO-0 is dominated by ZeRO-1 (same traffic, less memory, a sharded optimizer step)."""


@dataclass
class Point:
    """One rented configuration with its plan, time to train and total cost."""

    gpus: dict[str, int]
    spot: bool
    time_to_train_s: float
    total_cost_usd: float
    usd_per_hour: float
    plan: Plan | None = field(default=None, repr=False)
    estimate: Estimate | None = field(default=None, repr=False)
    cluster: Cluster | None = field(default=None, repr=False)


def pareto_front(points: list[Point]) -> list[Point]:
    """Returns the points no other point beats on both time and cost, fastest first."""
    front: list[Point] = []
    for p in sorted(points, key=lambda q: (q.time_to_train_s, q.total_cost_usd)):
        if not front or p.total_cost_usd < front[-1].total_cost_usd * (1 - 1e-9):
            front.append(p)
    return front


def best_compute_efficiency(
    model: ModelSpec,
    gpu: GPUType,
    gpus_per_node: int,
    params: CostParams,
    precision: str,
    flash: bool = True,
) -> float:
    """Returns the highest fraction of peak any layer or head shape reaches on this GPU.

    Every plan's per-GPU compute takes at least its share of the FLOPs at this efficiency,
    so it bounds the time of any plan from below.
    """
    src = params.compute

    def best_of() -> float:
        peak = gpu.peak_flops(precision)
        best = 0.0
        for tp in divisors(gpus_per_node):
            for mb in (1, 2, 4, 8, 16, 32):
                # sequence parallelism only removes work: the faster of the two bounds
                lt = src.layer(model, gpu, params, tp, mb, precision, flash, tp > 1).times
                layer_flops = 3 * mb * model.layer_flops() / tp
                best = max(best, layer_flops / ((lt.forward_s + lt.backward_s) * peak))
                ht = src.head(model, gpu, params, tp, mb, precision, flash).times
                head_flops = 3 * mb * model.head_flops() / tp
                best = max(best, head_flops / ((ht.forward_s + ht.backward_s) * peak))
        return best

    key = ("best_efficiency", model, gpu, gpus_per_node, params.gpu(gpu.name), precision, flash)
    return float(src.cached(key, best_of))


def _efficiency(
    model: ModelSpec, offer: Offer, precision: str, params: CostParams, flash: bool
) -> float:
    return best_compute_efficiency(model, offer.gpu, offer.gpus_per_node, params, precision, flash)


def _flops_to_train(model: ModelSpec, tokens: float) -> float:
    return tokens / model.seq * model.model_flops_per_sequence()


def _dominated(time_s: float, cost: float, points: list[Point]) -> bool:
    return any(p.time_to_train_s <= time_s and p.total_cost_usd <= cost for p in points)


@dataclass(frozen=True)
class Constraints:
    """What the user asked of the run."""

    deadline_s: float | None = None
    budget_usd: float | None = None
    max_usd_per_hour: float | None = None

    def admits(self, p: Point) -> bool:
        """Returns whether a point meets every constraint."""
        return (
            (self.deadline_s is None or p.time_to_train_s <= self.deadline_s)
            and (self.budget_usd is None or p.total_cost_usd <= self.budget_usd)
            and (self.max_usd_per_hour is None or p.usd_per_hour <= self.max_usd_per_hour)
        )


@dataclass
class ProvisionResult:
    """Every planned point, the front, the recommendation, and what pruning saved."""

    points: list[Point]
    front: list[Point]
    planned: int
    pruned: int
    search_time_s: float = 0.0
    recommended: Point | None = None
    reason: str = ""
    skipped: int = 0
    """Mix candidates the bounds could not rule out but the plan cap left unexplored."""


@dataclass(frozen=True)
class _Job:
    """What every step of one provisioning search shares."""

    model: ModelSpec
    tokens: float
    global_batch: int
    precision: str
    spot: bool
    params: CostParams
    terms: SpotTerms
    prune: bool
    flash: bool
    limits: PlanConstraints = field(default_factory=PlanConstraints)
    """Limits on each configuration's plan (GPU types and counts are the offers' business)."""
    max_gpus: int | None = None
    """No configuration rents more GPUs."""

    def unpack(self) -> tuple[ModelSpec, float, int, str, bool, CostParams, SpotTerms, bool, bool]:
        """Returns the fields in declaration order."""
        return (
            self.model,
            self.tokens,
            self.global_batch,
            self.precision,
            self.spot,
            self.params,
            self.terms,
            self.prune,
            self.flash,
        )


def _single_type(job: _Job, offer: Offer, points: list[Point]) -> tuple[int, int]:
    """Adds the points of every node count of one offer; returns (planned, pruned)."""
    model, tokens, global_batch, precision, spot, params, terms, prune, flash = job.unpack()
    planned = pruned = 0
    memo = SearchMemo()
    peak = offer.gpu.peak_flops(precision) * _efficiency(model, offer, precision, params, flash)
    flops = _flops_to_train(model, tokens)
    price = offer.price(spot)
    # built once (with the user's memory headroom), sliced per count
    all_nodes = job.limits.apply_to_cluster(offer.cluster(offer.max_nodes, spot)).nodes
    space = homogeneous_space(job.limits, PROVISION_SPACE)
    most = offer.max_nodes
    if job.max_gpus is not None:
        most = min(most, job.max_gpus // offer.gpus_per_node)
    for nodes in range(most, 0, -1):
        slow = spot_slowdown(offer, nodes, terms) if spot else 1.0
        if math.isinf(slow):
            continue
        n_gpus = nodes * offer.gpus_per_node
        usd_hour = price * n_gpus
        t_lb = flops / (peak * n_gpus) * slow
        if prune and _dominated(t_lb, t_lb / 3600 * usd_hour, points):
            pruned += 1
            continue
        planned += 1
        cluster = Cluster(all_nodes[:nodes])
        found = search_homogeneous(model, cluster, global_batch, precision, top_k=1,
                                   params=params, space=space, flash_attention=flash,
                                   memo=memo)  # fmt: skip
        if not found.ranked:
            continue
        plan, est = found.ranked[0]
        t = tokens / est.tokens_per_s * slow
        points.append(
            Point(
                {offer.gpu.name: n_gpus},
                spot,
                t,
                t / 3600 * usd_hour,
                usd_hour,
                plan=plan,
                estimate=est,
                cluster=cluster,
            )
        )
    return planned, pruned


def _mix_cluster(a: Offer, na: int, b: Offer, nb: int, spot: bool) -> Cluster:
    return Cluster(a.cluster(na, spot).nodes + b.cluster(nb, spot).nodes)


def _front_cost_at(points: list[Point]) -> tuple[np.ndarray, np.ndarray]:
    """Returns (times, best cost among points at least that fast) for vectorised dominance."""
    pts = sorted(points, key=lambda p: p.time_to_train_s)
    times = np.array([p.time_to_train_s for p in pts])
    costs = np.minimum.accumulate(np.array([p.total_cost_usd for p in pts])) if pts else times
    return times, costs


def _dominated_mask(t_lb: np.ndarray, c_lb: np.ndarray, points: list[Point]) -> np.ndarray:
    """Returns, per bound pair, whether some point is at least as fast and as cheap."""
    if not points:
        return np.zeros(t_lb.shape, dtype=bool)
    times, costs = _front_cost_at(points)
    idx = np.searchsorted(times, t_lb, side="right") - 1  # fastest-enough points: [0, idx]
    best = np.where(idx >= 0, costs[np.clip(idx, 0, None)], np.inf)
    return best <= c_lb


def _mixes(
    job: _Job, offers: list[Offer], points: list[Point], max_plans: int
) -> tuple[int, int, int]:
    """Adds two-type mixes that bounds cannot rule out; returns (planned, pruned, skipped).

    Bounds are computed for every (count, count) pair of every two offers at once (numpy);
    survivors are planned closest-to-the-front first (smallest ratio of their cost bound to
    the cost of the front at their time bound), each re-checked against every point found so
    far just before planning; past ``max_plans`` the rest are counted as skipped.
    """
    from hetplan.search.heterogeneous import search_heterogeneous

    model, tokens, global_batch, precision, spot, params, terms, prune, flash = job.unpack()

    flops = _flops_to_train(model, tokens)
    rate = {
        o.name: o.gpu.peak_flops(precision) * _efficiency(model, o, precision, params, flash)
        for o in offers
    }
    pairs: list[tuple[Offer, Offer, np.ndarray, np.ndarray, np.ndarray]] = []
    pruned = 0
    times, costs = _front_cost_at(points)
    for i, a in enumerate(offers):
        for b in offers[i + 1 :]:
            na = np.arange(1, a.max_nodes + 1)[:, None]
            nb = np.arange(1, b.max_nodes + 1)[None, :]
            ga, gb = na * a.gpus_per_node, nb * b.gpus_per_node
            usd_hour = a.price(spot) * ga + b.price(spot) * gb
            slow = np.ones(usd_hour.shape)
            if spot:
                sa = np.array([spot_slowdown(a, int(n), terms) for n in na[:, 0]])[:, None]
                sb = np.array([spot_slowdown(b, int(n), terms) for n in nb[0, :]])[None, :]
                slow = np.maximum(sa, sb) * slow
            t_lb = flops / (rate[a.name] * ga + rate[b.name] * gb) * slow
            c_lb = t_lb / 3600 * usd_hour
            ok = np.isfinite(t_lb)
            if job.max_gpus is not None:
                ok &= ga + gb <= job.max_gpus
            if prune:
                dom = _dominated_mask(t_lb, c_lb, points) & ok
                pruned += int(dom.sum())
                ok &= ~dom
            pairs.append((a, b, t_lb, c_lb, slow))
            pairs[-1][2][~ok] = np.inf  # ruled out
    # exhaustive mode (no pruning) plans every pair of counts
    cap = max_plans if prune else sys.maxsize
    # closest to the front first: cost bound over the front's cost at the time bound
    flat: list[tuple[float, float, float, int, int, int]] = []
    for pi, (_, _, t_lb, c_lb, _) in enumerate(pairs):
        live = np.isfinite(t_lb)
        if not live.any():
            continue
        if len(times):
            k = np.searchsorted(times, t_lb[live], side="right") - 1
            ratio = np.where(k >= 0, c_lb[live] / costs[np.clip(k, 0, None)], 0.0)
        else:
            ratio = np.zeros(int(live.sum()))
        xs, ys = np.nonzero(live)
        keep = np.argsort(ratio, kind="stable")[: 4 * cap]
        flat += [
            (
                float(ratio[q]),
                float(c_lb[xs[q], ys[q]]),
                float(t_lb[xs[q], ys[q]]),
                pi,
                int(xs[q]),
                int(ys[q]),
            )
            for q in keep
        ]
    flat.sort()
    order = flat[: 4 * cap]
    planned = 0
    tried: set[tuple[int, int, int]] = set()
    for _, c_lb_, t_lb_, pi, x, y in order:
        if planned >= cap:
            break
        tried.add((pi, x, y))
        if prune and _dominated(t_lb_, c_lb_, points):
            pruned += 1
            continue
        a, b, _, _, slow = pairs[pi]
        na_, nb_ = x + 1, y + 1
        planned += 1
        cluster = job.limits.apply_to_cluster(_mix_cluster(a, na_, b, nb_, spot))
        res = search_heterogeneous(model, cluster, global_batch, precision, 1, params, flash,
                                   job.limits)  # fmt: skip
        if not res.ranked:
            continue
        plan, est = res.ranked[0]
        # the whole rented cluster is paid for, even GPUs the best plan leaves idle
        rented = a.price(spot) * na_ * a.gpus_per_node + b.price(spot) * nb_ * b.gpus_per_node
        t = tokens / est.tokens_per_s * float(slow[x, y])
        gpus = {a.gpu.name: na_ * a.gpus_per_node, b.gpu.name: nb_ * b.gpus_per_node}
        points.append(Point(gpus, spot, t, t / 3600 * rented, rented, plan, est, cluster))
    # what was neither planned nor tried: ruled out by the final points, or skipped
    skipped = 0
    for pi, (_, _, t_lb, c_lb, _) in enumerate(pairs):
        live = np.isfinite(t_lb)
        left = live.copy()
        for qi, x, y in tried:
            if qi == pi:
                left[x, y] = False
        dom = _dominated_mask(t_lb, c_lb, points) & left if prune else np.zeros_like(left)
        pruned += int(dom.sum())
        skipped += int((left & ~dom).sum())
    return planned, pruned, skipped


def recommend(
    front: list[Point], objective: str, constraints: Constraints
) -> tuple[Point | None, str]:
    """Returns the point the objective picks among those meeting the constraints, and why."""
    ok = [p for p in front if constraints.admits(p)]
    if not ok:
        return None, _binding(front, constraints)
    if objective == "time":
        best = min(ok, key=lambda p: p.time_to_train_s)
        why = "fastest configuration" + _within(constraints)
    elif objective == "cost":
        best = min(ok, key=lambda p: p.total_cost_usd)
        why = "cheapest configuration" + _within(constraints)
    else:
        t0 = min(p.time_to_train_s for p in ok)
        c0 = min(p.total_cost_usd for p in ok)
        best = min(ok, key=lambda p: p.time_to_train_s / t0 + p.total_cost_usd / c0)
        why = (
            "balanced: smallest sum of time and cost, each relative to the best "
            "reachable" + _within(constraints)
        )
    return best, why


def _within(c: Constraints) -> str:
    parts = []
    if c.deadline_s is not None:
        parts.append(f"deadline {c.deadline_s / 86400:.1f} days")
    if c.budget_usd is not None:
        parts.append(f"budget ${c.budget_usd:,.0f}")
    if c.max_usd_per_hour is not None:
        parts.append(f"cap ${c.max_usd_per_hour:,.2f}/hour")
    return f" within the {', '.join(parts)}" if parts else ""


def _binding(front: list[Point], c: Constraints) -> str:
    if not front:
        return "no configuration of the market can train this model"
    checks = [
        ("deadline", c.deadline_s, lambda p: p.time_to_train_s),
        ("budget", c.budget_usd, lambda p: p.total_cost_usd),
        ("hourly cap", c.max_usd_per_hour, lambda p: p.usd_per_hour),
    ]
    for name, limit, key in checks:
        if limit is not None and all(key(p) > limit for p in front):
            closest = min(front, key=key)
            return (
                f"the {name} binds: no configuration meets it; the closest point needs "
                f"{closest.time_to_train_s / 86400:.2f} days and "
                f"${closest.total_cost_usd:,.0f} on {closest.gpus}"
            )
    return "no single configuration meets the deadline, budget and hourly cap together"


def provision(
    model: ModelSpec,
    market: Market,
    tokens: float,
    global_batch: int,
    precision: str,
    spot: bool = False,
    objective: str = "balanced",
    constraints: Constraints | None = None,
    params: CostParams | None = None,
    terms: SpotTerms | None = None,
    prune: bool = True,
    flash_attention: bool = True,
    mixes: bool = False,
    max_mix_plans: int = 64,
    limits: PlanConstraints | None = None,
) -> ProvisionResult:
    """Returns the time/cost front over the market's configurations (single types, and
    two-type mixes with ``mixes``) and the recommended point for ``objective`` (time, cost or
    balanced) under ``constraints``; ``limits`` constrain the plans (as for ``plan``), the
    GPU types and the number of GPUs rented."""
    limits = limits or PlanConstraints()
    if limits.flash_attention is not None:
        flash_attention = limits.flash_attention
    start = time.process_time()
    params = params or default_params()
    terms = terms or SpotTerms()
    if spot and terms.state_bytes <= 0:
        # fp32 master weights and two Adam moments: what a replacement node must recover
        terms = replace(terms, state_bytes=12.0 * model.total_params())
    constraints = constraints or Constraints()
    points: list[Point] = []
    planned = pruned = 0
    offers = [
        o
        for o in market.offers
        if o.gpu.supports(precision)
        and not (spot and o.spot_usd_per_gpu_hour is None)
        and (limits.gpu_types is None or o.gpu.name.lower() in
             {t.lower() for t in limits.gpu_types})
    ]  # fmt: skip
    # cheapest effective FLOP first: the low-cost end of the front prunes the rest early
    offers.sort(
        key=lambda o: (
            o.price(spot)
            / (
                o.gpu.peak_flops(precision)
                * _efficiency(model, o, precision, params, flash_attention)
            )
        )
    )
    if limits.gpu_types is not None:
        sold = {o.gpu.name.lower() for o in market.offers}
        for name in limits.gpu_types:
            if name.lower() not in sold:
                raise InputError("--gpu-types", f"the market sells no {name}")
    # GPU types filter the offers and max_gpus caps the counts: the clusters take the rest
    job = _Job(model, tokens, global_batch, precision, spot, params, terms, prune, flash_attention,
               replace(limits, gpu_types=None, max_gpus=None), limits.max_gpus)  # fmt: skip
    for offer in offers:
        a, b = _single_type(job, offer, points)
        planned += a
        pruned += b
    skipped = 0
    if mixes:
        a, b, skipped = _mixes(job, offers, points, max_mix_plans)
        planned += a
        pruned += b
    front = pareto_front(points)  # every point carries its plan and estimate()
    best, why = recommend(front, objective, constraints)
    return ProvisionResult(
        points, front, planned, pruned, time.process_time() - start, best, why, skipped
    )


def provision_single_type(
    model: ModelSpec,
    market: Market,
    tokens: float,
    global_batch: int,
    precision: str,
    spot: bool = False,
    params: CostParams | None = None,
    terms: SpotTerms | None = None,
    prune: bool = True,
) -> ProvisionResult:
    """Returns the time/cost front over single-type configurations of the market."""
    return provision(
        model,
        market,
        tokens,
        global_batch,
        precision,
        spot,
        params=params,
        terms=terms,
        prune=prune,
    )

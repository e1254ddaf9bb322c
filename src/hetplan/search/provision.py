"""Provisioning: which GPUs to rent and how many, as a time-versus-dollars Pareto front.

Single-type configurations: every node count of every offer, each with its best homogeneous
plan. Mixes of two types (``mixes``): every pair of node counts of every two offers, each
with its best heterogeneous plan. Both searches rank by ``estimate``. A configuration is
pruned without planning only when a point already found is at least as fast as its proven
lower bound on time and at least as cheap as its lower bound on cost (that time at its exact
hourly price): it cannot reach the front. The bounds (``provision_bounds``) are built from
the cost model's own per-layer, embedding and head times. Configurations are planned
closest-to-the-front first, and none is left unexplored: each is planned, pruned, or has no
possible plan (``ProvisionResult.impossible``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.market import Market, Offer, pricing_name
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints, homogeneous_space
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.homogeneous_candidates import SearchSpace
from hetplan.search.homogeneous_scoring import SearchMemo
from hetplan.search.progress import ProgressHook, SearchProgress
from hetplan.search.provision_batch import batch_floor_s
from hetplan.search.provision_bounds import TypeFloor, iteration_floor_s, type_floor
from hetplan.search.provision_stages import mix_iteration_floor_s, mix_time_floor_s
from hetplan.search.spot import (
    SpotTerms,
    checkpoint_floor_s,
    checkpoint_time_s,
    mixed_load,
    offer_load,
    slowdowns,
)

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
    bound_s: float = 0.0
    """The proven lower bound of ``time_to_train_s`` the search held before planning it."""
    owned: dict[str, int] = field(default_factory=dict)
    """Owned GPUs the configuration trains on beside the rented ``gpus``."""
    pricing: str = "on-demand"
    """How the rented GPUs are paid for: on-demand, reserved or spot (``market.PRICINGS``)."""


def pareto_front(points: list[Point]) -> list[Point]:
    """Returns the points no other point beats on both time and cost, fastest first."""
    front: list[Point] = []
    for p in sorted(points, key=lambda q: (q.time_to_train_s, q.total_cost_usd)):
        if not front or p.total_cost_usd < front[-1].total_cost_usd * (1 - 1e-9):
            front.append(p)
    return front


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


@dataclass(frozen=True)
class Unexplored:
    """A mix not planned before the time limit, with its proven lower bounds."""

    gpus: dict[str, int]
    time_bound_s: float
    cost_bound_usd: float

    def to_json(self) -> dict[str, object]:
        """Returns the JSON form (GPU counts by type, the bounds)."""
        return {"gpus": self.gpus, "time_bound_s": self.time_bound_s,
                "cost_bound_usd": self.cost_bound_usd}  # fmt: skip


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
    impossible: int = 0
    """Configurations with no possible plan, never planned: more GPUs than --max-gpus, a
    spot run preempted faster than it progresses, or too little memory for the model's
    weights, gradients and optimizer states."""
    impossible_by_reason: dict[str, int] = field(default_factory=dict)
    """``impossible`` by reason (``IMPOSSIBLE_REASONS``), the reasons that ruled any out."""
    unexplored: list[Unexplored] = field(default_factory=list)
    """Mixes left unplanned when the time limit struck (empty without one), fastest bound
    first: what each could at most reach."""
    pricing: str = "on-demand"
    """How every rented GPU was priced (``market.PRICINGS``)."""
    left_out: list[str] = field(default_factory=list)
    """Offers left out because they state no price for ``pricing`` (by name)."""
    owned_choice: str = ""
    """With owned nodes: which of them the recommendation uses, and why."""


IMPOSSIBLE_REASONS = {
    "max_gpus": "more GPUs than --max-gpus",
    "spot": "a spot run preempted faster than it progresses",
    "memory": "too little memory for the model's weights, gradients and optimizer states",
    "compute": "no GPU of the configuration computes (a rate of zero)",
}
"""Why a configuration has no possible plan (the keys of ``impossible_by_reason``)."""


def _count(reasons: dict[str, int], key: str, n: int) -> None:
    if n:
        reasons[key] = reasons.get(key, 0) + n


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
    progress: ProgressHook | None = None
    """Told after each configuration planned (explored: planned and pruned so far)."""
    done: list[int] = field(default_factory=lambda: [0, 0])
    """Configurations planned and pruned so far, for ``progress``."""
    impossible: dict[str, int] = field(default_factory=dict)
    """Configurations with no possible plan so far, by reason (``IMPOSSIBLE_REASONS``)."""
    stop_at: float | None = None
    """``time.monotonic()`` after which no further mix is planned (``--time-limit``)."""
    pricing: str = "on-demand"
    """The price every offer is rented at (``market.PRICINGS``); spot also means
    preemptions (``spot``)."""

    def tick(self, planned: int, pruned: int, best: list[Point]) -> None:
        """Counts configurations and tells ``progress`` (best: the fastest time to train)."""
        self.done[0] += planned
        self.done[1] += pruned
        if self.progress is not None and planned:
            fastest = min((p.time_to_train_s for p in best), default=None)
            self.progress(SearchProgress(sum(self.done), None, fastest))

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


def _floor(job: _Job, offer: Offer) -> TypeFloor:
    node = offer.cluster(1).nodes[0]  # its intra-node link prices the TP collectives
    return type_floor(job.model, offer.gpu, offer.gpus_per_node, job.global_batch, job.params,
                      job.precision, job.flash, node, job.limits.overlap_tp_comm)  # fmt: skip


def _iterations(job: _Job) -> float:
    return job.tokens / (job.global_batch * job.model.seq)


def _single_type(job: _Job, offer: Offer, points: list[Point]) -> tuple[int, int]:
    """Adds the points of every node count of one offer; returns (planned, pruned)."""
    model, tokens, global_batch, precision, spot, params, terms, prune, flash = job.unpack()
    planned = pruned = 0
    memo = SearchMemo()
    floor = _floor(job, offer)
    price = offer.price(job.pricing)
    # built once (with the user's memory headroom), sliced per count
    all_nodes = job.limits.apply_to_cluster(offer.cluster(offer.max_nodes, job.pricing)).nodes
    space = homogeneous_space(job.limits, PROVISION_SPACE)
    most = offer.max_nodes
    if job.max_gpus is not None:
        most = min(most, job.max_gpus // offer.gpus_per_node)
    _count(job.impossible, "max_gpus", offer.max_nodes - max(most, 0))
    # the iteration floor of every count at once (one array: its multipliers computed once)
    counts = np.arange(max(most, 0) + 1) * offer.gpus_per_node
    it_lbs = np.maximum(
        iteration_floor_s(model, global_batch, [floor], [counts], per_size=True),
        batch_floor_s(model, global_batch, [floor], counts, per_size=True),
    )
    it_lbs = it_lbs.min(axis=0)  # one micro-batch size per plan: the larger floor at each
    for nodes in range(most, 0, -1):
        load = offer_load(offer, nodes, terms)
        # a floor of every plan's checkpoint time (checkpoint_floor_s): one of the slowdown
        slow = slowdowns(*load, terms, checkpoint_floor_s(model, nodes), True) if spot else 1.0
        if math.isinf(slow):
            _count(job.impossible, "spot", 1)
            continue
        n_gpus = nodes * offer.gpus_per_node
        usd_hour = price * n_gpus
        it_lb = float(it_lbs[nodes])
        t_lb = _iterations(job) * it_lb * slow
        if prune and _dominated(t_lb, t_lb / 3600 * usd_hour, points):
            pruned += 1
            continue
        planned += 1
        job.tick(1, 0, points)
        cluster = Cluster(all_nodes[:nodes])
        found = search_homogeneous(model, cluster, global_batch, precision, top_k=1,
                                   params=params, space=space, flash_attention=flash,
                                   memo=memo)  # fmt: skip
        if not found.ranked:
            continue
        plan, est = found.ranked[0]
        if spot:  # the plan's own checkpoint time (its largest node's state)
            slow = slowdowns(*load, terms, checkpoint_time_s(plan, model))
            if math.isinf(slow):
                continue
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
                bound_s=t_lb,
                pricing=job.pricing,
            )
        )
    return planned, pruned


def _mix_cluster(a: Offer, na: int, b: Offer, nb: int, pricing: str) -> Cluster:
    return Cluster(a.cluster(na, pricing).nodes + b.cluster(nb, pricing).nodes)


def _front_cost_at(points: list[Point]) -> tuple[np.ndarray, np.ndarray]:
    """Returns (times, best cost among points at least that fast) for vectorised dominance."""
    pts = sorted(points, key=lambda p: p.time_to_train_s)
    times = np.array([p.time_to_train_s for p in pts])
    costs = np.minimum.accumulate(np.array([p.total_cost_usd for p in pts])) if pts else times
    return times, costs


def _front_cost(t_lb: np.ndarray, points: list[Point]) -> np.ndarray:
    """Returns, per time bound, the least cost of a point at least that fast (inf if none)."""
    if not points:
        return np.full(t_lb.shape, np.inf)
    times, costs = _front_cost_at(points)
    idx = np.searchsorted(times, t_lb, side="right") - 1  # fastest-enough points: [0, idx]
    return np.where(idx >= 0, costs[np.clip(idx, 0, None)], np.inf)


@dataclass
class _MixGrid:
    """Every (count, count) configuration of every pair of offers, flattened, with bounds."""

    pair: np.ndarray
    na: np.ndarray
    nb: np.ndarray
    t_lb: np.ndarray
    c_lb: np.ndarray
    slow: np.ndarray
    usd_hour: np.ndarray


def _mix_grid(
    job: _Job, offers: list[Offer], batch: bool = True
) -> tuple[_MixGrid, list[tuple[Offer, Offer]], int]:
    """Returns the bounds of every two-offer configuration that could have a plan, the offer
    pairs, and how many configurations have none (past --max-gpus, a spot run that never
    finishes, or too little memory for the model's state: the heterogeneous search's own
    refusal), counted by reason in ``job.impossible``. ``batch``: with the batch floor
    (``provision_batch``; False only to count what it prunes)."""
    from hetplan.search.heterogeneous import _state_floor_bytes

    model, spot = job.model, job.spot
    pairs: list[tuple[Offer, Offer]] = []
    parts: list[tuple[np.ndarray, ...]] = []
    impossible = 0
    floor_memo: dict[int, float] = {}

    def state_floor(n: int) -> float:
        if n not in floor_memo:
            floor_memo[n] = _state_floor_bytes(model, job.precision, n)
        return floor_memo[n]

    memory = {o.name: _gpu_memory(job, o) for o in offers}
    for i, a in enumerate(offers):
        for b in offers[i + 1 :]:
            fa, fb = _floor(job, a), _floor(job, b)
            na = np.arange(1, a.max_nodes + 1)[:, None]
            nb = np.arange(1, b.max_nodes + 1)[None, :]
            ga, gb = na * a.gpus_per_node, nb * b.gpus_per_node
            usd_hour = a.price(job.pricing) * ga + b.price(job.pricing) * gb
            slow = np.ones(usd_hour.shape)
            if spot:  # a floor: every plan checkpoints at least the mean node's state
                la = np.array([offer_load(a, int(n), job.terms) for n in na[:, 0]])
                lb = np.array([offer_load(b, int(n), job.terms) for n in nb[0, :]])
                load = mixed_load([(la[:, None, 0], la[:, None, 1]),
                                   (lb[None, :, 0], lb[None, :, 1])])  # fmt: skip
                slow = slowdowns(*load, job.terms, checkpoint_floor_s(model, na + nb), True)
            total = ga + gb
            ok = np.ones(total.shape, dtype=bool)
            if job.max_gpus is not None:
                ok &= total <= job.max_gpus
            _count(job.impossible, "max_gpus", int((~ok).sum()))
            finishes = np.broadcast_to(np.isfinite(slow), total.shape)
            _count(job.impossible, "spot", int((ok & ~finishes).sum()))
            ok &= finishes
            held = ga * memory[a.name] + gb * memory[b.name]
            sizes, where = np.unique(total[ok], return_inverse=True)  # each GPU count once
            need = np.array([state_floor(int(n)) for n in sizes])
            fits = need[where.ravel()] <= held[ok]
            _count(job.impossible, "memory", int((~fits).sum()))
            ok[ok] = fits
            xs, ys = np.nonzero(ok)  # the iteration floor only where a plan could finish
            slow_ok = np.broadcast_to(slow, total.shape)[xs, ys]
            if batch:  # whole micro-batches, layers and GPUs, size by size
                it_lb = mix_iteration_floor_s(model, job.global_batch, (fa, fb), ga[xs, 0],
                                              gb[0, ys], aware=False)  # fmt: skip
            else:
                it_lb = iteration_floor_s(model, job.global_batch, [fa, fb],
                                          [ga[xs, 0], gb[0, ys]])  # fmt: skip
            t_lb = _iterations(job) * it_lb * slow_ok
            fin = np.isfinite(t_lb)  # a rate of zero: no plan (never for a GPU type sold)
            _count(job.impossible, "compute", int((~fin).sum()))
            xs, ys, t_lb, slow_ok = xs[fin], ys[fin], t_lb[fin], slow_ok[fin]
            impossible += int(total.size - xs.size)
            pairs.append((a, b))
            parts.append((
                np.full(xs.shape, len(pairs) - 1), xs + 1, ys + 1, t_lb,
                t_lb / 3600 * usd_hour[xs, ys], slow_ok, usd_hour[xs, ys],
            ))  # fmt: skip
    cols = [np.concatenate(c) if c else np.zeros(0) for c in zip(*parts, strict=True)]
    if not cols:
        cols = [np.zeros(0)] * 7
    return _MixGrid(*cols), pairs, impossible


def _gpu_memory(job: _Job, offer: Offer) -> float:
    """Returns the memory one GPU of the offer gives the search (after the user's headroom)."""
    return float(job.limits.apply_to_cluster(offer.cluster(1)).nodes[0].gpu.memory_bytes)


def _mixes(
    job: _Job, offers: list[Offer], points: list[Point]
) -> tuple[int, int, list[Unexplored]]:
    """Adds every two-type mix that bounds cannot rule out; returns (planned, pruned,
    unexplored); those with no possible plan are counted by reason in ``job.impossible``.

    The bounds of every (count, count) configuration of every two offers are computed at once
    (numpy). Until none is left, the configurations the points found so far dominate at
    their bounds are pruned, and the live one closest to the front (smallest ratio of its
    cost bound to the front's cost at its time bound; beyond the front's fast end first) is
    planned with the heterogeneous search. Nothing is left unexplored, unless ``job.stop_at``
    passes (checked before each mix): the live mixes are then returned with their bounds."""
    from hetplan.search.het_cache import SearchCache
    from hetplan.search.heterogeneous import search_heterogeneous

    model, tokens, global_batch, precision, spot, params, _, prune, flash = job.unpack()
    grid, pairs, _ = _mix_grid(job, offers)
    cache = SearchCache(model, params)  # mixes of the same offers share their class tables
    live = np.arange(grid.t_lb.size)
    planned = pruned = 0
    if prune and live.size:  # the survivors of the single types' front, tightened
        _tighten(job, grid, pairs, live[_front_cost(grid.t_lb, points) > grid.c_lb])
    while live.size:
        t_lb, c_lb = grid.t_lb[live], grid.c_lb[live]
        front = _front_cost(t_lb, points)
        if prune:
            dom = front <= c_lb
            pruned += int(dom.sum())
            live, t_lb, c_lb, front = live[~dom], t_lb[~dom], c_lb[~dom], front[~dom]
            if not live.size:
                break
        if job.stop_at is not None and time.monotonic() >= job.stop_at:
            order = np.lexsort((grid.c_lb[live], grid.t_lb[live]))
            left = [_unexplored(grid, pairs, int(q)) for q in live[order]]
            return planned, pruned, left
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(np.isfinite(front), c_lb / front, 0.0)
        pick = int(np.lexsort((c_lb, ratio))[0])
        q = int(live[pick])
        live = np.delete(live, pick)
        planned += 1
        job.tick(1, 0, points)
        a, b = pairs[int(grid.pair[q])]
        na, nb = int(grid.na[q]), int(grid.nb[q])
        cluster = job.limits.apply_to_cluster(_mix_cluster(a, na, b, nb, job.pricing))
        res = search_heterogeneous(model, cluster, global_batch, precision, 1, params, flash,
                                   job.limits, cache=cache)  # fmt: skip
        if not res.ranked:
            continue
        plan, est = res.ranked[0]
        slow = 1.0
        if spot:  # the plan's own checkpoint time (its largest node's state)
            load = mixed_load([offer_load(a, na, job.terms), offer_load(b, nb, job.terms)])
            slow = slowdowns(*load, job.terms, checkpoint_time_s(plan, model))
            if math.isinf(slow):
                continue
        # the whole rented cluster is paid for, even GPUs the best plan leaves idle
        rented = float(grid.usd_hour[q])
        t = tokens / est.tokens_per_s * slow
        gpus = {a.gpu.name: na * a.gpus_per_node, b.gpu.name: nb * b.gpus_per_node}
        points.append(Point(gpus, spot, t, t / 3600 * rented, rented, plan, est, cluster,
                            float(grid.t_lb[q]), pricing=job.pricing))  # fmt: skip
    return planned, pruned, []


def _tighten(job: _Job, grid: _MixGrid, pairs: list[tuple[Offer, Offer]], idx: np.ndarray) -> None:
    """Raises the bounds of mixes ``idx`` to the costlier floors, so only where the first
    bound leaves them live: on spot, the bound over the fewest stages of any pipeline
    (``provision_stages.mix_time_floor_s``, type-aware batch floor included); on demand, the
    type-aware batch floor (each GPU at its own type's times, ``provision_mixbatch``)."""
    for k, (a, b) in enumerate(pairs):
        sel = idx[grid.pair[idx] == k]
        if not sel.size:
            continue
        na, nb = grid.na[sel].astype(int), grid.nb[sel].astype(int)
        floors = (_floor(job, a), _floor(job, b))
        if job.spot:
            t = mix_time_floor_s(job.model, job.global_batch, _iterations(job), job.terms,
                                 (a, b), floors, na, nb)  # fmt: skip
        else:
            it = mix_iteration_floor_s(job.model, job.global_batch, floors,
                                       na * a.gpus_per_node, nb * b.gpus_per_node)  # fmt: skip
            t = _iterations(job) * it * grid.slow[sel]
        grid.t_lb[sel] = np.maximum(grid.t_lb[sel], t)
        grid.c_lb[sel] = grid.t_lb[sel] / 3600 * grid.usd_hour[sel]


def _unexplored(grid: _MixGrid, pairs: list[tuple[Offer, Offer]], q: int) -> Unexplored:
    a, b = pairs[int(grid.pair[q])]
    gpus = {a.gpu.name: int(grid.na[q]) * a.gpus_per_node,
            b.gpu.name: int(grid.nb[q]) * b.gpus_per_node}  # fmt: skip
    return Unexplored(gpus, float(grid.t_lb[q]), float(grid.c_lb[q]))


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


def gpus_label(gpus: dict[str, int]) -> str:
    """Returns GPU counts as a person reads them: ``64 x A100-80GB + 8 x H100-80GB``."""
    return " + ".join(f"{n} x {name}" for name, n in gpus.items())


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
                f"${closest.total_cost_usd:,.0f} on {gpus_label(closest.gpus)}"
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
    limits: PlanConstraints | None = None,
    owned: Cluster | None = None,
    progress: ProgressHook | None = None,
    time_limit_s: float | None = None,
    pricing: str | None = None,
) -> ProvisionResult:
    """Returns the time/cost front over the market's configurations (single types, and
    two-type mixes with ``mixes``) and the recommended point for ``objective`` (time, cost or
    balanced) under ``constraints``; ``limits`` constrain the plans (as for ``plan``), the
    GPU types and the number of GPUs rented. With ``owned`` nodes, every configuration
    trains on a choice of them (1 to all nodes per type), and the market's offers only add
    to them (``provision_owned``). With
    ``time_limit_s``, no mix is planned once that many seconds have passed since the call:
    the mixes left are in ``ProvisionResult.unexplored`` with their bounds. ``pricing``
    (on-demand, reserved or spot; default: spot with ``spot``, else on-demand) prices every
    rented GPU; offers stating no price for it are left out (``ProvisionResult.left_out``)."""
    pricing = pricing_name(pricing if pricing is not None else spot)
    if spot and pricing != "spot":
        raise InputError("--spot", f"spot rental contradicts --pricing {pricing}")
    spot = pricing == "spot"
    stop_at = None if time_limit_s is None else time.monotonic() + time_limit_s
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
        and o.has_price(pricing)
        and (limits.gpu_types is None or o.gpu.name.lower() in
             {t.lower() for t in limits.gpu_types})
    ]  # fmt: skip
    left_out = [o.name for o in market.offers if not o.has_price(pricing)]
    if limits.gpu_types is not None:
        sold = {o.gpu.name.lower() for o in market.offers}
        for name in limits.gpu_types:
            if name.lower() not in sold:
                raise InputError("--gpu-types", f"the market sells no {name}")
    # GPU types filter the offers and max_gpus caps the counts: the clusters take the rest
    job = _Job(model, tokens, global_batch, precision, spot, params, terms, prune, flash_attention,
               replace(limits, gpu_types=None, max_gpus=None), limits.max_gpus,
               progress, stop_at=stop_at, pricing=pricing)  # fmt: skip
    # cheapest effective FLOP first: the low-cost end of the front prunes the rest early
    offers.sort(key=lambda o: o.price(pricing) / max(_floor(job, o).rate_flops))
    left: list[Unexplored] = []
    if owned is not None:
        from hetplan.search.provision_owned import explain_owned, owned_first

        planned, pruned = owned_first(job, owned, offers, points)
        front = pareto_front(points)
        best, why = recommend(front, objective, constraints)
        choice = explain_owned(best, points, limits.apply_to_cluster(owned))
        return ProvisionResult(points, front, planned, pruned, time.process_time() - start,
                               best, why + choice, 0, pricing=pricing, left_out=left_out,
                               owned_choice=choice.removeprefix("; "))  # fmt: skip
    for offer in offers:
        a, b = _single_type(job, offer, points)
        planned += a
        pruned += b
    if mixes:
        a, b, left = _mixes(job, offers, points)
        planned += a
        pruned += b
    front = pareto_front(points)  # every point carries its plan and estimate()
    best, why = recommend(front, objective, constraints)
    reasons = dict(job.impossible)
    return ProvisionResult(
        points, front, planned, pruned, time.process_time() - start, best, why,
        sum(reasons.values()), reasons, left, pricing, left_out,
    )  # fmt: skip


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

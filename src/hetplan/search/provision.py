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

This module holds the single types, the recommendation and the entry point; the shared
points, job and floors are in ``provision_points``, the two-type mixes in
``provision_mixes``, owned nodes in ``provision_owned``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from hetplan.cluster import Cluster, Node
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.market import Market, Offer, pricing_name
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints, homogeneous_space, require_mixed_schedule
from hetplan.search.homogeneous import SearchResult, search_homogeneous
from hetplan.search.homogeneous_candidates import SearchSpace
from hetplan.search.homogeneous_memory import SearchMemo
from hetplan.search.progress import ProgressHook
from hetplan.search.provision_batch import batch_floor_s
from hetplan.search.provision_bounds import iteration_floor_s
from hetplan.search.provision_dominance import described, dominators, swap_cap
from hetplan.search.provision_mixes import explore_mixes
from hetplan.search.provision_points import (
    Point,
    ProvisionJob,
    Unexplored,
    closest_to_front,
    count_reason,
    dominated_from_s,
    front_cost,
    front_cost_at,
    gpus_label,
    iterations,
    offer_floor,
    pareto_front,
)
from hetplan.search.spot import (
    SpotTerms,
    checkpoint_floor_s,
    configuration_plan,
    offer_load,
    slowdowns,
)
from hetplan.units import duration_text

PROVISION_SPACE = SearchSpace(zero_stages=(0, 1, 2, 3), max_virtual_stages=8, zero0_has_twin=True)
"""``plan``'s space (up to 8 model chunks a stage, as the heterogeneous search's single-type
baseline: a mix's plan on one type's nodes is then never faster than that configuration's
own, ``provision_mixes.explore_mixes``; with 4, GPT-3 175B's fastest point on the default
market took 7.82 days where 7.76 is reachable), less ZeRO-0 where it is dominated by ZeRO-1
(same traffic, less memory, a sharded optimizer step): wherever a plan has several
replicas; a single replica has only ZeRO-0 (it was left out with the rest: a configuration
whose best plan is one pipeline was priced by a slower one)."""


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
    dominated: int = 0
    """Configurations left out unplanned because a dominating offer's stand in for them
    (``provision_dominance``): never on the front, whatever their plans."""
    dominated_by: dict[str, str] = field(default_factory=dict)
    """Per dominated offer, an offer that dominates it."""


IMPOSSIBLE_REASONS = {
    "max_gpus": "more GPUs than --max-gpus",
    "spot": "a spot run preempted faster than it progresses",
    "memory": "too little memory for the model's weights, gradients and optimizer states",
    "compute": "no GPU of the configuration computes (a rate of zero)",
    "hourly_cap": "more per hour than --max-usd-per-hour",
}
"""Why a configuration has no possible plan (the keys of ``impossible_by_reason``)."""


@dataclass
class _Counts:
    """Every node count of one offer that could have a plan, with its proven bounds."""

    offer: Offer
    nodes: np.ndarray
    t_lb: np.ndarray
    slow: np.ndarray
    usd_hour: np.ndarray


def _offer_counts(job: ProvisionJob, offer: Offer) -> _Counts:
    """Returns the node counts of one offer that could have a plan with their bounds (the
    iteration floor x iterations x the spot slowdown's floor); the rest are counted by
    reason in ``job.impossible``."""
    model, global_batch, spot, terms = job.model, job.global_batch, job.spot, job.terms
    floor = offer_floor(job, offer)
    price = offer.price(job.pricing)
    most = offer.max_nodes
    if job.max_gpus is not None:
        most = min(most, job.max_gpus // offer.gpus_per_node)
    count_reason(job.impossible, "max_gpus", offer.max_nodes - max(most, 0))
    # the iteration floor of every count at once (one array: its multipliers computed once)
    counts = np.arange(max(most, 0) + 1) * offer.gpus_per_node
    it_lbs = np.maximum(
        iteration_floor_s(model, global_batch, [floor], [counts], per_size=True),
        batch_floor_s(model, global_batch, [floor], counts, per_size=True),
    )
    it_lbs = it_lbs.min(axis=0)  # one micro-batch size per plan: the larger floor at each
    cap = swap_cap(job.dominated_by, offer)
    rows: list[tuple[int, float, float, float]] = []
    for nodes in range(most, 0, -1):
        load = offer_load(offer, nodes, terms)
        # a floor of every plan's checkpoint time (checkpoint_floor_s): one of the slowdown
        slow = slowdowns(*load, terms, checkpoint_floor_s(model, nodes), True) if spot else 1.0
        if math.isinf(slow):
            count_reason(job.impossible, "spot", 1)
            continue
        usd_hour = price * nodes * offer.gpus_per_node
        if job.max_usd_per_hour is not None and usd_hour > job.max_usd_per_hour:
            count_reason(job.impossible, "hourly_cap", 1)
            continue
        if nodes <= cap:  # a dominating offer's configuration of as many nodes stands in
            job.dominated[0] += 1
            continue
        rows.append((nodes, iterations(job) * float(it_lbs[nodes]) * slow, slow, usd_hour))
    cols = [np.array(c, dtype=float) for c in zip(*rows, strict=True)] or [np.zeros(0)] * 4
    return _Counts(offer, cols[0].astype(int), cols[1], cols[2], cols[3])


def _single_types(job: ProvisionJob, offers: list[Offer], points: list[Point]) -> tuple[int, int]:
    """Adds the points of every node count of every offer that bounds cannot rule out;
    returns (planned, pruned).

    The bounds of every count are computed first. Until none is left, the counts the points
    found so far dominate at their bounds are pruned, and the live one closest to the front
    (smallest ratio of its cost bound to the front's cost at its time bound; beyond the
    front's fast end first, cheapest first) is planned with the homogeneous search, on spot
    ranked by each plan's own slowdown (``configuration_plan``). The front is the same in
    any order; this one builds it from the cheap end, so that it prunes early."""
    model, tokens, global_batch, precision, spot, params, terms, prune, flash = job.unpack()
    space = homogeneous_space(job.limits, PROVISION_SPACE)
    table = [_offer_counts(job, offer) for offer in offers]
    none = [np.zeros(0)]
    which = np.concatenate([np.full(t.nodes.size, k) for k, t in enumerate(table)] or none)
    node_counts = np.concatenate([t.nodes for t in table] or none)
    slow_lb = np.concatenate([t.slow for t in table] or none)
    usd_hour = np.concatenate([t.usd_hour for t in table] or none)
    t_lb = np.concatenate([t.t_lb for t in table] or none)
    c_lb = t_lb / 3600 * usd_hour
    memos: dict[int, tuple[SearchMemo, list[Node]]] = {}
    live = np.arange(t_lb.size)
    planned = pruned = 0
    at, seen = front_cost_at(points), len(points)
    while live.size:
        if len(points) != seen:  # points are only added: sorted again when one is
            at, seen = front_cost_at(points), len(points)
        front = front_cost(t_lb[live], points, at)
        if prune:
            dom = front <= c_lb[live]
            pruned += int(dom.sum())
            live, front = live[~dom], front[~dom]
            if not live.size:
                break
        pick = closest_to_front(c_lb[live], front)
        q = int(live[pick])
        live = np.delete(live, pick)
        planned += 1
        job.tick(1, 0, points)
        o, nodes, usd = int(which[q]), int(node_counts[q]), float(usd_hour[q])
        offer = table[o].offer
        if o not in memos:  # built once (with the user's memory headroom), sliced per count
            cluster_all = offer.cluster(offer.max_nodes, job.pricing)
            memos[o] = (SearchMemo(), list(job.limits.apply_to_cluster(cluster_all).nodes))
        memo, all_nodes = memos[o]
        cluster = Cluster(tuple(all_nodes[:nodes]))
        # a plan training slower than this adds nothing: the points found dominate it
        # (its iteration time x slowdown; a hair above, so rounding never cuts a plan)
        cut = math.inf
        if prune:
            cut = dominated_from_s(usd, points, at) / iterations(job) * (1 + 1e-9)
        search = partial(search_homogeneous, model, cluster, global_batch, precision,
                         params=params, space=space, flash_attention=flash, memo=memo,
                         cutoff=cut, exact_counts=False)  # fmt: skip

        def ranked_by(
            k: int, search: partial[SearchResult] = search
        ) -> list[tuple[Plan, Estimate]]:
            return search(top_k=k).ranked

        def weighted(
            slowdown_of: Callable[[Plan], float],
            floor: float,
            search: partial[SearchResult] = search,
        ) -> list[tuple[Plan, Estimate]]:
            return search(top_k=1, weight=slowdown_of, weight_floor=floor).ranked

        # on spot, the plan's own checkpoint time (its largest node's state)
        load = offer_load(offer, nodes, terms) if spot else None
        found = configuration_plan(ranked_by, model, terms, load, float(slow_lb[q]), weighted)
        if found is None:
            continue
        plan, est, slow = found
        t = tokens / est.tokens_per_s * slow
        n_gpus = nodes * offer.gpus_per_node
        points.append(Point({offer.gpu.name: n_gpus}, spot, t, t / 3600 * usd, usd,
                            plan=plan, estimate=est, cluster=cluster, bound_s=float(t_lb[q]),
                            pricing=job.pricing))  # fmt: skip
    return planned, pruned


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
        parts.append(f"deadline {duration_text(c.deadline_s)}")
    if c.budget_usd is not None:
        parts.append(f"budget ${c.budget_usd:,.0f}")
    if c.max_usd_per_hour is not None:
        parts.append(f"cap ${c.max_usd_per_hour:,.2f}/hour")
    return f" within the {', '.join(parts)}" if parts else ""


def _binding(front: list[Point], c: Constraints) -> str:
    if not front and c.max_usd_per_hour is not None:
        return (f"the hourly cap binds: no configuration within ${c.max_usd_per_hour:,.2f}"
                "/hour can train this model")  # fmt: skip
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
                f"{duration_text(closest.time_to_train_s)} and "
                f"${closest.total_cost_usd:,.0f} on {gpus_label(closest.gpus)}"
            )
    return "no single configuration meets the deadline, budget and hourly cap together"


def _largest_node(offers: list[Offer], owned: Cluster | None) -> int | None:
    """Returns the most GPUs a node of any configuration holds (None without nodes)."""
    sizes = [o.gpus_per_node for o in offers]
    if owned is not None:
        sizes += [n.gpus for n in owned.nodes]
    return max(sizes, default=None)


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
    if mixes:
        require_mixed_schedule(limits, "mixes")
    left_out = [o.name for o in market.offers if not o.has_price(pricing)]
    if len(left_out) == len(market.offers):
        raise InputError("--spot" if spot else "--pricing",
                         f"no offer of the market states a {pricing} price")  # fmt: skip
    if limits.gpu_types is not None:  # what is rented; owned nodes are the user's own
        sold = {o.gpu.name.lower() for o in market.offers}
        mine = set() if owned is None else {g.name.lower() for g in owned.gpu_types_used()}
        for name in limits.gpu_types:
            if name.lower() not in sold | mine:
                raise InputError("--gpu-types", f"the market sells no {name}")
    # GPU types filter the offers and max_gpus caps the counts: the clusters take the rest
    job = ProvisionJob(model, tokens, global_batch, precision, spot, params, terms, prune,
                       flash_attention, replace(limits, gpu_types=None, max_gpus=None),
                       limits.max_gpus, progress, stop_at=stop_at, pricing=pricing,
                       max_usd_per_hour=constraints.max_usd_per_hour,
                       largest=_largest_node(offers, owned))  # fmt: skip
    # cheapest effective FLOP first: the low-cost end of the front prunes the rest early
    offers.sort(key=lambda o: o.price(pricing) / max(offer_floor(job, o).rate_flops))
    if owned is None:  # offers a better, no dearer one stands in for (provision_dominance)
        job = replace(job, dominated_by=dominators(job, offers))
    left: list[Unexplored] = []
    if owned is not None:
        from hetplan.search.provision_owned import explain_owned, owned_first

        planned, pruned = owned_first(job, owned, offers, points)
        front = pareto_front(points)
        best, why = recommend(front, objective, constraints)
        choice = explain_owned(best, points, job.limits.apply_to_cluster(owned))
        return ProvisionResult(points, front, planned, pruned, time.process_time() - start,
                               best, why + choice, 0, pricing=pricing, left_out=left_out,
                               owned_choice=choice.removeprefix("; "))  # fmt: skip
    planned, pruned = _single_types(job, offers, points)
    if mixes:
        a, b, left = explore_mixes(job, offers, points)
        planned += a
        pruned += b
    front = pareto_front(points)  # every point carries its plan and estimate()
    if not front and planned and job.limits.active:
        # configurations were planned and none had a plan: the limits on plans did it
        given = limits.relaxations()
        node_gpus = max(o.gpus_per_node for o in offers)
        total = sum(o.gpus_per_node * o.max_nodes for o in offers)
        batch = job.global_batch
        whys = [w for _, option, _ in given
                if (w := limits.obstacle(option, model, node_gpus, total, batch))]  # fmt: skip
        raise InputError(", ".join(option for _, option, _ in given),
                         "no configuration of the market has a plan that satisfies "
                         + " ".join(limits.described())
                         + "".join(f": {w}" for w in whys[:1]))  # fmt: skip
    best, why = recommend(front, objective, constraints)
    reasons = dict(job.impossible)
    return ProvisionResult(
        points, front, planned, pruned, time.process_time() - start, best, why,
        sum(reasons.values()), reasons, left, pricing, left_out,
        dominated=job.dominated[0], dominated_by=described(job.dominated_by),
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

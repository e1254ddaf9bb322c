"""Provisioning: which GPUs to rent and how many, as a time-versus-dollars Pareto front.

Single-type configurations: every node count of every offer, each with the best homogeneous
plan. A count is skipped without planning when a lower bound on its time (from its aggregate
peak FLOP/s at the best calibrated efficiency) and on its cost already make it dominated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetplan.cost.estimate import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.market import Market, Offer
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.spot import SpotTerms, spot_slowdown


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


def pareto_front(points: list[Point]) -> list[Point]:
    """Returns the points no other point beats on both time and cost, fastest first."""
    front: list[Point] = []
    for p in sorted(points, key=lambda q: (q.time_to_train_s, q.total_cost_usd)):
        if not front or p.total_cost_usd < front[-1].total_cost_usd * (1 - 1e-9):
            front.append(p)
    return front


def time_lower_bound_s(
    model: ModelSpec, offer: Offer, nodes: int, tokens: float, precision: str, params: CostParams
) -> float:
    """Returns a time no plan on these nodes can beat: all FLOPs at the best GEMM efficiency."""
    flops = tokens / model.seq * model.model_flops_per_sequence()
    peak = offer.gpu.peak_flops(precision) * params.gpu(offer.gpu.name).gemm_max
    return flops / (peak * nodes * offer.gpus_per_node)


@dataclass
class ProvisionResult:
    """Every planned point, the front, and how much the pruning saved."""

    points: list[Point]
    front: list[Point]
    planned: int
    pruned: int


def _dominated(time_s: float, cost: float, points: list[Point]) -> bool:
    return any(p.time_to_train_s <= time_s and p.total_cost_usd <= cost for p in points)


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
    params = params or default_params()
    terms = terms or SpotTerms()
    points: list[Point] = []
    planned = pruned = 0
    for offer in market.offers:
        if not offer.gpu.supports(precision) or (spot and offer.spot_usd_per_gpu_hour is None):
            continue
        price_gpu = offer.price(spot)
        # largest counts first: the fast end of the front is found early and prunes the rest
        for nodes in range(offer.max_nodes, 0, -1):
            slow = spot_slowdown(offer, nodes, terms) if spot else 1.0
            if math.isinf(slow):
                continue
            usd_hour = price_gpu * nodes * offer.gpus_per_node
            t_lb = time_lower_bound_s(model, offer, nodes, tokens, precision, params) * slow
            if prune and _dominated(t_lb, t_lb / 3600 * usd_hour, points):
                pruned += 1
                continue
            planned += 1
            res = search_homogeneous(
                model, offer.cluster(nodes, spot), global_batch, precision, top_k=1, params=params
            )
            if not res.ranked:
                continue
            plan, est = res.ranked[0]
            t = tokens / est.tokens_per_s * slow
            points.append(
                Point(
                    {offer.gpu.name: nodes * offer.gpus_per_node},
                    spot,
                    t,
                    t / 3600 * usd_hour,
                    usd_hour,
                    plan,
                    est,
                )
            )
    return ProvisionResult(points, pareto_front(points), planned, pruned)

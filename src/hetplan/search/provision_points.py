"""What every step of one provisioning search shares: the points it finds (``Point``, the
Pareto front and dominance), the mixes a time limit left (``Unexplored``), the search's job
(``ProvisionJob``: model, tokens, pricing, limits, counters) and the per-offer floors it
prunes with (``offer_floor``, built from the cost model's own per-layer times).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams
from hetplan.market import Offer
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints
from hetplan.search.progress import ProgressHook, SearchProgress
from hetplan.search.provision_bounds import TypeFloor, type_floor
from hetplan.search.spot import SpotTerms


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


def dominated(time_s: float, cost: float, points: list[Point]) -> bool:
    """Returns whether a point found is at least as fast and at least as cheap."""
    return any(p.time_to_train_s <= time_s and p.total_cost_usd <= cost for p in points)


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


def count_reason(reasons: dict[str, int], key: str, n: int) -> None:
    """Adds ``n`` configurations with no possible plan for reason ``key``."""
    if n:
        reasons[key] = reasons.get(key, 0) + n


@dataclass(frozen=True)
class ProvisionJob:
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
    """``time.monotonic()`` after which no further mix is planned (``--time-limit``), and
    the mixes' costlier bounds are no longer computed (``provision_mixes``)."""
    pricing: str = "on-demand"
    """The price every offer is rented at (``market.PRICINGS``); spot also means
    preemptions (``spot``)."""
    max_usd_per_hour: float | None = None
    """No configuration costs more an hour (--max-usd-per-hour): a configuration above the
    cap is never planned, so it prunes none below it (a point dominated overall may be the
    best one under the cap)."""
    dominated_by: dict[str, list[Offer]] = field(default_factory=dict)
    """Per offer name, the offers that dominate it (``provision_dominance``): configurations
    they stand in for are left out unplanned."""
    dominated: list[int] = field(default_factory=lambda: [0])
    """Configurations left out so far because a dominating offer stands in for them."""
    largest: int | None = None
    """The most GPUs a node of any configuration holds: a data-parallel group spans at
    least one node per that many members beyond the first node's (the gradient reductions'
    floors, ``TypeFloor.reduce_tp``); None: no such floor."""

    def out_of_time(self) -> bool:
        """Returns whether ``stop_at`` has passed."""
        return self.stop_at is not None and time.monotonic() >= self.stop_at

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


def offer_floor(job: ProvisionJob, offer: Offer) -> TypeFloor:
    node = offer.cluster(1).nodes[0]  # its intra-node link prices the TP collectives
    return type_floor(job.model, offer.gpu, offer.gpus_per_node, job.global_batch, job.params,
                      job.precision, job.flash, node, job.limits.overlap_tp_comm,
                      job.largest)  # fmt: skip


def gpu_memory(job: ProvisionJob, offer: Offer) -> float:
    """Returns the memory one GPU of the offer gives the search (after the user's headroom)."""
    return float(job.limits.apply_to_cluster(offer.cluster(1)).nodes[0].gpu.memory_bytes)


def iterations(job: ProvisionJob) -> float:
    """Returns the optimizer steps the job's tokens take."""
    return job.tokens / (job.global_batch * job.model.seq)


def front_cost_at(points: list[Point]) -> tuple[np.ndarray, np.ndarray]:
    """Returns (times, best cost among points at least that fast) for vectorised dominance."""
    pts = sorted(points, key=lambda p: p.time_to_train_s)
    times = np.array([p.time_to_train_s for p in pts])
    costs = np.minimum.accumulate(np.array([p.total_cost_usd for p in pts])) if pts else times
    return times, costs


def front_cost(
    t_lb: np.ndarray, points: list[Point], at: tuple[np.ndarray, np.ndarray] | None = None
) -> np.ndarray:
    """Returns, per time bound, the least cost of a point at least that fast (inf if none);
    ``at``: ``front_cost_at(points)`` where the caller has it."""
    if not points:
        return np.full(t_lb.shape, np.inf)
    times, costs = front_cost_at(points) if at is None else at
    idx = np.searchsorted(times, t_lb, side="right") - 1  # fastest-enough points: [0, idx]
    return np.where(idx >= 0, costs[np.clip(idx, 0, None)], np.inf)


def closest_to_front(c_lb: np.ndarray, front: np.ndarray) -> int:
    """Returns the index of the live configuration to plan next: the smallest ratio of its
    cost bound to the front's cost at its time bound (``front``; none faster: ratio 0, so
    beyond the front's fast end first), then the cheapest bound, then the first."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(np.isfinite(front), c_lb / front, 0.0)
    return int(np.lexsort((c_lb, ratio))[0])  # stable: ties keep their order


def dominated_from_s(
    usd_per_hour: float, points: list[Point], at: tuple[np.ndarray, np.ndarray] | None = None
) -> float:
    """Returns the least time to train from which a configuration costing ``usd_per_hour``
    is dominated by a point found (``front_cost`` at most its cost; inf if never): with
    point i the fastest-enough at time t, it holds once t >= t_i and t x price >=
    the least cost C_i of points at least that fast, so at the least over i of
    max(t_i, C_i / price). A plan of the configuration slower than this adds nothing to
    the front. ``at``: ``front_cost_at(points)`` where the caller has it."""
    if not points or usd_per_hour <= 0:
        return math.inf
    times, costs = front_cost_at(points) if at is None else at
    return float(np.min(np.maximum(times, costs / usd_per_hour * 3600.0)))


def gpus_label(gpus: dict[str, int]) -> str:
    """Returns GPU counts as a person reads them: ``64 x A100-80GB + 8 x H100-80GB``."""
    return " + ".join(f"{n} x {name}" for name, n in gpus.items())

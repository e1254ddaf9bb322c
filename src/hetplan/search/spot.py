"""The spot-instance model: what one preemption costs and how preemptions stretch a run.

The building blocks here are shared by provisioning (``spot_slowdown``, an expectation under
a preemption rate) and by the trace replay of ``hetplan spot simulate`` (which charges
``preemption_loss_s``'s parts event by event), so the two never disagree:

- a checkpoint every ``interval`` seconds of training stalls training for ``checkpoint_s``;
- a preemption costs the restart, the recovery of the lost state (peers first, storage for
  the rest: ``elastic/recovery.py``) and everything done since the last committed
  checkpoint, on average half a checkpoint cycle;
- the interval that minimises the waste is Young's optimum sqrt(2 C M) (Young 1974; Daly
  2006 gives the higher-order correction), C the checkpoint time, M the mean time between
  preemptions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetplan.elastic.placement import node_shards, shard_bytes
from hetplan.elastic.recovery import expected_recovery_s
from hetplan.market import Offer
from hetplan.model import ModelSpec
from hetplan.plan import Plan

DEFAULT_STORAGE_BYTES_PER_S = 10e9 / 8
"""10 Gbit/s to object storage when the market names none: an assumption, not a measurement."""
LOCAL_WRITE_BYTES_PER_S = 2e9
"""Local NVMe write bandwidth for node-local checkpoints: an assumption (data-centre NVMe
drives write 2-7 GB/s), used for the checkpoint time C."""


@dataclass(frozen=True)
class SpotTerms:
    """How preemptions stretch a spot run."""

    checkpoint_interval_s: float | None = None
    """Training time between checkpoints (work lost per preemption is half a cycle on
    average); None: Young's optimum sqrt(2 C M) from the run's preemption rate."""
    state_bytes: float = 0.0
    """Training state a replacement node must recover (weights and optimizer states)."""
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S
    checkpoint_s: float | None = None
    """Time one checkpoint stalls training; None: the plan's largest node state written to
    local disk (``checkpoint_time_s``), as the replay of ``hetplan spot simulate`` does."""


def checkpoint_time_s(plan: Plan, model: ModelSpec) -> float:
    """Returns C: the checkpoint bytes of the node holding the most shards under ``plan``
    (``elastic/placement``) over the local-disk write rate."""
    sizes = shard_bytes(model)
    held = set(node_shards(plan, model).values())  # nodes holding the same shards: once
    per_node = [sum(sizes[s] for s in shards) for shards in held]
    return max(per_node, default=0) / LOCAL_WRITE_BYTES_PER_S


def checkpoint_floor_s(model: ModelSpec, nodes: Any, stages: Any = None) -> Any:
    """Returns a lower bound of ``checkpoint_time_s`` for any plan on ``nodes`` nodes: every
    shard is held by some node, so the fullest node holds at least the mean over the nodes.
    Also, one pipeline holds every shard, each on one of its stages, and every node of a
    stage holds all of the stage's shards; at most as many stages as shards hold any, so
    some node holds at least the shards' total over their number, and at least the largest
    shard. ``stages``: the plan has a pipeline of at most that many stages (its shards
    spread over no more)."""
    sizes = shard_bytes(model).values()
    total = sum(sizes)
    spread = np.minimum(np.maximum(np.asarray(nodes, float), 1.0), len(sizes))
    if stages is not None:
        spread = np.minimum(spread, np.maximum(np.asarray(stages, float), 1.0))
    out = np.maximum(total / spread, max(sizes))
    return out / LOCAL_WRITE_BYTES_PER_S


def young_daly_interval_s(checkpoint_s: Any, mtbf_s: Any) -> Any:
    """Returns the checkpoint interval sqrt(2 C M) minimising the expected waste (Young's
    first-order optimum), ``checkpoint_s`` = C, ``mtbf_s`` = M; inf without preemptions.
    Scalars or numpy arrays."""
    c, m = np.asarray(checkpoint_s, float), np.asarray(mtbf_s, float)
    with np.errstate(invalid="ignore"):
        out = np.where(np.isfinite(m), np.sqrt(2.0 * np.maximum(c, 0.0) * m), np.inf)
    return float(out) if out.ndim == 0 else out


def lost_work_s(interval_s: Any, checkpoint_s: Any = 0.0) -> Any:
    """Returns the expected wall time since the last committed checkpoint when a preemption
    strikes at a random moment of the checkpoint cycle: half of training plus writing
    (scalars or numpy arrays)."""
    return (interval_s + checkpoint_s) / 2.0


def preemption_loss_s(
    restart_s: float, recovery_s: float, interval_s: float, checkpoint_s: float = 0.0
) -> float:
    """Returns the expected wall time one preemption costs: restart, recovery, lost work."""
    return restart_s + recovery_s + lost_work_s(interval_s, checkpoint_s)


def useful_fraction(
    preemptions_per_s: Any, loss_s: Any, interval_s: Any, checkpoint_s: Any = 0.0
) -> Any:
    """Returns the share of wall time that trains for good (0 when the run never progresses):
    ``preemptions_per_s x loss_s`` of the time is lost to preemptions, and of the rest a share
    ``C / (interval + C)`` goes to writing checkpoints. Scalars or numpy arrays."""
    rate, loss = np.asarray(preemptions_per_s, float), np.asarray(loss_s, float)
    interval, c = np.asarray(interval_s, float), np.asarray(checkpoint_s, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        kept = 1.0 - np.where(rate > 0, rate * loss, 0.0)
        stall = np.where((c > 0) & np.isfinite(interval), interval / (interval + c), 1.0)
        out = np.where(kept > 0, kept * stall, 0.0)
    return float(out) if out.ndim == 0 else out


def recovery_s(offer: Offer, nodes: int, terms: SpotTerms) -> float:
    """Returns the modelled time to restore a replaced node's state, peers first (elastic/)."""
    if terms.state_bytes <= 0:
        return 0.0
    return expected_recovery_s(
        terms.state_bytes, nodes, offer.network_bytes_per_s, terms.storage_bytes_per_s
    )


def slowdowns(
    per_s: Any, fixed_s: Any, terms: SpotTerms, checkpoint_s: Any, floor: bool = False
) -> Any:
    """Returns wall time / useful time of runs (inf where one never progresses), numpy-wise:
    ``per_s`` preemptions a second, each costing ``fixed_s`` (restart and recovery, the mean
    over the offers weighted by their rates) plus the work lost since the last checkpoint;
    checkpoints of ``checkpoint_s`` (``terms.checkpoint_s`` when stated) every
    ``terms.checkpoint_interval_s`` or, when not stated, at Young's interval for the run's
    mean time between preemptions.

    With ``floor``, ``checkpoint_s`` is a lower bound of the plan's checkpoint time and the
    result a lower bound of the slowdown: the useful share falls as C grows at any fixed
    interval (more lost work, a longer stall), and at C the best interval is the exact
    optimum ``-C + sqrt(C^2 + 2 a C / L)`` (L preemptions a second, ``a = 1 - L (R + C/2)``,
    R the restart and recovery), which Young's interval approximates."""
    rate, fixed = np.asarray(per_s, float), np.asarray(fixed_s, float)
    c = np.asarray(checkpoint_s if terms.checkpoint_s is None else terms.checkpoint_s, float)
    with np.errstate(invalid="ignore", divide="ignore"):
        if terms.checkpoint_interval_s is not None:
            interval = np.full(np.broadcast(rate, c).shape, terms.checkpoint_interval_s)
        elif floor:
            a = 1.0 - rate * (fixed + c / 2.0)
            best = -c + np.sqrt(c * c + 2.0 * np.maximum(a, 0.0) * c / rate)
            interval = np.where(rate > 0, np.where(c > 0, best, 0.0), np.inf)
        else:
            interval = np.asarray(young_daly_interval_s(c, np.where(rate > 0, 1.0 / rate, np.inf)))
        loss = fixed + np.where(rate > 0, lost_work_s(interval, c), 0.0)
        useful = np.asarray(useful_fraction(rate, loss, interval, c))
        out = np.where(useful > 0, 1.0 / np.where(useful > 0, useful, 1.0), np.inf)
    return float(out) if out.ndim == 0 else out


def offer_load(offer: Offer, nodes: int, terms: SpotTerms) -> tuple[float, float]:
    """Returns ``nodes`` nodes of ``offer``'s preemptions a second (``rate x nodes`` per
    hour) and what each costs besides lost work: the restart and the recovery of the lost
    node's state (peers first)."""
    per_s = offer.preemption_rate_per_node_hour * nodes / 3600.0
    return per_s, offer.restart_s + recovery_s(offer, nodes, terms)


def mixed_load(loads: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """Returns the preemptions a second of a run over several offers (a preemption of any
    stops the whole run, so rates add) and the mean restart and recovery, rate-weighted."""
    per_s = sum(r for r, _ in loads)
    with np.errstate(invalid="ignore", divide="ignore"):
        fixed = np.where(np.asarray(per_s) > 0, sum(r * f for r, f in loads) / per_s, 0.0)
    return per_s, fixed


def spot_slowdown(offer: Offer, nodes: int, terms: SpotTerms, checkpoint_s: float = 0.0) -> float:
    """Returns wall time / useful time of ``nodes`` nodes of ``offer`` under preemptions (inf
    when the run never progresses), for a plan whose checkpoints take ``checkpoint_s``
    (``slowdowns``).

    Preemptions arrive at ``rate x nodes`` per hour; each costs ``preemption_loss_s``: the
    restart, the recovery of the lost node's training state (from surviving peers first,
    storage for the rest), and on average half a checkpoint cycle of lost work.
    """
    per_s, fixed = offer_load(offer, nodes, terms)
    return float(slowdowns(per_s, fixed, terms, checkpoint_s))


SPOT_RANKS = 4
"""Plans ``best_spot_plan`` asks the search for first (then four times as many a round)."""


def best_spot_plan(
    ranked_by: Callable[[int], list[tuple[Plan, Any]]],
    slowdown_of: Callable[[Plan], float],
    floor: float,
) -> tuple[Plan, Any, float] | None:
    """Returns the plan whose iteration time x its own slowdown (its checkpoint: its
    largest node's state) is least, with its estimate and slowdown; None if none finishes.

    ``ranked_by(k)`` returns a search's k best plans by iteration time (fewer: all there
    are); ``floor`` is at most any plan's slowdown (``checkpoint_floor_s``'s). The fastest
    iteration need not train fastest on spot: a plan with more stages checkpoints less per
    node. Plans come fastest first, so once the k-th iteration time x ``floor`` reaches
    the best product, no later plan can beat it; else the search is asked for more."""
    k = SPOT_RANKS
    while True:
        ranked = ranked_by(k)
        best: tuple[float, Plan, Any, float] | None = None
        for plan, est in ranked:
            slow = slowdown_of(plan)
            if math.isinf(slow):
                continue
            value = est.iteration_time_s * slow
            if best is None or value < best[0]:
                best = (value, plan, est, slow)
        if len(ranked) < k or (
            best is not None and ranked[-1][1].iteration_time_s * floor >= best[0]
        ):
            return None if best is None else best[1:]
        k *= 4


def configuration_plan(
    ranked_by: Callable[[int], list[tuple[Plan, Any]]],
    model: ModelSpec,
    terms: SpotTerms,
    load: tuple[Any, Any] | None = None,
    floor: float = 1.0,
    weighted: Callable[[Callable[[Plan], float], float], list[tuple[Plan, Any]]] | None = None,
) -> tuple[Plan, Any, float] | None:
    """Returns a rented configuration's plan, its estimate and its slowdown: on demand
    (``load`` None) the fastest iteration; on spot (``load``: its preemptions a second and
    their fixed cost) ``best_spot_plan``, each plan slowed by its own checkpoint time;
    ``floor``: a slowdown no plan of the configuration beats. None: no plan.

    ``weighted(slowdown_of, floor)``, where the search can rank by iteration time x a
    plan's slowdown itself (``search_homogeneous``'s ``weight``): its best plan by that
    product, in one search, the plans that never finish left unestimated."""
    if load is None:
        ranked = ranked_by(1)
        return None if not ranked else (ranked[0][0], ranked[0][1], 1.0)

    def slowdown_of(plan: Plan) -> float:
        return float(slowdowns(*load, terms, checkpoint_time_s(plan, model)))

    if weighted is not None:
        ranked = weighted(slowdown_of, floor)
        return None if not ranked else (ranked[0][0], ranked[0][1], slowdown_of(ranked[0][0]))
    return best_spot_plan(ranked_by, slowdown_of, floor)

"""Homogeneous 3D search: enumerate degrees and knobs, prune by divisibility and memory,
rank by estimate() itself, visiting candidates in order of a proven lower bound of it.

The parts: ``homogeneous_candidates`` (the space, its points and their plans),
``homogeneous_memory`` (each point's memory) and ``homogeneous_scoring`` (each point's lower
bound); this module runs them: every point scored (``score_candidates``), then visited in
bound order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.homogeneous_candidates import (
    Candidate,
    SearchSpace,
    candidate_plan,
    divisors,
    enumerate_candidates,
    lighten,
    lightens,
    tiebreak,
)
from hetplan.search.homogeneous_memory import SearchMemo
from hetplan.search.homogeneous_scoring import Scorer
from hetplan.search.progress import ProgressHook, SearchProgress

__all__ = [
    "Candidate",
    "Scored",
    "SearchMemo",
    "SearchResult",
    "SearchSpace",
    "candidate_plan",
    "divisors",
    "enumerate_candidates",
    "lighten",
    "lightens",
    "score_candidates",
    "search_homogeneous",
]


@dataclass
class Scored:
    """Candidates that fit, with lower bounds of their iteration time, smallest first; and
    what was pruned by memory."""

    ranked: list[tuple[float, Candidate]]
    candidates: int
    fitting: int
    min_memory_bytes: float


def score_candidates(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams | None = None,
    space: SearchSpace | None = None,
    flash_attention: bool = True,
    memo: SearchMemo | None = None,
    scorer: Scorer | None = None,
    sync: bool = True,
    exact_counts: bool = True,
    cutoff: float = math.inf,
) -> Scored:
    """Returns every fitting candidate with a lower bound of its estimate() time, smallest
    first (no estimate). ``memo`` may be shared by calls on clusters of the same node type.
    ``sync`` False: the bound without the gradient reduction (``Scorer.bound_s``).
    ``exact_counts`` False: the degrees and ZeRO stages whose state alone overflows memory
    (``Scorer.state_overflows``) are not enumerated, and memory is settled by its orders
    where they can (``MemoryScorer.fits``, no peak then), so ``candidates`` and
    ``min_memory_bytes`` count only the rest (the fitting ones are the same). ``cutoff``:
    only candidates whose bound is at most this are kept (a search that wants nothing
    slower), and one whose first bound is already at hand above it is not memory-checked,
    so ``fitting`` and ``min_memory_bytes`` count only the rest."""
    params = params or default_params()
    space = space or SearchSpace()
    if not cluster.is_homogeneous():  # (the bound reads one node's links for all)
        raise InputError(
            "--cluster", "the homogeneous search needs nodes of one GPU type, size and links"
        )
    gpu = cluster.nodes[0].gpu
    if not gpu.supports(precision):
        raise InputError("--precision", f"{gpu.name} has no {precision} support")
    n = cluster.num_gpus
    gpn = cluster.nodes[0].gpus
    scored: list[tuple[float, tuple[object, ...], Candidate]] = []
    count = 0
    min_mem = math.inf
    if scorer is None:
        scorer = Scorer(model, cluster, precision, global_batch, params, flash_attention,
                         memo or SearchMemo(), space)  # fmt: skip
    overflows = None if exact_counts else scorer.state_overflows
    for c in enumerate_candidates(model, n, gpn, global_batch, space, overflows):
        count += 1
        # under a cutoff, a bound already at hand first (it may spare the memory check)
        known = scorer.known_first_bound(c) if cutoff < math.inf else None
        if known is not None and known > cutoff:
            continue
        if exact_counts:
            peak = scorer.peak_bytes(c)
            fits = peak <= gpu.memory_bytes
        else:  # settled by the orders of memory where they can (no peak then)
            fits, computed = scorer.fits(c)
            peak = math.inf if computed is None else computed
        if not fits:
            min_mem = min(min_mem, peak)
            continue
        bound = known if known is not None and not sync else scorer.bound_s(c, sync)
        if bound <= cutoff:
            scored.append((bound, tiebreak(c), c))
    scored.sort(key=lambda x: (x[0], x[1]))
    return Scored([(t, c) for t, _, c in scored], count, len(scored), min_mem)


@dataclass
class SearchResult:
    """The best plans found, with their estimates, and what the search saw."""

    ranked: list[tuple[Plan, Estimate]]
    candidates: int
    """Points enumerated after divisibility pruning."""
    fitting: int
    """Points that fit in memory."""
    min_memory_bytes: float = math.inf
    """The smallest per-GPU peak of any point (when nothing fits)."""
    notes: list[str] = field(default_factory=list)
    evaluated: int = 0
    """Candidates estimated exactly (the rest were ruled out by their lower bound)."""


def search_homogeneous(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    top_k: int = 5,
    params: CostParams | None = None,
    space: SearchSpace | None = None,
    flash_attention: bool = True,
    memo: SearchMemo | None = None,
    progress: ProgressHook | None = None,
    weight: Callable[[Plan], float] | None = None,
    weight_floor: float = 1.0,
    cutoff: float = math.inf,
    exact_counts: bool = True,
) -> SearchResult:
    """Returns the top-k plans for a cluster of one GPU type by estimate(), best first,
    deterministically.

    Candidates are visited in order of a proven lower bound of their estimate() time and
    estimated exactly until the bound reaches the k-th best time found: no candidate that
    could rank in the top k is skipped. The bound comes in three steps: every candidate's
    without its gradient reduction (``Scorer.bound_s``, no data-parallel layout needed),
    raised to the whole bound when the candidate comes first in the order, then, when it
    comes first again, to its pipeline's replay on the same lower bounds
    (``Scorer.replay_bound_s``, one replay); only then is it estimated if it still comes
    first. ``progress`` is told after every estimate
    (candidates estimated, of the fitting ones at most, and the best time so far).

    ``weight``: rank by the iteration time x ``weight(plan)`` instead (a spot run's
    slowdown, which its checkpoint sets), a factor that must depend only on the plan's
    placement of layers on devices: its degrees, its chunks (interleaving, lightened
    stages), not its micro-batch, recomputation or ZeRO stage; ``weight_floor``: at most
    any plan's weight. The weight is computed once per placement, when one of its
    candidates first comes first in the order; a candidate of infinite weight (a run that
    never finishes) is never estimated.

    ``cutoff``: plans ranking above it (iteration time, x the weight) are not wanted: none
    is returned, and the visit stops once the bound passes it, so a search may return
    fewer plans, or none (``provision``: the front found so far dominates every plan of a
    configuration slower than its cutoff). ``exact_counts`` False: ``score_candidates``
    skips degrees whose state alone overflows memory (the counts read only the rest)."""
    params = params or default_params()
    space = space or SearchSpace()
    scorer = Scorer(model, cluster, precision, global_batch, params, flash_attention,
                     memo or SearchMemo(), space)  # fmt: skip
    floor = weight_floor if weight is not None else 1.0
    sc = score_candidates(model, cluster, global_batch, precision, params, space,
                          flash_attention, scorer=scorer, sync=False,
                          exact_counts=exact_counts,
                          cutoff=cutoff / floor if floor > 0 else math.inf)  # fmt: skip
    result = SearchResult([], sc.candidates, sc.fitting, sc.min_memory_bytes)
    # (lower bound, tie-break, refinement, index): sorted by the cheap bound, hence a heap;
    # refinement 0: the first bound, 1: the whole bound, 2: its pipeline replayed
    heap = [(b * floor, tiebreak(c), 0, i) for i, (b, c) in enumerate(sc.ranked)]
    weights: dict[tuple[object, ...], float] = {}
    ranked: list[tuple[float, tuple[object, ...], Plan, Estimate]] = []
    evaluated = 0
    while heap:
        bound, tb, refined, i = heapq.heappop(heap)
        if bound > cutoff or (len(ranked) >= top_k and bound > ranked[top_k - 1][0]):
            break
        c = sc.ranked[i][1]
        w = 1.0
        if weight is not None:
            v = c.virtual_stages if c.schedule == "Interleaved1F1B" else 1
            key = (c.tp, c.pp, c.dp, v, c.lightened)
            if key not in weights:
                weights[key] = weight(scorer.knob_plan(c))
            w = weights[key]
            if not math.isfinite(w):
                continue
        if refined == 0:
            heapq.heappush(heap, (scorer.bound_s(c) * w, tb, 1, i))
            continue
        if refined == 1:
            replayed = scorer.replay_bound_s(c)
            if replayed is not None and replayed * w > bound:
                heapq.heappush(heap, (replayed * w, tb, 2, i))
                continue
        # the candidate's plan on its layout's pipelines, whose sync layout is known
        plan = scorer.knob_plan(c)
        est = estimate(plan, model, cluster, params, validate=False,
                       layout=scorer.layout(c).sync)  # fmt: skip
        evaluated += 1
        if est.fits and est.iteration_time_s * w <= cutoff:
            ranked.append((est.iteration_time_s * w, tb, plan, est))
            ranked.sort(key=lambda x: (x[0], x[1]))
        if progress is not None:
            progress(SearchProgress(evaluated, len(sc.ranked), ranked[0][0] if ranked else None))
    result.ranked = [(plan, est) for _, _, plan, est in ranked[:top_k]]
    result.evaluated = evaluated
    return result

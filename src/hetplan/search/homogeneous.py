"""Homogeneous 3D search: enumerate degrees and knobs, prune by divisibility and memory,
rank by estimate() itself, visiting candidates in order of a proven lower bound of it.

The parts: ``homogeneous_candidates`` (the space, its points and their plans) and
``homogeneous_scoring`` (memory and the lower bound of each point); this module runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams, default_params
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
from hetplan.search.homogeneous_scoring import Scored, Scorer, SearchMemo, score_candidates
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
) -> SearchResult:
    """Returns the top-k plans for a cluster of one GPU type by estimate(), best first,
    deterministically.

    Candidates are visited in order of a proven lower bound of their estimate() time and
    estimated exactly until the bound reaches the k-th best time found: no candidate that
    could rank in the top k is skipped. ``progress`` is told after every estimate
    (candidates estimated, of the fitting ones at most, and the best time so far)."""
    params = params or default_params()
    space = space or SearchSpace()
    scorer = Scorer(model, cluster, precision, global_batch, params, flash_attention,
                     memo or SearchMemo(), space)  # fmt: skip
    sc = score_candidates(model, cluster, global_batch, precision, params, space,
                          flash_attention, scorer=scorer)  # fmt: skip
    result = SearchResult([], sc.candidates, sc.fitting, sc.min_memory_bytes)
    ranked: list[tuple[float, tuple[object, ...], Plan, Estimate]] = []
    evaluated = 0
    for bound, c in sc.ranked:
        if len(ranked) >= top_k and bound > ranked[top_k - 1][0]:
            break
        # the candidate's plan on its layout's pipelines, whose sync layout is known
        plan = scorer.knob_plan(c)
        est = estimate(plan, model, cluster, params, validate=False,
                       layout=scorer.layout(c).sync)  # fmt: skip
        evaluated += 1
        if est.fits:
            ranked.append((est.iteration_time_s, tiebreak(c), plan, est))
            ranked.sort(key=lambda x: (x[0], x[1]))
        if progress is not None:
            progress(SearchProgress(evaluated, len(sc.ranked), ranked[0][0] if ranked else None))
    result.ranked = [(plan, est) for _, _, plan, est in ranked[:top_k]]
    result.evaluated = evaluated
    return result

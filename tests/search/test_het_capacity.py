"""The generation's knob-setting bound reads two helpers: the capacity bound (the least time
in which groups of given per-layer times run the layers and the fixed costs) and the
pipeline shapes it weighs over a band of pipeline counts. Each against an independent
brute force: the capacity bound against every subset of the groups, bisected on the work
they can do in time T; the shapes by listing every count of the band."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from hetplan.search.het_generation import Rates, capacity_bound_s, pipeline_shapes_of


def _room(taus: list[float] | tuple[float, ...], fixed_s: float, t: float) -> float:
    """Layer-micro-batches groups of per-layer times ``taus`` run in time ``t`` carrying
    ``fixed_s`` of fixed costs between them: the costs fill the slowest groups first (each
    takes at most ``t``: where a second of fixed cost takes the least layer work), every
    group runs layers in what is left; -inf where the costs do not fit."""
    left, room = fixed_s, 0.0
    for tau in sorted(taus, reverse=True):
        take = min(left, t)
        left -= take
        room += (t - take) / tau
    return room if left <= 1e-12 * max(fixed_s, 1.0) else -math.inf


def _least_time(taus: list[float], work: float, fixed_s: float, most: int) -> float:
    """The least time in which some ``most`` or fewer of the groups (those a pipeline holds:
    they run its layers and carry its fixed costs) run ``work``: every subset, bisected."""
    best = math.inf
    for k in range(1, min(most, len(taus)) + 1):
        for part in itertools.combinations(taus, k):
            lo, hi = 0.0, 1e6
            for _ in range(80):
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if _room(part, fixed_s, mid) >= work else (mid, hi)
            best = min(best, hi)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_capacity_bound_is_below_the_least_time_and_tight_with_every_group(seed):
    """Hand cases first: two groups of 1 s and 2 s a layer, 3 layers, no fixed costs: they
    run 1.5 layers a second, so 2 s; one group of 1 s a layer, 1 layer and 1 s of fixed
    costs: 2 s. Then random groups against every subset of at most ``most`` of them: the
    bound is never above the least time, and equals it (to 1e-6) when every group may be
    used."""
    assert capacity_bound_s(Rates.of([1.0, 2.0]), 3.0, 0.0, 2) == pytest.approx(2.0)
    assert capacity_bound_s(Rates.of([1.0]), 1.0, 1.0, 1) == pytest.approx(2.0)
    rng = random.Random(seed)
    tight = 0
    for _ in range(60):
        n = rng.randint(1, 6)
        taus = sorted(rng.uniform(0.01, 1.0) * rng.choice([1, 10]) for _ in range(n))
        work = rng.uniform(1.0, 200.0)
        fixed = rng.choice([0.0, rng.uniform(0.0, 5.0), rng.uniform(0.0, 50.0)])
        most = rng.randint(1, n + 1)
        bound = capacity_bound_s(Rates.of(taus), work, fixed, most)
        least = _least_time(taus, work, fixed, most)
        assert bound <= least * (1 + 1e-6)
        if most >= n:
            assert bound == pytest.approx(least, rel=1e-6)
            tight += 1
    assert tight > 10


def test_pipeline_shapes_are_every_count_once():
    """Every (micro-batches, stages) the band's pipeline counts give, each once."""
    rng = random.Random(7)
    for _ in range(3000):
        total, groups, depth = rng.randint(1, 2000), rng.randint(1, 400), rng.randint(1, 40)
        lo = rng.randint(1, 500)
        hi = lo + rng.choice([0, 1, 7, 60, 500])
        want = {(-(-total // d), max(1, min(depth, groups - d + 1))) for d in range(lo, hi + 1)}
        got = pipeline_shapes_of(total, groups, depth, lo, hi)
        assert set(got) == want
        assert len(got) == len(want)
    # by hand: 8 micro-batches over 3 to 5 pipelines of 4 groups, 2 stages at most
    assert pipeline_shapes_of(8, 4, 2, 3, 5) == [(3, 2), (2, 1)]

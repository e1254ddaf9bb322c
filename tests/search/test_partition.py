"""Partition DP, uniform frontier and batch split against brute force on random costs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.search.partition import (
    best_on_frontier,
    partition_layers,
    split_batch,
    split_time_s,
    uniform_frontier,
)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _brute(layer_s, fixed_s, max_layers, m):
    p, n = layer_s.shape
    best = None
    for counts in _compositions(n, p):
        if any(c > cap for c, cap in zip(counts, max_layers, strict=True)):
            continue
        start, stage = 0, []
        for j, c in enumerate(counts):
            stage.append(fixed_s[j] + layer_s[j, start : start + c].sum())
            start += c
        value = sum(stage) + (m - 1) * max(stage)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_layers_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    p = int(rng.integers(1, 5))
    n = int(rng.integers(p, 10))
    layer_s = rng.uniform(0.1, 2.0, (p, n)) * rng.uniform(0.5, 3.0, (p, 1))
    fixed_s = rng.uniform(0.0, 1.0, p)
    max_layers = rng.integers(1, n + 1, p)
    m = int(rng.integers(1, 12))
    want = _brute(layer_s, fixed_s, max_layers, m)
    got = partition_layers(layer_s, fixed_s, max_layers, m)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert sum(got.layers) == n
        assert all(1 <= c <= cap for c, cap in zip(got.layers, max_layers, strict=True))
        assert got.time_s(m) == pytest.approx(want, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 5),
    st.integers(1, 12),
    st.integers(1, 30),
)
def test_uniform_frontier_matches_general_dp(seed, p, n, m):
    rng = np.random.default_rng(seed)
    tau = rng.uniform(0.2, 3.0, p)
    fixed = rng.uniform(0.0, 2.0, p)
    caps = rng.integers(1, n + 1, p)
    frontier = uniform_frontier(tau, fixed, caps, n)
    general = partition_layers(np.repeat(tau[:, None], n, axis=1), fixed, caps, m)
    if general is None:
        assert frontier == []
        return
    best = best_on_frontier(frontier, m)
    assert best.time_s(m) == pytest.approx(general.time_s(m), rel=1e-9)
    assert sum(best.layers) == n
    bott = [q.bottleneck_s for q in frontier]
    fills = [q.fill_s for q in frontier]
    assert bott == sorted(bott) and fills == sorted(fills, reverse=True)


@pytest.mark.parametrize("seed", range(30))
def test_split_batch_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 4))
    total = int(rng.integers(d, 10))
    fill = list(rng.uniform(1.0, 5.0, d))
    bott = list(rng.uniform(0.1, 2.0, d))
    got = split_batch(fill, bott, total)
    assert got is not None and sum(got) == total and min(got) >= 1
    want = min(
        split_time_s(fill, bott, list(c))
        for c in itertools.product(range(1, total + 1), repeat=d)
        if sum(c) == total
    )
    assert split_time_s(fill, bott, got) == pytest.approx(want)


@pytest.mark.parametrize("seed", range(20))
def test_split_batch_is_optimal_on_large_batches(seed):
    """Many micro-batches per pipeline (where ``split_batch`` hands most units out at once
    below a level): its slowest pipeline equals the least time T under which the
    pipelines hold every micro-batch, found over every pipeline's possible times (each
    holds ``floor((T - fill) / bottleneck) + 1`` micro-batches within T). Fills and
    bottlenecks from a few values, so times tie."""
    rng = np.random.default_rng(100 + seed)
    d = int(rng.integers(2, 13))
    total = int(rng.integers(4 * d, 600))
    fill = [float(x) for x in rng.choice([0.5, 1.0, 1.5, 2.0, 3.25], d)]
    bott = [float(x) for x in rng.choice([0.125, 0.25, 0.5, 0.75], d)]
    got = split_batch(fill, bott, total)
    assert got is not None and sum(got) == total and min(got) >= 1
    times = sorted({f + k * b for f, b in zip(fill, bott, strict=True) for k in range(total)})
    want = next(
        t for t in times
        if sum(int((t - f) / b) + 1 for f, b in zip(fill, bott, strict=True) if f <= t) >= total
    )  # fmt: skip
    assert split_time_s(fill, bott, got) == want


def test_split_batch_needs_one_unit_per_pipeline():
    assert split_batch([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 2) is None


def test_faster_stage_gets_more_layers():
    part = best_on_frontier(
        uniform_frontier(np.array([1.0, 3.0]), np.zeros(2), np.array([9, 9]), 8), 16
    )
    assert part.layers == (6, 2)


def test_memory_caps_respected_or_none():
    assert uniform_frontier(np.ones(2), np.zeros(2), np.array([3, 3]), 8) == []
    assert partition_layers(np.ones((2, 8)), np.zeros(2), np.array([3, 3]), 4) is None

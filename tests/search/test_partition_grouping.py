"""The pipeline-selection MILP against brute force over every multiset of pipelines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.search.grouping import (
    MilpMemo,
    device_classes,
    identical_pipelines,
    select_pipelines,
)
from hetplan.search.het_variants import pareto_rows
from hetplan.search.partition import split_batch, split_time_s


def _brute(counts, fill, bott, avail, total, bounds):
    v = len(fill)
    best = None
    for d in range(bounds[0], min(bounds[1], total) + 1):
        for combo in itertools.combinations_with_replacement(range(v), d):
            used = counts[list(combo)].sum(axis=0)
            if np.any(used > avail):
                continue
            f = [fill[i] for i in combo]
            b = [bott[i] for i in combo]
            split = split_batch(f, b, total)
            assert split is not None
            t = split_time_s(f, b, split)
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_select_pipelines_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    v = int(rng.integers(1, 7))
    counts = rng.integers(0, 3, (v, k))
    counts[counts.sum(axis=1) == 0, 0] = 1
    fill = rng.uniform(1.0, 10.0, v)
    bott = rng.uniform(0.1, 2.0, v)
    avail = rng.integers(1, 5, k)
    total = int(rng.integers(1, 12))
    lo = int(rng.integers(1, 3))
    bounds = (lo, int(rng.integers(lo, 6)))
    want = _brute(counts, fill, bott, avail, total, bounds)
    got = select_pipelines(counts, fill, bott, avail, total, bounds)
    if want is None:
        assert got is None
        return
    assert got is not None
    used = counts[list(got.variants)].sum(axis=0)
    assert np.all(used <= avail)
    assert sum(got.micro_batches) == total and min(got.micro_batches) >= 1
    assert bounds[0] <= len(got.variants) <= bounds[1]
    assert got.time_s <= want * (1 + 2e-4)


def _instance(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    v = int(rng.integers(1, 9))
    counts = rng.integers(0, 3, (v, k))
    counts[counts.sum(axis=1) == 0, 0] = 1
    fill = rng.uniform(1.0, 10.0, v)
    bott = rng.uniform(0.1, 2.0, v)
    avail = rng.integers(1, 5, k)
    total = int(rng.integers(1, 12))
    return counts, fill, bott, avail, total, (1, int(rng.integers(1, 6)))


@pytest.mark.parametrize("seed", range(30))
def test_cutoff_prunes_exactly(seed):
    counts, fill, bott, avail, total, bounds = _instance(seed)
    want = _brute(counts, fill, bott, avail, total, bounds)
    if want is None:
        return
    assert select_pipelines(counts, fill, bott, avail, total, bounds, cutoff_s=want * 0.999) is None
    got = select_pipelines(counts, fill, bott, avail, total, bounds, cutoff_s=want * 1.01)
    assert got is not None and want <= got.time_s <= want * (1 + 2e-4)


def test_memo_answers_repeated_instances_without_solving():
    solved = 0
    for seed in range(20):
        counts, fill, bott, avail, total, _ = _instance(seed)
        memo = MilpMemo()
        first = select_pipelines(counts, fill, bott, avail, total, (1, 5), memo=memo)
        answered = (memo.solves, memo.rounded, memo.proofs)
        again = select_pipelines(counts, fill, bott, avail, total, (1, 5), memo=memo)
        # the second run asks neither HiGHS nor packing_bound: every answer is remembered
        assert (memo.solves, memo.rounded, memo.proofs) == answered
        assert memo.hits >= sum(answered)
        assert again == first
        solved += sum(answered) > 0
    assert solved >= 10


@pytest.mark.parametrize("seed", range(20))
def test_pareto_rows_match_pairwise_dominance(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 300)), int(rng.integers(1, 4))
    c = rng.integers(0, 4, (n, k))
    f = rng.integers(1, 20, n).astype(float)  # small integers: many ties and duplicates
    b = rng.integers(1, 10, n).astype(float)
    kept = set(pareto_rows(c, f, b).tolist())
    for v in range(n):
        beaten = any(
            np.all(c[u] <= c[v]) and f[u] <= f[v] and b[u] <= b[v]
            and (np.any(c[u] < c[v]) or f[u] < f[v] or b[u] < b[v] or u < v)
            for u in range(n) if u != v
        )  # fmt: skip
        assert (v in kept) == (not beaten)


def test_device_classes_split_by_links_and_groups_stay_in_nodes():
    cluster = parse_inline_cluster("A100-80GB:2x4,T4:1x2")
    classes = device_classes(cluster)
    assert [c.key for c in classes] == ["A100-80GB", "T4"]
    groups = classes[0].groups(2)
    assert len(groups) == 4
    assert all(len({d.rpartition(":")[0] for d in g}) == 1 for g in groups)
    # the count the searches read without listing the groups: 2 nodes x 4 GPUs, 1 x 2
    by_hand = {(0, 1): 8, (0, 2): 4, (0, 4): 2, (0, 8): 0, (1, 1): 2, (1, 2): 1, (1, 4): 0}
    for (c, tp), n in by_hand.items():
        assert classes[c].group_count(tp) == n == len(classes[c].groups(tp))


def test_identical_pipelines_by_hand():
    # variant 0: one group of class 0, fill 1 s, 1 s per micro-batch; variant 1: one group
    # of class 1, fill 2 s, 0.5 s; variant 2: a group of each, fill 0.5 s, 0.25 s.
    # 2 and 4 groups, 8 micro-batches. Copies of 0: 2, 4 micro-batches each, 1 + 3 = 4 s;
    # of 1: 4, 2 each, 2 + 0.5 = 2.5 s; of 2: 2, 4 each, 0.5 + 3 * 0.25 = 1.25 s
    counts = np.array([[1, 0], [0, 1], [1, 1]])
    fill, bott = np.array([1.0, 2.0, 0.5]), np.array([1.0, 0.5, 0.25])
    avail = np.array([2, 4])
    sel = identical_pipelines(counts, fill, bott, avail, 8, (1, 8))
    assert sel is not None
    assert sel.variants == (2, 2) and sel.micro_batches == (4, 4)
    assert sel.time_s == pytest.approx(1.25)
    # at least 3 pipelines: only variant 1 can be copied 3 times or more
    sel = identical_pipelines(counts, fill, bott, avail, 8, (3, 8))
    assert sel is not None and sel.variants == (1, 1, 1, 1)
    assert sel.time_s == pytest.approx(2.5)
    # at most 3: variant 1 three times, 3 + 3 + 2 micro-batches, 2 + 2 * 0.5 = 3 s
    sel = identical_pipelines(counts, fill, bott, avail, 8, (3, 3))
    assert sel is not None and sorted(sel.micro_batches) == [2, 3, 3]
    assert sel.time_s == pytest.approx(3.0)
    assert identical_pipelines(counts, fill, bott, avail, 8, (5, 8)) is None
    # interleaved pipelines run a multiple of their stages: variant 1 in steps of 3 cannot
    # split 8 micro-batches, and only it fits 3 times
    steps = np.array([2, 3, 4])
    assert identical_pipelines(counts, fill, bott, avail, 8, (3, 8), steps) is None
    # steps of 2, 3, 8: variant 0 twice, 4 each: 1 + 3 = 4 s; variant 2 once (one step of
    # 8 cannot be shared): 0.5 + 7 * 0.25 = 2.25 s
    sel = identical_pipelines(counts, fill, bott, avail, 8, (1, 8), np.array([2, 3, 8]))
    assert sel is not None and sel.variants == (2,) and sel.micro_batches == (8,)
    assert sel.time_s == pytest.approx(2.25)
    # steps of 2, 3, 4: variant 2 twice, 4 each: 1.25 s
    sel = identical_pipelines(counts, fill, bott, avail, 8, (1, 8), steps)
    assert sel is not None and sel.variants == (2, 2) and sel.micro_batches == (4, 4)

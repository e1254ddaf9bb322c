"""The pipeline-selection MILP against brute force over every multiset of pipelines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.search.grouping import device_classes, select_pipelines
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


def test_device_classes_split_by_links_and_groups_stay_in_nodes():
    cluster = parse_inline_cluster("A100-80GB:2x4,T4:1x2")
    classes = device_classes(cluster)
    assert [c.key for c in classes] == ["A100-80GB", "T4"]
    groups = classes[0].groups(2)
    assert len(groups) == 4
    assert all(len({d.rpartition(":")[0] for d in g}) == 1 for g in groups)

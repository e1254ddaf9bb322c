"""The selection MILP's quick answers (packing_bound.py) against brute force and an
independent LP solver, the counted table and the identical-pipeline selection against
brute force, and the batched layer frontiers against one row at a time."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linprog

from hetplan.search.packing_bound import (
    counted_selection,
    lp_relaxation,
    settle,
    uniform_selection,
    units_bound,
)
from hetplan.search.partition import uniform_frontier, uniform_frontiers


def _instance(seed: int):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    n = int(rng.integers(1, 7))
    a = rng.integers(0, 3, size=(k, n)).astype(float)
    a[rng.integers(0, k, size=n), np.arange(n)] += 1  # every column uses some group
    cap = rng.integers(1, 12, size=n).astype(np.int64)
    avail = rng.integers(1, 6, size=k).astype(np.int64)
    lo = int(rng.integers(1, 3))
    hi = lo + int(rng.integers(0, 4))
    return a, cap, avail, lo, hi


def _upper(a, avail, hi):
    return np.minimum(np.min(np.where(a > 0, avail[:, None] // np.maximum(a, 1), np.inf), 0), hi)


def _brute_max(a, cap, avail, lo, hi, upper):
    """The most micro-batches of any integer selection (-1 when none is allowed)."""
    best = -1
    for x in itertools.product(*(range(int(u) + 1) for u in upper)):
        xv = np.array(x)
        if lo <= xv.sum() <= hi and np.all(a @ xv <= avail):
            best = max(best, int(cap @ xv))
    return best


@pytest.mark.parametrize("seed", range(150))
def test_bound_holds_and_answers_match_brute_force(seed):
    a, cap, avail, lo, hi = _instance(seed)
    upper = _upper(a, avail, hi)
    _, duals = lp_relaxation(a, cap, avail, hi, upper)
    best = _brute_max(a, cap, avail, lo, hi, upper)
    bound = units_bound(a, cap, avail, lo, hi, upper, duals)
    assert bound >= best - 1e-9 or best == -1  # -1: no selection at all
    for need in range(1, int(cap.sum() * hi) + 2):
        got = settle(a, cap, avail, (lo, hi), need, want_point=True)
        if got is False:
            assert best < need, (need, best)
        elif got is not None:
            x = np.asarray(got)
            assert lo <= x.sum() <= hi and np.all(a @ x <= avail) and cap @ x >= need
            assert np.all(x >= 0) and np.all(x <= upper)


def _brute_fewest(a, cap, avail, lo, hi, upper, need, same_column=False):
    """The fewest pipelines of any integer selection running ``need`` micro-batches (None
    when none does); ``same_column``: only selections of one column."""
    best = None
    for x in itertools.product(*(range(int(u) + 1) for u in upper)):
        xv = np.array(x)
        if same_column and np.count_nonzero(xv) > 1:
            continue
        if lo <= xv.sum() <= hi and np.all(a @ xv <= avail) and cap @ xv >= need:
            best = int(xv.sum()) if best is None else min(best, int(xv.sum()))
    return best


@pytest.mark.parametrize("seed", range(80))
def test_counted_selection_is_exact_with_fewest_pipelines(seed):
    a, cap, avail, lo, hi = _instance(seed)
    upper = _upper(a, avail, hi)
    for need in range(1, int(cap.sum() * hi) + 2, 3):
        want = _brute_fewest(a, cap, avail, lo, hi, upper, need)
        got = counted_selection(a, cap, avail, lo, hi, need)
        if want is None:
            assert got is False, (need, got)
            continue
        assert isinstance(got, np.ndarray), (need, got)
        assert lo <= got.sum() <= hi and np.all(a @ got <= avail) and cap @ got >= need
        assert int(got.sum()) == want


@pytest.mark.parametrize("seed", range(80))
def test_uniform_selection_is_the_fewest_identical_pipelines(seed):
    a, cap, avail, lo, hi = _instance(seed)
    upper = _upper(a, avail, hi)
    for need in range(1, int(cap.max() * hi) + 2, 2):
        want = _brute_fewest(a, cap, avail, lo, hi, upper, need, same_column=True)
        got = uniform_selection(cap, lo, hi, upper, need)
        if want is None:
            assert got is None
            continue
        assert got is not None and np.count_nonzero(got) == 1
        assert lo <= got.sum() <= hi and np.all(a @ got <= avail) and cap @ got >= need
        assert int(got.sum()) == want


def test_counted_selection_by_hand():
    # classes of 4 and 4 groups; column 0 takes 2+0 groups and runs 5, column 1 takes 1+2
    # and runs 4 (test_hand_instance). With two pipelines at most: 2x col 0 runs 10,
    # col 0 + col 1 runs 9, 2x col 1 runs 8; so 10 needs 2 pipelines and 11 is impossible.
    # With three: 1x col 0 + 2x col 1 (A 4, V 4) runs 13, the most.
    a = np.array([[2.0, 1.0], [0.0, 2.0]])
    cap = np.array([5, 4])
    avail = np.array([4, 4])
    assert list(counted_selection(a, cap, avail, 1, 2, 5)) == [1, 0]
    assert list(counted_selection(a, cap, avail, 1, 2, 10)) == [2, 0]
    assert counted_selection(a, cap, avail, 1, 2, 11) is False
    assert list(counted_selection(a, cap, avail, 1, 3, 13)) == [1, 2]
    assert counted_selection(a, cap, avail, 1, 3, 14) is False


@pytest.mark.parametrize("seed", range(60))
def test_lp_optimum_matches_highs(seed):
    a, cap, avail, _, hi = _instance(seed)
    upper = _upper(a, avail, hi)
    x, duals = lp_relaxation(a, cap, avail, hi, upper)
    res = linprog(
        -cap.astype(float),
        A_ub=np.vstack([a, np.ones((1, a.shape[1]))]),
        b_ub=np.append(avail, hi).astype(float),
        bounds=list(zip(np.zeros(len(upper)), upper, strict=True)),
        method="highs",
    )
    assert res.status == 0
    assert cap @ x == pytest.approx(-res.fun, rel=1e-9, abs=1e-9)
    assert np.all(a @ x <= avail + 1e-9) and x.sum() <= hi + 1e-9
    # the duals of the optimum prove the LP value: the bound is tight without ``lo``
    assert units_bound(a, cap, avail, 0, hi, upper, duals) == pytest.approx(-res.fun, abs=1e-7)


@pytest.mark.parametrize("seed", range(60))
def test_lp_with_fewest_pipelines_matches_highs(seed):
    a, cap, avail, lo, hi = _instance(seed)
    upper = _upper(a, avail, hi)
    x, duals = lp_relaxation(a, cap, avail, hi, upper, lo)
    n = a.shape[1]
    res = linprog(
        -cap.astype(float),
        A_ub=np.vstack([a, np.ones((1, n)), -np.ones((1, n))]),
        b_ub=np.concatenate([avail, [hi, -lo]]).astype(float),
        bounds=list(zip(np.zeros(n), upper, strict=True)),
        method="highs",
    )
    bound = units_bound(a, cap, avail, lo, hi, upper, duals)
    if res.status == 2:  # no fractional point has lo pipelines: nor an integer one
        assert _brute_max(a, cap, avail, lo, hi, upper) == -1
        return
    assert res.status == 0
    assert cap @ x == pytest.approx(-res.fun, rel=1e-9, abs=1e-9)
    assert lo - 1e-9 <= x.sum() <= hi + 1e-9
    assert bound == pytest.approx(-res.fun, abs=1e-7)  # the duals prove the LP value


def test_hand_instance():
    # two classes of 4 groups; a pipeline of column 0 takes 2+0 groups and runs 5
    # micro-batches, column 1 takes 1+2 and runs 4. Integer selections of at most 3
    # pipelines: 2x col 0 (A 4) runs 10, 1x col 0 + 2x col 1 (A 4, V 4) runs 13, 2x col 1
    # runs 8; the LP relaxation's optimum is that same point, so 14 is proven impossible
    a = np.array([[2.0, 1.0], [0.0, 2.0]])
    cap = np.array([5, 4])
    avail = np.array([4, 4])
    assert settle(a, cap, avail, (1, 3), 14) is False
    x = settle(a, cap, avail, (1, 3), 13, want_point=True)
    assert isinstance(x, np.ndarray) and list(x) == [1, 2]
    assert settle(a, cap, avail, (1, 3), 13) is None  # no point asked: the MILP decides


@pytest.mark.parametrize("seed", range(20))
def test_batched_frontiers_equal_row_by_row(seed):
    rng = np.random.default_rng(seed)
    p, layers, rows = int(rng.integers(1, 6)), int(rng.integers(4, 24)), 9
    tau = rng.uniform(0.5, 3.0, size=(rows, p)).round(2)
    fixed = rng.uniform(0.0, 4.0, size=(rows, p)).round(2)
    caps = rng.integers(0, layers + 3, size=(rows, p))
    together = uniform_frontiers(tau, fixed, caps, layers)
    alone = [uniform_frontier(tau[r], fixed[r], caps[r], layers) for r in range(rows)]
    assert together == alone
    assert any(together) or p > layers  # the case is not vacuous

"""Cheap exact answers for the pipeline-selection MILP's feasibility question (grouping.py):
can pipelines ``x`` (integers, ``0 <= x <= upper``) with ``a @ x <= avail`` and
``lo <= sum(x) <= hi`` run ``cap @ x >= need`` micro-batches?

* *No*, proven: any ``y >= 0`` (one per class) and any ``t`` give, for every such x,
  ``cap @ x <= avail @ y + max(t lo, t hi) + sum_v upper_v max(0, cap_v - a_v @ y - t)``
  (weak LP duality, term by term). ``y`` and ``t`` come from the LP relaxation solved by a
  small bounded-variable simplex; the bound is then recomputed from that formula, so a
  simplex inaccuracy can only weaken it, never make it wrong. ``cap @ x`` is an integer.
* *Yes*, proven: identical pipelines of one column (the fewest that suffice); else the
  LP optimum rounded down (or one fractional column up), completed greedily; every point
  checked in integers.
* Either, exactly: a table over the groups left and the number of pipelines
  (``counted_selection``) where it is small (``DP_CELLS``); its point has the fewest
  pipelines.

"No" is the MILP's own answer; a "yes" point is as good an answer as HiGHS's (any point
that runs every micro-batch within the time asked). Anything else goes to HiGHS.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

MAX_PIVOTS = 200
SHORTFALL = 1e3
HINTS = 3
TOL = 1e-9
DP_CELLS = 32_000_000
"""The most (groups-left cell, column, pipeline count) steps ``counted_selection`` takes:
numpy does a column's cells at once, so 32 M steps of the 64-GPU three-type bench case
(17 x 17 x 33 cells, 70 columns, 31 counts: 20.7 M) take tens of milliseconds, against
0.3 s to import HiGHS for the MILP."""


def lp_relaxation(
    a: FloatArray,
    cap: NDArray[Any],
    avail: NDArray[Any],
    hi: float,
    upper: FloatArray,
    lo: float = 0.0,
) -> tuple[FloatArray, FloatArray]:
    """Returns (x, duals) of ``max cap @ x`` over ``a @ x <= avail``, ``lo <= sum(x) <=
    hi``, ``0 <= x <= upper`` (bounded-variable primal simplex from the all-slack basis,
    Dantzig's rule, Bland's after degenerate steps; ``sum(x) >= lo`` through a shortfall
    variable priced at ``-SHORTFALL`` per pipeline, so that the start is feasible); duals:
    one per class row, then the upper and the lower count rows. After ``MAX_PIVOTS``
    pivots it returns where it stands (any duals give a valid bound)."""
    k, n = a.shape
    m = k + 2
    full = np.zeros((m, n + m + 1))
    full[:k, :n] = a
    full[k : k + 2, :n] = 1.0
    full[:, n : n + m] = np.eye(m)  # slacks; the last: the shortfall, basic at ``lo``
    full[k + 1, n + m] = -1.0  # the surplus above ``lo``
    b = np.concatenate([avail, [hi, lo]]).astype(float)
    penalty = SHORTFALL * (1.0 + float(np.max(cap, initial=0)))
    cost = np.concatenate([cap.astype(float), np.zeros(m - 1), [-penalty, 0.0]])
    ub = np.concatenate([upper.astype(float), np.full(m + 1, np.inf)])
    basis = np.arange(n, n + m)
    inv = np.eye(m)  # the basis matrix's inverse, updated at each pivot
    at_upper = np.zeros(n + m + 1, dtype=bool)
    rhs = b.copy()  # b less the columns resting at their upper bound
    degenerate = 0
    pi = np.zeros(m)
    for _ in range(MAX_PIVOTS):
        xb = inv @ rhs
        pi = cost[basis] @ inv
        gain = cost - pi @ full
        gain[at_upper] *= -1.0
        gain[basis] = 0.0
        if degenerate > 2:  # Bland: the first improving index, against cycling
            cand = np.flatnonzero(gain > TOL)
            if cand.size == 0:
                break
            j = int(cand[0])
        else:
            j = int(np.argmax(gain))
            if gain[j] <= TOL:
                break
        col = inv @ full[:, j]
        delta = col if at_upper[j] else -col  # change of the basics per unit step
        room = np.full(m, np.inf)
        falls, rises = delta < -TOL, delta > TOL
        room[falls] = xb[falls] / -delta[falls]
        top = ub[basis]
        room[rises] = (top[rises] - xb[rises]) / delta[rises]
        r = int(np.argmin(room))
        theta = max(0.0, float(room[r]))
        if not np.isfinite(min(theta, ub[j])):  # unbounded: impossible with x boxed
            break
        if ub[j] <= theta:  # the entering variable reaches its other bound first
            rhs -= (1.0 if not at_upper[j] else -1.0) * ub[j] * full[:, j]
            at_upper[j] = not at_upper[j]
            degenerate = 0
            continue
        degenerate = degenerate + 1 if theta <= TOL else 0
        leaving = int(basis[r])
        if at_upper[j]:
            rhs += ub[j] * full[:, j]
            at_upper[j] = False
        if rises[r]:
            at_upper[leaving] = True
            rhs -= ub[leaving] * full[:, leaving]
        basis[r] = j
        piv = inv[r] / col[r]
        inv -= np.outer(col, piv)
        inv[r] = piv
    x = np.where(at_upper, ub, 0.0)
    x[basis] = inv @ rhs
    return np.clip(x[:n], 0.0, upper), pi


def units_bound(
    a: FloatArray,
    cap: IntArray,
    avail: IntArray,
    lo: int,
    hi: int,
    upper: FloatArray,
    duals: FloatArray,
) -> float:
    """Returns an upper bound of ``cap @ x`` over the selection's integer points from the
    duals of the class rows (negative ones taken as zero), the count rows' multiplier t
    chosen best for ``lo <= sum(x) <= hi``: the bound is convex piecewise linear in t,
    least at a breakpoint (0 or a reduced capacity), or unbounded below (no point at all)
    when even every column at its upper bound makes fewer than ``lo`` pipelines."""
    k = a.shape[0]
    if lo > float(upper.sum()):
        return -math.inf
    y = np.maximum(duals[:k], 0.0)
    red = cap.astype(float) - y @ a
    t = np.concatenate([[0.0], red])
    over = np.maximum(red[None, :] - t[:, None], 0.0) @ upper
    count = np.maximum(t * lo, t * hi)
    return float(avail.astype(float) @ y + np.min(count + over))


def _complete(
    x: IntArray, ai: IntArray, avail: IntArray, hi: int, upper: IntArray, order: IntArray
) -> IntArray:
    """Returns ``x`` with pipelines added, column by column in ``order``, as many as still
    fit in the groups left, the column's upper bound and ``hi`` pipelines."""
    x = x.copy()
    left = avail - ai @ x
    count = int(x.sum())
    for v in order:
        if count >= hi:
            break
        col = ai[:, v]
        most = int(upper[v]) - int(x[v])
        if most <= 0:
            continue
        fit = int(np.min(np.where(col > 0, left // np.maximum(col, 1), most)))
        add = min(most, fit, hi - count)
        if add > 0:
            x[v] += add
            left -= add * col
            count += add
    return x


def rounded_selection(
    a: FloatArray,
    cap: IntArray,
    avail: IntArray,
    lo: int,
    hi: int,
    upper: FloatArray,
    x_lp: FloatArray,
    need: int,
    duals: FloatArray | None = None,
) -> IntArray | None:
    """Returns integer pipelines per column meeting every constraint and ``need``, or None
    when no try reaches it (which proves nothing). Tries, in turn: the LP optimum rounded
    down, then that with one fractional column rounded up (each fractional column in
    turn), each completed with the columns that still fit by largest capacity, then (with
    ``duals``) by largest capacity less the dual price of the groups they use; every
    candidate is checked in integers."""
    ai = np.rint(a).astype(np.int64)
    avail = avail.astype(np.int64)
    top = upper.astype(np.int64)
    base = np.minimum(np.floor(x_lp + 1e-9).astype(np.int64), top)
    if np.any(ai @ base > avail) or int(base.sum()) > hi:
        base = np.zeros_like(base)
    starts = [base]
    for v in np.flatnonzero(x_lp - base > 1e-9):
        up = base.copy()
        up[v] += 1
        if up[v] <= top[v] and int(up.sum()) <= hi and np.all(ai @ up <= avail):
            starts.append(up)
    orders = [np.argsort(-cap, kind="stable")]
    if duals is not None:
        price = np.maximum(duals[: a.shape[0]], 0.0) @ a
        orders.append(np.argsort(-(cap - price), kind="stable"))
    for start in starts:
        for order in orders:
            x = _complete(start, ai, avail, hi, top, order)
            count = int(x.sum())
            if lo <= count <= hi and np.all(ai @ x <= avail) and int(cap @ x) >= need:
                return x
    return None


def uniform_selection(
    cap: IntArray, lo: int, hi: int, upper: FloatArray, need: int
) -> IntArray | None:
    """Returns the selection of identical pipelines (one column) that runs ``need``
    micro-batches with the fewest pipelines (the largest capacity among those), or None
    when no single column can. ``upper[v]``: the most pipelines of column v the groups
    hold (each class's groups over the groups a pipeline takes)."""
    n = np.maximum(-(-need // np.maximum(cap, 1)), lo)
    ok = (cap > 0) & (n <= np.minimum(upper, hi))
    if not np.any(ok):
        return None
    cols = np.flatnonzero(ok)
    v = int(cols[np.lexsort((-cap[cols], n[cols]))[0]])
    x = np.zeros(cap.size, dtype=np.int64)
    x[v] = n[v]
    return x


def counted_selection(
    a: FloatArray, cap: IntArray, avail: IntArray, lo: int, hi: int, need: int
) -> bool | IntArray | None:
    """Returns, by dynamic programming over the groups left, a selection with the fewest
    pipelines (from ``lo``) that runs ``need`` micro-batches, or False when none does
    (every selection of up to ``hi`` pipelines was covered); None when the table would
    exceed ``DP_CELLS`` steps (unknown).

    ``best[j][r]``: the most micro-batches of exactly j pipelines using at most ``r``
    groups of each class; ``best[j + 1][r] = max_v best[j][r - a_v] + cap_v``. Removing m
    pipelines of a selection leaves one of j, so no selection of j + m pipelines runs
    more than ``best[j][avail] + m * max(cap)``: the table stops when that falls short."""
    ai = np.rint(a).astype(np.int64)
    k, n = ai.shape
    cols = [v for v in range(n) if np.all(ai[:, v] <= avail) and cap[v] > 0]
    shape = tuple(int(x) + 1 for x in avail)
    if math.prod(shape) * max(len(cols), 1) * hi > DP_CELLS:
        return None
    if lo <= 0 and need <= 0:
        return np.zeros(n, dtype=np.int64)
    none = np.iinfo(np.int64).min // 4
    full = tuple(int(x) for x in avail)
    most = int(cap.max(initial=0))
    best = [np.zeros(shape, dtype=np.int64)]
    for j in range(1, hi + 1):
        prev, nxt = best[-1], np.full(shape, none, dtype=np.int64)
        for v in cols:
            dst = tuple(slice(int(ai[i, v]), None) for i in range(k))
            src = tuple(slice(0, shape[i] - int(ai[i, v])) for i in range(k))
            np.maximum(nxt[dst], prev[src] + int(cap[v]), out=nxt[dst])
        best.append(nxt)
        top = int(nxt[full])
        if j >= lo and top >= need:
            x = np.zeros(n, dtype=np.int64)
            r = np.array(full, dtype=np.int64)
            for i in range(j, 0, -1):  # back through the table: which pipeline came last
                for v in cols:
                    left = r - ai[:, v]
                    if np.all(left >= 0) and best[i - 1][tuple(left)] + cap[v] == best[i][tuple(r)]:
                        x[v] += 1
                        r = left
                        break
            return x
        if top < 0 or top + (hi - j) * most < need:
            return False
    return False


def settle(
    a: FloatArray,
    cap: IntArray,
    avail: IntArray,
    num_pipelines: tuple[int, int],
    need: int,
    want_point: bool = False,
    hints: list[FloatArray] | None = None,
) -> bool | IntArray | None:
    """Returns False when no selection runs ``need`` micro-batches (proven by the dual
    bound); with ``want_point``, a selection that does, when rounding finds one; else
    None (unknown: ask the MILP). ``a[k, v]``: groups of class k a pipeline of column v
    uses; ``cap[v]``: micro-batches one runs. ``hints``: duals that proved neighbouring
    instances (any duals give a valid bound), tried before the simplex; the duals of a
    new proof are added to it (the last ``HINTS`` kept)."""
    lo, hi = num_pipelines
    if cap.size == 0 or int(cap.max()) * hi < need:
        return False
    upper = np.minimum(
        np.min(np.where(a > 0, avail[:, None] // np.maximum(a, 1), np.inf), axis=0), hi
    )
    if want_point:  # identical pipelines first: the plans estimate ranks best
        x = uniform_selection(cap, lo, hi, upper, need)
        if x is not None:
            return x
    margin = need - 1e-6 * max(1, need)
    for duals in reversed(hints or []):
        if units_bound(a, cap, avail, lo, hi, upper, duals) < margin:
            return False
    x_lp, duals = lp_relaxation(a, cap, avail, hi, upper, lo)
    if units_bound(a, cap, avail, lo, hi, upper, duals) < margin:
        if hints is not None:
            hints.append(duals)
            del hints[:-HINTS]
        return False
    if want_point:
        x = rounded_selection(a, cap, avail, lo, hi, upper, x_lp, need, duals)
        return x if x is not None else counted_selection(a, cap, avail, lo, hi, need)
    return None

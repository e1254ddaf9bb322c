"""Layer partition of one pipeline and batch split across pipelines, on cost arrays.

A pipeline running ``m`` micro-batches on stages with per-micro-batch times ``t_j`` is
modelled as ``fill + (m - 1) * bottleneck`` with ``fill = sum(t_j) + extra`` and
``bottleneck = max(t_j)`` (the 1F1B steady state). Both solvers below are exact for that
objective; ``estimate`` replays the real schedule on the plans built from them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class Partition:
    """Layers per stage of one pipeline and the resulting per-micro-batch stage times."""

    layers: tuple[int, ...]
    stage_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        """Returns the slowest stage's time per micro-batch."""
        return max(self.stage_s)

    @property
    def fill_s(self) -> float:
        """Returns the sum of stage times (one micro-batch through the whole pipeline)."""
        return float(sum(self.stage_s))

    def time_s(self, micro_batches: int) -> float:
        """Returns the modelled pipeline time for ``micro_batches`` micro-batches."""
        return self.fill_s + (micro_batches - 1) * self.bottleneck_s


def _min_sum_dp(
    cost: FloatArray, feasible: NDArray[np.bool_], layers: int
) -> tuple[float, list[int]] | None:
    """Returns the least total stage time over contiguous splits, with its layer counts.

    ``cost[j, a, b]`` is stage j's time on layers [a, b); ``feasible`` masks allowed ranges.
    """
    p = cost.shape[0]
    inf = np.inf
    best = np.full(layers + 1, inf)
    best[0] = 0.0
    choice = np.zeros((p, layers + 1), dtype=np.int64)
    for j in range(p):
        total = best[:, None] + np.where(feasible[j], cost[j], inf)
        choice[j] = np.argmin(total, axis=0)
        best = total[choice[j], np.arange(layers + 1)]
    if not np.isfinite(best[layers]):
        return None
    counts, end = [], layers
    for j in range(p - 1, -1, -1):
        start = int(choice[j, end])
        counts.append(end - start)
        end = start
    return float(best[layers]), counts[::-1]


def partition_layers(
    layer_s: FloatArray,
    fixed_s: FloatArray,
    max_layers: IntArray,
    micro_batches: int,
    min_layers: int = 1,
) -> Partition | None:
    """Returns the contiguous layer split minimising ``fill + (m-1) * bottleneck``, or None.

    ``layer_s[j, l]``: time of layer l on stage j per micro-batch (layers may differ);
    ``fixed_s[j]``: stage j's time independent of its layers (embedding, head);
    ``max_layers[j]``: most layers stage j holds in memory. Exact: it runs a min-sum DP
    under each candidate bottleneck, in increasing order, until no larger one can win.
    """
    p, n = layer_s.shape
    cum = np.concatenate([np.zeros((p, 1)), np.cumsum(layer_s, axis=1)], axis=1)
    a = np.arange(n + 1)
    span = a[None, :] - a[:, None]
    cost = fixed_s[:, None, None] + cum[:, None, :] - cum[:, :, None]
    feasible = (span[None] >= min_layers) & (span[None] <= np.asarray(max_layers)[:, None, None])
    base = _min_sum_dp(cost, feasible, n)
    if base is None:
        return None
    min_sum = base[0]
    thresholds = np.unique(cost[feasible])
    best: tuple[float, list[int]] | None = None
    for t in thresholds:
        if best is not None and (micro_batches - 1) * t + min_sum >= best[0]:
            break
        found = _min_sum_dp(cost, feasible & (cost <= t), n)
        if found is None:
            continue
        counts = found[1]
        stage = _stage_times(cum, fixed_s, counts)
        value = sum(stage) + (micro_batches - 1) * max(stage)
        if best is None or value < best[0]:
            best = (value, counts)
    assert best is not None
    return Partition(tuple(best[1]), tuple(_stage_times(cum, fixed_s, best[1])))


def _stage_times(cum: FloatArray, fixed_s: FloatArray, counts: list[int]) -> list[float]:
    out, start = [], 0
    for j, c in enumerate(counts):
        out.append(float(fixed_s[j] + cum[j, start + c] - cum[j, start]))
        start += c
    return out


def uniform_frontier(
    per_layer_s: FloatArray, fixed_s: FloatArray, max_layers: IntArray, layers: int
) -> list[Partition]:
    """Returns the Pareto set of (bottleneck, fill) splits when every layer costs the same.

    For each candidate bottleneck T, the fastest stages are filled first up to what fits
    under T and in memory, which minimises the fill; any optimum of ``fill + (m-1) *
    bottleneck`` for any m is on the returned list. Empty when no split fits.
    """
    tau = np.asarray(per_layer_s, dtype=float)[None, :]
    fixed = np.asarray(fixed_s, dtype=float)[None, :]
    return uniform_frontiers(tau, fixed, np.asarray(max_layers, dtype=np.int64)[None, :], layers)[0]


BATCH_CELLS = 1 << 21
"""The most (pipeline, threshold, stage) cells ``uniform_frontiers`` holds at once."""


def uniform_frontiers(
    per_layer_s: FloatArray, fixed_s: FloatArray, max_layers: IntArray, layers: int
) -> list[list[Partition]]:
    """Returns ``uniform_frontier`` of every row (pipelines of the same stage count), in
    one pass of array operations over all of them."""
    tau = np.asarray(per_layer_s, dtype=float)
    fixed = np.asarray(fixed_s, dtype=float)
    cap = np.minimum(np.asarray(max_layers, dtype=np.int64), layers)
    n, p = tau.shape
    out: list[list[Partition]] = [[] for _ in range(n)]
    if p > layers or n == 0:
        return out
    ok = np.flatnonzero((cap.min(axis=1) >= 1) & (cap.sum(axis=1) >= layers))
    if ok.size == 0:
        return out
    per_row = p * p * int(cap[ok].max())
    step = max(1, BATCH_CELLS // per_row)
    for lo in range(0, ok.size, step):
        rows = ok[lo : lo + step]
        for i, front in zip(rows.tolist(), _frontiers(tau[rows], fixed[rows], cap[rows], layers),
                            strict=True):  # fmt: skip
            out[i] = front
    return out


def _frontiers(
    tau: FloatArray, fixed: FloatArray, cap: IntArray, layers: int
) -> list[list[Partition]]:
    n = tau.shape[0]
    # stages fastest first (each row its own order): filling them in that order is a
    # running sum; every figure below is per stage or a max, the same in either order,
    # and the fill is summed back in the stages' own order
    order = np.argsort(tau, axis=1, kind="stable")
    back = np.argsort(order, axis=1, kind="stable")
    r = np.arange(n)[:, None]
    tau, fixed, cap = tau[r, order], fixed[r, order], cap[r, order]
    ls = np.arange(1, int(cap.max()) + 1)
    grid = fixed[:, :, None] + ls[None, None, :] * tau[:, :, None]  # (n, p, L)
    grid = np.where(ls[None, None, :] <= cap[:, :, None], grid, np.inf).reshape(n, -1)
    # below, some stage cannot take a layer; above the least-fill split's bottleneck,
    # every threshold gives that split again
    top = np.max(fixed + _fill_in_order(cap, layers) * tau, axis=1)
    least = np.max(fixed + tau, axis=1)
    thr = np.sort(grid, axis=1)
    dup = np.zeros(thr.shape, dtype=bool)
    dup[:, 1:] = thr[:, 1:] == thr[:, :-1]
    keep = ~dup & (thr >= least[:, None]) & (thr <= top[:, None])
    kept = keep.sum(axis=1)
    # the kept thresholds of each row first, in order
    thr = np.sort(np.where(keep, thr, np.inf), axis=1)
    out: list[list[Partition]] = [[] for _ in range(n)]
    for rows in _buckets(kept):
        width = int(kept[rows].max())
        if width == 0:
            continue
        points = _points(thr[rows, :width], tau[rows], fixed[rows], cap[rows], back[rows],
                         top[rows], layers)  # fmt: skip
        for row, front in zip(rows.tolist(), points, strict=True):
            out[row] = front
    return out


def _buckets(kept: IntArray) -> list[IntArray]:
    """Returns the rows in one or two groups by their number of thresholds: rows are padded
    to the most of their group, so rows of few thresholds go apart where that spares at
    least a quarter of the cells."""
    n = kept.size
    rows = np.arange(n)
    if n < 8:
        return [rows]
    by = np.argsort(kept, kind="stable")
    k = kept[by]
    split = np.arange(1, n)
    cells = split * k[:-1] + (n - split) * k[-1]
    i = int(np.argmin(cells))
    if cells[i] > 0.75 * n * k[-1]:
        return [rows]
    return [np.sort(by[: i + 1]), np.sort(by[i + 1 :])]


def _points(
    thr: FloatArray,
    tau: FloatArray,
    fixed: FloatArray,
    cap: IntArray,
    back: IntArray,
    top: FloatArray,
    layers: int,
) -> list[list[Partition]]:
    """Returns each row's frontier from its thresholds ``thr`` (ascending, padded with
    infinity), its stages fastest first (``back``: to their own order)."""
    n = thr.shape[0]
    keep = np.isfinite(thr)
    eps = 1e-12 * np.maximum(1.0, top)  # the largest threshold kept is ``top`` itself
    arg = (thr[:, :, None] - fixed[:, None, :] + eps[:, None, None]) / tau[:, None, :]
    under = np.floor(np.where(keep[:, :, None], arg, 0.0)).astype(np.int64)
    caps = np.minimum(under, cap[:, None, :])  # (n, T, p)
    keep &= (caps.min(axis=2) >= 1) & (caps.sum(axis=2) >= layers)
    counts = _fill_in_order(caps, layers)
    stage = fixed[:, None, :] + counts * tau[:, None, :]
    bott = np.where(keep, stage.max(axis=2), np.inf)
    r = np.arange(n)[:, None]
    stage = stage[r[:, :, None], np.arange(stage.shape[1])[None, :, None], back[:, None, :]]
    fill = np.where(keep, stage.sum(axis=2), np.inf)  # (in the stages' own order)
    idx = np.lexsort((fill, bott), axis=-1)
    f = fill[r, idx]
    prev = np.full(f.shape, np.inf)
    prev[:, 1:] = np.minimum.accumulate(f, axis=1)[:, :-1]
    good = f < prev * (1 - 1e-12)  # strictly less fill than every smaller bottleneck
    # the kept points of every row at once, row by row in that order
    rows, at = np.nonzero(good)
    picked = idx[rows, at]
    layer_rows = counts[rows, picked][np.arange(rows.size)[:, None], back[rows]].tolist()
    time_rows = stage[rows, picked].tolist()
    ends = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).tolist()
    return [
        [Partition(tuple(c), tuple(x))
         for c, x in zip(layer_rows[a:b], time_rows[a:b], strict=True)]
        for a, b in itertools.pairwise(ends)
    ]  # fmt: skip


def _fill_in_order(caps: IntArray, layers: int) -> IntArray:
    """Returns the layer counts that fill stages in their order along the last axis (one
    layer each first) up to ``caps``."""
    extra = caps - 1
    before = np.cumsum(extra, axis=-1) - extra
    return np.clip(layers - caps.shape[-1] - before, 0, extra) + 1


def best_on_frontier(frontier: list[Partition], micro_batches: int) -> Partition:
    """Returns the frontier split with the least time for ``micro_batches``."""
    return min(frontier, key=lambda q: q.time_s(micro_batches))


def split_batch(
    fill_s: list[float],
    bottleneck_s: list[float],
    total: int,
    steps: list[int] | None = None,
) -> list[int] | None:
    """Returns micro-batches per pipeline (each >= 1, summing to ``total``) minimising the
    slowest ``fill + (m-1) * bottleneck``; None if there are more pipelines than units.
    With ``steps``, pipeline i runs a positive multiple of ``steps[i]`` (interleaved
    schedules: of its stages); None when no such split sums to ``total``.

    Greedy on the time after one more unit; exact for this min-max of increasing terms
    when every step is 1 (with steps, a heuristic that may miss an exact total).
    """
    n = len(fill_s)
    step = steps or [1] * n
    if n == 0 or total < sum(step):
        return None
    counts = list(step)
    left = total - sum(step)
    if steps is None and left > n:
        left -= _take_below(fill_s, bottleneck_s, counts, left)
    heap = [(fill_s[i] + (counts[i] + step[i] - 1) * bottleneck_s[i], i) for i in range(n)]
    heapq.heapify(heap)
    while left and heap:
        _, i = heapq.heappop(heap)
        if step[i] > left:  # never fits again: what is left only shrinks
            continue
        counts[i] += step[i]
        left -= step[i]
        heapq.heappush(heap, (fill_s[i] + (counts[i] + step[i] - 1) * bottleneck_s[i], i))
    return None if left else counts


def _take_below(
    fill_s: list[float], bottleneck_s: list[float], counts: list[int], left: int
) -> int:
    """Gives every pipeline (one micro-batch each so far, in ``counts``) the units the greedy
    of ``split_batch`` would give it below a level T, all at once; returns how many. The
    greedy takes units in order of the time after them, ``fill + c * bottleneck`` after c
    (each pipeline's rising with c): those below T come before all others, so taking them
    first changes nothing. T spreads ``left`` units over the pipelines in real numbers
    (each below T takes at most ``(T - fill) / bottleneck`` of them), so at most ``left``
    fall below it; the greedy hands out the few left over."""
    if min(bottleneck_s) <= 0:
        return 0
    active = list(range(len(fill_s)))
    while True:  # the level where the pipelines it passes take ``left`` units in reals
        level = (left + sum(fill_s[i] / bottleneck_s[i] for i in active)) / sum(
            1.0 / bottleneck_s[i] for i in active
        )
        keep = [i for i in active if fill_s[i] < level]
        if len(keep) == len(active):
            break
        active = keep
    given = [0] * len(fill_s)
    for i in active:
        f, b = fill_s[i], bottleneck_s[i]
        c = max(1, int((level - f) / b))  # the greedy's own times decide, up or down
        while c > 1 and f + c * b >= level:
            c -= 1
        while f + (c + 1) * b < level:
            c += 1
        given[i] = c - 1 if f + c * b >= level else c
    took = sum(given)
    if took > left:  # rounding: leave it all to the greedy
        return 0
    for i, g in enumerate(given):
        counts[i] += g
    return took


def split_time_s(fill_s: list[float], bottleneck_s: list[float], counts: list[int]) -> float:
    """Returns the slowest pipeline's modelled time for a batch split."""
    return max(f + (m - 1) * b for f, b, m in zip(fill_s, bottleneck_s, counts, strict=True))

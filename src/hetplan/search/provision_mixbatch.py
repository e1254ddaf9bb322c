"""A type-aware batch floor for a mix of two GPU types: each GPU at its own type's times.

``provision_batch.batch_floor_s`` prices all N GPUs of a mix at the faster type's layer
times, so 504 H100 with 8 V100 get the floor of 512 H100. Here a mix has N_A GPUs of type A
and N_B of type B, and every pipeline r of a plan uses a_r GPUs of A and b_r of B (whole
numbers: a stage is a tensor-parallel group inside one node, of one type), runs m_r
micro-batches (they sum to M = global batch / micro-batch size), and sum_r a_r <= N_A,
sum_r b_r <= N_B. For any weights (w_A, w_B) >= 0 (a price per GPU of each type):

    sum_r m_r x (w_A a_r + w_B b_r) / m_r <= w_A N_A + w_B N_B,

so if every pipeline of m micro-batches finishing in T costs at least c_w(T, m) at those
prices, M x min_m c_w(T, m) / m <= w_A N_A + w_B N_B: a T where this fails for some weights
is infeasible (the dual of the linear program that splits the micro-batches over the
pipelines' kinds: the weights are its multipliers, any of them gives a valid bound, a grid
of them, ``WEIGHTS``, is taken). A pipeline is of one of three kinds:

* **all on A**: at least ``provision_batch``'s whole-GPU count G_A(T, m) on A's own tables
  (the same proof, with A's times only), cost w_A x G_A;
* **all on B**: likewise w_B x G_B;
* **mixed** (stages of both types): at least one GPU of each. Its u_A layer units on A stages
  and u_B on B stages (u_A + u_B = L + e + h, the layers with the embedding's and head's
  whole-layer units, ``provision_batch``'s argument over the options of both types) need,
  with caps (the most units one stage at a degree holds: busy, drain) as there,
  a >= u_A x rho_A where rho_A is the least GPUs per unit over A's degrees (t / cap(t)), and
  its path u_A x pi_A + u_B x pi_B <= the path budget, pi the least path per unit over the
  degrees (time + fixed / cap): the stage sums of ``provision_batch`` split by type and each
  bounded by its best degree. So the cost is at least the least over u_B in the interval the
  path allows of w_A max(1, u_A rho_A) + w_B max(1, u_B rho_B), a convex piecewise-linear
  function of u_B: its least is at an end of the interval or a kink (u_A rho_A = 1 or
  u_B rho_B = 1), all evaluated. The families of ``provision_batch`` hold as there: every
  pipeline meets the base (stage and path budgets), and either the drain of one model chunk
  per stage (the path in one of ``DRAIN_PATHS`` intervals) or interleaving (its path within
  T / 2, or p <= m < 2p stages, so more than m / 2: at least one GPU per stage, the cheaper
  type's weight for all but one of each type), and an interleaved one also meets the base
  with two chunks' fixed costs per stage. Each type's stages also pay their layers'
  gradient reduction among the fewest pipelines the mix can have (``provision_batch.Sync``,
  at that type's own ``TypeFloor.reduce_tp``).

With m in ranges [m_lo, m_hi] (budgets at m_lo, division by m_hi) and the costs made
non-increasing in T (a longer time never needs more), the floor at each micro-batch size is
the largest grid time (steps of ``STEP``) below the first where every weight's test holds;
the floor is the least over the sizes. The pure kinds read ``provision_batch``'s own tables
(``_table``; its grid mapped onto this one at the next grid time at or above, so never
larger); all read the ``TypeFloor`` tables (``params.compute``), as the other floors.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from hetplan.model import ModelSpec
from hetplan.search.provision_batch import (
    INTERLEAVED_CHUNKS,
    Drain,
    Sync,
    _busiest_floor_s,
    _ranges,
    _table,
    fewest_pipelines,
    grid_sync,
    stage_caps,
)
from hetplan.search.provision_bounds import TypeFloor, path_floor_s

_SLACK = 1e-9
WEIGHTS: tuple[tuple[float, float], ...] = (
    (1.0, 0.0),
    *((1.0, 2.0**k) for k in range(-3, 4)),
    (0.0, 1.0),
)
"""(w_A, w_B) pairs the floor is the largest over: B worth nothing, 1/8 to 8 of A, A
worth nothing."""
STEP = 1.01
"""Ratio of consecutive iteration times of this floor's grid (it gives up at most 1%)."""
EXACT_M, RATIO = 16, 1.1
"""Micro-batches per pipeline taken one by one up to ``EXACT_M``, then in ranges growing by
``RATIO`` (any ranges are valid: budgets at the range's least, division by its most;
``provision_batch``'s 32 and 1.05 prune 8 more mixes of 31,400 on the default spot market
for 5 more CPU seconds)."""
DRAIN_PATHS = 2
"""Intervals of a mixed pipeline's path for the drain bound (``provision_batch``'s 4: any
count is valid; 2 halves the cost: on the default spot market, with ranges of 32 and
1.05, 4 pruned 82 more mixes of 31,400 for 15 more CPU seconds)."""


_Cands = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Per candidate split (stacked): the A part's cost, the B part's, a penalty (0 or inf)."""


def _per_unit(
    units: float,
    f: TypeFloor,
    i: int,
    stage: np.ndarray,
    extra: float,
    drain_budget: np.ndarray | None,
    chunks: int = 1,
    sync: Sync | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (rho, pi): the least GPUs per unit and the least path per unit over ``f``'s
    degrees at micro-batch size index i, stages within ``stage`` seconds per micro-batch
    (and their backward within ``drain_budget``) with at least ``chunks`` model chunks each
    (each its fixed cost); inf where no stage holds a unit. ``sync``: each layer's gradient
    reduction on ``f`` too (``provision_batch.Sync``)."""
    tps = np.array(f.tps, dtype=float)
    times = np.array(f.layer_tp[i])
    fixed = chunks * max(f.fixed_s, 0.0)
    drain = None
    if drain_budget is not None:
        drain = Drain(drain_budget, np.array(f.layer_back_tp[i]), fixed / 2, extra)
    caps = stage_caps(units, times, fixed, stage, None, drain, sync)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(caps > 0, tps / caps, np.inf).min(axis=-1)
        pi = np.where(caps > 0, times + fixed / caps, np.inf).min(axis=-1)
    return rho, pi


def _candidates(
    units: float, ra: np.ndarray, pa: np.ndarray, rb: np.ndarray, pb: np.ndarray, path: np.ndarray
) -> _Cands:
    """Returns, stacked per candidate u_B (ends of the interval the path allows, the two
    kinks), max(1, u_A rho_A) and max(1, u_B rho_B), and a penalty: 0, or inf where no split
    meets the path (the two are then 0)."""
    budget = path * (1 + _SLACK)
    ok = units * np.minimum(pa, pb) <= budget
    with np.errstate(divide="ignore", invalid="ignore"):
        d = pb - pa
        edge = (budget - units * pa) / d
        fin = np.isfinite(pa) & np.isfinite(pb)
        lo = np.where(fin & (d < 0), np.maximum(edge, 0.0), 0.0)
        hi = np.where(fin & (d > 0), np.minimum(edge, units), float(units))
        lo = np.where(~np.isfinite(pa), float(units), lo)  # only B holds units
        hi = np.where(~np.isfinite(pb), 0.0, hi)  # only A holds units
        hi = np.maximum(hi, lo)
        u = np.stack([lo, hi, np.clip(units - 1.0 / ra, lo, hi), np.clip(1.0 / rb, lo, hi)])
        ua = units - u
        ca = np.maximum(1.0, np.where(ua > 0, ua * ra, 0.0))
        cb = np.maximum(1.0, np.where(u > 0, u * rb, 0.0))
    return (np.where(ok, ca, 0.0), np.where(ok, cb, 0.0),
            np.where(ok, 0.0, np.inf)[None])  # fmt: skip


def _cost(cands: _Cands, wa: float, wb: float) -> np.ndarray:
    """Returns the least w_A a + w_B b over the candidates."""
    ca, cb, penalty = cands
    return np.asarray((wa * ca + wb * cb + penalty).min(axis=0))


@lru_cache(maxsize=512)
def _mixed_table(
    model: ModelSpec, global_batch: int, fa: TypeFloor, fb: TypeFloor, i: int
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (the grid of iteration times, per grid time and weight the least cost per
    micro-batch of a mixed pipeline (module docstring), non-increasing in time)."""
    floors = [fa, fb]
    lt = np.concatenate([f.layer_tp[i] for f in floors])
    et = np.concatenate([f.embed_tp[i] for f in floors])
    ht = np.concatenate([f.head_tp[i] for f in floors])
    de = int(np.floor(et / lt * (1 - _SLACK)).min())
    dh = int(np.floor(ht / lt * (1 - _SLACK)).min())
    cut = (et.min() - de * lt.max()) + (ht.min() - dh * lt.max())
    units, extra = model.layers + de + dh, float(de + dh)
    lo = path_floor_s(model, floors, i, 1)
    m_total = global_batch // fa.micro_batches[i]
    fixed = max(max(f.fixed_s, 0.0) for f in floors)
    hi = m_total * (model.layers * lt.max() + fixed + et.max() + ht.max()) * STEP
    grid = lo * STEP ** np.arange(int(np.ceil(np.log(hi / lo) / np.log(STEP))) + 1)
    m_lo, m_hi = (np.array(x, dtype=float) for x in zip(*_ranges(m_total, EXACT_M, RATIO),
                                                         strict=True))  # fmt: skip
    t = grid[:, None]
    shape = (grid.size, m_lo.size)
    stage = np.broadcast_to(t / m_lo, shape)
    back = all(f.layer_back_tp for f in floors)
    # each layer's gradient reduction among the fewest pipelines (provision_batch.Sync)
    members = fewest_pipelines(m_total, _busiest_floor_s((fa, fb), i), grid)
    sa, sb = (grid_sync(f.reduce_tp, members, m_lo, extra) for f in floors)

    def cands(path: np.ndarray, budget: np.ndarray | None, chunks: int = 1) -> _Cands:
        ra, pa = _per_unit(units, fa, i, stage, extra, budget, chunks, sa)
        rb, pb = _per_unit(units, fb, i, stage, extra, budget, chunks, sb)
        return _candidates(units, ra, pa, rb, pb, np.broadcast_to(path, shape))

    base = cands(t - cut, None)
    drains: list[_Cands] = []
    half = inter_base = base
    if back:
        ratio = np.maximum(grid / lo, 1.0) ** (1.0 / DRAIN_PATHS)
        several = m_lo > 1
        for k in range(DRAIN_PATHS):
            p_lo, p_hi = lo * ratio**k, lo * ratio ** (k + 1)
            if k == DRAIN_PATHS - 1:
                p_hi = grid
            budget = np.where(several, (grid - p_lo)[:, None] / np.maximum(m_lo - 1, 1), np.inf)
            drains.append(cands(p_hi[:, None] - cut, budget))
        # interleaved: each stage pays the fixed cost of every chunk it runs
        half = cands(t / 2 - cut, None, INTERLEAVED_CHUNKS)
        inter_base = cands(t - cut, None, INTERLEAVED_CHUNKS)
    out = np.empty((grid.size, len(WEIGHTS)))
    for j, (wa, wb) in enumerate(WEIGHTS):
        cost = _cost(base, wa, wb)
        if back:
            drain = np.min([_cost(c, wa, wb) for c in drains], axis=0)
            # interleaved with p <= m < 2p stages (p > m / 2 >= m_lo / 2; m >= 2p is
            # ``half``): a GPU per stage, one of each type at least
            count = wa + wb + np.maximum(m_lo // 2 + 1 - 2, 0) * min(wa, wb)
            inter = np.maximum(_cost(inter_base, wa, wb), np.minimum(count, _cost(half, wa, wb)))
            cost = np.maximum(cost, np.minimum(drain, inter))
        cost = np.maximum(cost, wa + wb)
        out[:, j] = np.minimum.accumulate((cost / m_hi).min(axis=1) * (1 - _SLACK))
    return grid, out


def _pure_on(grid: np.ndarray, own: np.ndarray, kappa: np.ndarray, least: float) -> np.ndarray:
    """Returns a pure kind's GPUs per micro-batch (``kappa`` on its ``own`` grid) on
    ``grid``: at the next own time at or above (never more than the true need); inf below
    its own path floor; past its grid, ``least`` (what no time lowers)."""
    at = np.searchsorted(own, grid * (1 - _SLACK), side="left")
    out = np.where(at < own.size, kappa[np.clip(at, 0, own.size - 1)], least)
    return np.where(grid < own[0] * (1 - _SLACK), np.inf, out)


def mix_batch_floor_s(
    model: ModelSpec,
    global_batch: int,
    floors: tuple[TypeFloor, TypeFloor],
    ga: np.ndarray,
    gb: np.ndarray,
    stages: int = 1,
    per_size: bool = False,
) -> np.ndarray:
    """Returns the type-aware floor (module docstring) of every plan on ``ga`` GPUs of type
    ``floors[0]`` and ``gb`` of ``floors[1]`` (arrays of equal shape), whose every pipeline
    has at least ``stages`` stages (the pure kinds' counts; a mixed one has at least two).
    ``per_size``: the floor at each micro-batch size (stacked on a first axis) instead of
    their least."""
    fa, fb = floors
    na, nb = np.asarray(ga, dtype=float), np.asarray(gb, dtype=float)
    best = np.full(na.shape, np.inf)
    sizes: list[np.ndarray] = []
    for i, size in enumerate(fa.micro_batches):
        m = global_batch // size
        grid, mixed = _mixed_table(model, global_batch, fa, fb, i)
        least = stages / m
        pure = []
        for f in floors:
            own, kappa = _table(model, global_batch, (f,), i, stages, floors)
            pure.append(_pure_on(grid, own, kappa, least))
        floor_i = np.full(na.shape, grid[0])
        for j, (wa, wb) in enumerate(WEIGHTS):
            with np.errstate(invalid="ignore"):
                ka = np.where(np.isfinite(pure[0]), wa * pure[0], np.inf)
                kb = np.where(np.isfinite(pure[1]), wb * pure[1], np.inf)
            need = m * np.minimum(np.minimum(ka, kb), mixed[:, j])
            have = (wa * na + wb * nb) * (1 + _SLACK)
            first = np.searchsorted(-need, -have, side="left")
            at = np.where(first > 0, grid[np.clip(first - 1, 0, grid.size - 1)], grid[0])
            floor_i = np.maximum(floor_i, at)
        floor_i = np.where((na > 0) & (nb > 0), floor_i, np.inf)
        sizes.append(floor_i)
        best = np.minimum(best, floor_i)
    return np.stack(sizes) if per_size else best

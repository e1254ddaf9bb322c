"""A proven floor of the iteration time from the global batch: whole micro-batches, whole
layers, whole GPUs.

The throughput floor (``provision_bounds``) lets every GPU run a fraction of a micro-batch;
a plan cannot. With micro-batch size b the global batch is M = global / b micro-batches;
each pipeline r of a plan runs m_r >= 1 of them (the m_r sum to M) on its g_r GPUs (the
g_r sum to at most the configuration's N), in p stages of per-micro-batch times s_j
(``estimate.stage_times``: l_j layers at the stage's TP degree t_j, at least l_j x layer(t_j)
with layer(t) the fastest forward + backward of one layer at TP t on the configuration's
types, plus each stage's fixed cost per micro-batch, at least ``TypeFloor.fixed_s``). If the
iteration takes T:

* **busy**: each stage computes m_r micro-batches, so every s_j <= T / m_r, and a stage at
  TP t holds at most cap(t) = min(L, floor((T / m_r - fixed) / layer(t))) layers;
* **path**: the first micro-batch runs forward through every stage and back, so
  T >= sum_j s_j >= sum_j l_j layer(t_j) + p x fixed + the fastest embedding and head;
* the stages hold all L layers. With x_t the layers at TP t, the pipeline has
  g_r = sum_j t_j >= sum_t x_t t / cap(t) GPUs and p >= sum_t x_t / cap(t) stages, so its
  path is at least sum_t x_t (layer(t) + fixed / cap(t)) plus the embedding and head: the
  least GPUs under that path budget is a linear program in x (at most two TP degrees in its
  optimum, solved in closed form), and g_r, a whole number, at least its ceiling;
* **embedding and head**: the first stage also runs the embedding, the last the head, so
  its layers fit in cap(t) less floor(embedding(t) / layer(t)) (head likewise): the stages
  hold L + e + h whole layers' worth, e and h the least such counts over the degrees (the
  path keeps the rest of the embedding's and the head's time).

So a pipeline of m micro-batches needs at least G(T, m) GPUs, and some pipeline has
g_r / m_r <= N / M: T is feasible only if M x min_m G(T, m) / m <= N. That holds for
larger T once it holds (every cap grows, every budget loosens); the floor is the largest T
of a geometric grid (steps of ``STEP``) where it fails, below the first where it holds. Where
N < M single GPUs each run whole micro-batches (one GPU cannot run 1.5 of them in 1.5
micro-batch times), and a pipeline's GPUs beyond what its stages' caps need add nothing:
what the throughput floor misses for configurations with more GPUs than the batch can feed.

**The schedule** (``_schedule_gpus``). A stage is one device group running its actions one
at a time, and the replay (``estimate``) starts no action before its inputs exist:

* one model chunk per stage (1F1B, GPipe): a stage's first backward needs some
  micro-batch's forward through every stage and its backward back to the stage; then the
  stage runs its m backwards (b_k each, at least its layers' ``layer_back_tp``, their TP
  collectives included, and half the fixed cost); after its last one, that micro-batch's
  backward still crosses the earlier stages. So T >= path + (m - 1) b_k for every stage k:
  with the path P in [P_i, P_i+1] (``DRAIN_PATHS`` geometric intervals of [path floor, T]),
  each stage's backward is within (T - P_i) / (m - 1) and the path within P_i+1, and G is
  at least the least over the intervals of the linear program with that cap too;
* interleaved (v chunks): a valid plan's pipeline of p > 1 stages runs m >= p micro-batches
  (``plan.validate_plan``: in equal groups, ``schedule.interleave_fits``). With m < 2p it
  has p > m / 2 stages, so at least m // 2 + 1 GPUs; with m >= 2p its busiest stage runs
  m >= 2p micro-batches of at least (its path) / p each, so T >= 2 x path: the linear
  program with the path within T / 2. One stage (p = 1) runs m micro-batches of its whole
  path: the same holds for m >= 2. Either way each stage runs v >= 2 chunks, each with the
  fixed cost per micro-batch (``estimate.stage_times``: v x the action and micro-batch
  costs), so the base bound holds with twice ``fixed``: on the default spot market (GPT-3
  1.3B) 1,500 more mixes of 26,300 are pruned by their bounds.

A pipeline is of one family or the other: G is at least the smaller of the two. TP
collectives enter through the ``TypeFloor`` layer times (``provision_bounds``).

**The gradient reduction** (``Sync``). Every pipeline of a plan holds every layer, so each
layer's gradients are reduced among the plan's R pipelines, and a device ends no earlier
than its last backward and then the part of its layers' reductions no overlap hides
(``dp_sync.reduction_floor_s``, ``TypeFloor.reduce_tp``, as the heterogeneous search's
bounds charge it). A stage of l layers running m micro-batches is busy l (m layer(t) +
reduction(t, R)) + m fixed, in every family above. R is at least the fewest pipelines that
can share the batch (``fewest_pipelines``): a stage holding a layer is busy at least the
configuration's fastest layer and least fixed cost per micro-batch, so a pipeline runs at
most T / that of them. One pipeline (R = 1) reduces nothing. On the default spot market
(GPT-3 1.3B) 24,799 live mixes become 23,887, for about 3 more CPU seconds of bounds.

The floor is the least over the micro-batch sizes (divisors of the global batch); it reads
the same ``TypeFloor`` tables (``params.compute``) as the other floors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hetplan.model import ModelSpec
from hetplan.search.provision_bounds import TypeFloor, path_floor_s

STEP = 1.01
"""Ratio of consecutive iteration times of the grid (the floor gives up at most 1%)."""
_SLACK = 1e-9
"""Relative tolerance that always errs towards a lower floor (float rounding)."""


def _layer_times(floors: tuple[TypeFloor, ...], i: int, attr: str = "layer_tp") -> dict[int, float]:
    """Returns, per TP degree some type allows, the fastest layer time at size index i
    (``attr``: forward + backward, or ``layer_back_tp``: the backward alone)."""
    out: dict[int, float] = {}
    for f in floors:
        for t, x in zip(f.tps, getattr(f, attr)[i], strict=True):
            out[t] = min(out.get(t, np.inf), x)
    return out


def least_gpus(
    layers: float,
    tps: np.ndarray,
    times: np.ndarray,
    fixed: float,
    stage_s: np.ndarray,
    path_s: np.ndarray,
    most: float | None = None,
    drain: Drain | None = None,
    sync: Sync | None = None,
) -> np.ndarray:
    """Returns the least GPUs (real: the linear program's optimum) of a pipeline holding
    ``layers`` layers in stages of at most ``stage_s`` seconds per micro-batch each (each
    stage ``fixed`` seconds plus its layers), with at most ``path_s`` seconds on the path
    for the layers and the stages' fixed costs (at least one stage per ``cap`` layers);
    arrays of one shape. TP degree ``tps[k]`` runs one layer in ``times[k]``; a stage holds
    at most ``most`` layers (default ``layers``); inf where no stage fits. ``drain``: each
    stage's backward alone is also at most ``drain.budget_s`` (same shape as ``stage_s``),
    a layer's backward at ``tps[k]`` taking ``drain.times[k]`` and each stage's
    ``drain.fixed``; a stage holds ``drain.loose`` units beyond the layers that fit (the
    embedding's and the head's whole-layer units, whose backward is not counted). ``sync``:
    each stage's layers also reduce their gradients (``Sync``)."""
    # the degrees on a first axis: each degree's plane contiguous for the pairs below
    caps = np.moveaxis(stage_caps(layers, times, fixed, stage_s, most, drain, sync), -1, 0)
    col = (len(tps),) + (1,) * (caps.ndim - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        pos = caps > 0
        a = np.where(pos, np.reshape(tps, col) / caps, np.inf)  # GPUs per layer at each degree
        b = np.where(pos, np.reshape(times, col) + fixed / caps, np.inf)  # path per layer
        budget = path_s * (1 + _SLACK)
        best = np.where(layers * b <= budget, layers * a, np.inf).min(axis=0)
        finite = np.isfinite(a)
        for k1, k2 in itertools.combinations(range(len(tps)), 2):
            a1, a2, b1, b2 = a[k1], a[k2], b[k1], b[k2]
            # x layers at degree k1, the rest at k2, the path budget met exactly (the
            # optimum mixes at most two degrees, the path bound binding)
            x = (layers * b2 - budget) / (b2 - b1)
            ok = finite[k1] & finite[k2] & (b1 != b2) & (x >= 0) & (x <= layers)
            g = np.where(ok, x * a1 + (layers - x) * a2, np.inf)
            np.minimum(best, g, out=best)
    return best


def stage_caps(
    layers: float,
    times: np.ndarray,
    fixed: float | np.ndarray,
    stage_s: np.ndarray,
    most: float | None = None,
    drain: Drain | None = None,
    sync: Sync | None = None,
) -> np.ndarray:
    """Returns the most whole layers (shape ``stage_s.shape + times.shape``) one stage holds
    at each degree (``least_gpus``'s caps): within ``stage_s`` seconds per micro-batch with
    ``fixed`` seconds besides, at most ``most`` (default ``layers``), with ``drain`` its
    backward within the drain's budget (plus its loose units), and with ``sync`` its layers
    with their gradient reductions within the same budget (plus its loose units)."""
    if sync is not None and sync.loose == 0:  # every unit a layer with its reduction
        times, sync = times + sync.per_layer_s, None
    slot = (stage_s[..., None] - fixed) / times * (1 + _SLACK) + _SLACK
    caps = np.clip(np.floor(slot), 0, layers if most is None else most)
    if sync is not None:
        with np.errstate(invalid="ignore"):
            busy = (stage_s[..., None] - fixed) / (times + sync.per_layer_s) * (1 + _SLACK)
        busy = np.where(stage_s[..., None] >= fixed, busy + _SLACK, -1.0)
        caps = np.minimum(caps, np.where(busy >= 0, np.floor(busy) + sync.loose, 0.0))
    if drain is not None:
        with np.errstate(invalid="ignore"):
            back = (drain.budget_s[..., None] - drain.fixed) / drain.times * (1 + _SLACK)
        back = np.where(drain.budget_s[..., None] >= drain.fixed, back + _SLACK, -1.0)
        caps = np.minimum(caps, np.where(back >= 0, np.floor(back) + drain.loose, 0.0))
    return np.asarray(caps)


@dataclass(frozen=True)
class Drain:
    """A cap on each stage's backward alone (``least_gpus``): per-micro-batch budget
    ``budget_s`` (an array), ``times[k]`` a layer's fastest backward at TP ``tps[k]``,
    ``fixed`` a stage's fixed backward cost, ``loose`` units a stage holds uncounted."""

    budget_s: np.ndarray
    times: np.ndarray
    fixed: float
    loose: float


@dataclass(frozen=True)
class Sync:
    """The gradient reduction a stage's layers add to its busy time (``least_gpus``): every
    pipeline of a plan holds every layer, so a layer's holders are the plan's R pipelines,
    and a device ends no earlier than its last backward and then the part of its layers'
    reductions among them that no overlap hides (``dp_sync.reduction_floor_s``, as the
    heterogeneous search's bounds charge it). With m micro-batches a stage of l layers is
    busy l x (m x layer + reduction) + m x fixed, so per micro-batch each layer costs its
    time plus ``per_layer_s`` (the reduction / m; it broadcasts against the caps: stage
    budgets by degree); a stage holds ``loose`` units beyond (the embedding's and the
    head's whole-layer units, whose reduction is not counted)."""

    per_layer_s: np.ndarray
    loose: float


def fewest_pipelines(m_total: int, busy_s: float, grid: np.ndarray) -> np.ndarray:
    """Returns, per iteration time of ``grid``, the fewest pipelines of any plan finishing
    ``m_total`` micro-batches in it: every pipeline has a stage holding a layer, busy at
    least m x ``busy_s`` (the fastest layer and the least fixed cost of the configuration's
    types) for its m micro-batches, so m <= T / busy_s and R >= m_total x busy_s / T."""
    return np.maximum(np.ceil(m_total * busy_s / grid * (1 - _SLACK)), 1.0)


def reduction_s(reduce: tuple[tuple[float, ...], ...], members: np.ndarray) -> np.ndarray:
    """Returns ``reduce[k][n]`` (per degree k, holders n) at ``members`` (an array), shape
    ``members.shape + (degrees,)``; past the table, its last column (never more)."""
    table = np.asarray(reduce)
    at = np.clip(members.astype(int), 0, table.shape[1] - 1)
    return np.moveaxis(table[:, at], 0, -1)


def grid_sync(
    reduce: tuple[tuple[float, ...], ...], members: np.ndarray, m_lo: np.ndarray, loose: float
) -> Sync | None:
    """Returns the ``Sync`` of a table's (grid time, micro-batch range) cells: the reduction
    ``reduce`` charges among ``members`` holders per grid time, over the range's m_lo
    micro-batches; None where nothing is charged (no table, or one pipeline at every time)."""
    if not reduce:
        return None
    per = reduction_s(reduce, members)[:, None, :] / m_lo[None, :, None]
    return Sync(per, loose) if per.any() else None


def _ranges(top: int, exact: int, ratio: float) -> list[tuple[int, int]]:
    """Returns [lo, hi] ranges covering 1..top: one by one up to ``exact``, then growing."""
    out, lo = [], 1
    while lo <= top:
        hi = lo if lo <= exact else min(top, max(lo, int(lo * ratio)))
        out.append((lo, hi))
        lo = hi + 1
    return out


def _table(
    model: ModelSpec,
    global_batch: int,
    floors: tuple[TypeFloor, ...],
    i: int,
    stages: int,
    fleet: tuple[TypeFloor, ...] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (the grid of iteration times T, the least GPUs per micro-batch any plan
    needs to finish in T, non-increasing) at micro-batch size index i, a pipeline's stages
    on ``floors``' types; ``fleet``: every type of the configuration (default ``floors``),
    whose fastest layer bounds the micro-batches of any pipeline (``fewest_pipelines``)."""
    lt = _layer_times(floors, i)
    # the backward alone (the schedule's bound); tables built without it: no such bound
    bt = _layer_times(floors, i, "layer_back_tp") if all(f.layer_back_tp for f in floors) else {}
    tps = tuple(sorted(lt))
    # the embedding and the head in whole layers of their stage's degree (module docstring)
    parts = []
    for attr in ("embed_tp", "head_tp"):
        at: dict[int, float] = {}
        for f in floors:
            for t, x in zip(f.tps, getattr(f, attr)[i], strict=True):
                at[t] = min(at.get(t, np.inf), x)
        whole = min(int(np.floor(at[t] / lt[t] * (1 - _SLACK))) for t in tps)
        least = min(at.values())
        parts.append((whole, least - whole * max(lt.values())))
    (de, ce), (dh, ch) = parts
    fixed = min(max(f.fixed_s, 0.0) for f in floors)
    return _grid_table(
        model.layers,
        de + dh,
        global_batch // floors[0].micro_batches[i],
        tps,
        tuple(lt[t] for t in tps),
        fixed,
        min(f.embed_s[i] for f in floors) + min(f.head_s[i] for f in floors),
        ce + ch,
        path_floor_s(model, list(floors), i, 1),
        stages,
        tuple(bt[t] for t in tps) if bt else (),
        _reductions(floors, tps),
        _busiest_floor_s(floors if fleet is None else fleet, i),
    )


def _reductions(
    floors: tuple[TypeFloor, ...], tps: tuple[int, ...]
) -> tuple[tuple[float, ...], ...]:
    """Returns, per degree of ``tps`` and holders, the least ``TypeFloor.reduce_tp`` of the
    types allowing it; empty (no such floor) where a type has none."""
    if not all(f.reduce_tp for f in floors):
        return ()
    out = []
    for t in tps:
        rows = [np.asarray(f.reduce_tp[f.tps.index(t)]) for f in floors if t in f.tps]
        out.append(tuple(np.min(rows, axis=0).tolist()))
    return tuple(out)


def _busiest_floor_s(fleet: tuple[TypeFloor, ...], i: int) -> float:
    """Returns the least per-micro-batch time of a stage holding a layer on any of the
    ``fleet``'s types at micro-batch size index i: its fastest layer and least fixed cost."""
    least = min(min(f.layer_tp[i]) for f in fleet) + min(max(f.fixed_s, 0.0) for f in fleet)
    # rounded down to a power of BUSY_STEP: fleets with close times share their tables
    return float(BUSY_STEP ** np.floor(np.log(least) / np.log(BUSY_STEP))) if least > 0 else 0.0


BUSY_STEP = 1.25
"""Ratio of the powers ``_busiest_floor_s`` rounds down to."""


@lru_cache(maxsize=4096)
def _grid_table(
    layers: int,
    extra: int,
    m_total: int,
    tps_: tuple[int, ...],
    times_: tuple[float, ...],
    fixed: float,
    ends: float,
    cut: float,
    lo: float,
    stages: int,
    back_: tuple[float, ...] = (),
    reduce_: tuple[tuple[float, ...], ...] = (),
    busy_s: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``_table`` from what it depends on (types with the same fastest times share it):
    every pipeline has at least ``stages`` GPUs, one per stage."""
    grid, gpus, m_hi = _gpu_table(layers, extra, m_total, tps_, times_, fixed, ends, cut, lo,
                                  back_, reduce_, busy_s)  # fmt: skip
    kappa = (np.maximum(gpus, stages) / m_hi).min(axis=1)
    return grid, np.minimum.accumulate(kappa)


DRAIN_PATHS = 4
"""Intervals of a pipeline's path the drain bound splits [path floor, T] into (geometric)."""


@lru_cache(maxsize=1024)
def _gpu_table(
    layers: int,
    extra: int,
    m_total: int,
    tps_: tuple[int, ...],
    times_: tuple[float, ...],
    fixed: float,
    ends: float,
    cut: float,
    lo: float,
    back_: tuple[float, ...] = (),
    reduce_: tuple[tuple[float, ...], ...] = (),
    busy_s: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns the grid of iteration times from ``lo``, the least whole GPUs of a pipeline
    finishing m_lo micro-batches in each (grid x ranges), and each range's m_hi: its
    ``layers`` and ``extra`` whole layers' worth of embedding and head, with ``cut`` seconds
    of the path besides (``_table``); with ``back_`` (a layer's fastest backward per
    degree), the least over the schedules of the drain and interleaving bounds (module
    docstring); with ``reduce_`` (``_reductions``) each layer's gradient reduction among the
    fewest pipelines a plan finishing in T has (``fewest_pipelines`` of ``busy_s``)."""
    tps, times = np.array(tps_, dtype=float), np.array(times_)
    hi = m_total * (layers * times.max() + fixed + ends) * STEP
    grid = lo * STEP ** np.arange(int(np.ceil(np.log(hi / lo) / np.log(STEP))) + 1)
    # pipelines of m micro-batches in ranges [m_lo, m_hi] (one by one up to EXACT_M): no
    # fewer GPUs than at m_lo (a longer stage budget never needs more), 1/m >= 1/m_hi
    m_lo, m_hi = (np.array(x, dtype=float) for x in zip(*_ranges(m_total, EXACT_M, RATIO),
                                                         strict=True))  # fmt: skip
    t = grid[:, None]
    path = np.broadcast_to(t - cut, (grid.size, m_lo.size))
    units = layers + extra
    stage = t / m_lo
    sync = grid_sync(reduce_, fewest_pipelines(m_total, busy_s, grid), m_lo, float(extra))
    g = least_gpus(units, tps, times, fixed, stage, path, sync=sync)
    if back_:
        g = np.maximum(g, _schedule_gpus(units, extra, tps, times, fixed, cut, lo, grid, m_lo,
                                         np.array(back_), sync))  # fmt: skip
    return grid, np.ceil(g * (1 - _SLACK)), m_hi


def _schedule_gpus(
    units: int,
    extra: int,
    tps: np.ndarray,
    times: np.ndarray,
    fixed: float,
    cut: float,
    lo: float,
    grid: np.ndarray,
    m_lo: np.ndarray,
    back: np.ndarray,
    sync: Sync | None = None,
) -> np.ndarray:
    """Returns, per (T, range), the least real GPUs of a pipeline of at least m_lo
    micro-batches finishing in T under either schedule family (module docstring): one model
    chunk per stage (``drain_gpus``) or interleaved (``interleaved_gpus``)."""
    one = drain_gpus(units, extra, tps, times, fixed, cut, lo, grid, m_lo, back, sync)
    return np.minimum(one, interleaved_gpus(units, tps, times, fixed, cut, grid, m_lo, sync))


INTERLEAVED_CHUNKS = 2
"""The fewest model chunks an interleaved stage runs, each with its fixed cost per
micro-batch."""


def interleaved_gpus(
    units: int,
    tps: np.ndarray,
    times: np.ndarray,
    fixed: float,
    cut: float,
    grid: np.ndarray,
    m_lo: np.ndarray,
    sync: Sync | None = None,
) -> np.ndarray:
    """Returns, per (T in ``grid``, m_lo), the least GPUs of an interleaved pipeline of at
    least m_lo micro-batches finishing in T: its p stages run m >= p (in equal groups); m <
    2p needs p > m / 2 >= m_lo / 2 GPUs, m >= 2p keeps the path within T / 2 (the busiest
    stage runs m >= 2p micro-batches of at least path / p each). Either way each stage runs
    v >= 2 chunks, each paying ``fixed`` per micro-batch (``estimate.stage_times``: v x the
    action and micro-batch costs), so the base bound holds with twice the fixed cost."""
    t = grid[:, None]
    shape = (grid.size, m_lo.size)
    stage = np.broadcast_to(t / m_lo, shape)
    per_stage = INTERLEAVED_CHUNKS * fixed
    base = least_gpus(units, tps, times, per_stage, stage, np.broadcast_to(t - cut, shape),
                      sync=sync)  # fmt: skip
    half = least_gpus(units, tps, times, per_stage, stage,
                      np.broadcast_to(t / 2 - cut, shape), sync=sync)  # fmt: skip
    return np.maximum(base, np.minimum(np.broadcast_to(m_lo // 2 + 1, shape), half))


def drain_gpus(
    units: int,
    extra: int,
    tps: np.ndarray,
    times: np.ndarray,
    fixed: float,
    cut: float,
    lo: float,
    grid: np.ndarray,
    m_lo: np.ndarray,
    back: np.ndarray,
    sync: Sync | None = None,
) -> np.ndarray:
    """Returns, per (T in ``grid``, m_lo), the least GPUs of a pipeline of one model chunk
    per stage and at least m_lo micro-batches finishing in T: T >= path + (m - 1) x every
    stage's backward; a path in [P_k, P_k+1] (``DRAIN_PATHS`` geometric intervals from the
    path floor ``lo`` to T) leaves each stage's backward (T - P_k) / (m - 1)."""
    t = grid[:, None]
    shape = (grid.size, m_lo.size)
    stage = np.broadcast_to(t / m_lo, shape)
    ratio = np.maximum(grid / lo, 1.0) ** (1.0 / DRAIN_PATHS)
    one = np.full(shape, np.inf)
    several = m_lo > 1
    for k in range(DRAIN_PATHS):
        p_lo, p_hi = lo * ratio**k, lo * ratio ** (k + 1)
        if k == DRAIN_PATHS - 1:
            p_hi = grid  # the last interval ends at T itself
        budget = np.where(several, (grid - p_lo)[:, None] / np.maximum(m_lo - 1, 1), np.inf)
        drain = Drain(budget, back, fixed / 2, float(extra))
        path = np.broadcast_to(p_hi[:, None] - cut, shape)
        one = np.minimum(one, least_gpus(units, tps, times, fixed, stage, path, drain=drain,
                                         sync=sync))  # fmt: skip
    return one


EXACT_M = 32
"""Micro-batches per pipeline taken one by one; past this, in ranges growing by ``RATIO``."""
RATIO = 1.05


def batch_floor_s(
    model: ModelSpec,
    global_batch: int,
    floors: list[TypeFloor],
    gpus: np.ndarray,
    stages: int = 1,
    per_size: bool = False,
) -> np.ndarray:
    """Returns the floor of the iteration time (module docstring) of every plan on ``gpus``
    GPUs in all (a numpy array of counts) of the types ``floors``, whose every pipeline has
    at least ``stages`` stages; inf where there is no GPU. ``per_size``: the floor at each
    micro-batch size (stacked on a first axis) instead of their least."""
    total = np.asarray(gpus, dtype=float)
    best = np.full(total.shape, np.inf)
    sizes: list[np.ndarray] = []
    key = tuple(floors)
    for i, size in enumerate(floors[0].micro_batches):
        grid, kappa = _table(model, global_batch, key, i, stages)
        need = kappa * (global_batch // size)  # GPUs a plan finishing in grid[k] needs
        # the first grid time whose need the count meets; the floor is the one before it
        first = np.searchsorted(-need, -total * (1 + _SLACK), side="left")
        at = np.where(first > 0, grid[np.clip(first - 1, 0, grid.size - 1)], grid[0])
        at = np.where(total > 0, at, np.inf)
        sizes.append(at)
        best = np.minimum(best, at)
    return np.stack(sizes) if per_size else best

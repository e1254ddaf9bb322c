"""Proven lower bounds on a rented configuration's iteration time, from the cost model's blocks.

Every plan the searches can return for a configuration (one offer, or two offers mixed) is
priced by ``estimate``. These facts of ``estimate`` hold for any plan on those GPUs:

* **throughput**: every device runs its share of the layers and the head, each at no more
  than the best fraction of peak any layer or head shape of the plan's micro-batch size
  reaches on its GPU type (over every tensor-parallel degree that divides its node, with
  and without sequence parallelism); the iteration lasts at least as long as the busiest
  device, hence at least ``flops / sum(GPUs x peak x best efficiency)``;
* **critical path**: the replay of the schedule runs each micro-batch's forward through
  every stage in order and its backward back, each stage taking its layers' times (plus
  the embedding on the first stage and the head on the last), so the iteration lasts at
  least one micro-batch's forward and backward through all layers, the embedding and the
  head, each at the fastest time any of the configuration's GPU types reaches for it;
* **coupled**: the two hold for the same plan, whose TP degrees cannot be both the most
  efficient (throughput) and the fastest (path): a Lagrangian combination of them over the
  pieces' choices of type and degree (``coupled_floor_s``), the dual of the linear program
  that relaxes those choices.

Every layer at TP > 1 also runs its tensor-parallel collectives, which ``estimate`` puts on
the stage's backward: a stage at TP t is busy for them too, and they lie on the path. The
per-layer floors at TP t add the least of them (``tp_comm_floor_s``: ``stage_times``' own
collective time of a one-layer stage, less the share overlap may hide), so the throughput,
path and coupled floors hold with them.

A plan has one micro-batch size, a divisor of the global batch: the bound is, over those
sizes, the least of the largest of the three at that size (a large micro-batch computes
efficiently but lengthens the critical path). All read ``params.compute``, so a measured
profile moves the bound as it moves the estimate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hetplan.cluster import Node
from hetplan.cost.dp_sync import reduction_floor_s
from hetplan.cost.estimate import StageKey, stage_times
from hetplan.cost.params import CostParams
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.homogeneous_candidates import divisors


@dataclass(frozen=True)
class TypeFloor:
    """What no plan beats on one GPU type, per micro-batch size a plan may use (one per
    plan): ``micro_batches[i]`` is a size, the other fields its floors."""

    micro_batches: tuple[int, ...]
    rate_flops: tuple[float, ...]
    """Model FLOP/s of one GPU at the best efficiency any layer or head shape reaches."""
    layer_s: tuple[float, ...]
    """Fastest forward + backward of one transformer layer for one micro-batch."""
    embed_s: tuple[float, ...]
    """Fastest forward + backward of the embedding for one micro-batch."""
    head_s: tuple[float, ...]
    """Fastest forward + backward of the head (final norm, output layer, loss)."""
    fixed_s: float = 0.0
    """What every stage adds to each micro-batch's forward + backward whatever it computes:
    the fixed cost per micro-batch and the pipelining runtime's cost per action, at one
    model chunk (``estimate.stage_times``; more chunks add more)."""
    tps: tuple[int, ...] = ()
    """The tensor-parallel degrees a stage on this type may use (the divisors of its node)."""
    layer_tp: tuple[tuple[float, ...], ...] = ()
    """``layer_tp[i][k]``: fastest forward + backward of one layer at micro-batch size i and
    TP ``tps[k]`` (with or without sequence parallelism)."""
    embed_tp: tuple[tuple[float, ...], ...] = ()
    """The embedding's, likewise."""
    head_tp: tuple[tuple[float, ...], ...] = ()
    """The head's, likewise."""
    layer_back_tp: tuple[tuple[float, ...], ...] = ()
    """``layer_back_tp[i][k]``: fastest backward alone of one layer at micro-batch size i
    and TP ``tps[k]`` (a stage's backward, ``provision_batch``'s pipeline drain)."""
    reduce_tp: tuple[tuple[float, ...], ...] = ()
    """``reduce_tp[k][n]``: what one layer's gradient reduction among n data-parallel
    holders costs a device holding it at TP ``tps[k]`` beside no compute, whatever the ZeRO
    stage (``dp_sync.reduction_floor_s``), n from 0 to the global batch (the most pipelines
    a plan has); empty without the node (no such floor)."""


def micro_batches(global_batch: int) -> list[int]:
    """Returns every micro-batch size a plan may use: the global batch is a whole number of
    micro-batches in both searches, so a divisor of it."""
    return divisors(global_batch)


def tp_comm_floor_s(
    model: ModelSpec,
    node: Node,
    params: CostParams,
    tp: int,
    mb: int,
    precision: str,
    flash: bool,
    sp: bool,
    overlap: bool,
) -> float:
    """Returns the least tensor-parallel collective time one layer adds to a stage's
    backward at TP ``tp`` on ``node`` (``estimate.stage_times``' own: a one-layer stage's
    ``tp_comm``, without the embedding's and head's). With ``overlap`` (plans may overlap
    their TP collectives, only with sequence parallelism) ``stage_times`` hides
    min(tp_overlap x comm, compute): at most that share, so (1 - tp_overlap) x comm stays."""
    if tp <= 1:
        return 0.0
    stub = Plan(mb, mb, (), precision=precision, sequence_parallel=sp, flash_attention=flash)
    key = StageKey(node.gpu, node.intra_node_bytes_per_s, tp, 1, False, False, False)
    comm = max(stage_times(stub, model, key, node, params)[3], 0.0)
    if overlap and sp:
        comm *= 1.0 - min(max(params.gpu(node.gpu.name).tp_overlap, 0.0), 1.0)
    return comm


def type_floor(
    model: ModelSpec,
    gpu: GPUType,
    gpus_per_node: int,
    global_batch: int,
    params: CostParams,
    precision: str,
    flash: bool,
    node: Node | None = None,
    overlap_tp: bool = True,
    largest: int | None = None,
) -> TypeFloor:
    """Returns the floors of ``gpu`` in nodes of ``gpus_per_node`` (memoized), over every
    tensor-parallel degree dividing the node, with and without sequence parallelism. With
    the ``node`` (its intra-node link), each layer at TP > 1 also pays its tensor-parallel
    collectives (``tp_comm_floor_s``; ``overlap_tp``: plans may overlap them); with the
    node and ``largest`` (the most GPUs a node of any configuration holds), the gradient
    reduction's floors ``reduce_tp``."""
    src = params.compute

    def make() -> TypeFloor:
        layer_flops, head_flops = 3 * model.layer_flops(), 3 * model.head_flops()
        cols: list[tuple[float, float, float, float]] = []
        per_tp: list[tuple[tuple[float, ...], ...]] = []
        mbs = micro_batches(global_batch)
        tps = tuple(divisors(gpus_per_node))
        for mb in mbs:
            rate = 0.0
            lts: list[float] = []
            ets: list[float] = []
            hts: list[float] = []
            bts: list[float] = []
            for tp in tps:
                fb = bk = float("inf")
                for sp in {False, tp > 1}:
                    lt = src.layer(model, gpu, params, tp, mb, precision, flash, sp).times
                    tc = 0.0
                    if node is not None:  # on the backward side of the replay, as estimate's
                        tc = tp_comm_floor_s(model, node, params, tp, mb, precision, flash, sp,
                                             overlap_tp)  # fmt: skip
                    fb = min(fb, lt.forward_s + lt.backward_s + tc)
                    bk = min(bk, lt.backward_s + tc)
                    rate = max(rate, mb * layer_flops / tp / (lt.forward_s + lt.backward_s + tc))
                ht = src.head(model, gpu, params, tp, mb, precision, flash).times
                hb = ht.forward_s + ht.backward_s
                rate = max(rate, mb * head_flops / tp / hb)
                et = src.embedding(model, gpu, params, tp, mb, precision, flash).times
                lts.append(fb)
                hts.append(hb)
                ets.append(et.forward_s + et.backward_s)
                bts.append(bk)
            cols.append((rate, min(lts), min(ets), min(hts)))
            per_tp.append((tuple(lts), tuple(ets), tuple(hts), tuple(bts)))
        rates, layers, embeds, heads = zip(*cols, strict=True)
        fixed = max(params.gpu(gpu.name).microbatch_overhead_s, 0.0) + 2 * max(
            src.action_overhead_s(gpu), 0.0
        )
        lt_, et_, ht_, bt_ = zip(*per_tp, strict=True)
        reduce: tuple[tuple[float, ...], ...] = ()
        if node is not None and largest is not None:
            holders = range(global_batch + 1)
            reduce = tuple(
                tuple(reduction_floor_s(model, precision, tp, node, n, largest, params)
                      for n in holders)
                for tp in tps
            )  # fmt: skip
        return TypeFloor(tuple(mbs), rates, layers, embeds, heads, fixed, tps, lt_, et_, ht_,
                         bt_, reduce)  # fmt: skip

    link = None
    if node is not None:
        link = (node.gpu, node.intra_node_bytes_per_s, overlap_tp, node.network_bytes_per_s,
                node.gpus, largest)  # fmt: skip
    key = ("type_floor", model, gpu, gpus_per_node, global_batch, params.gpu(gpu.name),
           precision, flash, link)  # fmt: skip
    out: TypeFloor = src.cached(key, make)
    return out


def path_floor_s(model: ModelSpec, floors: list[TypeFloor], i: int, stages: int = 1) -> float:
    """Returns the critical-path floor of an iteration at micro-batch ``floors[.].
    micro_batches[i]`` on GPUs of these types: one micro-batch through every layer, the
    embedding and the head, each on its fastest type, and through the fixed costs of at
    least ``stages`` stages."""
    return (
        model.layers * min(f.layer_s[i] for f in floors)
        + min(f.embed_s[i] for f in floors)
        + min(f.head_s[i] for f in floors)
        + stages * min(f.fixed_s for f in floors)
    )


def iteration_floor_s(
    model: ModelSpec,
    global_batch: int,
    floors: list[TypeFloor],
    gpus: list[np.ndarray],
    stages: int = 1,
    per_size: bool = False,
) -> np.ndarray:
    """Returns the lower bound of the iteration time for every count combination:
    ``gpus[i]`` holds the GPU counts of type ``floors[i]`` (numpy arrays that broadcast), of
    plans whose every pipeline has at least ``stages`` stages (each pays its fixed costs per
    micro-batch).

    A plan has one micro-batch size: the bound at each size is the larger of the
    throughput, critical-path and coupled floors at that size (``coupled_floor_s``), and
    the plan's time is at least the least of these over the sizes.

    Throughput with fixed costs: a device of pipeline r is busy at least m_r (its
    micro-batches) x (its FLOPs per micro-batch / its best rate + its fixed cost), at most
    the iteration T; times its rate and summed over the devices, T x (sum of rates) >= all
    FLOPs + sum of m_r x rate x fixed, and the pipelines' m_r sum to global / micro-batch
    (each pipeline has a device), so the second term is at least that many times the least
    rate x fixed of the types.

    ``per_size``: the bound at each size instead (stacked on a first axis, in the order of
    ``micro_batches``), for callers that couple it with other floors size by size."""
    flops = global_batch * model.model_flops_per_sequence()
    best: np.ndarray | None = None
    sizes: list[np.ndarray] = []
    for i in range(len(floors[0].micro_batches)):
        rate = sum(f.rate_flops[i] * g for f, g in zip(floors, gpus, strict=True))
        m = global_batch // floors[0].micro_batches[i]
        fixed_work = m * stages * min(f.rate_flops[i] * f.fixed_s for f in floors)
        with np.errstate(divide="ignore"):
            at = np.maximum((flops + fixed_work) / np.asarray(rate, dtype=float),
                            path_floor_s(model, floors, i, stages))  # fmt: skip
            at = np.maximum(at, coupled_floor_s(model, m, floors, i, rate, stages))
        sizes.append(at)
        best = at if best is None else np.minimum(best, at)
    assert best is not None
    return np.stack(sizes) if per_size else best


Line = tuple[float, float]
"""A piece's cost at one GPU type and TP degree as ``a + lambda x b``: ``a`` its weighted
device-seconds (TP x the type's rate x its time), ``b`` its time."""


def piece_lines(
    model: ModelSpec, floors: list[TypeFloor], i: int, stages: int = 1
) -> list[tuple[int, list[Line]]]:
    """Returns, at micro-batch size ``floors[.].micro_batches[i]``, what every micro-batch
    passes through once per pipeline, as (how many, lines over the types and TP degrees):
    the layers, the embedding, the head, and ``stages`` stages' fixed costs (TP 1 at
    least)."""
    out: list[tuple[int, list[Line]]] = []
    for count, attr in ((model.layers, "layer_tp"), (1, "embed_tp"), (1, "head_tp")):
        lines = [
            (t * f.rate_flops[i] * x, x)
            for f in floors
            for t, x in zip(f.tps, getattr(f, attr)[i], strict=True)
        ]
        out.append((count, lines))
    out.append((stages, [(f.rate_flops[i] * f.fixed_s, f.fixed_s) for f in floors]))
    return out


def _envelope(lines: list[Line], lam: float) -> float:
    return min(a + lam * b for a, b in lines)


def _kinks(lines: list[Line]) -> list[float]:
    """Returns the positive multipliers where the lower envelope of ``lines`` bends."""
    out = []
    for (a1, b1), (a2, b2) in itertools.combinations(lines, 2):
        if b1 != b2:
            lam = (a2 - a1) / (b1 - b2)
            if lam > 0:
                at = a1 + lam * b1
                if at <= _envelope(lines, lam) * (1 + 1e-12):  # on the envelope: a bend
                    out.append(lam)
    return out


def coupled_floor_s(
    model: ModelSpec,
    m: int,
    floors: list[TypeFloor],
    i: int,
    rate: np.ndarray | float,
    stages: int = 1,
) -> np.ndarray:
    """Returns the floor that couples throughput and critical path at micro-batch size i
    (``m`` = global batch / size micro-batches in all, ``rate`` = sum of GPUs x their
    type's best rate, per count combination).

    Small tensor-parallel degrees compute efficiently but make each micro-batch's path
    long; large ones shorten the path and spend more device-seconds: the throughput floor
    takes every piece at its most efficient degree, the path floor at its fastest, and no
    plan has both. For pipeline r with m_r micro-batches and stages j (TP t_j on a GPU of
    rate w_j, per micro-batch time s_j): its devices are busy m_r s_j each, at most T, so
    T x rate >= sum_r m_r E_r with E_r = sum_j t_j w_j s_j; its path P_r = sum_j s_j <= T.
    For any lambda >= 0, E_r + lambda P_r = sum_j (t_j w_j + lambda) s_j >= H(lambda): every
    layer, the embedding, the head and one fixed cost each at the least (t w + lambda) x
    time over the types and degrees. Hence T x rate >= m (H(lambda) - lambda T), that is
    T >= m H(lambda) / (rate + lambda m). H is concave and piecewise linear, so the ratio is
    largest at one of its bends (or at 0, or at infinity: the path floor). With ``stages``,
    every pipeline has at least that many stages, each with its fixed costs."""
    lams, h0, h1, p0, p1 = _multipliers(model, tuple(floors), i)
    hs, path = h0 + stages * h1, p0 + stages * p1  # the fixed costs once per stage
    r = np.asarray(rate, dtype=float)
    # lambda -> infinity: every piece at its fastest (the path floor)
    out = np.full(r.shape, path)
    with np.errstate(divide="ignore", invalid="ignore"):
        at = m * hs / (r[..., None] + lams * m)  # every bend at once
        out = np.maximum(out, np.nan_to_num(at, nan=0.0).max(axis=-1, initial=0.0))
    return out


@lru_cache(maxsize=4096)
def _multipliers(
    model: ModelSpec, floors: tuple[TypeFloor, ...], i: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Returns what ``coupled_floor_s`` needs, independent of the GPU counts and of the
    stages: the multipliers where H bends (and 0); at each, H of the layers, embedding and
    head, and of one stage's fixed costs; and both at infinity (their fastest times)."""
    *pieces, (_, fixed) = piece_lines(model, list(floors), i, 1)
    lams = {0.0}
    for _, lines in [*pieces, (1, fixed)]:
        lams.update(_kinks(lines))
    grid = sorted(lams)
    h0 = [sum(n * _envelope(lines, lam) for n, lines in pieces) for lam in grid]
    h1 = [_envelope(fixed, lam) for lam in grid]
    p0 = float(sum(n * min(b for _, b in lines) for n, lines in pieces))
    return np.array(grid), np.array(h0), np.array(h1), p0, min(b for _, b in fixed)

"""Baselines for a mixed cluster, scored by the same ``estimate``: the best plan on one GPU
type alone (the homogeneous search), and the best Megatron-style uniform plan over every
GPU (every candidate that fits, in order of a proven bound, no finalist cap)."""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import cast

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams
from hetplan.cost.sharding import dominated_by_zero1
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints, homogeneous_space
from hetplan.search.het_bounds import PlanBounds
from hetplan.search.het_cache import SearchCache
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.homogeneous_candidates import SearchSpace, divisors
from hetplan.search.layout import uniform_plan
from hetplan.search.provision_bounds import iteration_floor_s, type_floor

Scored = tuple[Plan, Estimate]


def best_single_type(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams,
    flash_attention: bool,
    constraints: PlanConstraints | None = None,
    cache: SearchCache | None = None,
) -> tuple[Scored | None, list[str]]:
    """Returns the fastest homogeneous plan on the nodes of any one class (within the
    constraints), and notes; ``cache`` keeps each class's answer for other searches, and
    the homogeneous search's memo per node hardware (it holds across node counts).

    Classes are searched most peak FLOP/s first, each after the first with the best time
    so far as its cutoff: a class whose provisioning floor (``provision_bounds.
    iteration_floor_s``, proven for every plan of its GPUs) is above it is not searched,
    and otherwise its search stops where its own proven bound passes it
    (``search_homogeneous``). The answer is the same: a class's best that beats the
    cutoff is found whole."""
    space = homogeneous_space(constraints or PlanConstraints())
    notes: list[str] = []
    best: Scored | None = None
    groups: dict[tuple[str, int, float, float], list[str]] = {}
    for n in cluster.nodes:
        sig = (n.gpu.name, n.gpus, n.intra_node_bytes_per_s, n.network_bytes_per_s)
        groups.setdefault(sig, []).append(n.name)
    subs = []
    for sig, names in groups.items():
        sub = cluster.without_nodes({n.name for n in cluster.nodes} - set(names))
        if not sub.nodes[0].gpu.supports(precision):
            notes.append(f"{sig[0]} has no {precision} support; left out")
            continue
        subs.append((sig, sub))
    order = sorted(range(len(subs)), key=lambda i: -subs[i][1].nodes[0].gpu.peak_flops(precision)
                   * subs[i][1].num_gpus)  # fmt: skip
    answers: dict[int, object] = {}
    for i in order:
        sig, sub = subs[i]
        cutoff = math.inf if best is None else best[1].iteration_time_s
        answers[i] = answer = _single(model, sub, global_batch, precision, params, space,
                                      flash_attention, cache, cutoff)  # fmt: skip
        top = cast(Scored | None, None if isinstance(answer, InputError) else answer)
        if top and (best is None or top[1].iteration_time_s < best[1].iteration_time_s):
            best = top
    for i, (sig, _) in enumerate(subs):  # in the cluster's order
        answer = answers[i]
        if isinstance(answer, InputError):
            notes.append(f"single-type baseline on {sig[0]}: {answer.reason}")
    return best, notes


def _single(
    model: ModelSpec,
    sub: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams,
    space: SearchSpace,
    flash_attention: bool,
    cache: SearchCache | None,
    cutoff: float,
) -> object:
    """Returns the homogeneous search's top plan on ``sub`` (or None), or the InputError it
    raised; None also where no plan is at most ``cutoff``. ``cache`` keeps the top plan,
    and the largest cutoff under which none was found."""
    key = (sub.nodes, global_batch, precision, space, flash_attention)
    if cache is not None:
        if key in cache.homogeneous:
            return cache.homogeneous[key]
        if cache.homogeneous_none_under.get(key, -math.inf) >= cutoff:
            return None
    if cutoff < math.inf:  # provisioning's proven floor of every plan on these nodes
        node = sub.nodes[0]
        floor = type_floor(model, node.gpu, node.gpus, global_batch, params, precision,
                           flash_attention)  # fmt: skip
        if (
            float(iteration_floor_s(model, global_batch, [floor], [np.array(sub.num_gpus)]))
            > cutoff
        ):
            _found_none(cache, key, cutoff)
            return None
    memo = None
    if cache is not None:
        memo = cache.homogeneous_memo(sub.nodes[0], global_batch, precision, space,
                                      flash_attention)  # fmt: skip
    try:
        res = search_homogeneous(
            model, sub, global_batch, precision, 1, params, space=space,
            flash_attention=flash_attention, memo=memo, exact_counts=False, cutoff=cutoff,
        )  # fmt: skip
        answer: object = res.ranked[0] if res.ranked else None
    except InputError as exc:
        answer = exc
    if answer is None and cutoff < math.inf:  # none under the cutoff: maybe above
        _found_none(cache, key, cutoff)
    elif cache is not None:
        cache.homogeneous[key] = answer
    return answer


def _found_none(cache: SearchCache | None, key: tuple[object, ...], cutoff: float) -> None:
    """Records in ``cache`` that no plan of ``key``'s nodes is at most ``cutoff``."""
    if cache is not None:
        known = cache.homogeneous_none_under.get(key, -math.inf)
        cache.homogeneous_none_under[key] = max(cutoff, known)


def best_uniform(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams,
    flash_attention: bool,
    constraints: PlanConstraints | None = None,
    ceiling_s: float = math.inf,
) -> Scored | None:
    """Returns the fastest Megatron-style plan over all GPUs: equal layers and batch shares
    (micro-batches up to 8, no or full recomputation, ZeRO 0/1 unless the constraints name
    other values; only plans they allow); ``ceiling_s``: only plans whose bound is below it
    (the heterogeneous search's ceiling), None where none is.

    Candidates that fit (the memory ``estimate`` sums) are estimated in order of a proven
    lower bound of their time (``PlanBounds.bound_s``) until the bound passes the best
    estimate. That bound and the memory check are taken lazily: candidates wait in order
    of a cheaper floor of the bound (``PlanBounds.compute_floor_s``), and one is bounded
    and checked when its floor comes first, so the candidates estimated, and their order,
    are those of bounding them all."""
    if not all(n.gpu.supports(precision) for n in cluster.nodes):
        return None
    n_gpus = cluster.num_gpus
    gpn = math.gcd(*(n.gpus for n in cluster.nodes))
    bounds = PlanBounds(model, cluster, params)
    c = constraints or PlanConstraints()
    recomputes = c.recompute or ("none", "full")
    # (floor or bound, index, bounded, plan): the index breaks ties in enumeration order
    queue: list[tuple[float, int, bool, Plan]] = []
    for tp in divisors(gpn):
        if model.heads % tp or model.ffn % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for pp in divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if pp > model.layers or global_batch % dp:
                continue
            # one layout of the degrees (equal shares: dp divides the batch), its knobs set
            # per candidate below
            base = uniform_plan(cluster, model.layers, tp, pp, dp, 1, global_batch)
            for mb in divisors(global_batch // dp):
                if mb > 8 if c.micro_batch is None else mb not in c.micro_batch:
                    continue
                zeros: tuple[int, ...] = (0, 1) if dp > 1 else (0,)
                if c.zero_stage is not None and dp > 1:
                    zeros = tuple(z for z in c.zero_stage if z <= 3)
                for rc in recomputes:
                    for zero in zeros:
                        if dominated_by_zero1(zero, dp, pp > 1, False, zeros):
                            continue
                        sp = tp > 1 if c.sequence_parallel is None else c.sequence_parallel
                        plan = replace(
                            base, micro_batch_size=mb, precision=precision, recompute=rc,
                            zero_stage=zero, sequence_parallel=sp,
                            flash_attention=flash_attention, overlap_tp_comm=c.overlap_tp_comm,
                        )  # fmt: skip
                        if not c.allows(plan):
                            continue
                        floor = bounds.compute_floor_s(plan)
                        # the caller has plans this fast: the slower ones are not sought
                        if ceiling_s == math.inf or floor < ceiling_s:
                            queue.append((floor, len(queue), False, plan))
    heapq.heapify(queue)
    best: Scored | None = None
    while queue:
        key, i, bounded, plan = heapq.heappop(queue)
        if best is not None and key >= best[1].iteration_time_s:
            break
        if not bounded:
            bound = bounds.bound_s(plan, False)
            if (ceiling_s == math.inf or bound < ceiling_s) and bounds.fits(plan)[0]:
                heapq.heappush(queue, (bound, i, True, plan))
            continue
        est = estimate(plan, model, cluster, params, validate=False)
        if est.fits and (best is None or est.iteration_time_s < best[1].iteration_time_s):
            best = (plan, est)
    return best

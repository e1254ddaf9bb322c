"""Two-type mixes for ``provision --mixes``: the bounds of every (count, count) configuration
of every two offers at once (``mix_grid``, numpy), tightened where the first bounds leave a
mix live (``tighten``), and the exploration that plans the live mix closest to the front
with the heterogeneous search until every mix is planned or pruned (``explore_mixes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.comm import step_collectives_s
from hetplan.cost.estimate_result import Estimate
from hetplan.market import Offer
from hetplan.plan import Plan
from hetplan.search.provision_bounds import iteration_floor_s
from hetplan.search.provision_dominance import swap_cap
from hetplan.search.provision_points import (
    Point,
    ProvisionJob,
    Unexplored,
    closest_to_front,
    count_reason,
    dominated_from_s,
    front_cost,
    front_cost_at,
    gpu_memory,
    iterations,
    offer_floor,
)
from hetplan.search.provision_stages import mix_iteration_floor_s, mix_time_floor_s
from hetplan.search.spot import (
    checkpoint_floor_s,
    configuration_plan,
    mixed_load,
    offer_load,
    slowdowns,
)


def mix_cluster(a: Offer, na: int, b: Offer, nb: int, pricing: str) -> Cluster:
    """Returns the cluster of ``na`` nodes of offer ``a`` and ``nb`` of ``b``."""
    return Cluster(a.cluster(na, pricing).nodes + b.cluster(nb, pricing).nodes)


@dataclass
class MixGrid:
    """Every (count, count) configuration of every pair of offers, flattened, with bounds."""

    pair: np.ndarray
    na: np.ndarray
    nb: np.ndarray
    t_lb: np.ndarray
    c_lb: np.ndarray
    slow: np.ndarray
    usd_hour: np.ndarray


def mix_grid(
    job: ProvisionJob, offers: list[Offer], batch: bool = True
) -> tuple[MixGrid, list[tuple[Offer, Offer]], int]:
    """Returns the bounds of every two-offer configuration that could have a plan, the offer
    pairs, and how many configurations have none (past --max-gpus, a spot run that never
    finishes, or too little memory for the model's state: the heterogeneous search's own
    refusal), counted by reason in ``job.impossible``. The bounds are of the plans using
    every node (``explore_mixes``: the others are dominated), so they add the step's
    scalar all-reduces across all the nodes (``spread_floor_s``). ``batch``: with the batch floor
    (``provision_batch``; False only to count what it prunes); once ``job.stop_at`` has
    passed, the pairs left get the cheap floors alone (still proven, looser: no mix is
    planned after it, so they only list the mixes left)."""
    from hetplan.search.heterogeneous import _state_floor_bytes

    model, spot = job.model, job.spot
    pairs: list[tuple[Offer, Offer]] = []
    parts: list[tuple[np.ndarray, ...]] = []
    impossible = 0
    floor_memo: dict[int, float] = {}

    def state_floor(n: int) -> float:
        if n not in floor_memo:
            floor_memo[n] = _state_floor_bytes(model, job.precision, n)
        return floor_memo[n]

    memory = {o.name: gpu_memory(job, o) for o in offers}
    for i, a in enumerate(offers):
        for b in offers[i + 1 :]:
            fa, fb = offer_floor(job, a), offer_floor(job, b)
            na = np.arange(1, a.max_nodes + 1)[:, None]
            nb = np.arange(1, b.max_nodes + 1)[None, :]
            ga, gb = na * a.gpus_per_node, nb * b.gpus_per_node
            usd_hour = a.price(job.pricing) * ga + b.price(job.pricing) * gb
            slow = np.ones(usd_hour.shape)
            if spot:  # a floor: every plan checkpoints at least the mean node's state
                la = np.array([offer_load(a, int(n), job.terms) for n in na[:, 0]])
                lb = np.array([offer_load(b, int(n), job.terms) for n in nb[0, :]])
                load = mixed_load([(la[:, None, 0], la[:, None, 1]),
                                   (lb[None, :, 0], lb[None, :, 1])])  # fmt: skip
                slow = slowdowns(*load, job.terms, checkpoint_floor_s(model, na + nb), True)
            total = ga + gb
            ok = np.ones(total.shape, dtype=bool)
            if job.max_gpus is not None:
                ok &= total <= job.max_gpus
            count_reason(job.impossible, "max_gpus", int((~ok).sum()))
            if job.max_usd_per_hour is not None:
                capped = ok & (usd_hour > job.max_usd_per_hour)
                count_reason(job.impossible, "hourly_cap", int(capped.sum()))
                ok &= ~capped
            finishes = np.broadcast_to(np.isfinite(slow), total.shape)
            count_reason(job.impossible, "spot", int((ok & ~finishes).sum()))
            ok &= finishes
            held = ga * memory[a.name] + gb * memory[b.name]
            sizes, where = np.unique(total[ok], return_inverse=True)  # each GPU count once
            need = np.array([state_floor(int(n)) for n in sizes])
            fits = need[where.ravel()] <= held[ok]
            count_reason(job.impossible, "memory", int((~fits).sum()))
            ok[ok] = fits
            # a dominating offer (not the partner) stands in for the dominated one's nodes
            stood_in = ok & ((na <= swap_cap(job.dominated_by, a, b))
                             | (nb <= swap_cap(job.dominated_by, b, a)))  # fmt: skip
            stood = int(stood_in.sum())
            job.dominated[0] += stood
            ok &= ~stood_in
            xs, ys = np.nonzero(ok)  # the iteration floor only where a plan could finish
            slow_ok = np.broadcast_to(slow, total.shape)[xs, ys]
            if batch and not job.out_of_time():  # whole micro-batches, layers and GPUs
                it_lb = mix_iteration_floor_s(model, job.global_batch, (fa, fb), ga[xs, 0],
                                              gb[0, ys], aware=False)  # fmt: skip
            else:
                it_lb = iteration_floor_s(model, job.global_batch, [fa, fb],
                                          [ga[xs, 0], gb[0, ys]])  # fmt: skip
            it_lb = it_lb + spread_floor_s(job, a, b, xs + ys + 2)  # every node used
            t_lb = iterations(job) * it_lb * slow_ok
            fin = np.isfinite(t_lb)  # a rate of zero: no plan (never for a GPU type sold)
            count_reason(job.impossible, "compute", int((~fin).sum()))
            xs, ys, t_lb, slow_ok = xs[fin], ys[fin], t_lb[fin], slow_ok[fin]
            impossible += int(total.size - xs.size) - stood
            pairs.append((a, b))
            parts.append((
                np.full(xs.shape, len(pairs) - 1), xs + 1, ys + 1, t_lb,
                t_lb / 3600 * usd_hour[xs, ys], slow_ok, usd_hour[xs, ys],
            ))  # fmt: skip
    cols = [np.concatenate(c) if c else np.zeros(0) for c in zip(*parts, strict=True)]
    if not cols:
        cols = [np.zeros(0)] * 7
    return MixGrid(*cols), pairs, impossible


def explore_mixes(
    job: ProvisionJob, offers: list[Offer], points: list[Point]
) -> tuple[int, int, list[Unexplored]]:
    """Adds every two-type mix that bounds cannot rule out; returns (planned, pruned,
    unexplored); those with no possible plan are counted by reason in ``job.impossible``.

    The bounds of every (count, count) configuration of every two offers are computed at once
    (numpy). Until none is left, the configurations the points found so far dominate at
    their bounds are pruned, and the live one closest to the front (smallest ratio of its
    cost bound to the front's cost at its time bound; beyond the front's fast end first) is
    planned with the heterogeneous search, which looks only for plans faster than the time
    from which the points found dominate the mix (``dominated_from_s`` over the iterations
    and the mix's least slowdown: its ``ceiling_s``), so that its bounds cut the rest.
    Nothing is left unexplored, unless ``job.stop_at`` passes (checked before each mix): the
    live mixes are then returned with their bounds.

    The search looks only for plans with a device on every node of the mix (its bounds,
    ``spread_floor_s``, only for those): a plan leaving a node idle is a plan of the smaller
    configuration of the nodes it uses (a single type, or a mix with fewer nodes), which is
    planned, pruned or impossible (every count of every offer, and every mix, is; by
    induction on the nodes, each smaller mix's own idle-node plans likewise). Its point there
    is at least as fast, its slowdown no larger (the idle nodes' preemptions add to the rate
    and to the cost of each: the useful share only falls) and its price lower, so it
    dominates the mix's; where that configuration was pruned, a point found dominates its
    bounds and so this plan. The search's single-type baseline is the case of a whole type
    left idle."""
    from hetplan.search.het_cache import SearchCache
    from hetplan.search.heterogeneous import search_heterogeneous

    model, tokens, global_batch, precision, spot, params, _, prune, flash = job.unpack()
    grid, pairs, _ = mix_grid(job, offers)
    cache = SearchCache(model, params)  # mixes of the same offers share their class tables
    live = np.arange(grid.t_lb.size)
    planned = pruned = 0
    if prune and live.size:  # the survivors of the single types' front, tightened
        tighten(job, grid, pairs, live[front_cost(grid.t_lb, points) > grid.c_lb])
    while live.size:
        t_lb, c_lb = grid.t_lb[live], grid.c_lb[live]
        at = front_cost_at(points)  # the points sorted once for both dominance tests
        front = front_cost(t_lb, points, at)
        if prune:
            dom = front <= c_lb
            pruned += int(dom.sum())
            live, t_lb, c_lb, front = live[~dom], t_lb[~dom], c_lb[~dom], front[~dom]
            if not live.size:
                break
        if job.out_of_time():
            order = np.lexsort((grid.c_lb[live], grid.t_lb[live]))
            left = [unexplored_of(grid, pairs, int(q)) for q in live[order]]
            return planned, pruned, left
        pick = closest_to_front(c_lb, front)
        q = int(live[pick])
        live = np.delete(live, pick)
        planned += 1
        job.tick(1, 0, points)
        a, b = pairs[int(grid.pair[q])]
        na, nb = int(grid.na[q]), int(grid.nb[q])
        cluster = job.limits.apply_to_cluster(mix_cluster(a, na, b, nb, job.pricing))
        # a plan slower than this adds nothing: the points found dominate it (its iteration
        # time x its slowdown, at least the mix's floor; a hair above, so rounding never
        # cuts a plan)
        cut = math.inf
        if prune:
            cut = (dominated_from_s(float(grid.usd_hour[q]), points, at) / iterations(job)
                   / float(grid.slow[q]) * (1 + 1e-9))  # fmt: skip

        def ranked_by(
            k: int, cluster: Cluster = cluster, cut: float = cut
        ) -> list[tuple[Plan, Estimate]]:
            return search_heterogeneous(model, cluster, global_batch, precision, k, params,
                                        flash, job.limits, cache=cache, ceiling_s=cut,
                                        single_type=False, every_node=True).ranked  # fmt: skip

        load = None  # on spot, the plan's own checkpoint time (its largest node's state)
        if spot:
            load = mixed_load([offer_load(a, na, job.terms), offer_load(b, nb, job.terms)])
        found = configuration_plan(ranked_by, model, job.terms, load, float(grid.slow[q]))
        if found is None:
            continue
        plan, est, slow = found
        # the whole rented cluster is paid for, even GPUs the best plan leaves idle
        rented = float(grid.usd_hour[q])
        t = tokens / est.tokens_per_s * slow
        gpus = {a.gpu.name: na * a.gpus_per_node, b.gpu.name: nb * b.gpus_per_node}
        points.append(Point(gpus, spot, t, t / 3600 * rented, rented, plan, est, cluster,
                            float(grid.t_lb[q]), pricing=job.pricing))  # fmt: skip
    return planned, pruned, []


def tighten(
    job: ProvisionJob, grid: MixGrid, pairs: list[tuple[Offer, Offer]], idx: np.ndarray
) -> None:
    """Raises the bounds of mixes ``idx`` to the costlier floors, so only where the first
    bound leaves them live: on spot, the bound over the fewest stages of any pipeline
    (``provision_stages.mix_time_floor_s``, type-aware batch floor included); on demand, the
    type-aware batch floor (each GPU at its own type's times, ``provision_mixbatch``). Once
    ``job.stop_at`` has passed, the pairs left keep their first bounds (no mix is planned
    after it: the bounds only list the mixes left)."""
    for k, (a, b) in enumerate(pairs):
        if job.out_of_time():
            return
        sel = idx[grid.pair[idx] == k]
        if not sel.size:
            continue
        na, nb = grid.na[sel].astype(int), grid.nb[sel].astype(int)
        floors = (offer_floor(job, a), offer_floor(job, b))
        step = spread_floor_s(job, a, b, na + nb)
        if job.spot:
            t = mix_time_floor_s(job.model, job.global_batch, iterations(job), job.terms,
                                 (a, b), floors, na, nb, step)  # fmt: skip
        else:
            it = mix_iteration_floor_s(job.model, job.global_batch, floors,
                                       na * a.gpus_per_node, nb * b.gpus_per_node)  # fmt: skip
            t = iterations(job) * (it + step) * grid.slow[sel]
        grid.t_lb[sel] = np.maximum(grid.t_lb[sel], t)
        grid.c_lb[sel] = grid.t_lb[sel] / 3600 * grid.usd_hour[sel]


def spread_floor_s(job: ProvisionJob, a: Offer, b: Offer, nodes: np.ndarray) -> np.ndarray:
    """Returns, per count of nodes of a mix of offers ``a`` and ``b`` (an array), the least
    time the step's scalar all-reduces take in a plan the mixes' search must consider: one
    with a device on every node (``explore_mixes``), whose all-reduces over all its devices
    cross every node (``comm.step_collectives_s``, the steps inside a node left out: a node
    may hold one device). ``estimate`` adds them to the end of every stage, after everything
    the iteration floors bound (none counts them), so they add to those floors."""
    kinds = [a.cluster(1, job.pricing).nodes[0], b.cluster(1, job.pricing).nodes[0]]
    counts, where = np.unique(np.asarray(nodes, dtype=int), return_inverse=True)
    per = np.array([step_collectives_s(kinds, int(k), 1, job.params) for k in counts])
    return np.asarray(per[where].reshape(np.shape(nodes)), dtype=float)


def unexplored_of(grid: MixGrid, pairs: list[tuple[Offer, Offer]], q: int) -> Unexplored:
    """Returns mix ``q`` of the grid as left unplanned, with its bounds."""
    a, b = pairs[int(grid.pair[q])]
    gpus = {a.gpu.name: int(grid.na[q]) * a.gpus_per_node,
            b.gpu.name: int(grid.nb[q]) * b.gpus_per_node}  # fmt: skip
    return Unexplored(gpus, float(grid.t_lb[q]), float(grid.c_lb[q]))

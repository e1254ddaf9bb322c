"""Provisioning with owned nodes: which of them to train on, and what to rent beside them.

Configurations: every choice of owned nodes (per GPU type, 0 to all of its nodes in file
order, one node at least; ``owned_subsets``) alone, and with every node count of every
offer beside them (planned by the homogeneous search where the result is one kind of node,
else the heterogeneous one). A configuration pays amortisation and energy for the owned
nodes it holds (``cost.money``): those it leaves out stay free for other work. Rented GPUs
cost their rental at the job's pricing; a configuration is pruned only when a point found
is at least as fast as its proven time bound and as cheap as its cost bound
(``provision_bounds``), as for rented configurations.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from hetplan.cluster import Cluster, Node
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.money import node_parts
from hetplan.market import Offer
from hetplan.plan import Plan
from hetplan.search.constraints import homogeneous_space
from hetplan.search.het_cache import SearchCache
from hetplan.search.provision import PROVISION_SPACE
from hetplan.search.provision_batch import batch_floor_s
from hetplan.search.provision_bounds import TypeFloor, iteration_floor_s, type_floor
from hetplan.search.provision_points import (
    Point,
    ProvisionJob,
    closest_to_front,
    count_reason,
    dominated,
    front_cost,
    gpus_label,
    iterations,
    offer_floor,
)
from hetplan.search.spot import (
    checkpoint_floor_s,
    configuration_plan,
    offer_load,
    slowdowns,
)
from hetplan.units import duration_text


def owned_usd_per_hour(owned: Cluster) -> float:
    """Returns what the owned nodes cost per hour of training (amortisation and energy)."""
    total = 0.0
    for node in owned.nodes:
        part = node_parts(node)
        total += 0.0 if part is None else part.total * node.gpus
    return total


def _plan(
    job: ProvisionJob, cluster: Cluster, cache: SearchCache | None = None, top_k: int = 1
) -> list[tuple[Plan, Estimate]]:
    """Returns the ``top_k`` best plans of ``cluster`` by iteration time."""
    from hetplan.search.heterogeneous import search_heterogeneous
    from hetplan.search.homogeneous import search_homogeneous

    if cluster.is_homogeneous():
        space = homogeneous_space(job.limits, PROVISION_SPACE)
        res = search_homogeneous(job.model, cluster, job.global_batch, job.precision,
                                 top_k=top_k, params=job.params, space=space,
                                 flash_attention=job.flash)  # fmt: skip
        return res.ranked
    het = search_heterogeneous(job.model, cluster, job.global_batch, job.precision, top_k,
                               job.params, job.flash, job.limits, cache=cache)  # fmt: skip
    return het.ranked


def owned_subsets(owned: Cluster) -> list[Cluster]:
    """Returns every choice of owned nodes a run may train on, most GPUs first: per GPU type
    (and node size), 0 to all of its nodes, the first ones in file order, at least one node
    in all."""
    groups: dict[tuple[str, int], list[Node]] = {}
    for node in owned.nodes:
        groups.setdefault((node.gpu.name, node.gpus), []).append(node)
    choices = []
    for counts in itertools.product(*(range(len(g) + 1) for g in groups.values())):
        if sum(counts):
            nodes = [n for g, k in zip(groups.values(), counts, strict=True) for n in g[:k]]
            chosen = {id(n) for n in nodes}
            choices.append(tuple(n for n in owned.nodes if id(n) in chosen))  # file order
    choices.sort(key=lambda ns: -sum(n.gpus for n in ns))
    return [Cluster(ns, owned.gpu_types) for ns in choices]


@dataclass(frozen=True)
class _Config:
    """One configuration: owned nodes and rented ones, with its price and time bound."""

    cluster: Cluster
    rented: dict[str, int]
    usd_hour: float
    load: tuple[float, float] | None
    """The rented offer's preemptions (None: none)."""
    t_lb: float
    """Proven lower bound of the time to train (inf: no plan finishes)."""
    owned: dict[str, int]

    @property
    def cost_lb(self) -> float:
        """Returns the proven lower bound of the cost (the time bound at the hourly price)."""
        return self.t_lb / 3600 * self.usd_hour


def _gpus_by_type(cluster: Cluster) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in cluster.nodes:
        out[node.gpu.name] = out.get(node.gpu.name, 0) + node.gpus
    return out


def owned_first(
    job: ProvisionJob, owned: Cluster, offers: list[Offer], points: list[Point]
) -> tuple[int, int]:
    """Adds, for every choice of owned nodes (``owned_subsets``), the owned-only point and
    every owned + rented configuration the bounds cannot rule out; returns (planned,
    pruned). A configuration pays for the owned nodes it holds, not the others: they stay
    free for other work (``docs/provision.md``)."""
    owned = job.limits.apply_to_cluster(owned)
    planned = pruned = 0
    floor_memo: dict[tuple[str, int], TypeFloor] = {}
    # the mixes are made of the same kinds of nodes: their searches share class tables,
    # layer-split frontiers and single-type baselines (the same answers, built once)
    cache = SearchCache(job.model, job.params)

    def floors_of(cluster: Cluster) -> tuple[list[TypeFloor], list[np.ndarray]]:
        kinds: dict[tuple[str, int], int] = {}
        gpu_of = {n.gpu.name: n.gpu for n in cluster.nodes}
        for node in cluster.nodes:
            kinds[(node.gpu.name, node.gpus)] = kinds.get((node.gpu.name, node.gpus), 0) + node.gpus
        j = job
        for g, per in kinds:
            if (g, per) not in floor_memo:
                floor_memo[(g, per)] = type_floor(j.model, gpu_of[g], per, j.global_batch,
                                                  j.params, j.precision, j.flash)  # fmt: skip
        return [floor_memo[k] for k in kinds], [np.array(c) for c in kinds.values()]

    def bound(cluster: Cluster, load: tuple[float, float] | None, it_lb: float) -> float:
        """Returns the proven lower bound of the time to train (inf: no plan finishes).
        ``load``: the rented offer's preemptions (None: none); ``it_lb``: the iteration's
        floor. The slowdown's floor takes every plan's checkpoint at least the mean node's
        state."""
        slow = 1.0
        if load is not None:
            slow = slowdowns(*load, job.terms, checkpoint_floor_s(job.model, len(cluster.nodes)),
                             True)  # fmt: skip
        return iterations(job) * it_lb * slow

    def plan_one(c: _Config) -> None:
        """Plans one configuration and adds its point (a plan's own slowdown: its largest
        node's checkpoint)."""
        nonlocal planned
        planned += 1
        job.tick(1, 0, points)
        floor = 1.0  # on spot, the plan that trains fastest with its own checkpoint
        if c.load is not None:
            least = checkpoint_floor_s(job.model, len(c.cluster.nodes))
            floor = float(slowdowns(*c.load, job.terms, least, True))
        found = configuration_plan(lambda k: _plan(job, c.cluster, cache, k), job.model,
                                   job.terms, c.load, floor)  # fmt: skip
        if found is None:
            return
        plan, est, slow = found
        t = job.tokens / est.tokens_per_s * slow
        points.append(Point(dict(c.rented), job.spot, t, t / 3600 * c.usd_hour, c.usd_hour,
                            plan, est, c.cluster, c.t_lb, dict(c.owned),
                            job.pricing))  # fmt: skip

    rent_nodes: dict[str, list[Node]] = {}
    for offer in offers:
        rent_nodes[offer.name] = [
            replace(n, name=f"rented-{n.name}")
            for n in job.limits.apply_to_cluster(
                offer.cluster(max(offer.max_nodes, 1), job.pricing)
            ).nodes
        ]
    configs: list[_Config] = []
    for mine in owned_subsets(owned):
        floors, counts = floors_of(mine)
        own_hour = owned_usd_per_hour(mine)
        owned_gpus = _gpus_by_type(mine)
        it = float(iteration_floor_s(job.model, job.global_batch, floors, counts))
        own_total = int(sum(int(np.sum(c)) for c in counts))
        it = max(it, float(batch_floor_s(job.model, job.global_batch, floors,
                                         np.array(own_total))))  # fmt: skip
        configs.append(_Config(mine, {}, own_hour, None, bound(mine, None, it), owned_gpus))
        for offer in offers:
            fl = offer_floor(job, offer)
            most = offer.max_nodes
            if job.max_gpus is not None:
                most = min(most, (job.max_gpus - mine.num_gpus) // offer.gpus_per_node)
            # whole micro-batches, layers and GPUs, every count of the offer at once
            totals = own_total + np.arange(max(most, 0) + 1) * offer.gpus_per_node
            whole = batch_floor_s(job.model, job.global_batch, [*floors, fl], totals)
            for n in range(1, most + 1):
                load = offer_load(offer, n, job.terms) if job.spot else None
                gpus = n * offer.gpus_per_node
                usd_hour = own_hour + gpus * offer.price(job.pricing)
                it = float(iteration_floor_s(job.model, job.global_batch, [*floors, fl],
                                             [*counts, np.array(gpus)]))  # fmt: skip
                it = max(it, float(whole[n]))
                cluster = Cluster(mine.nodes + tuple(rent_nodes[offer.name][:n]), owned.gpu_types)
                t_lb = bound(cluster, load, it)
                configs.append(_Config(cluster, {offer.gpu.name: gpus}, usd_hour, load, t_lb,
                                       owned_gpus))  # fmt: skip
    if job.max_usd_per_hour is not None:  # above the cap: never planned, prunes nothing
        capped = [c for c in configs if c.usd_hour > job.max_usd_per_hour]
        count_reason(job.impossible, "hourly_cap", len(capped))
        configs = [c for c in configs if c.usd_hour <= job.max_usd_per_hour]
    configs = [c for c in configs if math.isfinite(c.t_lb)]
    # the owned nodes alone first (one kind of GPU: the quick homogeneous search), then the
    # live configuration closest to the front (smallest ratio of its cost bound to the
    # front's cost at its time bound), re-checking the rest against every new point
    for c in [c for c in configs if not c.rented]:
        if job.prune and dominated(c.t_lb, c.cost_lb, points):
            pruned += 1
        else:
            plan_one(c)
    live = [c for c in configs if c.rented]
    while live:
        if job.prune:
            keep = [c for c in live if not dominated(c.t_lb, c.cost_lb, points)]
            pruned += len(live) - len(keep)
            live = keep
            if not live:
                break
        front = front_cost(np.array([c.t_lb for c in live]), points)
        plan_one(live.pop(closest_to_front(np.array([c.cost_lb for c in live]), front)))
    return planned, pruned


def explain_owned(best: Point | None, points: list[Point], owned: Cluster) -> str:
    """Returns which owned GPUs the chosen configuration uses and why, and whether renting
    paid off."""
    if best is None:
        return ""
    every = _gpus_by_type(owned)
    if best.owned == every:
        used = f"; uses all {owned.num_gpus} owned GPUs"
    else:
        full = [p for p in points if p.owned == every and p.gpus == best.gpus]
        cmp = (
            f" (all of them would take {duration_text(full[0].time_to_train_s)} for "
            f"${full[0].total_cost_usd:,.0f})"
            if full
            else " (all of them, with the same rental, were ruled out by proven bounds)"
        )
        used = (
            f"; uses {sum(best.owned.values())} of the {owned.num_gpus} owned GPUs "
            f"({gpus_label(best.owned)}): this objective "
            f"prefers {duration_text(best.time_to_train_s)} for "
            f"${best.total_cost_usd:,.0f}{cmp}; owned GPUs left out are not charged"
        )
    alone = next((p for p in points if not p.gpus and p.owned == best.owned), None)
    if alone is None:
        return used + "; these owned GPUs alone have no plan that fits, so renting is needed"
    if not best.gpus:
        # the fastest rental of any choice of owned nodes: a configuration pruned was
        # dominated by a point found, so none is faster than the fastest found
        rented = [p for p in points if p.gpus]
        faster = [p for p in rented if p.time_to_train_s < alone.time_to_train_s]
        if not faster:
            return used + ", no rental: no rented addition makes the run faster"
        quick = min(faster, key=lambda p: p.time_to_train_s)
        mine = "" if quick.owned == best.owned else f"{gpus_label(quick.owned)} owned + "
        return used + (
            f", no rental: renting costs more than its time saving is worth "
            f"to this objective (the fastest rental, {mine}{gpus_label(quick.gpus)}, cuts "
            f"{duration_text(alone.time_to_train_s, quick.time_to_train_s)} "
            f"for ${quick.total_cost_usd - alone.total_cost_usd:,.0f} more)"
        )
    return used + (
        f"; rents {gpus_label(best.gpus)} ({best.pricing}) beside them: "
        f"{duration_text(alone.time_to_train_s, best.time_to_train_s, sep=' -> ')}, "
        f"${alone.total_cost_usd:,.0f} -> ${best.total_cost_usd:,.0f}"
    )

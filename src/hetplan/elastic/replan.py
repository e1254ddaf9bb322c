"""Replanning after nodes are lost (or join): a warm-started repair of the old plan.

The repair keeps every surviving stage where it is (so its checkpoint shards stay local),
drops the stages of lost nodes, appends TP groups of joined nodes to the pipelines, then
re-splits each pipeline's layers to balance its stages (greedy on per-layer times taken
from the old plan's estimate) and the global batch across pipelines (by their modelled
rates), scored with the one cost model. Beside it, the old plan on its intact pipelines
alone (layouts and schedule kept, the batch rebalanced); the faster wins. A full search
(``search=True``) runs beside them and the faster plan wins; the repair alone is what makes
replanning take well under a second.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import interleave_fits
from hetplan.elastic.placement import node_of
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage

REBALANCE_ROUNDS = 2


@dataclass
class ReplanResult:
    """The new plan, its estimate, the cluster it runs on, and what changed."""

    plan: Plan
    estimate: Estimate
    old_estimate: Estimate
    cluster: Cluster
    method: str
    """'repair' (warm start) or 'search' (full heterogeneous search)."""
    replan_time_s: float
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    min_memory_bytes: float = math.inf
    """The least per-GPU peak of any plan weighed (the repair's, the search's): with a plan
    that does not fit, what the remaining GPUs would need to hold."""


def surviving_cluster(cluster: Cluster, lost: list[str], joined: Cluster | None) -> Cluster:
    """Returns the cluster less the lost nodes plus the joined ones; checks every name."""
    names = [n.name for n in cluster.nodes]
    for name in lost:
        if cluster.node_or_none(name) is None:
            raise InputError(
                "--lost", f"node {name} is not in the cluster (its nodes: {', '.join(names)})"
            )
    if len(set(lost)) != len(lost):
        raise InputError("--lost", "a node is named twice")
    rest = [n for n in cluster.nodes if n.name not in set(lost)]
    extra = list(joined.nodes) if joined is not None else []
    for node in extra:
        if node.name in {n.name for n in rest}:
            raise InputError("--joined", f"node {node.name} is already in the cluster")
    if not rest and not extra:
        raise InputError(
            "--lost", f"every node of the cluster is lost ({', '.join(lost)}); nothing to train on"
        )
    types = dict(cluster.gpu_types)
    if joined is not None:
        types.update(joined.gpu_types)
    return Cluster(tuple(rest + extra), types)


def _layer_time_s(old: Estimate, cluster: Cluster) -> dict[tuple[str, int], float]:
    """Returns (GPU type, TP) -> modelled time of one layer per micro-batch, from ``old``."""
    acc: dict[tuple[str, int], list[float]] = {}
    for st in old.stages:
        if st.layers > 0:
            acc.setdefault((st.gpu, len(st.devices)), []).append(st.per_micro_batch_s / st.layers)
    return {k: min(v) for k, v in acc.items()}


def _time_of(
    key: tuple[str, int], known: dict[tuple[str, int], float], cluster: Cluster, precision: str
) -> float:
    if key in known:
        return known[key]
    gpus = {n.gpu.name: n.gpu for n in cluster.nodes}
    (ref_gpu, ref_tp), ref_t = next(iter(known.items()))
    ref = gpus.get(ref_gpu)
    new = gpus[key[0]]
    if ref is None:
        return ref_t
    return ref_t * ref.peak_flops(precision) * ref_tp / (new.peak_flops(precision) * key[1])


def split_layers(layers: int, per_layer_s: list[float], multiple: int = 1) -> list[int]:
    """Returns layers per stage minimising the slowest stage (greedy water-filling, exact)."""
    n = len(per_layer_s)
    if layers < n * multiple:
        raise InputError("layers", f"{layers} layers cannot give {n} stages {multiple} each")
    out = [multiple] * n
    heap = [((multiple + multiple) * t, j) for j, t in enumerate(per_layer_s)]
    heapq.heapify(heap)
    for _ in range((layers - n * multiple) // multiple):
        _, j = heapq.heappop(heap)
        out[j] += multiple
        heapq.heappush(heap, ((out[j] + multiple) * per_layer_s[j], j))
    return out


def split_batch(global_batch: int, micro: int, rates: list[float]) -> list[int]:
    """Returns batch shares in micro-batch multiples, proportional to ``rates``, each >= 1."""
    total = global_batch // micro
    if total < len(rates):
        raise InputError("global_batch_size", f"{total} micro-batches for {len(rates)} pipelines")
    want = [total * r / sum(rates) for r in rates]
    out = [max(1, math.floor(w)) for w in want]
    while sum(out) > total:
        j = max(range(len(out)), key=lambda k: (out[k] - want[k], out[k]))
        out[j] -= 1
    while sum(out) < total:
        j = max(range(len(out)), key=lambda k: want[k] - out[k])
        out[j] += 1
    return [m * micro for m in out]


def _repair(
    old: Plan,
    old_est: Estimate,
    model: ModelSpec,
    cluster: Cluster,
    new: Cluster,
    params: CostParams,
) -> tuple[Plan, Estimate, list[str]]:
    """Returns the repaired plan, its estimate, and notes."""
    notes: list[str] = []
    alive = {n.name for n in new.nodes}
    known = _layer_time_s(old_est, cluster)
    pipes: list[list[tuple[str, ...]]] = []
    for pipe in old.pipelines:
        groups = [s.devices for s in pipe.stages if all(node_of(d) in alive for d in s.devices)]
        if groups:
            pipes.append(groups)
    tp = max((s.tp for p in old.pipelines for s in p.stages), default=1)
    old_names = {n.name for n in cluster.nodes}
    extra: list[tuple[str, ...]] = []
    for node in new.nodes:
        if node.name in old_names:
            continue
        if not node.gpu.supports(old.precision):
            notes.append(f"joined node {node.name} ({node.gpu.name}) has no {old.precision}")
            continue
        devs = node.devices()
        extra += [tuple(devs[i : i + tp]) for i in range(0, node.gpus - tp + 1, tp)]
    if not pipes and not extra:
        raise InputError("--lost", "no stage of the plan survives and no node joined")
    if not pipes:
        pipes = [[]]
    for k, group in enumerate(extra):
        pipes[k % len(pipes)].append(group)
    schedule, v = old.schedule, old.virtual_stages
    if schedule == "Interleaved1F1B":
        schedule, v = "1F1B", 1
        notes.append("repaired plan runs 1F1B (Interleaved1F1B needs a fresh search)")
    stages_of: list[tuple[Stage, ...]] = []
    for groups in pipes:
        per = [
            _time_of((new.device_node(g[0]).gpu.name, len(g)), known, new, old.precision)
            for g in groups
        ]
        while len(groups) > model.layers:  # drop the slowest groups beyond one layer each
            j = max(range(len(groups)), key=lambda k: per[k])
            groups, per = groups[:j] + groups[j + 1 :], per[:j] + per[j + 1 :]
        split = split_layers(model.layers, per)
        stages_of.append(tuple(Stage(n, g) for n, g in zip(split, groups, strict=True)))
    micro = old.micro_batch_size
    max_pipes = old.global_batch_size // micro
    if len(stages_of) > max_pipes:
        notes.append(f"kept {max_pipes} pipelines: the batch has only {max_pipes} micro-batches")
        stages_of = stages_of[:max_pipes]
    rates = [1.0 / sum(s.layers for s in st) for st in stages_of]
    base = replace(old, schedule=schedule, virtual_stages=v)

    def shared(shares: list[int]) -> Plan:
        return replace(
            base,
            pipelines=tuple(Pipeline(b, st) for b, st in zip(shares, stages_of, strict=True)),
        )

    best = _rebalanced(old, rates, shared, model, new, params)
    if not best[1].fits and best[0].recompute != "full":
        plan = replace(best[0], recompute="full")
        est = estimate(plan, model, new, params)
        if est.fits:
            notes.append("switched to full recomputation to fit the remaining memory")
            best = (plan, est)
    return best[0], best[1], notes


def _faster(a: Estimate, b: Estimate) -> bool:
    """Returns whether ``a`` is the better outcome: it fits where ``b`` does not, or both
    fit (or neither) and ``a`` is faster."""
    return (a.fits, -a.iteration_time_s) > (b.fits, -b.iteration_time_s)


def _rebalanced(
    old: Plan,
    rates: list[float],
    shared: Callable[[list[int]], Plan],
    model: ModelSpec,
    new: Cluster,
    params: CostParams,
) -> tuple[Plan, Estimate]:
    """Returns the best of ``REBALANCE_ROUNDS + 1`` plans ``shared(shares)`` with the batch
    split by the pipelines' rates, the first rates given, each next from the estimate."""
    best: tuple[Plan, Estimate] | None = None
    for _ in range(REBALANCE_ROUNDS + 1):
        shares = split_batch(old.global_batch_size, old.micro_batch_size, rates)
        plan = shared(shares)
        est = estimate(plan, model, new, params)
        if best is None or _faster(est, best[1]):
            best = (plan, est)
        rates = [b / t for b, t in zip(shares, est.pipeline_times_s, strict=True)]
    assert best is not None
    return best


def _intact(
    old: Plan, old_est: Estimate, model: ModelSpec, new: Cluster, params: CostParams
) -> tuple[Plan, Estimate, list[str]] | None:
    """Returns the old plan on its intact pipelines alone (every stage on surviving nodes),
    its stages, chunks and schedule kept and the batch rebalanced over them by their rates,
    with its estimate and notes; None where no pipeline is intact or the batch has too few
    micro-batches for them. Interleaved, each count must run in PyTorch's and Megatron-Core's
    equal groups (``interleave_fits``), else the plan runs 1F1B."""
    alive = {n.name for n in new.nodes}
    keep = [
        (pipe, t)
        for pipe, t in zip(old.pipelines, old_est.pipeline_times_s, strict=True)
        if all(node_of(d) in alive for s in pipe.stages for d in s.devices)
    ]
    micro = old.micro_batch_size
    if not keep or len(keep) == old.dp or len(keep) > old.global_batch_size // micro:
        return None

    def shared(shares: list[int]) -> Plan:
        schedule, v = old.schedule, old.virtual_stages
        if schedule == "Interleaved1F1B" and not all(
            len(pipe.stages) == 1 or interleave_fits(len(pipe.stages), b // micro)
            for (pipe, _), b in zip(keep, shares, strict=True)
        ):
            schedule, v = "1F1B", 1
        return replace(
            old,
            schedule=schedule,
            virtual_stages=v,
            pipelines=tuple(
                Pipeline(b, pipe.stages) for (pipe, _), b in zip(keep, shares, strict=True)
            ),
        )

    rates = [pipe.batch_size / t for pipe, t in keep]
    best = _rebalanced(old, rates, shared, model, new, params)
    notes = [f"kept the {len(keep)} intact pipelines of {old.dp}, their layouts unchanged"]
    if best[0].schedule != old.schedule:
        notes.append(f"they run {best[0].schedule}: their micro-batch counts do not interleave")
    return best[0], best[1], notes


def _nums(values: list[int]) -> str:
    """Returns numbers as a list; a long one with runs of equal values as 'value (xN)' per
    run, in order (254 batch shares read '8 (x246), 9 (x8)')."""
    if len(values) <= 12:
        return ", ".join(map(str, values))
    runs = [(v, len(list(group))) for v, group in itertools.groupby(values)]
    return ", ".join(str(v) if n == 1 else f"{v} (x{n})" for v, n in runs)


def describe_changes(old: Plan, new: Plan, lost: list[str]) -> list[str]:
    """Returns one line per change between two plans."""
    out = [f"lost nodes: {', '.join(lost)}"] if lost else []
    od, nd = set(old.devices()), set(new.devices())
    if od - nd:
        gone = sum(node_of(d) in set(lost) for d in od - nd)
        idle = len(od - nd) - gone
        out.append(f"devices removed: {len(od - nd)}" + (
            f" ({gone} on lost nodes, {idle} idle)" if idle else ""))  # fmt: skip
    if nd - od:
        out.append(f"devices added: {len(nd - od)}")
    if old.dp != new.dp:
        out.append(f"pipelines: {old.dp} -> {new.dp}")
    ob = [p.batch_size for p in old.pipelines]
    nb = [p.batch_size for p in new.pipelines]
    if ob != nb:
        out.append(f"batch shares: {_nums(ob)} -> {_nums(nb)}")
    for i, pipe in enumerate(new.pipelines):
        layers = [s.layers for s in pipe.stages]
        before = [s.layers for s in old.pipelines[i].stages] if i < old.dp else None
        if before != layers:
            was = "none" if before is None else _nums(before)
            out.append(f"pipeline {i} layers: {was} -> {_nums(layers)}")
    for key in ("schedule", "recompute", "micro_batch_size"):
        if getattr(old, key) != getattr(new, key):
            out.append(f"{key}: {getattr(old, key)} -> {getattr(new, key)}")
    return out


def replan(
    old: Plan,
    model: ModelSpec,
    cluster: Cluster,
    lost: list[str],
    joined: Cluster | None = None,
    params: CostParams | None = None,
    search: bool = False,
) -> ReplanResult:
    """Returns a new plan on the surviving (and joined) nodes, warm-started from ``old``."""
    start = time.perf_counter()
    params = params or default_params()
    new = surviving_cluster(cluster, lost, joined)
    old_est = estimate(old, model, cluster, params)
    plan, est, notes = _repair(old, old_est, model, cluster, new, params)
    method = "repair"
    kept = _intact(old, old_est, model, new, params) if joined is None else None
    if kept is not None and _faster(kept[1], est):
        plan, est, notes = kept
    least = est.max_memory_bytes
    if search or not est.fits:
        from hetplan.search.heterogeneous import search_heterogeneous

        res = search_heterogeneous(
            model, new, old.global_batch_size, old.precision, 1, params, old.flash_attention
        )
        notes += res.notes
        least = min(least, res.min_memory_bytes)
        if res.ranked and (
            not est.fits or res.ranked[0][1].iteration_time_s < est.iteration_time_s
        ):
            plan, est = res.ranked[0]
            method = "search"
    if not est.fits:
        notes.append("no plan found fits in the remaining memory")
    changes = describe_changes(old, plan, lost)
    elapsed = time.perf_counter() - start
    return ReplanResult(plan, est, old_est, new, method, elapsed, changes, notes, least)

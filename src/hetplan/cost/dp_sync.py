"""Data-parallel traffic of a plan, as ``estimate`` prices it: who reduces gradients with
whom (``sync_layout``: layer segments shared by replicas, their holders and the nodes of
each group), the once-a-step gradient sync per segment (``grad_sync_times``), and ZeRO-2/3's
per-micro-batch collectives (``sharded_microbatch_s``; the schedules in ``cost.sharding``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from hetplan.cluster import Node
from hetplan.cost import comm
from hetplan.cost.compute import elementwise_bytes_per_s
from hetplan.cost.memory import edge_params, stage_params
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.pipeline_classes import pipeline_classes, pipeline_talkers
from hetplan.cost.sharding import bucket_count, deferred_sync, exposed_sync_s, zero3_exposed_s
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.plan import Plan, element_bytes


def sharded_microbatch_s(
    plan: Plan,
    model: ModelSpec,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    single: bool,
    group: list[Node],
    params: CostParams,
    concurrency: dict[str, int],
    forward_s: float,
    backward_s: float,
) -> tuple[float, float]:
    """Returns ZeRO-2/3's exposed collective time per micro-batch of a stage and, for
    ZeRO-2, the parameter all-gather after the optimizer step (see ``cost.sharding``).

    ``group``: the nodes of the stage's data-parallel group; ``forward_s``/``backward_s``:
    the stage's per-micro-batch forward and backward-side compute they can hide under. A
    collective ends for every member together, so the share of it that runs beside compute
    is the group's least (``grad_overlap`` over its members' GPU types, as the once-a-step
    reduction takes it over its holders), whatever order the members come in."""
    if plan.zero_stage < 2 or len(group) <= 1 or deferred_sync(plan):
        return 0.0, 0.0
    e = element_bytes(plan.precision)
    total = stage_params(model, layers, tp, first, last, single)
    share = min(params.gpu(name).grad_overlap for name in {n.gpu.name for n in group})

    def gather(n: float) -> float:  # all-gather of n parameters
        return comm.group_allgather_s(n * e, group, params, concurrency)

    def scatter(n: float) -> float:  # reduce-scatter of n parameters' gradients
        return comm.group_reduce_scatter_s(n * GRAD_BYTES, group, params, concurrency)

    if plan.zero_stage == 3:
        # the layers only: embedding and head sync once a step (``grad_sync_times``)
        per_layer = model.layer_params() / tp
        lz = measured_zero3_layer(plan, model, tp, group, params)
        if lz is not None:
            return layers * (lz.forward_s + lz.backward_s), 0.0
        g, r = layers * gather(per_layer), layers * scatter(per_layer)
        return zero3_exposed_s(g, r, layers, forward_s, backward_s, share), 0.0
    buckets = bucket_count(total, len(group))
    r = buckets * scatter(total / buckets)
    exposed = exposed_sync_s(r, backward_s, share, plan.overlap_grad_reduce, buckets)
    return exposed, gather(total)


def zero2_buffer_s(p_local: float, dp: int, gpu: GPUType, eff: GPUEfficiency) -> float:
    """Returns ZeRO-2's memory work per micro-batch on a device holding ``p_local``
    parameters among ``dp`` members: its fp32 gradient buffer cleared for the next
    micro-batch (one write of the buffer) and the micro-batch's reduced shard added to the
    step's (two shard reads, one write). Memory-bound, on the device's own type; the
    runtime's ``zero.ZeroBucket`` does exactly this (DeepSpeed's ZeRO-2 copies each
    micro-batch's gradients into its reduction bucket instead: the same volume)."""
    if p_local <= 0 or dp <= 1:
        return 0.0
    return p_local * GRAD_BYTES * (1.0 + 3.0 / dp) / elementwise_bytes_per_s(gpu, eff)


def measured_zero3_layer(
    plan: Plan, model: ModelSpec, tp: int, group: list[Node], params: CostParams
) -> Any:
    """Returns one layer's ZeRO-3 cost as a profile (``hetplan profile --links``) measured
    it over a group of this size and GPU type, overlap included (forward: its all-gather;
    backward: another all-gather and its reduce-scatter), or None."""
    if len({n.gpu.name for n in group}) != 1:
        return None
    part = f"zero3_comm_dp{len(group)}"
    return params.compute.ask(
        "part_times", group[0].gpu, model, part, tp, plan.micro_batch_size, plan.precision
    )


def _sync_groups(plan: Plan, model: ModelSpec) -> list[tuple[float, list[tuple[int, int]]]]:
    """Returns [(parameters, [(pipeline, stage), ...])] per layer segment shared by replicas."""
    return segment_holders([tuple(p.layer_ranges()) for p in plan.pipelines], model)


def segment_holders(
    ranges: Sequence[tuple[tuple[int, int], ...]], model: ModelSpec
) -> list[tuple[float, list[tuple[int, int]]]]:
    """Returns ``_sync_groups`` of pipelines whose stages hold these layer ranges (per
    pipeline, per stage: [first, end)): per layer segment, its parameters and holders."""
    dp = len(ranges)
    # pipelines with the same stage boundaries hold a segment at the same stage
    kinds: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for r, rng in enumerate(ranges):
        kinds.setdefault(rng, []).append(r)
    bounds = {0, model.layers}
    for kind in kinds:
        for a, _ in kind:
            bounds.add(a)
    cuts = sorted(bounds)
    out = []
    for a, b in pairwise(cuts):
        stage_of = [0] * dp
        holds = [False] * dp
        for kind, rs in kinds.items():
            for j, (x, y) in enumerate(kind):
                if x <= a < y:
                    for r in rs:
                        stage_of[r], holds[r] = j, True
        holders = [(r, stage_of[r]) for r in range(dp) if holds[r]]
        # memory's count: a segment of the whole model is held by single-stage replicas
        # only, where a tied head is the embedding's table (one tensor, synced once)
        first, last = a == 0, b == model.layers
        params = stage_params(model, b - a, 1, first, last, first and last)
        out.append((float(params), holders))
    return out


@dataclass
class SyncLayout:
    """Who reduces gradients with whom: per layer segment shared by replicas, its
    parameters and holders (pipeline, stage), and per tensor-parallel rank the nodes of the
    group's members; how many devices of each node talk across nodes at once; and per stage
    the members of its (largest) data-parallel group."""

    groups: list[tuple[float, list[tuple[int, int]]]]
    members: list[list[list[Node]]]
    concurrency: dict[str, int]
    dp_members: dict[tuple[int, int], list[Node]]
    edge_params: list[float] = field(default_factory=list)
    """Per segment, the embedding and head parameters in it (ZeRO-3 syncs them once a step)."""
    spread: tuple[list[Node], int, int] = field(default_factory=lambda: ([], 0, 0))
    """One node of each GPU type the plan's devices are on, how many nodes they are on, and
    the most devices the plan uses on one of them (the step's all-reduces of one number
    span them all: ``comm.scalar_allreduce_s``)."""
    classes: dict[tuple[bool, int], tuple[Any, ...]] = field(default_factory=dict, repr=False)
    """``layout_classes``' memo: per interleaving and pipelines (their id), (pipelines,
    talkers, pipeline classes); the pipelines are kept, so their id stays theirs."""
    sync_times: dict[tuple[Any, ...], tuple[Any, list[float]]] = field(
        default_factory=dict, repr=False
    )
    """``grad_sync_times``' memo: per (ZeRO stage, precision, deferred), the
    parameters it was computed with and its times (searches estimate many knob settings of
    one layout; the times read only these)."""


def layout_classes(
    plan: Plan, layout: SyncLayout, node_of: Any
) -> tuple[dict[str, int], list[int]]:
    """Returns the plan's ``pipeline_talkers`` and ``pipeline_classes``, memoised in its
    layout for the same pipelines (searches estimate many knob settings of one layout)."""
    key = (plan.virtual_stages > 1, id(plan.pipelines))
    hit = layout.classes.get(key)
    if hit is not None and hit[0] is plan.pipelines:
        return hit[1], hit[2]
    talkers = pipeline_talkers(plan, node_of)
    classes = pipeline_classes(plan, node_of, talkers, layout.dp_members)
    layout.classes[key] = (plan.pipelines, talkers, classes)
    return talkers, classes


def sync_layout(plan: Plan, model: ModelSpec, node_of: Any) -> SyncLayout:
    """Returns the data-parallel layout of ``plan`` (``node_of``: device name -> Node)."""
    groups = _sync_groups(plan, model) if plan.dp > 1 else []
    group_members: list[list[list[Node]]] = []
    one_node: dict[tuple[int, int], bool] = {}  # a stage's TP group on one node
    for _, holders in groups:
        tps = [plan.pipelines[r].stages[j].tp for r, j in holders]
        tp_min = min(tps)
        for r, j in holders:
            if (r, j) not in one_node:
                devs = plan.pipelines[r].stages[j].devices
                name = devs[0].rpartition(":")[0]
                one_node[(r, j)] = all(d.rpartition(":")[0] == name for d in devs)
        same = all(one_node[h] for h in holders)  # then every rank sees the same nodes
        per_rank: list[list[Node]] = []
        for i in range(tp_min):
            if same and per_rank:
                per_rank.append(per_rank[0])
                continue
            per_rank.append([node_of(plan.pipelines[r].stages[j].devices[i]) for r, j in holders])
        group_members.append(per_rank)
    crossing: dict[str, set[str]] = {}
    for (_, holders), per_rank in zip(groups, group_members, strict=True):
        for i, members in enumerate(per_rank):
            if len({n.name for n in members}) > 1:
                for r, j in holders:
                    dev = plan.pipelines[r].stages[j].devices[i]
                    crossing.setdefault(dev.rpartition(":")[0], set()).add(dev)
    concurrency = {k: len(v_) for k, v_ in crossing.items()}
    dp_members: dict[tuple[int, int], list[Node]] = {}
    for (_, holders), per_rank in zip(groups, group_members, strict=True):
        for h in holders:
            if per_rank and len(per_rank[0]) > len(dp_members.get(h, [])):
                dp_members[h] = per_rank[0]
    edges = [0.0] * len(groups)  # segments in layer order: the embedding's first
    if groups:  # one segment: single-stage replicas, a tied table counted once (memory's)
        single = len(groups) == 1
        edges[0] += edge_params(model, 1, True, single, single)
        if not single:
            edges[-1] += edge_params(model, 1, False, True, False)
    per_node: Counter[str] = Counter()
    first_dev: dict[str, str] = {}  # per node name, a device on it
    for pipe in plan.pipelines:
        for st in pipe.stages:
            for d in st.devices:
                name = d.rpartition(":")[0]
                per_node[name] += 1
                first_dev.setdefault(name, d)
    kinds = {id(n.gpu): n for n in map(node_of, first_dev.values())}
    spread = (list(kinds.values()), len(per_node), max(per_node.values(), default=0))
    return SyncLayout(
        groups, group_members, concurrency, dp_members, edge_params=edges, spread=spread
    )


def uniform_sync_layout(
    nodes: Sequence[Node], tp: int, pp: int, dp: int, split: Sequence[int], model: ModelSpec
) -> SyncLayout:
    """Returns ``sync_layout`` of the Megatron-layout plan ``search.layout.uniform_plan``
    builds on ``nodes`` (all of one size; rank ``(stage x dp + replica) x tp + t`` on the
    rank-th device in node order; stage j holds ``split[j]`` layers), from node indices
    alone: no plan, no device names. Its TP groups sit inside a node (``tp`` divides the
    node's GPUs), so every TP rank of a stage sees the same data-parallel nodes; stage j's
    replicas occupy devices ``[j dp tp, (j + 1) dp tp)``, and all of them talk across nodes
    where that range spans more than one node."""
    gpn = nodes[0].gpus
    groups: list[tuple[float, list[tuple[int, int]]]] = []
    members: list[list[list[Node]]] = []
    concurrency: Counter[str] = Counter()
    dp_members: dict[tuple[int, int], list[Node]] = {}
    if dp > 1:
        start = 0
        for j, layers in enumerate(split):
            first, last = start == 0, start + layers == model.layers
            params = stage_params(model, layers, 1, first, last, first and last)
            holders = [(r, j) for r in range(dp)]
            group = [nodes[((j * dp + r) * tp) // gpn] for r in range(dp)]
            groups.append((float(params), holders))
            members.append([group] * tp)
            lo, hi = j * dp * tp, (j + 1) * dp * tp  # the stage's devices
            if (hi - 1) // gpn != lo // gpn:
                for k in range(lo // gpn, (hi - 1) // gpn + 1):
                    concurrency[nodes[k].name] += min(hi, (k + 1) * gpn) - max(lo, k * gpn)
            for h in holders:
                dp_members[h] = group
            start += layers
    edges = [0.0] * len(groups)
    if groups:
        single = len(groups) == 1
        edges[0] += edge_params(model, 1, True, single, single)
        if not single:
            edges[-1] += edge_params(model, 1, False, True, False)
    used = tp * pp * dp
    spread = ([nodes[0]], -(-used // gpn), min(gpn, used))
    return SyncLayout(groups, members, dict(concurrency), dp_members, edge_params=edges,
                      spread=spread)  # fmt: skip


GRAD_BYTES = 4.0
"""Gradients are reduced in fp32. (fp16 runs of DeepSpeed and 2021 Megatron reduce fp16
gradients by default; AMP's T4 trials, the fp16 runs with data parallelism in the shipped
data, are ranked better with fp32 volumes, so 4 bytes stays.)"""


def reduction_bytes_per_param(zero_stage: int, precision: str) -> float:
    """Returns the bytes per parameter of an all-reduce that a once-a-step gradient
    reduction moves: ZeRO-0's all-reduce of fp32 gradients (4); ZeRO-1's (and deferred
    ZeRO-2/3's) reduce-scatter of them and all-gather of the values, half an all-reduce's
    volume each ((4 + e) / 2, e the element size: ``grad_sync_times``)."""
    if zero_stage == 0:
        return GRAD_BYTES
    return (GRAD_BYTES + element_bytes(precision)) / 2.0


def reduction_floor_s(
    model: ModelSpec,
    precision: str,
    tp: int,
    node: Node,
    members: int,
    largest: int,
    params: CostParams,
    per_param: float | None = None,
    overlap: bool = True,
) -> float:
    """Returns the least time one layer's gradient reduction costs a device holding it at
    TP ``tp`` on ``node`` that no overlap hides, with ``members`` data-parallel holders
    (``largest``: the most GPUs a node of the cluster holds), whatever the ZeRO stage
    (``per_param``: bytes an all-reduce of which it moves per parameter; default the least
    of any stage). Each device reduces the layer's parameters over its TP degree (at least:
    a segment's volume is over its holders' least degree) among the holders: once a step
    (``reduction_bytes_per_param``), or ZeRO-2 a reduce-scatter per
    micro-batch and the all-gather after the step, ZeRO-3 two gathers and a reduce-scatter
    per micro-batch (at least (4 + e) / 2 either way: ``sharded_microbatch_s``), each at
    least ``comm.allreduce_floor_s_per_byte``. At least ``1 - grad_overlap`` of it (of the
    device's own GPU type: a group takes its members' least) runs beside no compute
    (``sharding.unhidden_sync_s``, ``zero3_exposed_s``); all of it without ``overlap``."""
    if members <= 1:
        return 0.0
    if per_param is None:
        per_param = reduction_bytes_per_param(1, precision)
    share = params.gpu(node.gpu.name).grad_overlap if overlap else 0.0
    per_byte = comm.allreduce_floor_s_per_byte(node, members, largest, params)
    return (1.0 - share) * model.layer_params() / tp * per_param * per_byte


Slot = tuple[int, int]
"""A stage: (pipeline, stage)."""


def holder_floors(
    segments: Sequence[tuple[float, Sequence[Slot]]], per_byte: Callable[[Sequence[Slot]], float]
) -> dict[Slot, float]:
    """Returns, per stage, the sum over the segments it holds of the segment's parameters
    (over its holders' least TP degree, as ``segments`` gives them) at ``per_byte`` of its
    holders: seconds per byte an all-reduce moves per parameter."""
    out: dict[Slot, float] = {}
    for n_tp, holders in segments:
        t = n_tp * per_byte(holders)
        for h in holders:
            out[h] = out.get(h, 0.0) + t
    return out


def placed_reduction_floors(
    plan: Plan, model: ModelSpec, node_of: Any, params: CostParams
) -> dict[Slot, float]:
    """Returns, per stage (pipeline, stage) of a placed plan, a lower bound of its once-a-step
    gradient reductions in ``grad_sync_times`` per byte that an all-reduce moves per
    parameter (``reduction_bytes_per_param``; ``node_of``: device name -> Node): the sum,
    over the layer segments it holds (``_sync_groups``), of the segment's parameters over
    its holders' least TP degree at ``comm.group_floor_s_per_byte`` of the group of the
    holders' first devices (the first rank's group; each segment takes the most of its
    ranks' times). Every device of a node in such a group talks across nodes while it
    reduces, so the node's link is shared by at least the group's members on it. Stages
    holding nothing that others hold are left out (``holder_floors``)."""
    if plan.dp <= 1:
        return {}
    segments = []
    for n_params, holders in _sync_groups(plan, model):
        if len(holders) > 1 and n_params > 0:
            tp_min = min(plan.pipelines[r].stages[j].tp for r, j in holders)
            segments.append((n_params / tp_min, holders))

    def first_devices(holders: Sequence[Slot]) -> float:
        members = [node_of(plan.pipelines[r].stages[j].devices[0]) for r, j in holders]
        return comm.group_floor_s_per_byte(members, params)

    return holder_floors(segments, first_devices)


def grad_sync_times(
    layout: SyncLayout, plan: Plan, params: CostParams, model: ModelSpec | None = None
) -> list[float]:
    """Returns, per layer segment of ``layout``, the time of its gradient sync once per
    step: an all-reduce of the fp32 gradients; under ZeRO-1, and ZeRO-2/3 deferred by
    pipelining to ZeRO-1's once a step (``deferred_sync``), a reduce-scatter of the fp32
    gradients and an all-gather of the updated parameters in the plan's precision (ring
    volumes: 4/8 + e/8 of the fp32 all-reduce); zero where one replica holds it, and under
    ZeRO-2 otherwise, which reduces every micro-batch (``sharded_microbatch_s``). ZeRO-3
    shards the layers per micro-batch, but its embedding and head stay whole and sync as
    ZeRO-1's, once a step, as the runtime runs them (``runtime/fsdp.py``). Deferred ZeRO-3
    layers gather and reduce-scatter once a step with FSDP: where a profile measured a
    layer's ZeRO-3 cost (``model`` given), its backward's (one gather, one reduce-scatter)
    per layer and step."""
    deferred = deferred_sync(plan)
    measured = deferred and plan.zero_stage == 3 and model is not None
    key = (plan.zero_stage, plan.precision, deferred)
    hit = None if measured else layout.sync_times.get(key)
    if hit is not None and hit[0] is params:
        return hit[1]
    out = _grad_sync_times(layout, plan, params, model, deferred)
    if not measured:
        layout.sync_times[key] = (params, out)
    return out


def _grad_sync_times(
    layout: SyncLayout, plan: Plan, params: CostParams, model: ModelSpec | None, deferred: bool
) -> list[float]:
    out = []
    zero3 = plan.zero_stage == 3 and not deferred
    sharded = plan.zero_stage == 1 or deferred or zero3
    e = element_bytes(plan.precision)
    for k, ((n_params, holders), per_rank) in enumerate(
        zip(layout.groups, layout.members, strict=True)
    ):
        if zero3:
            n_params = layout.edge_params[k]
        if len(holders) <= 1 or n_params <= 0 or (plan.zero_stage == 2 and not deferred):
            out.append(0.0)
            continue
        tp_min = len(per_rank)
        n = n_params / tp_min
        conc = layout.concurrency
        times: dict[int, float] = {}  # ranks on the same nodes share one list: once each
        for members in per_rank:
            if id(members) in times:
                continue
            lz = None
            if deferred and plan.zero_stage == 3 and model is not None:
                lz = measured_zero3_layer(plan, model, tp_min, members, params)
            if lz is not None:  # the layers as FSDP runs them, the rest as ZeRO-1
                edge = layout.edge_params[k]
                layers = round((n_params - edge) / model.layer_params()) if model else 0
                t = layers * lz.backward_s
                if edge > 0:
                    t += comm.group_reduce_scatter_s(edge / tp_min * GRAD_BYTES, members,
                                                     params, conc)  # fmt: skip
                    t += comm.group_allgather_s(edge / tp_min * e, members, params, conc)
            elif sharded:
                t = comm.group_reduce_scatter_s(n * GRAD_BYTES, members, params, conc)
                t += comm.group_allgather_s(n * e, members, params, conc)
            else:
                t = comm.group_allreduce_s(n * GRAD_BYTES, members, params, conc)
            times[id(members)] = t
        out.append(max(times.values()))
    return out

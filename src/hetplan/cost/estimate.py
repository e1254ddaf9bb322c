"""estimate(plan, model, cluster): the one cost model every search and report shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from hetplan.cluster import Cluster, Node
from hetplan.cost import comm
from hetplan.cost.memory import (
    MemoryBreakdown,
    stage_activation_bytes,
    stage_params,
    state_bytes,
    zero3_working_bytes,
)
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import Replay, peak_in_flight, pipeline_replay, replay
from hetplan.cost.sharding import bucket_count, exposed_sync_s, zero3_exposed_s
from hetplan.cost.sources import ComputeSource, LayerTimeSource, combine_sources
from hetplan.cost.trust import warnings_for
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.plan import Plan, element_bytes, validate_plan


@dataclass
class StageEstimate:
    """One stage of one pipeline: per-micro-batch times, memory, and its end of iteration."""

    pipeline: int
    stage: int
    devices: tuple[str, ...]
    gpu: str
    layers: int
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    """Tensor-parallel collectives per micro-batch (forward, backward and recompute)."""
    send_s: float
    """Sending one micro-batch's activations to the next stage."""
    memory: MemoryBreakdown
    capacity_bytes: float
    grad_sync_s: float = 0.0
    optimizer_s: float = 0.0
    p2p_wait_s: float = 0.0
    """Per micro-batch, forward and backward: time blocked in its own pipeline transfers."""
    overhead_s: float = 0.0
    """Fixed per-micro-batch cost (all chunks, forward and backward), inside forward_s and
    backward_s."""
    zero_comm_s: float = 0.0
    """ZeRO-2/3 collectives per micro-batch not hidden behind its compute."""
    param_gather_s: float = 0.0
    """ZeRO-2: all-gather of the updated parameter shards after the optimizer step."""
    compute_source: str = "analytical"
    """Where the stage's compute times came from: measured, interpolated, scaled or
    analytical (the least trustworthy of its pieces)."""
    busy_s: float = 0.0
    last_backward_end_s: float = 0.0
    sync_end_s: float = 0.0
    end_s: float = 0.0

    @property
    def per_micro_batch_s(self) -> float:
        """Returns the stage's time for one micro-batch, forward and backward."""
        return (
            self.forward_s
            + self.backward_s
            + self.recompute_s
            + self.tp_comm_s
            + self.zero_comm_s
            + self.p2p_wait_s
        )

    @property
    def headroom_bytes(self) -> float:
        """Returns free memory at the peak (negative if it does not fit)."""
        return self.capacity_bytes - self.memory.total


@dataclass
class Estimate:
    """Predicted iteration time, memory, throughput and price of one plan."""

    iteration_time_s: float
    breakdown: dict[str, float]
    stages: list[StageEstimate]
    pipeline_times_s: list[float]
    fits: bool
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    cost_usd_per_hour: float | None
    usd_per_million_tokens: float | None
    compute_source: str
    bottleneck: str
    replays: list[Replay] = field(default_factory=list, repr=False)
    peak_used: dict[str, str] = field(default_factory=dict)
    """Per GPU type: which datasheet peak the compute model and the MFU use."""
    warnings: list[str] = field(default_factory=list)
    """Why the prediction deserves less trust (uncalibrated GPU, regime no measured run
    covers, MFU above the best measured); filled by ``hetplan.cost.trust``."""

    @property
    def peak_memory_bytes(self) -> dict[str, float]:
        """Returns peak bytes per device name."""
        return {d: s.memory.total for s in self.stages for d in s.devices}

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON object the CLI prints."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "fits": self.fits,
            "peak_memory_gb": {d: round(b / 1e9, 4) for d, b in self.peak_memory_bytes.items()},
            "cost_usd_per_hour": self.cost_usd_per_hour,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "breakdown": self.breakdown,
            "pipeline_times_s": self.pipeline_times_s,
            "compute_source": self.compute_source,
            "stages": [
                {
                    "pipeline": st.pipeline,
                    "stage": st.stage,
                    "gpu": st.gpu,
                    "layers": st.layers,
                    "compute_source": st.compute_source,
                }
                for st in self.stages
            ],
            "peak_used": self.peak_used,
            "bottleneck": self.bottleneck,
            "warnings": self.warnings,
        }


@dataclass(frozen=True)
class StageKey:
    """What a stage's per-micro-batch times depend on besides the plan's knobs."""

    gpu: GPUType
    node_intra_bps: float
    tp: int
    layers: int
    first: bool
    last: bool
    single: bool


def stage_times(
    plan: Plan,
    model: ModelSpec,
    key: StageKey,
    node: Node,
    params: CostParams,
) -> tuple[float, float, float, float, float, str]:
    """Returns (forward, backward, recompute, tp_comm, overhead) per micro-batch and where
    the compute times came from."""
    gpu, tp, mb, prec = key.gpu, key.tp, plan.micro_batch_size, plan.precision
    eff = params.gpu(gpu.name)
    src: ComputeSource = params.compute
    layer = src.layer(
        model, gpu, params, tp, mb, prec, plan.flash_attention, plan.sequence_parallel
    )
    lt = layer.times
    sources = [layer.source] if key.layers else []
    fwd = key.layers * lt.forward_s
    bwd = key.layers * lt.backward_s
    if plan.recompute == "full":
        rc = key.layers * lt.forward_s
    elif plan.recompute == "selective":
        rc = key.layers * lt.selective_recompute_s
    else:
        rc = 0.0
    if key.first:
        et = src.embedding(model, gpu, params, tp, mb, prec, plan.flash_attention)
        fwd += et.times.forward_s
        bwd += et.times.backward_s
        sources.append(et.source)
    if key.last:
        ht = src.head(model, gpu, params, tp, mb, prec, plan.flash_attention)
        fwd += ht.times.forward_s
        bwd += ht.times.backward_s
        sources.append(ht.source)
    v = plan.virtual_stages
    action = src.action_overhead_s(gpu)  # the pipelining runtime's, per action and chunk
    fwd += v * action
    bwd += v * action
    # the fixed cost of each micro-batch on each chunk (framework, launches, handshakes)
    overhead = v * eff.microbatch_overhead_s
    fwd += overhead / 2
    bwd += overhead / 2
    act = mb * model.seq * model.hidden * element_bytes(prec)
    lc = src.ask("part_times", gpu, model, "tp_comm", tp, mb, prec) if tp > 1 else None
    if lc is not None:  # one layer's collectives as measured (zero: inside the layer times)
        full = plan.recompute == "full"
        tp_comm = key.layers * (lc.forward_s + lc.backward_s + (lc.forward_s if full else 0.0))
    else:
        one = comm.intra_node_allreduce_s(act, tp, node, params)
        n_ar = 4 * key.layers + (2 * key.layers if plan.recompute == "full" else 0)
        n_ar += (1 if key.first else 0) + (1 if key.last else 0)
        tp_comm = n_ar * one
    if plan.overlap_tp_comm and plan.sequence_parallel:
        # Megatron-Core/Transformer Engine (which need sequence parallelism for it) split the
        # TP matmuls into chunks whose collectives run under the neighbouring chunks' math:
        # a fitted share hides, never more than the compute it hides under
        tp_comm -= min(eff.tp_overlap * tp_comm, fwd + bwd + rc)
    return fwd, bwd, rc, tp_comm, overhead, combine_sources(sources)


def part_split(
    plan: Plan,
    model: ModelSpec,
    gpu: GPUType,
    tp: int,
    first: bool,
    last: bool,
    params: CostParams,
) -> tuple[float, float, float, float]:
    """Returns the embedding's and the head's forward and backward times per micro-batch of a
    stage that holds them (zero for the part it does not hold)."""
    src, mb, prec, flash = (
        params.compute,
        plan.micro_batch_size,
        plan.precision,
        plan.flash_attention,
    )
    ef = eb = hf = hb = 0.0
    if first:
        et = src.embedding(model, gpu, params, tp, mb, prec, flash).times
        ef, eb = et.forward_s, et.backward_s
    if last:
        ht = src.head(model, gpu, params, tp, mb, prec, flash).times
        hf, hb = ht.forward_s, ht.backward_s
    return ef, eb, hf, hb


def p2p_wait_s(sends: list[float], j: int, v: int, exposed: float) -> float:
    """Returns the time stage ``j`` of a pipeline (``sends[k]``: one transfer from stage k to
    k+1, wrapping for interleaved chunks) spends blocked in its own transfers per
    micro-batch: forward, receive the input and send the output; backward, the same for
    the gradients; the ``exposed`` share of each (1: blocking send/recv as in DeepSpeed's
    pipeline engine, 0: fully asynchronous)."""
    p = len(sends)
    if p <= 1 or exposed <= 0:
        return 0.0
    total = 0.0
    for c in range(v):
        vs = c * p + j
        if vs > 0:
            total += sends[(j - 1) % p]
        if vs < p * v - 1:
            total += sends[j]
    return 2.0 * exposed * total


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
    the stage's per-micro-batch forward and backward-side compute they can hide under."""
    if plan.zero_stage < 2 or len(group) <= 1:
        return 0.0, 0.0
    e = element_bytes(plan.precision)
    total = stage_params(model, layers, tp, first, last, single)
    share = params.gpu(group[0].gpu.name).grad_overlap

    def gather(n: float) -> float:  # all-gather of n parameters
        return comm.group_allreduce_s(n * e, group, params, concurrency, 0.5)

    def scatter(n: float) -> float:  # reduce-scatter of n parameters' gradients
        return comm.group_allreduce_s(n * GRAD_BYTES, group, params, concurrency, 0.5)

    if plan.zero_stage == 3:
        per_layer = model.layer_params() / tp
        rest = max(total - layers * per_layer, 0.0)  # embedding and head
        units = layers + (1 if rest > 0 else 0)
        g = layers * gather(per_layer) + (gather(rest) if rest > 0 else 0.0)
        r = layers * scatter(per_layer) + (scatter(rest) if rest > 0 else 0.0)
        return zero3_exposed_s(g, r, units, forward_s, backward_s, share), 0.0
    buckets = bucket_count(total, len(group))
    r = buckets * scatter(total / buckets)
    exposed = exposed_sync_s(r, backward_s, share, plan.overlap_grad_reduce, buckets)
    return exposed, gather(total)


def pipeline_talkers(plan: Plan, node_of: Any) -> dict[str, int]:
    """Returns, per node, how many of its devices exchange pipeline activations or gradients
    with a stage on another node (they send at about the same time, over the node's link)."""
    devs: dict[str, set[str]] = {}
    wrap = plan.virtual_stages > 1  # interleaved chunks also pass from the last stage to the first
    for pipe in plan.pipelines:
        p = len(pipe.stages)
        for j in range(p if wrap else p - 1):
            a, b = pipe.stages[j], pipe.stages[(j + 1) % p]
            na, nb = node_of(a.devices[0]).name, node_of(b.devices[0]).name
            if na != nb and p > 1:
                devs.setdefault(na, set()).update(a.devices)
                devs.setdefault(nb, set()).update(b.devices)
    return {k: len(v) for k, v in devs.items()}


def _sync_groups(plan: Plan, model: ModelSpec) -> list[tuple[float, list[tuple[int, int]]]]:
    """Returns [(parameters, [(pipeline, stage), ...])] per layer segment shared by replicas."""
    bounds = {0, model.layers}
    for pipe in plan.pipelines:
        for a, _ in pipe.layer_ranges():
            bounds.add(a)
    cuts = sorted(bounds)
    out = []
    for a, b in pairwise(cuts):
        holders = []
        for r, pipe in enumerate(plan.pipelines):
            for j, (x, y) in enumerate(pipe.layer_ranges()):
                if x <= a < y:
                    holders.append((r, j))
        params = (b - a) * model.layer_params()
        if a == 0:
            params += model.embedding_params()
        if b == model.layers:
            params += model.head_params()
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


def sync_layout(plan: Plan, model: ModelSpec, node_of: Any) -> SyncLayout:
    """Returns the data-parallel layout of ``plan`` (``node_of``: device name -> Node)."""
    groups = _sync_groups(plan, model) if plan.dp > 1 else []
    group_members: list[list[list[Node]]] = []
    for _, holders in groups:
        tps = [plan.pipelines[r].stages[j].tp for r, j in holders]
        tp_min = min(tps)
        per_rank = []
        for i in range(tp_min):
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
    return SyncLayout(groups, group_members, concurrency, dp_members)


GRAD_BYTES = 4.0
"""Gradients are reduced in fp32. (fp16 runs of DeepSpeed and 2021 Megatron reduce fp16
gradients by default; AMP's T4 trials, the fp16 runs with data parallelism in the shipped
data, are ranked better with fp32 volumes, so 4 bytes stays.)"""


def grad_sync_times(layout: SyncLayout, plan: Plan, params: CostParams) -> list[float]:
    """Returns, per layer segment of ``layout``, the time of its gradient all-reduce once per
    step (ZeRO-1's reduce-scatter and parameter all-gather move the same volume); zero where
    one replica holds it, and under ZeRO-2/3, which reduce every micro-batch
    (``sharded_microbatch_s``)."""
    out = []
    for (n_params, holders), per_rank in zip(layout.groups, layout.members, strict=True):
        if len(holders) <= 1 or plan.zero_stage >= 2:  # ZeRO-2/3: every micro-batch
            out.append(0.0)
            continue
        tp_min = len(per_rank)
        out.append(
            max(
                comm.group_allreduce_s(
                    n_params * GRAD_BYTES / tp_min,
                    members,
                    params,
                    layout.concurrency,
                )
                for members in per_rank
            )
        )
    return out


def estimate(
    plan: Plan,
    model: ModelSpec,
    cluster: Cluster,
    params: CostParams | None = None,
    profile: LayerTimeSource | None = None,
    record: bool = False,
    validate: bool = True,
    layout: SyncLayout | None = None,
) -> Estimate:
    """Returns the predicted iteration time, memory, throughput and price of ``plan``.

    ``layout``: the plan's ``sync_layout`` when the caller already has it (it depends on
    the pipelines' devices and layers only; searches reuse one per device layout)."""
    if validate:
        validate_plan(plan, model, cluster)
    params = params or default_params()
    if profile is not None:
        params = params.with_profile(profile)
    node_memo: dict[str, Node] = {}

    def node_of(device: str) -> Node:
        node = node_memo.get(device)
        if node is None:
            node = node_memo[device] = cluster.device_node(device)
        return node

    dp = plan.dp
    v = plan.virtual_stages
    if layout is None:
        layout = sync_layout(plan, model, node_of)
    act_memo: dict[tuple[int, int, bool, bool, int], float] = {}
    groups = layout.groups
    concurrency, dp_members = layout.concurrency, layout.dp_members
    gather_memo: dict[tuple[Any, ...], tuple[float, float]] = {}
    talkers = pipeline_talkers(plan, node_of)
    stages: list[StageEstimate] = []
    replays: list[Replay] = []
    pipeline_times: list[float] = []
    by_pipe: list[list[StageEstimate]] = []
    replay_cache: dict[tuple[Any, ...], Replay] = {}
    stage_memo: dict[tuple[Any, ...], tuple[float, float, float, float, float, str]] = {}
    opt_memo: dict[tuple[Any, ...], float] = {}
    for r, pipe in enumerate(plan.pipelines):
        p = len(pipe.stages)
        m = plan.num_micro_batches(pipe)
        nodes = [node_of(s.devices[0]) for s in pipe.stages]
        row: list[StageEstimate] = []
        for j, stage in enumerate(pipe.stages):
            node = nodes[j]
            first, last = j == 0, j == p - 1
            # replicas repeat the same stages: compute each distinct one once
            memo_key = (id(node), stage.tp, stage.layers, first, last, p == 1)
            hit = stage_memo.get(memo_key)
            if hit is None:
                key = StageKey(
                    node.gpu, node.intra_node_bytes_per_s, stage.tp, stage.layers, first, last,
                    p == 1,
                )  # fmt: skip
                hit = stage_memo[memo_key] = stage_times(plan, model, key, node, params)
            fwd, bwd, rc, tpc, over, src = hit
            p_local = stage_params(model, stage.layers, stage.tp, first, last, p == 1)
            zero_mb = param_gather = 0.0
            if plan.zero_stage >= 2 and (r, j) in dp_members:
                group = dp_members[(r, j)]
                gkey = (id(group), stage.layers, stage.tp, first, last, fwd, bwd + rc + tpc)
                if gkey not in gather_memo:
                    gather_memo[gkey] = sharded_microbatch_s(
                        plan, model, stage.layers, stage.tp, first, last, p == 1, group, params,
                        concurrency, fwd, bwd + rc + tpc,
                    )  # fmt: skip
                zero_mb, param_gather = gather_memo[gkey]
            act = plan.micro_batch_size * model.seq * model.hidden * element_bytes(plan.precision)
            nxt = nodes[(j + 1) % p]
            if p > 1:  # every device of a node sending across nodes shares its link
                conc = max(talkers.get(node.name, 0), talkers.get(nxt.name, 0), stage.tp)
                send = comm.p2p_s(act / stage.tp, node, nxt, params, conc)
            else:
                send = 0.0
            w, g, o = state_bytes(p_local, plan.precision, plan.zero_stage, dp)
            if plan.zero_stage == 3 and dp > 1:
                w += zero3_working_bytes(model, stage.tp, plan.precision)
            units = peak_in_flight(plan.schedule, p, m, v, j)
            akey = (stage.tp, stage.layers, first, last, units)
            acts = act_memo.get(akey, -1.0)
            if acts < 0:
                acts = act_memo[akey] = stage_activation_bytes(
                    model, stage.layers, stage.tp, plan.micro_batch_size,
                    plan.sequence_parallel, plan.recompute, plan.flash_attention, first, last,
                    units, v, plan.precision,
                )  # fmt: skip
            mem = MemoryBreakdown(w, g, o, acts, params.memory_reserve_bytes)
            eff = params.gpu(node.gpu.name)
            shards = dp if plan.zero_stage >= 1 else 1
            opt_key = (id(node.gpu), stage.tp, stage.layers, first, last, p_local, shards)
            opt_s = opt_memo.get(opt_key, -1.0)
            if opt_s < 0:
                pieces = [("layer", stage.layers), ("embed", int(first)), ("head", int(last))]
                opt_s = opt_memo[opt_key] = params.compute.optimizer_s(
                    model, node.gpu, eff, stage.tp, plan.precision, pieces, p_local, shards
                )[0]
            row.append(
                StageEstimate(
                    pipeline=r,
                    stage=j,
                    devices=stage.devices,
                    gpu=node.gpu.name,
                    layers=stage.layers,
                    forward_s=fwd,
                    backward_s=bwd,
                    recompute_s=rc,
                    tp_comm_s=tpc,
                    send_s=send,
                    memory=mem,
                    capacity_bytes=node.gpu.memory_bytes,
                    optimizer_s=opt_s,
                    zero_comm_s=zero_mb,
                    param_gather_s=param_gather,
                    overhead_s=over,
                    compute_source=src,
                )
            )
        for j, st in enumerate(row):
            st.p2p_wait_s = p2p_wait_s(
                [x.send_s for x in row], j, v, params.gpu(st.gpu).p2p_exposed
            )
        # chunk times: layers split evenly over v chunks; the embedding runs on chunk 0 of the
        # first stage and the head on chunk v-1 of the last
        fwd_c, bwd_c = [], []
        for j, st in enumerate(row):
            ef = eb = hf = hb = 0.0
            if v > 1 and (j == 0 or j == p - 1):
                gpu = node_of(st.devices[0]).gpu
                ef, eb, hf, hb = part_split(plan, model, gpu, len(st.devices), j == 0,
                                             j == p - 1, params)  # fmt: skip
            f = (st.forward_s - ef - hf + st.p2p_wait_s / 2) / v
            b = (st.backward_s + st.recompute_s + st.tp_comm_s + st.zero_comm_s - eb - hb
                 + st.p2p_wait_s / 2) / v  # fmt: skip
            fwd_c.append([f + (ef if c == 0 else 0.0) + (hf if c == v - 1 else 0.0)
                          for c in range(v)])  # fmt: skip
            bwd_c.append([b + (eb if c == 0 else 0.0) + (hb if c == v - 1 else 0.0)
                          for c in range(v)])  # fmt: skip
        sends = [st.send_s for st in row]
        sig = (
            plan.schedule,
            m,
            v,
            tuple(map(tuple, fwd_c)),
            tuple(map(tuple, bwd_c)),
            tuple(sends),
        )
        rep = replay_cache.get(sig)
        if rep is None:
            if record:
                rep = replay(plan.schedule, m, v, fwd_c, bwd_c, sends, record=True)
            else:
                rep = pipeline_replay(plan.schedule, m, v, fwd_c, bwd_c, sends)
            replay_cache[sig] = rep
        replays.append(rep)
        pipeline_times.append(rep.makespan_s)
        for j, st in enumerate(row):
            st.busy_s = rep.busy_s[j]
            st.last_backward_end_s = rep.last_backward_end_s[j]
        by_pipe.append(row)
        stages.extend(row)

    sync_s: dict[tuple[int, int], float] = {}
    exposed_s: dict[tuple[int, int], float] = {}
    ready: dict[tuple[int, int], float] = {}
    for t, (n_params, holders) in zip(grad_sync_times(layout, plan, params), groups,
                                      strict=True):  # fmt: skip
        if len(holders) <= 1:
            continue
        end = max(replays[r].last_backward_end_s[j] for r, j in holders)
        window = min(
            replays[r].last_backward_end_s[j] - replays[r].grads_ready_from_s[j] for r, j in holders
        )
        share = min(params.gpu(by_pipe[r][j].gpu).grad_overlap for r, j in holders)
        tp_min = min(plan.pipelines[r].stages[j].tp for r, j in holders)
        buckets = bucket_count(n_params / tp_min, len(holders))
        exposed = exposed_sync_s(t, window, share, plan.overlap_grad_reduce, buckets)
        for h in holders:
            sync_s[h] = sync_s.get(h, 0.0) + t
            exposed_s[h] = exposed_s.get(h, 0.0) + exposed
            ready[h] = max(ready.get(h, 0.0), end)
    for st in stages:
        key2 = (st.pipeline, st.stage)
        st.grad_sync_s = sync_s.get(key2, 0.0)
        st.sync_end_s = max(st.last_backward_end_s, ready.get(key2, 0.0) + exposed_s.get(key2, 0))
        st.end_s = st.sync_end_s + st.optimizer_s + st.param_gather_s

    crit = max(stages, key=lambda s: s.end_s)
    iteration = crit.end_s
    n_mb = plan.num_micro_batches(plan.pipelines[crit.pipeline])
    compute = n_mb * (crit.forward_s + crit.backward_s + crit.recompute_s)
    breakdown = {
        "forward_s": n_mb * crit.forward_s,
        "backward_s": n_mb * crit.backward_s,
        "recompute_s": n_mb * crit.recompute_s,
        "tensor_parallel_comm_s": n_mb * crit.tp_comm_s,
        "pipeline_p2p_wait_s": n_mb * crit.p2p_wait_s,
        "sharded_dp_comm_s": n_mb * crit.zero_comm_s + crit.param_gather_s,
        "pipeline_bubble_s": crit.last_backward_end_s
        - compute
        - n_mb * (crit.tp_comm_s + crit.zero_comm_s + crit.p2p_wait_s),
        "pipeline_send_s_per_micro_batch": crit.send_s,
        "data_parallel_sync_s": crit.sync_end_s - crit.last_backward_end_s,
        "data_parallel_sync_total_s": crit.grad_sync_s,
        "optimizer_s": crit.optimizer_s,
        "microbatch_overhead_s": n_mb * crit.overhead_s,
    }
    tokens = plan.global_batch_size * model.seq
    n_gpus = len(plan.devices())
    model_flops = plan.global_batch_size * model.model_flops_per_sequence()
    if plan.recompute == "full":
        extra = plan.global_batch_size * model.layers * model.layer_flops()
    elif plan.recompute == "selective":
        extra = plan.global_batch_size * model.layers * model.layer_attention_flops()
    else:
        extra = 0.0
    gpu_of = {node_of(st.devices[0]).gpu.name: node_of(st.devices[0]).gpu for st in stages}
    peak_sum = sum(node_of(d).gpu.peak_flops(plan.precision) for d in plan.devices())
    price: float | None = 0.0
    for d in plan.devices():
        node_price = node_of(d).usd_per_gpu_hour
        price = None if price is None or node_price is None else price + node_price
    tokens_per_s = tokens / iteration
    fits = all(s.memory.total <= s.capacity_bytes for s in stages)
    bottleneck = (
        f"pipeline {crit.pipeline} stage {crit.stage} ({crit.gpu} x{len(crit.devices)}, "
        f"{crit.layers} layers)"
    )
    est = Estimate(
        iteration_time_s=iteration,
        breakdown=breakdown,
        stages=stages,
        pipeline_times_s=pipeline_times,
        fits=fits,
        tokens_per_s=tokens_per_s,
        tflops_per_gpu=model_flops / iteration / n_gpus / 1e12,
        hardware_tflops_per_gpu=(model_flops + extra) / iteration / n_gpus / 1e12,
        mfu=model_flops / iteration / peak_sum,
        cost_usd_per_hour=price,
        usd_per_million_tokens=(price / (tokens_per_s * 3600) * 1e6) if price is not None else None,
        compute_source=combine_sources([s.compute_source for s in stages]),
        bottleneck=bottleneck,
        replays=replays,
        peak_used={st.gpu: gpu_of[st.gpu].peak_label(plan.precision) for st in stages},
    )
    est.warnings = warnings_for(plan, est, cluster, params)
    return est

"""estimate(plan, model, cluster): the one cost model every search and report shares."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hetplan.cluster import Cluster, Node
from hetplan.cost import comm
from hetplan.cost.dp_sync import (
    SyncLayout,
    grad_sync_times,
    layout_classes,
    sharded_microbatch_s,
    sync_layout,
    zero2_buffer_s,
)
from hetplan.cost.estimate_result import Estimate, StageEstimate
from hetplan.cost.memory import (
    MemoryBreakdown,
    held_chunks,
    stage_activation_bytes,
    stage_params,
    stage_state,
)
from hetplan.cost.money import MoneyParts, node_parts
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import Replay, held_layers, peak_in_flight, pipeline_replay, replay
from hetplan.cost.sharding import (
    bucket_count,
    deferred_sync,
    first_bucket_ready_s,
    serial_end_s,
    unhidden_sync_s,
)
from hetplan.cost.sources import ComputeSource, LayerTimeSource, combine_sources
from hetplan.cost.trust import warnings_for
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.plan import Plan, Stage, element_bytes, validate_plan


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
    lc = None
    if tp > 1:  # as measured; with SP, its own collectives where the profile has them
        sp_part = "tp_comm_sp" if plan.sequence_parallel else "tp_comm"
        lc = src.ask("part_times", gpu, model, sp_part, tp, mb, prec)
        lc = lc if lc is not None else src.ask("part_times", gpu, model, "tp_comm", tp, mb, prec)
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


def uneven_chunks(stage: Stage, v: int) -> tuple[int, ...] | None:
    """Returns the stage's per-chunk layers where its chunks differ in size, else None (the
    even split, costed as before)."""
    chunks = stage.chunks
    if chunks is None or v <= 1 or len(set(chunks)) == 1:
        return None
    return chunks


def chunk_split(
    full_s: float, empty_s: float, layers: int, chunks: tuple[int, ...], extra_s: float = 0.0
) -> list[float]:
    """Returns per-chunk times of a stage's ``len(chunks)`` chunks from its per-micro-batch
    time with its layers (``full_s``) and without them (``empty_s``, the same stage's
    ``stage_times`` for zero layers: the per-chunk fixed costs): each chunk takes an equal
    share of the fixed costs and of ``extra_s`` and its own layers' share of the rest
    (stage times are affine in the layers)."""
    v = len(chunks)
    per_layer = (full_s - empty_s) / layers if layers else 0.0
    return [(empty_s + extra_s) / v + n * per_layer for n in chunks]


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


REPLAY_MEMO_SIZE = 50_000
"""Replays kept across estimate() calls (searches estimate many plans whose pipelines run
the same times): a replay is a pure function of its signature (schedule, micro-batches,
chunks, chunk times, sends); cleared when full."""
_REPLAYS: dict[tuple[Any, ...], Replay] = {}


def replay_sig(
    schedule: str,
    m: int,
    v: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    sends: list[float],
) -> tuple[Any, ...]:
    """Returns what a replay is a pure function of: its memo key."""
    return (schedule, m, v, tuple(map(tuple, fwd_c)), tuple(map(tuple, bwd_c)), tuple(sends))


def memo_replay(
    schedule: str,
    m: int,
    v: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    sends: list[float],
) -> Replay:
    """Returns ``pipeline_replay`` of a pipeline's chunk times and sends, memoised across
    calls (``replay_sig``): ``estimate`` and the homogeneous search's replay bound, which
    replays the same pipeline just before it is estimated, share one replay."""
    sig = replay_sig(schedule, m, v, fwd_c, bwd_c, sends)
    rep = _REPLAYS.get(sig)
    if rep is None:
        rep = pipeline_replay(schedule, m, v, fwd_c, bwd_c, sends)
        if len(_REPLAYS) >= REPLAY_MEMO_SIZE:
            _REPLAYS.clear()
        _REPLAYS[sig] = rep
    return rep


def estimate(
    plan: Plan,
    model: ModelSpec,
    cluster: Cluster,
    params: CostParams | None = None,
    profile: LayerTimeSource | None = None,
    record: bool = False,
    validate: bool = True,
    layout: SyncLayout | None = None,
    dedupe: bool = True,
) -> Estimate:
    """Returns the predicted iteration time, memory, throughput and price of ``plan``.

    ``layout``: the plan's ``sync_layout`` when the caller already has it (it depends on
    the pipelines' devices and layers only; searches reuse one per device layout).
    Pipelines identical for the cost model (``pipeline_classes``) are costed once; with
    ``dedupe`` False every pipeline is costed on its own (the reference tests hold the
    shared path against)."""
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
    deferred = deferred_sync(plan)
    if layout is None:
        layout = sync_layout(plan, model, node_of)
    act_memo: dict[tuple[Any, ...], float] = {}
    groups = layout.groups
    concurrency, dp_members = layout.concurrency, layout.dp_members
    gather_memo: dict[tuple[Any, ...], tuple[float, float]] = {}
    talkers, pipe_class = layout_classes(plan, layout, node_of)
    if not dedupe:
        pipe_class = list(range(dp))
    stages: list[StageEstimate] = []
    replays: list[Replay] = []
    pipeline_times: list[float] = []
    by_pipe: list[list[StageEstimate]] = []
    replay_cache: dict[tuple[Any, ...], Replay] = {}
    stage_memo: dict[tuple[Any, ...], tuple[float, float, float, float, float, str]] = {}
    opt_memo: dict[tuple[Any, ...], float] = {}
    for r, pipe in enumerate(plan.pipelines):
        same = pipe_class[r]
        if same != r:  # a repeat of an earlier pipeline on identical hardware: its results
            replays.append(replays[same])
            pipeline_times.append(pipeline_times[same])
            by_pipe.append(by_pipe[same])
            continue
        p = len(pipe.stages)
        m = plan.num_micro_batches(pipe)
        nodes = [node_of(s.devices[0]) for s in pipe.stages]
        row: list[StageEstimate] = []
        for j, stage in enumerate(pipe.stages):
            node = nodes[j]
            first, last = j == 0, j == p - 1
            # replicas repeat the same stages: compute each distinct one once
            memo_key = (id(node.gpu), node.intra_node_bytes_per_s, stage.tp, stage.layers,
                        first, last, p == 1)  # fmt: skip
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
            if plan.zero_stage >= 2 and (r, j) in dp_members and not deferred:
                group = dp_members[(r, j)]
                gkey = (id(group), stage.layers, stage.tp, first, last, fwd, bwd + rc + tpc)
                if gkey not in gather_memo:
                    gather_memo[gkey] = sharded_microbatch_s(
                        plan, model, stage.layers, stage.tp, first, last, p == 1, group, params,
                        concurrency, fwd, bwd + rc + tpc,
                    )  # fmt: skip
                zero_mb, param_gather = gather_memo[gkey]
                if plan.zero_stage == 2:
                    eff = params.gpu(node.gpu.name)
                    zero_mb += zero2_buffer_s(p_local, len(group), node.gpu, eff)
            act = plan.micro_batch_size * model.seq * model.hidden * element_bytes(plan.precision)
            nxt = nodes[(j + 1) % p]
            if p > 1:  # every device of a node sending across nodes shares its link
                conc = max(talkers.get(node.name, 0), talkers.get(nxt.name, 0), stage.tp)
                send = comm.p2p_s(act / stage.tp, node, nxt, params, conc)
            else:
                send = 0.0
            # deferred: ZeRO-2/3 with pipelining as PyTorch runs them (cost.sharding)
            w, g, o = stage_state(model, stage.layers, stage.tp, first, last, p == 1,
                                  plan.precision, plan.zero_stage, dp, deferred)  # fmt: skip
            units = peak_in_flight(plan.schedule, p, m, v, j)
            uneven = uneven_chunks(stage, v)
            akey = (stage.tp, stage.layers, first, last, units, uneven, m)
            acts = act_memo.get(akey, -1.0)
            if acts < 0:
                # the first stage's embedding outputs: counted from the action order
                chunks = held_chunks(stage.layers, v, first, uneven)
                held = held_layers(plan.schedule, p, m, j, chunks) if chunks else None
                acts = act_memo[akey] = stage_activation_bytes(
                    model, stage.layers, stage.tp, plan.micro_batch_size,
                    plan.sequence_parallel, plan.recompute, plan.flash_attention, first, last,
                    units, v, plan.precision, held,
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
        # chunk times: layers split evenly over v chunks unless a stage states its chunks;
        # the embedding runs on chunk 0 of the first stage and the head on chunk v-1 of the last
        fwd_c, bwd_c = [], []
        for j, st in enumerate(row):
            ef = eb = hf = hb = 0.0
            if v > 1 and (j == 0 or j == p - 1):
                gpu = node_of(st.devices[0]).gpu
                ef, eb, hf, hb = part_split(plan, model, gpu, len(st.devices), j == 0,
                                             j == p - 1, params)  # fmt: skip
            b_side = st.backward_s + st.recompute_s + st.tp_comm_s
            uneven = uneven_chunks(pipe.stages[j], v)
            if uneven is None:
                f = (st.forward_s - ef - hf + st.p2p_wait_s / 2) / v
                b = (b_side + st.zero_comm_s - eb - hb + st.p2p_wait_s / 2) / v
                fs, bs = [f] * v, [b] * v
            else:  # each chunk its own layers' share, the fixed costs evenly
                node = nodes[j]
                ekey = (id(node), len(st.devices), 0, j == 0, j == p - 1, p == 1)
                empty = stage_memo.get(ekey)
                if empty is None:
                    key0 = StageKey(node.gpu, node.intra_node_bytes_per_s, len(st.devices), 0,
                                    j == 0, j == p - 1, p == 1)  # fmt: skip
                    empty = stage_memo[ekey] = stage_times(plan, model, key0, node, params)
                fs = chunk_split(st.forward_s - ef - hf, empty[0] - ef - hf, st.layers, uneven,
                                 st.p2p_wait_s / 2)  # fmt: skip
                bs = chunk_split(b_side - eb - hb, sum(empty[1:4]) - eb - hb, st.layers, uneven,
                                 st.zero_comm_s + st.p2p_wait_s / 2)  # fmt: skip
            fwd_c.append([fs[c] + (ef if c == 0 else 0.0) + (hf if c == v - 1 else 0.0)
                          for c in range(v)])  # fmt: skip
            bwd_c.append([bs[c] + (eb if c == 0 else 0.0) + (hb if c == v - 1 else 0.0)
                          for c in range(v)])  # fmt: skip
        sends = [st.send_s for st in row]
        if record:
            sig = replay_sig(plan.schedule, m, v, fwd_c, bwd_c, sends)
            rep = replay_cache.get(sig)
            if rep is None:
                rep = replay_cache[sig] = replay(plan.schedule, m, v, fwd_c, bwd_c, sends,
                                                 record=True)  # fmt: skip
        else:
            rep = memo_replay(plan.schedule, m, v, fwd_c, bwd_c, sends)
        replays.append(rep)
        pipeline_times.append(rep.makespan_s)
        for j, st in enumerate(row):
            st.busy_s = rep.busy_s[j]
            st.last_backward_end_s = rep.last_backward_end_s[j]
        by_pipe.append(row)
        stages.extend(row)

    # per holder, its reductions (one per layer segment it shares) on its one link: each
    # may start once its first bucket is ready on every member and takes its whole time;
    # what no window hides (the last bucket, the share compute interferes with) follows
    # its last gradient (``sharding``). One segment: ``exposed_sync_s`` after the end.
    sync_s: dict[tuple[int, int], float] = {}
    overlapped: dict[tuple[int, int], list[tuple[float, float]]] = {}
    unhidden: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for t, (n_params, holders) in zip(grad_sync_times(layout, plan, params, model), groups,
                                      strict=True):  # fmt: skip
        if len(holders) <= 1:
            continue
        # a repeated pipeline's stages are its first copy's (``pipe_class``: the same row,
        # replay and TP degrees), and only the first copies' stages are read below: the
        # times, the least overlap and TP over them are those over every holder
        own = [(r, j) for r, j in holders if pipe_class[r] == r]
        ends = [replays[r].last_backward_end_s[j] for r, j in own]
        end = max(ends)
        share = min(params.gpu(by_pipe[r][j].gpu).grad_overlap for r, j in own)
        tp_min = min(plan.pipelines[r].stages[j].tp for r, j in own)
        buckets = bucket_count(n_params / tp_min, len(holders))
        # (without overlap the tail is the whole reduction after the end, which bounds this)
        released = first_bucket_ready_s(
            [replays[r].grads_ready_from_s[j] for r, j in own], ends, buckets
        )
        tail = unhidden_sync_s(t, share, plan.overlap_grad_reduce, buckets)
        for h in own:
            sync_s[h] = sync_s.get(h, 0.0) + t
            overlapped.setdefault(h, []).append((released, t))
            unhidden.setdefault(h, []).append((end, tail))
    # the step's scalar all-reduces over all devices (gradient norm and loss)
    scalar = comm.step_collectives_s(*layout.spread, params)
    for st in stages:
        key2 = (st.pipeline, st.stage)
        st.grad_sync_s = sync_s.get(key2, 0.0)
        st.sync_end_s = st.last_backward_end_s
        if key2 in overlapped:
            st.sync_end_s = max(st.sync_end_s, serial_end_s(overlapped[key2]),
                                serial_end_s(unhidden[key2]))  # fmt: skip
        st.end_s = st.sync_end_s + st.optimizer_s + st.param_gather_s + scalar

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
        "step_collectives_s": scalar,
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
    peak_sum = 0.0
    money: MoneyParts | None = MoneyParts()  # rental, amortisation, energy (cost/money.py)
    repeats = Counter(id(row) for row in by_pipe)  # a repeated pipeline shares its row
    for row in {id(row): row for row in by_pipe}.values():
        for st in row:  # per stage: its devices' peaks and prices (one node each)
            node, n = node_of(st.devices[0]), len(st.devices) * repeats[id(row)]
            peak_sum += n * node.gpu.peak_flops(plan.precision)
            part = node_parts(node)
            money = None if money is None or part is None else money + part.scaled(n)
    price = None if money is None else money.total
    tokens_per_s = tokens / iteration
    fits = all(s.memory.total <= s.capacity_bytes for s in stages)
    bottleneck = (
        f"pipeline {crit.pipeline} stage {crit.stage} ({crit.gpu} x{len(crit.devices)}, "
        f"{crit.layers} layers)"
    )
    est = Estimate(
        iteration_time_s=iteration,
        breakdown=breakdown,
        distinct_stages=stages,
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
        pipeline_class=pipe_class,
        plan_pipelines=plan.pipelines,
        cost_parts=money,
    )
    est.warnings = warnings_for(plan, est, cluster, params)
    return est

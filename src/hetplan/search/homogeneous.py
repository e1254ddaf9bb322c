"""Homogeneous 3D search: enumerate degrees and knobs, prune by divisibility and memory,
score with a closed-form pipeline time from the cost tables, re-rank finalists by estimate()."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from hetplan.cluster import Cluster
from hetplan.cost import comm
from hetplan.cost.compute import optimizer_time_s
from hetplan.cost.estimate import Estimate, estimate, p2p_wait_s, zero3_exposed_s
from hetplan.cost.memory import (
    combine_activation_bytes,
    stage_params,
    state_bytes,
    zero3_working_bytes,
)
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import peak_in_flight
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan, element_bytes
from hetplan.search.layout import even_layer_split, uniform_plan

FINALIST_MARGIN = 1.15
"""Candidates whose closed-form time is within this factor of the best are re-scored."""
MAX_FINALISTS = 200


def divisors(n: int) -> list[int]:
    """Returns the positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Candidate:
    """One point of the homogeneous search space."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: str
    zero_stage: int
    schedule: str
    virtual_stages: int
    sequence_parallel: bool


@dataclass
class SearchResult:
    """The best plans found, with their estimates, and what the search saw."""

    ranked: list[tuple[Plan, Estimate]]
    candidates: int
    """Points enumerated after divisibility pruning."""
    fitting: int
    """Points that fit in memory."""
    min_memory_bytes: float = math.inf
    """The smallest per-GPU peak of any point (when nothing fits)."""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SearchSpace:
    """Which knobs the search may turn."""

    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_virtual_stages: int = 8
    sequence_parallel: tuple[bool, ...] = (False, True)
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B")


def enumerate_candidates(
    model: ModelSpec, num_gpus: int, gpus_per_node: int, global_batch: int, space: SearchSpace
) -> Iterator[Candidate]:
    """Yields every candidate that passes divisibility rules (not memory)."""
    for tp in divisors(gpus_per_node):
        if space.tp and tp not in space.tp:
            continue
        if model.heads % tp or model.ffn % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for pp in divisors(num_gpus // tp):
            if pp > model.layers or (space.pp and pp not in space.pp):
                continue
            dp = num_gpus // (tp * pp)
            if global_batch % dp or (space.dp and dp not in space.dp):
                continue
            per_replica = global_batch // dp
            for mb in divisors(per_replica):
                if space.micro_batch and mb not in space.micro_batch:
                    continue
                m = per_replica // mb
                schedules: list[tuple[str, int]] = [("1F1B", 1)]
                if pp > 1 and "Interleaved1F1B" in space.schedules and m % pp == 0:
                    min_layers = model.layers // pp
                    for v in range(2, space.max_virtual_stages + 1):
                        splits = set(even_layer_split(model.layers, pp))
                        if v <= min_layers and all(x % v == 0 for x in splits):
                            schedules.append(("Interleaved1F1B", v))
                if "1F1B" not in space.schedules:
                    schedules = [s for s in schedules if s[0] != "1F1B"]
                for rc in space.recompute:
                    for zero in space.zero_stages:
                        if zero and dp == 1:
                            continue
                        if zero >= 2 and pp > 1:
                            continue  # ZeRO-2/3 shard gradients that pipelining accumulates
                        for sched, v in schedules:
                            for sp in space.sequence_parallel:
                                if sp and tp == 1:
                                    continue
                                yield Candidate(tp, pp, dp, mb, rc, zero, sched, v, sp)


@dataclass(frozen=True)
class _Shape:
    """The parts of a candidate's cost that do not depend on the data-parallel degree."""

    split: tuple[int, ...]
    stage_t: tuple[float, ...]
    """Per micro-batch compute and TP time per stage."""
    first_forward_s: float
    layer_compute_s: float
    p_first: float
    p_last: float
    act_bytes: float
    """One micro-batch's activations sent between stages."""
    layer_act_bytes: float
    """Activations one layer keeps per micro-batch."""
    embed_act_bytes: float
    head_act_bytes: float
    working_act_bytes: float
    """Full recomputation: one layer's activations rebuilt during its backward."""


class SearchMemo:
    """Caches of shape costs and collective times, valid for one model, one node type (GPU,
    GPUs per node, links) and one set of parameters; reusable across node counts."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[object, ...], _Shape] = {}
        self.syncs: dict[tuple[object, ...], float] = {}


@dataclass
class _Scorer:
    """Closed-form memory and time of candidates on one cluster, from shared cost tables."""

    model: ModelSpec
    cluster: Cluster
    precision: str
    global_batch: int
    params: CostParams
    flash: bool
    memo: SearchMemo

    def shape(self, c: Candidate) -> _Shape:
        """Returns the candidate's costs that do not depend on its data-parallel degree."""
        model, cluster, precision, params, flash, memo = (
            self.model,
            self.cluster,
            self.precision,
            self.params,
            self.flash,
            self.memo,
        )
        key = (c.tp, c.pp, c.micro_batch, c.recompute, c.sequence_parallel, precision, flash)
        hit = memo.shapes.get(key)
        if hit is not None:
            return hit
        node = cluster.nodes[0]
        gpu = node.gpu
        mb = c.micro_batch
        src = params.compute
        lt = src.layer(model, gpu, params, c.tp, mb, precision, flash).times
        split = tuple(even_layer_split(model.layers, c.pp))
        act = mb * model.seq * model.hidden * element_bytes(precision)
        ar = comm.intra_node_allreduce_s(act, c.tp, node, params)
        if src.tp_comm_included(gpu, model, c.tp, mb, precision):
            ar = 0.0
        rc_per_layer = {"none": 0.0, "selective": lt.selective_recompute_s, "full": lt.forward_s}[
            c.recompute
        ]
        n_ar = 4 + (2 if c.recompute == "full" else 0)
        per_layer = lt.forward_s + lt.backward_s + rc_per_layer + n_ar * ar
        et = src.embedding(model, gpu, params, c.tp, mb, precision, flash).times
        ht = src.head(model, gpu, params, c.tp, mb, precision, flash).times
        stage_t = [x * per_layer for x in split]
        stage_t[0] += et.forward_s + et.backward_s + ar
        stage_t[-1] += ht.forward_s + ht.backward_s + ar
        single = c.pp == 1
        e = element_bytes(precision)
        shape = _Shape(
            split=split,
            stage_t=tuple(stage_t),
            first_forward_s=lt.forward_s * split[0] + et.forward_s,
            layer_compute_s=lt.forward_s + lt.backward_s,
            p_first=stage_params(model, split[0], c.tp, True, single, single),
            p_last=stage_params(model, split[-1], c.tp, single, True, single),
            act_bytes=act,
            layer_act_bytes=mb
            * model.layer_activation_bytes(c.tp, c.sequence_parallel, c.recompute, flash, e),
            embed_act_bytes=mb * model.embedding_activation_bytes(c.tp, c.sequence_parallel, e),
            head_act_bytes=mb * model.head_activation_bytes(c.tp, e),
            working_act_bytes=(
                mb * model.layer_activation_bytes(c.tp, c.sequence_parallel, "none", flash, e)
                if c.recompute == "full"
                else 0.0
            ),
        )
        memo.shapes[key] = shape
        return shape

    def peak_bytes(self, c: Candidate) -> float:
        """Returns the larger peak of the first and last stage of a candidate."""
        model, precision, global_batch, params = (
            self.model,
            self.precision,
            self.global_batch,
            self.params,
        )
        m = global_batch // c.dp // c.micro_batch
        shape = self.shape(c)
        worst = 0.0
        for j in {0, c.pp - 1}:
            first, last = j == 0, j == c.pp - 1
            p_local = shape.p_first if first else shape.p_last
            w, g, o = state_bytes(p_local, precision, c.zero_stage, c.dp)
            if c.zero_stage == 3:
                w += zero3_working_bytes(model, c.tp, precision)
            units = peak_in_flight(c.schedule, c.pp, m, c.virtual_stages, j)
            acts = combine_activation_bytes(
                shape.split[j], shape.layer_act_bytes, shape.embed_act_bytes,
                shape.head_act_bytes, shape.working_act_bytes, first, last, units,
                c.virtual_stages,
            )  # fmt: skip
            worst = max(worst, w + g + o + acts + params.memory_reserve_bytes)
        return worst

    def dp_allreduce_s(self, size_bytes: float, c: Candidate, volume: float) -> float:
        """Returns the all-reduce time among one stage's replicas in the Megatron layout."""
        cluster, params, memo = self.cluster, self.params, self.memo
        key = (size_bytes, c.tp, c.dp, volume)
        hit = memo.syncs.get(key)
        if hit is None:
            nodes = cluster.nodes
            gpn = nodes[0].gpus
            members = [nodes[(r * c.tp) // gpn % len(nodes)] for r in range(c.dp)]
            spans = len({n.name for n in members}) > 1
            conc = {n.name: min(gpn, c.tp * c.dp) for n in members} if spans else {}
            hit = comm.group_allreduce_s(size_bytes, members, params, conc, volume)
            memo.syncs[key] = hit
        return hit

    def score_s(self, c: Candidate) -> float:
        """Returns a closed-form iteration time of a candidate from the same cost tables."""
        cluster, precision, global_batch, params = (
            self.cluster,
            self.precision,
            self.global_batch,
            self.params,
        )
        node = cluster.nodes[0]
        shape = self.shape(c)
        m = global_batch // c.dp // c.micro_batch
        gpn = node.gpus
        if c.pp > 1:
            cross = (c.tp * c.dp) >= gpn
            send = comm.p2p_s(
                shape.act_bytes / c.tp,
                node,
                cluster.nodes[-1] if cross and len(cluster.nodes) > 1 else node,
                params,
                concurrency=min(c.tp * c.dp, gpn) if cross else 1,
            )
        else:
            send = 0.0
        v = c.virtual_stages
        eff = params.gpu(node.gpu.name)
        per_mb = v * (eff.microbatch_overhead_s + 2 * params.compute.action_overhead_s(node.gpu))
        sends = [send] * c.pp
        stage_t = [
            t + per_mb + p2p_wait_s(sends, j, v, eff.p2p_exposed)
            for j, t in enumerate(shape.stage_t)
        ]
        p_local = shape.p_first
        if c.dp > 1 and c.zero_stage == 3:
            gather = self.dp_allreduce_s(p_local * element_bytes(precision), c, 1.0)
            stage_t[0] += zero3_exposed_s(gather, shape.split[0] * shape.layer_compute_s)
        bottleneck = max(stage_t)
        # 1F1B: m micro-batches at the bottleneck's pace plus the fill and drain of the others,
        # which interleaving divides by v (Narayanan et al. 2021)
        pipe = m * bottleneck + (sum(stage_t) - bottleneck) / v + 2 * (c.pp - 1) * send * v
        # gradient sync of the first stage (it finishes last), overlapped with its last backward
        if c.dp > 1:
            sync = self.dp_allreduce_s(p_local * 4.0, c, 0.5 if c.zero_stage == 3 else 1.0)
            exposed = max(0.0, sync - (stage_t[0] - shape.first_forward_s))
        else:
            exposed = 0.0
        gpu = node.gpu
        opt = optimizer_time_s(
            p_local / (c.dp if c.zero_stage else 1), gpu, params.gpu(gpu.name), precision
        )
        return pipe + exposed + opt


@dataclass
class Scored:
    """Candidates that fit, with closed-form times, best first; and what was pruned."""

    ranked: list[tuple[float, Candidate]]
    candidates: int
    fitting: int
    min_memory_bytes: float


def score_candidates(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams | None = None,
    space: SearchSpace | None = None,
    flash_attention: bool = True,
    memo: SearchMemo | None = None,
) -> Scored:
    """Returns every fitting candidate with its closed-form time, best first (no estimate).

    ``memo`` may be shared by calls on clusters of the same node type and model."""
    params = params or default_params()
    space = space or SearchSpace()
    gpus_per_node = {n.gpus for n in cluster.nodes}
    if len({n.gpu.name for n in cluster.nodes}) != 1 or len(gpus_per_node) != 1:
        raise InputError("--cluster", "the homogeneous search needs one GPU type and node size")
    gpu = cluster.nodes[0].gpu
    if not gpu.supports(precision):
        raise InputError("--precision", f"{gpu.name} has no {precision} support")
    n = cluster.num_gpus
    gpn = gpus_per_node.pop()
    scored: list[tuple[float, tuple[object, ...], Candidate]] = []
    count = 0
    min_mem = math.inf
    scorer = _Scorer(model, cluster, precision, global_batch, params, flash_attention,
                     memo or SearchMemo())  # fmt: skip
    for c in enumerate_candidates(model, n, gpn, global_batch, space):
        count += 1
        peak = scorer.peak_bytes(c)
        if peak > gpu.memory_bytes:
            min_mem = min(min_mem, peak)
            continue
        t = scorer.score_s(c)
        scored.append((t, _tiebreak(c), c))
    scored.sort(key=lambda x: (x[0], x[1]))
    return Scored([(t, c) for t, _, c in scored], count, len(scored), min_mem)


def search_homogeneous(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    top_k: int = 5,
    params: CostParams | None = None,
    space: SearchSpace | None = None,
    flash_attention: bool = True,
    finalists: int | None = None,
) -> SearchResult:
    """Returns the top-k plans for a cluster of one GPU type, best first, deterministically."""
    params = params or default_params()
    sc = score_candidates(model, cluster, global_batch, precision, params, space, flash_attention)
    result = SearchResult([], sc.candidates, sc.fitting, sc.min_memory_bytes)
    if not sc.ranked:
        return result
    if finalists is None:
        # every candidate the closed form puts near the best is re-scored by estimate()
        best = sc.ranked[0][0]
        near = sum(1 for t, _ in sc.ranked if t <= best * FINALIST_MARGIN)
        finalists = min(max(4 * top_k, 24, near), MAX_FINALISTS)
    ranked: list[tuple[Plan, Estimate]] = []
    for _, c in sc.ranked[:finalists]:
        plan = candidate_plan(model, cluster, c, global_batch, precision, flash_attention)
        est = estimate(plan, model, cluster, params, validate=False)
        if est.fits:
            ranked.append((plan, est))
    ranked.sort(key=lambda pe: (pe[1].iteration_time_s, _tiebreak(_candidate_of(pe[0]))))
    result.ranked = ranked[:top_k]
    return result


def candidate_plan(
    model: ModelSpec,
    cluster: Cluster,
    c: Candidate,
    global_batch: int,
    precision: str,
    flash_attention: bool = True,
) -> Plan:
    """Returns the uniform plan of a candidate."""
    return uniform_plan(
        cluster,
        model.layers,
        c.tp,
        c.pp,
        c.dp,
        c.micro_batch,
        global_batch,
        precision=precision,
        recompute=c.recompute,
        zero_stage=c.zero_stage,
        schedule=c.schedule,
        virtual_stages=c.virtual_stages,
        sequence_parallel=c.sequence_parallel,
        flash_attention=flash_attention,
    )


def _tiebreak(c: Candidate) -> tuple[object, ...]:
    # prefer simpler plans on ties: less recomputation, lower ZeRO, fewer chunks
    rc = ("none", "selective", "full").index(c.recompute)
    return (rc, c.zero_stage, c.virtual_stages, c.pp, c.tp, -c.micro_batch, c.sequence_parallel)


def _candidate_of(plan: Plan) -> Candidate:
    first = plan.pipelines[0]
    return Candidate(
        first.stages[0].tp,
        len(first.stages),
        plan.dp,
        plan.micro_batch_size,
        plan.recompute,
        plan.zero_stage,
        plan.schedule,
        plan.virtual_stages,
        plan.sequence_parallel,
    )

"""Homogeneous 3D search: enumerate degrees and knobs, prune by divisibility and memory,
rank by estimate() itself, visiting candidates in order of a proven lower bound of it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from hetplan.chunk_layout import lightened_chunks
from hetplan.cluster import Cluster, Node
from hetplan.cost.estimate import (
    Estimate,
    StageKey,
    SyncLayout,
    chunk_split,
    estimate,
    grad_sync_times,
    part_split,
    stage_times,
    sync_layout,
)
from hetplan.cost.memory import (
    combine_activation_bytes,
    held_chunks,
    stage_params,
    state_bytes,
    zero3_working_bytes,
)
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import held_layers, peak_in_flight
from hetplan.cost.sharding import bucket_count, exposed_sync_s
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage, element_bytes
from hetplan.search.layout import even_layer_split, uniform_plan
from hetplan.search.progress import ProgressHook, SearchProgress


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
    lightened: bool = False
    """Interleaved with the first and last stages one layer lighter than the others (in
    the chunk beside the embedding and the head; Llama 3 405B's layout), where the
    layers do not split evenly into equal chunks (``lightened_chunks``)."""


def lightens(layers: int, pp: int, v: int) -> bool:
    """Returns whether ``layers`` fill ``pp`` stages of ``v`` equal chunks but for one layer
    less on the first and the last stage (``layers + 2 = pp * v * n``, n >= 1). With n = 1
    the first chunk holds only the embedding and the last only the head, as Meta states
    of Llama 3 405B (126 layers, PP 16, V 8)."""
    return pp > 1 and v > 1 and (layers + 2) % (pp * v) == 0


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
    evaluated: int = 0
    """Candidates estimated exactly (the rest were ruled out by their lower bound)."""


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
    virtual_stages: tuple[int, ...] | None = None
    """Model chunks per stage allowed (1: not interleaved); None: 1..max_virtual_stages."""
    overlap_grad_reduce: bool = True
    """Plan option of every candidate: gradient reduction overlapped with the backward."""
    overlap_tp_comm: bool = False
    """Plan option of every candidate: TP collectives overlapped with the TP matmuls."""


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
                    top_v = max(space.virtual_stages or (space.max_virtual_stages,))
                    for v in range(2, top_v + 1):
                        splits = set(even_layer_split(model.layers, pp))
                        if v <= min_layers and all(x % v == 0 for x in splits):
                            schedules.append(("Interleaved1F1B", v))
                        elif lightens(model.layers, pp, v):
                            schedules.append(("Interleaved1F1B", -v))
                if "1F1B" not in space.schedules:
                    schedules = [s for s in schedules if s[0] != "1F1B"]
                if space.virtual_stages is not None:
                    schedules = [s for s in schedules if abs(s[1]) in space.virtual_stages]
                for rc in space.recompute:
                    for zero in space.zero_stages:
                        if zero and dp == 1:
                            continue
                        if zero >= 2 and pp > 1:
                            # dominated: pipelined, frameworks run ZeRO-2/3 with ZeRO-1's
                            # traffic and no less memory (DeepSpeed's pipeline engine refuses
                            # them; PyTorch's pipelining stages defer FSDP's gradient sync
                            # and resharding to the last micro-batch), and estimate prices
                            # them so (cost.sharding.deferred_sync; docs/search.md)
                            continue
                        for sched, v in schedules:
                            for sp in space.sequence_parallel:
                                if sp and tp == 1:
                                    continue
                                yield Candidate(tp, pp, dp, mb, rc, zero, sched, abs(v), sp,
                                                v < 0)  # fmt: skip


@dataclass(frozen=True)
class _Shape:
    """Activation sizes of a candidate's stages (memory), independent of its DP degree."""

    split: tuple[int, ...]
    p_first: float
    p_last: float
    layer_act_bytes: float
    """Activations one layer keeps per micro-batch."""
    embed_act_bytes: float
    head_act_bytes: float
    working_act_bytes: float
    """Full recomputation: one layer's activations rebuilt during its backward."""


@dataclass
class _Layout:
    """The device layout of a (tp, pp, dp) triple: a plan with default knobs, the nodes of
    one pipeline's stages and the data-parallel groups, for the bound."""

    plan: Plan
    nodes: list[Node]
    sync: SyncLayout
    holds: list[list[int]]
    """Per stage of pipeline 0: the indices of the sync groups (layer segments) it holds."""
    sync_s: dict[int, list[float]] = field(default_factory=dict)
    """Per ZeRO stage: per stage of pipeline 0, the gradient reduction no overlap hides."""


class SearchMemo:
    """Caches of shapes, layouts and stage times, valid for one model, one node type (GPU,
    GPUs per node, links) and one set of parameters; reusable across node counts."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[object, ...], _Shape] = {}
        self.stages: dict[tuple[object, ...], tuple[float, float, float, float, float]] = {}
        self.optimizer: dict[tuple[object, ...], float] = {}


@dataclass
class _Scorer:
    """Memory and a proven lower bound of estimate()'s iteration time for candidates on one
    cluster, from estimate()'s own building blocks (stage times, gradient sync, optimizer)."""

    model: ModelSpec
    cluster: Cluster
    precision: str
    global_batch: int
    params: CostParams
    flash: bool
    memo: SearchMemo
    space: SearchSpace
    layouts: dict[tuple[int, int, int], _Layout] = field(default_factory=dict)

    def shape(self, c: Candidate) -> _Shape:
        """Returns the candidate's activation sizes (they do not depend on its DP degree)."""
        model, precision, flash, memo = self.model, self.precision, self.flash, self.memo
        key = (c.tp, c.pp, c.micro_batch, c.recompute, c.sequence_parallel, precision, flash)
        hit = memo.shapes.get(key)
        if hit is not None:
            return hit
        mb = c.micro_batch
        split = tuple(even_layer_split(model.layers, c.pp))
        single = c.pp == 1
        e = element_bytes(precision)
        shape = _Shape(
            split=split,
            p_first=stage_params(model, split[0], c.tp, True, single, single),
            p_last=stage_params(model, split[-1], c.tp, single, True, single),
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
            light = lightened_chunks(shape.split, c.virtual_stages)[j] if c.lightened else None
            chunks = held_chunks(shape.split[j], c.virtual_stages, first, light)
            held = held_layers(c.schedule, c.pp, m, j, chunks) if chunks else None
            acts = combine_activation_bytes(
                shape.split[j], shape.layer_act_bytes, shape.embed_act_bytes,
                shape.head_act_bytes, shape.working_act_bytes, first, last, units,
                c.virtual_stages, held,
            )  # fmt: skip
            worst = max(worst, w + g + o + acts + params.memory_reserve_bytes)
        return worst

    def layout(self, c: Candidate) -> _Layout:
        """Returns the layout of the candidate's degrees (built once per triple)."""
        key = (c.tp, c.pp, c.dp)
        hit = self.layouts.get(key)
        if hit is None:
            plan = uniform_plan(self.cluster, self.model.layers, c.tp, c.pp, c.dp, 1,
                                self.global_batch)  # fmt: skip
            node_of = self.cluster.device_node
            sync = sync_layout(plan, self.model, node_of)
            holds: list[list[int]] = [[] for _ in range(c.pp)]
            for g, (_, holders) in enumerate(sync.groups):
                for r, j in holders:
                    if r == 0:
                        holds[j].append(g)
            nodes = [node_of(st.devices[0]) for st in plan.pipelines[0].stages]
            hit = self.layouts[key] = _Layout(plan, nodes, sync, holds)
        return hit

    def knob_plan(self, c: Candidate) -> Plan:
        """Returns the candidate's plan (its layout with its knobs)."""
        sp = self.space
        base = self.layout(c).plan
        if c.lightened:
            base = lighten(base, c.virtual_stages)
        return replace(
            base,
            micro_batch_size=c.micro_batch,
            precision=self.precision,
            recompute=c.recompute,
            zero_stage=c.zero_stage,
            schedule=c.schedule,
            virtual_stages=c.virtual_stages,
            sequence_parallel=c.sequence_parallel,
            flash_attention=self.flash,
            overlap_grad_reduce=sp.overlap_grad_reduce,
            overlap_tp_comm=sp.overlap_tp_comm,
        )

    def _exposed(self, lay: _Layout, plan: Plan) -> list[float]:
        """Returns, per stage of pipeline 0, the least gradient reduction no overlap hides
        (an unbounded overlap window) under the plan's ZeRO stage."""
        sync_s = grad_sync_times(lay.sync, plan, self.params)
        out = []
        for j, node in enumerate(lay.nodes):
            share = self.params.gpu(node.gpu.name).grad_overlap
            exposed = 0.0
            for g in lay.holds[j]:
                n_params, holders = lay.sync.groups[g]
                tp_min = min(lay.plan.pipelines[r].stages[i].tp for r, i in holders)
                buckets = bucket_count(n_params / tp_min, len(holders))
                exposed += exposed_sync_s(sync_s[g], math.inf, share,
                                          self.space.overlap_grad_reduce, buckets)  # fmt: skip
            out.append(exposed)
        return out

    def bound_s(self, c: Candidate) -> float:
        """Returns a lower bound of estimate()'s iteration time of the candidate's plan.

        Per stage j, with per-micro-batch forward F, backward-side B (backward, recompute,
        TP collectives) from ``stage_times``: its first forward waits for the first chunk of
        every earlier stage (sum F/v), it then computes m (F + B), and after its last
        backward the earlier stages still run one backward chunk each (sum B/v) before
        stage 0 ends; a stage ends with the part of its gradient reduction no overlap can
        hide, then its optimizer step. Transfers and waits only add (left out)."""
        model, params, memo = self.model, self.params, self.memo
        lay = self.layout(c)
        plan = self.knob_plan(c)
        v = c.virtual_stages
        m = self.global_batch // c.dp // c.micro_batch
        p = c.pp
        shards = c.dp if c.zero_stage >= 1 else 1
        exposed_by_stage = lay.sync_s.get(c.zero_stage)
        if exposed_by_stage is None:
            exposed_by_stage = lay.sync_s[c.zero_stage] = self._exposed(lay, plan)
        starts, tails, busy, ends = 0.0, 0.0, [], []
        f_acc = b_acc = 0.0
        for j, node in enumerate(lay.nodes):
            layers = lay.plan.pipelines[0].stages[j].layers
            first, last = j == 0, j == p - 1
            skey = (node.gpu.name, node.intra_node_bytes_per_s, c.tp, layers, first, last,
                    c.micro_batch, c.recompute, v, self.precision, self.flash,
                    self.space.overlap_tp_comm, c.sequence_parallel)  # fmt: skip
            times = memo.stages.get(skey)
            if times is None:
                key = StageKey(node.gpu, node.intra_node_bytes_per_s, c.tp, layers, first, last,
                               p == 1)  # fmt: skip
                times = memo.stages[skey] = stage_times(plan, model, key, node, params)[:5]
            fwd, bwd, rc, tpc, _ = times
            if c.lightened:  # the fill and drain run its quickest chunk (with its part)
                f_first, b_first = self._quickest_chunk(c, plan, j, node, layers, skey, times)
            else:
                f_first, b_first = fwd / v, (bwd + rc + tpc) / v
            p_local = stage_params(model, layers, c.tp, first, last, p == 1)
            okey = (node.gpu.name, c.tp, layers, first, last, self.precision, shards)
            opt = memo.optimizer.get(okey)
            if opt is None:
                pieces = [("layer", layers), ("embed", int(first)), ("head", int(last))]
                opt = memo.optimizer[okey] = params.compute.optimizer_s(
                    model, node.gpu, params.gpu(node.gpu.name), c.tp, self.precision, pieces,
                    p_local, shards,
                )[0]  # fmt: skip
            exposed = exposed_by_stage[j]
            own = f_acc + m * (fwd + bwd + rc + tpc)
            busy.append(own + exposed + opt)
            ends.append(own + b_acc)
            f_acc += f_first
            b_acc += b_first
            if first:
                starts, tails = exposed, opt  # stage 0's reduction and optimizer
        bound = max(max(busy), max(ends) + starts + tails)
        return bound * (1.0 - 1e-9)

    def _quickest_chunk(
        self,
        c: Candidate,
        plan: Plan,
        j: int,
        node: Node,
        layers: int,
        skey: tuple[object, ...],
        times: tuple[float, float, float, float, float],
    ) -> tuple[float, float]:
        """Returns the least forward and backward-side time of any chunk of stage ``j`` of a
        lightened candidate, as estimate() splits them (without transfers)."""
        memo, p, v = self.memo, c.pp, c.virtual_stages
        first, last = j == 0, j == p - 1
        ekey = (*skey[:3], 0, *skey[4:])
        empty = memo.stages.get(ekey)
        if empty is None:
            key = StageKey(node.gpu, node.intra_node_bytes_per_s, c.tp, 0, first, last, p == 1)
            empty = memo.stages[ekey] = stage_times(plan, self.model, key, node, self.params)[:5]
        pkey = ("parts", *skey)
        parts = memo.stages.get(pkey)
        if parts is None:
            parts = memo.stages[pkey] = (
                *part_split(plan, self.model, node.gpu, c.tp, first, last, self.params),
                0.0,
            )
        ef, eb, hf, hb, _ = parts
        fwd, bwd, rc, tpc, _ = times
        chunks = lightened_chunks(self.shape(c).split, v)[j]
        fs = chunk_split(fwd - ef - hf, empty[0] - ef - hf, layers, chunks)
        bs = chunk_split(bwd + rc + tpc - eb - hb, sum(empty[1:4]) - eb - hb, layers, chunks)
        ends = [(ef if k == 0 else 0.0) + (hf if k == v - 1 else 0.0) for k in range(v)]
        endb = [(eb if k == 0 else 0.0) + (hb if k == v - 1 else 0.0) for k in range(v)]
        return (
            min(f + e for f, e in zip(fs, ends, strict=True)),
            min(b + e for b, e in zip(bs, endb, strict=True)),
        )


def lighten(plan: Plan, v: int) -> Plan:
    """Returns ``plan`` (an even split over its stages) with each stage's layers in ``v``
    chunks, the first stage's lighter chunk first and the last stage's last."""
    split = [s.layers for s in plan.pipelines[0].stages]
    chunks = lightened_chunks(split, v)
    pipes = tuple(
        Pipeline(
            pipe.batch_size,
            tuple(
                Stage(s.layers, s.devices, ch) for s, ch in zip(pipe.stages, chunks, strict=True)
            ),
        )
        for pipe in plan.pipelines
    )
    return replace(plan, pipelines=pipes)


@dataclass
class Scored:
    """Candidates that fit, with lower bounds of their iteration time, smallest first; and
    what was pruned by memory."""

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
    scorer: _Scorer | None = None,
) -> Scored:
    """Returns every fitting candidate with a lower bound of its estimate() time, smallest
    first (no estimate). ``memo`` may be shared by calls on clusters of the same node type."""
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
    if scorer is None:
        scorer = _Scorer(model, cluster, precision, global_batch, params, flash_attention,
                         memo or SearchMemo(), space)  # fmt: skip
    for c in enumerate_candidates(model, n, gpn, global_batch, space):
        count += 1
        peak = scorer.peak_bytes(c)
        if peak > gpu.memory_bytes:
            min_mem = min(min_mem, peak)
            continue
        scored.append((scorer.bound_s(c), _tiebreak(c), c))
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
    memo: SearchMemo | None = None,
    progress: ProgressHook | None = None,
) -> SearchResult:
    """Returns the top-k plans for a cluster of one GPU type by estimate(), best first,
    deterministically.

    Candidates are visited in order of a proven lower bound of their estimate() time and
    estimated exactly until the bound reaches the k-th best time found: no candidate that
    could rank in the top k is skipped. ``progress`` is told after every estimate
    (candidates estimated, of the fitting ones at most, and the best time so far)."""
    params = params or default_params()
    space = space or SearchSpace()
    scorer = _Scorer(model, cluster, precision, global_batch, params, flash_attention,
                     memo or SearchMemo(), space)  # fmt: skip
    sc = score_candidates(model, cluster, global_batch, precision, params, space,
                          flash_attention, scorer=scorer)  # fmt: skip
    result = SearchResult([], sc.candidates, sc.fitting, sc.min_memory_bytes)
    ranked: list[tuple[float, tuple[object, ...], Plan, Estimate]] = []
    evaluated = 0
    for bound, c in sc.ranked:
        if len(ranked) >= top_k and bound > ranked[top_k - 1][0]:
            break
        # the candidate's plan on its layout's pipelines, whose sync layout is known
        plan = scorer.knob_plan(c)
        est = estimate(plan, model, cluster, params, validate=False,
                       layout=scorer.layout(c).sync)  # fmt: skip
        evaluated += 1
        if est.fits:
            ranked.append((est.iteration_time_s, _tiebreak(c), plan, est))
            ranked.sort(key=lambda x: (x[0], x[1]))
        if progress is not None:
            progress(SearchProgress(evaluated, len(sc.ranked), ranked[0][0] if ranked else None))
    result.ranked = [(plan, est) for _, _, plan, est in ranked[:top_k]]
    result.evaluated = evaluated
    return result


def candidate_plan(
    model: ModelSpec,
    cluster: Cluster,
    c: Candidate,
    global_batch: int,
    precision: str,
    flash_attention: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_tp_comm: bool = False,
) -> Plan:
    """Returns the uniform plan of a candidate."""
    plan = uniform_plan(
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
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_tp_comm=overlap_tp_comm,
    )
    return lighten(plan, c.virtual_stages) if c.lightened else plan


def _tiebreak(c: Candidate) -> tuple[object, ...]:
    # prefer simpler plans on ties: less recomputation, lower ZeRO, fewer chunks
    rc = ("none", "selective", "full").index(c.recompute)
    return (rc, c.zero_stage, c.virtual_stages, c.lightened, c.pp, c.tp, -c.micro_batch,
            c.sequence_parallel)  # fmt: skip

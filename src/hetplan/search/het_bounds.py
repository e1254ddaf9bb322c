"""Proven lower bounds the heterogeneous search prunes by: a pipeline's replay (or its
closed form) on times no larger than ``estimate``'s, and ``PlanBounds``, memory and an
iteration-time bound of concrete plans (devices placed).

Nothing here models time on its own: stage times come from ``estimate``'s ``stage_times``
and ``part_split``, each transfer from ``comm.p2p_s`` with the node links shared as
``pipeline_talkers`` counts, each stage's wait in its transfers from ``p2p_wait_s``, the
optimizer step from ``params.compute.optimizer_s``, memory from the memory functions
``estimate`` sums and the replay from ``schedule.replay``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster import Cluster, Node
from hetplan.cost import comm
from hetplan.cost.dp_sync import (
    placed_reduction_floors,
    reduction_bytes_per_param,
    reduction_floor_s,
)
from hetplan.cost.estimate import StageKey, p2p_wait_s, part_split, stage_times
from hetplan.cost.memory import (
    edge_params,
    held_chunks,
    stage_activation_bytes,
    stage_params,
    stage_state,
)
from hetplan.cost.params import CostParams
from hetplan.cost.pipeline_classes import pipeline_classes, pipeline_talkers
from hetplan.cost.schedule import EXACT_ACTION_LIMIT, held_layers, peak_in_flight, replay
from hetplan.cost.sharding import deferred_sync
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, element_bytes
from hetplan.search.hashed import Hashed


def chunk_times(
    fwd_s: float,
    bwd_s: float,
    wait_s: float,
    v: int,
    parts: tuple[float, float, float, float],
) -> tuple[list[float], list[float]]:
    """Returns one stage's forward and backward-side time per chunk as ``estimate`` replays
    them: the layers (and half the transfer wait each way) split evenly over ``v``
    chunks, the embedding on chunk 0 and the head on chunk v-1 (``parts``, when v > 1)."""
    ef, eb, hf, hb = parts if v > 1 else (0.0, 0.0, 0.0, 0.0)
    f = (fwd_s - ef - hf + wait_s / 2) / v
    b = (bwd_s - eb - hb + wait_s / 2) / v
    fc = [f + (ef if c == 0 else 0.0) + (hf if c == v - 1 else 0.0) for c in range(v)]
    bc = [b + (eb if c == 0 else 0.0) + (hb if c == v - 1 else 0.0) for c in range(v)]
    return fc, bc


def replay_is_exact(p: int, m: int, v: int) -> bool:
    """Returns whether ``estimate`` replays a pipeline of this size action by action (its
    longer runs are extrapolated, where only the closed-form bound is proven)."""
    return (p == 1 and v == 1) or 2 * p * m * v <= EXACT_ACTION_LIMIT or m <= 3 * p


def pipeline_bound_s(
    schedule: str,
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
    opt_s: list[float],
    spans: tuple[list[float], list[float]] | None = None,
) -> float:
    """Returns a lower bound of the latest ``last backward end + optimizer`` over one
    pipeline's stages in ``estimate``, for any plan whose stages' chunks take at least
    ``fwd_c[j][c]`` / ``bwd_c[j][c]`` per micro-batch (waits included), whose transfers
    take at least ``send_s`` (stage j to j+1, wrapping) and whose optimizer steps take at
    least ``opt_s``.

    The replay is monotone in every duration, so replaying these times bounds
    ``estimate``'s where it replays exactly. Otherwise (see ``closed_bound_s``) per stage
    j: its first forward waits for chunk 0 of every earlier stage and the transfers
    between them, it then computes all its m micro-batches, and after its last backward
    (chunk 0 of the last micro-batch) every earlier stage still runs that chunk's
    backward, transfers included, before stage 0 ends. ``spans``: the replay's
    ``last_backward_spans`` where the caller keeps them (replayed here otherwise)."""
    p, v = len(fwd_c), len(fwd_c[0])
    if not replay_is_exact(p, m, v):
        return closed_bound_s(m, fwd_c, bwd_c, send_s, opt_s)
    if spans is None:
        spans = last_backward_spans(schedule, m, fwd_c, bwd_c, send_s)
    ends, _ = spans
    return max(e + o for e, o in zip(ends, opt_s, strict=True)) * (1.0 - 1e-9)


def last_backward_spans(
    schedule: str,
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
) -> tuple[list[float], list[float]]:
    """Returns each stage's last backward end, and when its gradients start to become
    ready (``Replay.grads_ready_from_s``: its last backward's start, interleaved the
    earliest final backward of a chunk), in the replay of these times (where
    ``replay_is_exact``: ``pipeline_bound_s``). Both only grow with every duration."""
    p, v = len(fwd_c), len(fwd_c[0])
    if p == 1 and v == 1:
        end = m * (fwd_c[0][0] + bwd_c[0][0])
        return [end], [end - bwd_c[0][0]]
    rep = replay(schedule, m, v, fwd_c, bwd_c, list(send_s))
    return rep.last_backward_end_s, rep.grads_ready_from_s


def closed_bound_s(
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
    opt_s: list[float],
) -> float:
    """Returns the closed-form bound of ``pipeline_bound_s`` (non-decreasing in ``m``)."""
    return closed_bound_at(m, closed_terms(fwd_c, bwd_c, send_s, opt_s))


ClosedTerms = list[tuple[float, float, float, float]]
"""Per stage: its first forward's start, its per-micro-batch work, its optimizer step and
what of the first micro-batch's backward still follows its own (``closed_bound_s``)."""


def closed_terms(
    fwd_c: list[list[float]], bwd_c: list[list[float]], send_s: list[float], opt_s: list[float]
) -> ClosedTerms:
    """Returns ``closed_bound_s``'s terms of a pipeline, which do not depend on ``m``."""
    out = []
    f_acc = b_acc = 0.0
    for j in range(len(fwd_c)):
        out.append((f_acc, sum(fwd_c[j]) + sum(bwd_c[j]), opt_s[j], b_acc))
        f_acc += fwd_c[j][0] + send_s[j]
        b_acc += bwd_c[j][0] + send_s[j]
    return out


def closed_bound_at(m: int, terms: ClosedTerms) -> float:
    """Returns ``closed_bound_s`` at ``m`` micro-batches from its terms (``closed_terms``)."""
    out = last = 0.0
    for start, per, opt, back in terms:
        own = start + m * per
        out = max(out, own + opt)
        last = max(last, own + back)
    return max(out, last + terms[0][2]) * (1.0 - 1e-9)


def reduction_kind(plan: Plan) -> tuple[float, bool] | None:
    """Returns what a plan's once-a-step gradient reduction moves, as bytes of an
    all-reduce per parameter (``dp_sync.reduction_bytes_per_param``), and whether it
    overlaps the backward; None where a stage reduces nothing once a step after its
    backward (one pipeline, or ZeRO-2/3 reducing every micro-batch)."""
    deferred = plan.zero_stage >= 2 and plan.dp > 1 and deferred_sync(plan)
    return reduction_kind_of(plan.zero_stage, plan.dp, plan.precision,
                             plan.overlap_grad_reduce, deferred)  # fmt: skip


def reduction_kind_of(
    zero_stage: int, dp: int, precision: str, overlap: bool, deferred: bool
) -> tuple[float, bool] | None:
    """Returns ``reduction_kind`` of a plan from its parts (``deferred``: its ZeRO-2/3 run
    as ZeRO-1 once a step, ``sharding.deferred``; read for ZeRO-2/3 only)."""
    if dp <= 1 or (zero_stage >= 2 and not deferred):
        return None
    return reduction_bytes_per_param(zero_stage, precision), overlap


def stage_reduction_floors(
    model: ModelSpec,
    precision: str,
    tp: int,
    node: Node,
    layers: int,
    dp: int,
    largest: int,
    params: CostParams,
    kind: tuple[float, bool],
    edges: tuple[bool, bool, bool],
    placed: float = 0.0,
) -> tuple[float, float]:
    """Returns lower bounds of a stage's once-a-step gradient reductions in ``estimate``
    (``PlanBounds._tail``), for ``layers`` layers at TP ``tp`` on ``node`` among ``dp``
    pipelines, each holding every layer (``largest``: the most GPUs a node of the cluster
    holds; ``kind``: ``reduction_kind``; ``edges``: the stage is first, last, alone): what
    it waits for after its last backward, and their whole time. Each layer's
    ``dp_sync.reduction_floor_s`` among ``dp`` holders, wherever they are, and the embedding
    and the head at the same rate per parameter (``memory.edge_params``); or, where the
    holders are placed, ``placed`` (``dp_sync.placed_reduction_floors``: seconds per byte
    an all-reduce moves per parameter) at the same shares; the larger of the two."""
    per_param, overlap = kind
    one = reduction_floor_s(model, precision, tp, node, dp, largest, params, per_param, overlap)
    whole = reduction_floor_s(model, precision, tp, node, dp, largest, params, per_param, False)
    # the embedding's and head's parameters, in layers' worth (the floor is linear)
    units = layers + edge_params(model, tp, *edges) * tp / model.layer_params()
    mine = placed * per_param
    share = params.gpu(node.gpu.name).grad_overlap if overlap else 0.0
    return max(units * one, (1.0 - share) * mine), max(units * whole, mine)


def tailed_bound_s(
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
    opt_s: list[float],
    tails: list[tuple[float, float]],
    spans: tuple[list[float], list[float]] | None,
) -> float:
    """Returns a lower bound of one pipeline's latest stage end in ``estimate`` with its
    stages' reductions (``tails``: per stage, what follows its last backward and their
    whole time, ``stage_reduction_floors``): each stage ends no earlier than its last
    backward and the tail, nor than its reductions' whole time after its gradients start
    to be ready, then its optimizer step. ``spans``: the stages' last backward ends and
    gradient-ready times in the proven replay (``last_backward_spans``); None: the closed
    form, with each tail added to the optimizer step."""
    if spans is not None:
        ends, ready = spans
        parts = zip(ends, ready, tails, opt_s, strict=True)
        return max(max(e + t, r + whole) + o for e, r, (t, whole), o in parts) * (1.0 - 1e-9)
    opt = [o + t for o, (t, _) in zip(opt_s, tails, strict=True)]
    return closed_bound_s(m, fwd_c, bwd_c, send_s, opt)


@dataclass
class _Row:
    """One distinct pipeline of a plan as ``PlanBounds`` bounds it."""

    r: int
    """The first of the plan's pipelines it stands for (the others' stages hold the same
    layers: the same reductions)."""
    m: int
    fwd: list[list[float]]
    bwd: list[list[float]]
    sends: list[float]
    opt: list[float]
    stages: list[tuple[Node, int, int]]
    """Per stage: its node, TP degree and layers (its reduction's tail)."""
    ends: list[float] | None
    """Per stage, its last backward's end in the proven replay; None: the closed form."""
    ready: list[float] | None
    """Per stage, when its gradients start to become ready in that replay (None with
    ``ends``; never after its end)."""


LAYOUT_MEMO = 4096
"""Pipelines whose talkers and classes ``PlanBounds`` keeps (cleared when full)."""


_Shape = tuple[tuple[int, tuple[int, ...] | None, int], ...]
"""A pipeline's stages as ``PlanBounds.fits`` reads them: layers, chunks, TP degree."""
_FitGroup = tuple[_Shape, int, tuple[float, ...]]
"""Pipelines of one shape and batch share, with the least GPU memory at each stage."""


class PlanBounds:
    """Memory and a proven lower bound of ``estimate``'s iteration time for concrete plans
    (devices placed), from ``estimate``'s own pieces; caches stage times, optimizer steps
    and pipeline bounds across plans that share them (twins differing in ZeRO or sequence
    parallelism share everything but memory and the optimizer's shards). ``pipes``: pipeline
    bounds by their stage times (keyed by every number they read), shared across clusters."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: Cluster,
        params: CostParams,
        pipes: dict[tuple[object, ...], tuple[list[float], list[float]]] | None = None,
    ) -> None:
        self.model = model
        self.cluster = cluster
        self.params = params
        self._nodes: dict[str, Node] = {}
        self._stage: dict[tuple[object, ...], tuple[float, ...]] = {}
        self._opt: dict[tuple[object, ...], float] = {}
        self._pipe: dict[tuple[object, ...], tuple[list[float], list[float]]] = (
            {} if pipes is None else pipes
        )
        self._plans: dict[tuple[object, ...], float] = {}
        self._rows: dict[tuple[object, ...], list[_Row]] = {}
        self._tails: dict[tuple[object, ...], tuple[float, float]] = {}
        self._largest = max((n.gpus for n in cluster.nodes), default=1)
        self._layouts: dict[tuple[Hashed, bool], tuple[dict[str, int], list[int]]] = {}
        self._placed: dict[Hashed, dict[tuple[int, int], float]] = {}
        self._fit_layouts: dict[Hashed, list[_FitGroup]] = {}
        self._hashes: dict[int, Hashed] = {}
        self._site_memo: dict[Hashed, list[tuple[Node, int, int, bool, bool, int]]] = {}

    def node(self, device: str) -> Node:
        """Returns the node of a device (memoized)."""
        hit = self._nodes.get(device)
        if hit is None:
            hit = self._nodes[device] = self.cluster.device_node(device)
        return hit

    def fits(self, plan: Plan) -> tuple[bool, float]:
        """Returns whether every stage fits, and the largest peak of a stage that does not
        (0 when all fit): the sums ``estimate`` makes, from the same memory functions."""
        model, dp = self.model, plan.dp
        deferred = deferred_sync(plan)  # pipelined ZeRO-2/3, as estimate prices them
        worst = 0.0
        ok = True
        sums: dict[tuple[object, ...], float] = {}  # replicas repeat the same stages: once each
        for shape, batch, room in self._fit_groups(plan.pipelines):
            p = len(shape)
            m = batch // plan.micro_batch_size
            for j, (layers, chunks, tp) in enumerate(shape):
                skey = (layers, chunks, tp, j, p, m)
                total = sums.get(skey)
                if total is None:
                    first, last = j == 0, j == p - 1
                    state = sum(stage_state(
                        model, layers, tp, first, last, p == 1, plan.precision,
                        plan.zero_stage, dp, deferred,
                    ))  # fmt: skip
                    units = peak_in_flight(plan.schedule, p, m, plan.virtual_stages, j)
                    even = held_chunks(layers, plan.virtual_stages, first)
                    acts = stage_activation_bytes(
                        model, layers, tp, plan.micro_batch_size,
                        plan.sequence_parallel, plan.recompute, plan.flash_attention, first,
                        last, units, plan.virtual_stages, plan.precision,
                        held_layers(plan.schedule, p, m, j, even) if even else None,
                    )  # fmt: skip
                    total = sums[skey] = state + acts + self.params.memory_reserve_bytes
                if total > room[j]:
                    ok = False
                    worst = max(worst, total)
        return ok, worst

    def _fit_groups(self, pipelines: tuple[Pipeline, ...]) -> list[_FitGroup]:
        """Returns the pipelines grouped by what ``fits`` reads of them but their nodes
        (each stage's layers, chunks and TP degree; the batch share), with the least GPU
        memory at each position over the group: a stage fits on every pipeline of its group
        exactly when it fits in that least memory, and its peak is the same on all. Memoised
        by the pipelines (ZeRO, schedule and sequence-parallel twins share them)."""
        key = self._hashed(pipelines)
        hit = self._fit_layouts.get(key)
        if hit is not None:
            return hit
        groups: dict[tuple[_Shape, int], list[float]] = {}
        for pipe in pipelines:
            shape = tuple((s.layers, s.chunks, s.tp) for s in pipe.stages)
            mems = [self.node(s.devices[0]).gpu.memory_bytes for s in pipe.stages]
            room = groups.get((shape, pipe.batch_size))
            if room is None:
                groups[(shape, pipe.batch_size)] = mems
            else:
                room[:] = [min(a, b) for a, b in zip(room, mems, strict=True)]
        if len(self._fit_layouts) >= LAYOUT_MEMO:
            self._fit_layouts.clear()
        hit = self._fit_layouts[key] = [
            (shape, batch, tuple(room)) for (shape, batch), room in groups.items()
        ]
        return hit

    def bound_s(self, plan: Plan, exact: bool = True) -> float:
        """Returns a lower bound of ``estimate(plan).iteration_time_s``: per pipeline, the
        replay (or its closed-form bound) of ``stage_times`` with the plan's transfers
        (the node links shared as ``pipeline_talkers`` counts) and waits, each stage
        ending with its optimizer step and the part of its once-a-step gradient reduction
        no overlap hides (``_tail``); ZeRO-2/3's per-micro-batch collectives only
        add (left out). ``exact=False``: the closed-form bound alone (cheaper)."""
        tk = self._time_key(plan)
        shards = plan.dp if plan.zero_stage >= 1 else 1
        kind = reduction_kind(plan)
        hashed = self._hashed(plan.pipelines)
        key = (hashed, plan.schedule, *tk, shards, kind, exact)
        hit = self._plans.get(key)
        if hit is None:
            # twins differing in the ZeRO stage alone share the rows (the optimizer's shards
            # aside); each reduction kind only adds its tails
            rkey = (hashed, plan.schedule, *tk, shards, exact)
            rows = self._rows.get(rkey)
            if rows is None:
                rows = self._rows[rkey] = self._pipeline_rows(plan, tk, shards, exact)
            hit = self._plans[key] = self._combine(plan, rows, kind)
        return hit

    def _combine(self, plan: Plan, rows: list[_Row], kind: tuple[float, bool] | None) -> float:
        """Returns the bound from each distinct pipeline's row, every stage's optimizer
        step with its reduction's tail after its last backward, and no earlier than its
        reductions' whole time after its gradients start to be ready (where replayed)."""
        out = 0.0
        placed = None if kind is None else self._placed_floors(plan)
        for row in rows:
            p = len(row.stages)
            tails = [(0.0, 0.0)] * p  # after the last backward, whole
            if kind is not None and placed is not None:
                tails = []
                for j, (node, tp, layers) in enumerate(row.stages):
                    edges = (j == 0, j == p - 1, p == 1)
                    mine = placed.get((row.r, j), 0.0)
                    tails.append(self._tail(node, tp, layers, plan, kind, edges, mine))
            spans = None if row.ends is None or row.ready is None else (row.ends, row.ready)
            b = tailed_bound_s(row.m, row.fwd, row.bwd, row.sends, row.opt, tails, spans)
            out = max(out, b)
        return out

    def _tail(
        self,
        node: Node,
        tp: int,
        layers: int,
        plan: Plan,
        kind: tuple[float, bool],
        edges: tuple[bool, bool, bool],
        placed: float = 0.0,
    ) -> tuple[float, float]:
        """Returns lower bounds of a stage's gradient reductions in ``estimate``, for
        ``layers`` layers at TP ``tp`` on ``node`` (memoised): what it waits for after its
        last backward, and their whole time. Every one of the plan's ``dp`` pipelines holds
        every layer, so each layer's ``dp_sync.reduction_floor_s`` among ``dp`` holders; and
        the embedding and the head (``edges``: the stage is first, last, alone), which every
        pipeline's first and last stage hold, at the same rate per parameter among at least
        as many (``memory.edge_params``; a tied table's holders are both). ``estimate`` ends
        the stage no earlier than its last backward, every reduction's unhidden part
        (``sharding.unhidden_sync_s``, all of it without overlap), then its optimizer step;
        and its reductions run one after another on its link, each once its first bucket is
        ready on every holder, so no earlier than its own gradients start to be ready
        (``Replay.grads_ready_from_s``).

        ``placed``: the stage's reductions' floor per byte an all-reduce moves per parameter
        with the plan's own holders (``dp_sync.placed_reduction_floors``: the nodes they
        span and share); the larger of the two floors holds."""
        key = (id(node), tp, layers, plan.dp, kind, edges, placed)
        hit = self._tails.get(key)
        if hit is None:
            hit = self._tails[key] = stage_reduction_floors(
                self.model, plan.precision, tp, node, layers, plan.dp, self._largest,
                self.params, kind, edges, placed,
            )  # fmt: skip
        return hit

    def _placed_floors(self, plan: Plan) -> dict[tuple[int, int], float]:
        """Returns ``dp_sync.placed_reduction_floors`` of the plan (memoised by its
        pipelines: ZeRO and sequence-parallel twins share it)."""
        key = self._hashed(plan.pipelines)
        hit = self._placed.get(key)
        if hit is None:
            if len(self._placed) >= LAYOUT_MEMO:
                self._placed.clear()
            hit = self._placed[key] = placed_reduction_floors(
                plan, self.model, self.node, self.params
            )
        return hit

    def _hashed(self, pipelines: tuple[Pipeline, ...]) -> Hashed:
        """Returns ``pipelines`` with its hash taken once per tuple (twins share one: the
        memo's keys hash it for every knob setting otherwise), kept by its id."""
        hit = self._hashes.get(id(pipelines))
        if hit is not None and hit.value is pipelines:
            return hit
        if len(self._hashes) >= LAYOUT_MEMO:
            self._hashes.clear()
        hit = self._hashes[id(pipelines)] = Hashed(pipelines)
        return hit

    def _classes(self, plan: Plan) -> tuple[dict[str, int], list[int]]:
        """Returns the plan's ``pipeline_talkers`` and ``pipeline_classes`` (a pipeline
        identical for the cost model to an earlier one bounds the same), memoised for its
        pipelines (twins share them; keyed by ``_hashed``)."""
        key = (self._hashed(plan.pipelines), plan.virtual_stages > 1)
        hit = self._layouts.get(key)
        if hit is None:
            talkers = pipeline_talkers(plan, self.node)
            hit = (talkers, pipeline_classes(plan, self.node, talkers, {}))
            if len(self._layouts) >= LAYOUT_MEMO:
                self._layouts.clear()
            self._layouts[key] = hit
        return hit

    @staticmethod
    def _time_key(plan: Plan) -> tuple[object, ...]:
        """Returns the plan's knobs that ``stage_times`` and ``part_split`` read."""
        return (plan.micro_batch_size, plan.precision, plan.recompute, plan.virtual_stages,
                plan.flash_attention, plan.overlap_tp_comm, plan.sequence_parallel)  # fmt: skip

    def _stage_fb(
        self,
        plan: Plan,
        tk: tuple[object, ...],
        node: Node,
        tp: int,
        layers: int,
        first: bool,
        last: bool,
    ) -> tuple[float, ...]:
        """Returns a stage's forward, backward side (recomputation and TP collectives) and
        ``part_split`` per micro-batch (``stage_times``; memoised by what they read of the
        node, its GPU and link inside it, as ``estimate`` memoises them, and by TP degree,
        layers, position and the knobs ``tk`` = ``_time_key``)."""
        skey = (id(node.gpu), node.intra_node_bytes_per_s, tp, layers, first, last, *tk)
        fb = self._stage.get(skey)
        if fb is None:
            model, params = self.model, self.params
            key = StageKey(node.gpu, node.intra_node_bytes_per_s, tp, layers, first, last,
                           first and last)  # fmt: skip
            f, b, rc, tpc, _, _ = stage_times(plan, model, key, node, params)
            split = part_split(plan, model, node.gpu, tp, first, last, params)
            fb = self._stage[skey] = (f, b + rc + tpc, *split)
        return fb

    def compute_floor_s(self, plan: Plan) -> float:
        """Returns a lower bound of ``bound_s(plan)`` (either form) at a fraction of its
        cost: the most any stage spends on its own micro-batches, each taking at least its
        forward and backward side (``stage_times``). A stage runs every micro-batch of its
        pipeline one after another; transfer waits, the fill, gradient reductions and the
        optimizer step only add to the end ``bound_s`` bounds."""
        tk = self._time_key(plan)
        out = 0.0
        for node, tp, layers, first, last, batch in self._sites(plan.pipelines):
            f, b = self._stage_fb(plan, tk, node, tp, layers, first, last)[:2]
            out = max(out, (batch // plan.micro_batch_size) * (f + b))
        return out * (1.0 - 1e-6)

    def _sites(
        self, pipelines: tuple[Pipeline, ...]
    ) -> list[tuple[Node, int, int, bool, bool, int]]:
        """Returns the (node, TP degree, layers, first, last, batch share) of the stages of
        ``pipelines``, one per distinct ``_stage_fb`` key and share (memoised by them: knob
        twins share it)."""
        key = self._hashed(pipelines)
        hit = self._site_memo.get(key)
        if hit is None:
            sites: dict[tuple[object, ...], tuple[Node, int, int, bool, bool, int]] = {}
            for pipe in pipelines:
                p = len(pipe.stages)
                for j, s in enumerate(pipe.stages):
                    node = self.node(s.devices[0])
                    site = (node, s.tp, s.layers, j == 0, j == p - 1, pipe.batch_size)
                    sites.setdefault((id(node.gpu), node.intra_node_bytes_per_s, *site[1:]), site)
            if len(self._site_memo) >= LAYOUT_MEMO:
                self._site_memo.clear()
            hit = self._site_memo[key] = list(sites.values())
        return hit

    def _pipeline_rows(
        self, plan: Plan, tk: tuple[object, ...], shards: int, exact: bool
    ) -> list[_Row]:
        """Returns, per distinct pipeline, its chunk times, transfers, optimizer steps and
        the stages' (node, TP, layers), with its stages' last backward ends where the replay
        is proven (``exact``), else None (the closed form)."""
        model, params = self.model, self.params
        v = plan.virtual_stages
        act = plan.micro_batch_size * model.seq * model.hidden * element_bytes(plan.precision)
        talkers, same = self._classes(plan)
        out: list[_Row] = []
        for r, pipe in enumerate(plan.pipelines):
            if same[r] != r:
                continue
            p = len(pipe.stages)
            m = plan.num_micro_batches(pipe)
            nodes = [self.node(s.devices[0]) for s in pipe.stages]
            fwd, bwd, opt, sends, parts = [], [], [], [], []
            for j, stage in enumerate(pipe.stages):
                node = nodes[j]
                first, last = j == 0, j == p - 1
                fb = self._stage_fb(plan, tk, node, stage.tp, stage.layers, first, last)
                fwd.append(fb[0])
                bwd.append(fb[1])
                parts.append(fb[2:])
                okey = (id(node.gpu), stage.tp, stage.layers, first, last, p == 1,
                        plan.precision, shards)  # fmt: skip
                o = self._opt.get(okey)
                if o is None:
                    p_local = stage_params(model, stage.layers, stage.tp, first, last, p == 1)
                    pieces = [("layer", stage.layers), ("embed", int(first)), ("head", int(last))]
                    o = self._opt[okey] = params.compute.optimizer_s(
                        model, node.gpu, params.gpu(node.gpu.name), stage.tp, plan.precision,
                        pieces, p_local, shards,
                    )[0]  # fmt: skip
                opt.append(o)
                nxt = nodes[(j + 1) % p]
                if p > 1:
                    conc = max(talkers.get(node.name, 0), talkers.get(nxt.name, 0), stage.tp)
                    sends.append(comm.p2p_s(act / stage.tp, node, nxt, params, conc))
                else:
                    sends.append(0.0)
            fwd_c, bwd_c = [], []
            for j in range(p):
                w = p2p_wait_s(sends, j, v, params.gpu(nodes[j].gpu.name).p2p_exposed)
                fc, bc = chunk_times(fwd[j], bwd[j], w, v, parts[j])  # type: ignore[arg-type]
                fwd_c.append(fc)
                bwd_c.append(bc)
            ends = ready = None
            if exact and replay_is_exact(p, m, v):
                pkey = (plan.schedule, m, tuple(map(tuple, fwd_c)), tuple(map(tuple, bwd_c)),
                        tuple(sends))  # fmt: skip
                spans = self._pipe.get(pkey)
                if spans is None:
                    spans = self._pipe[pkey] = last_backward_spans(
                        plan.schedule, m, fwd_c, bwd_c, sends
                    )
                ends, ready = spans
            desc = [(nodes[j], st.tp, st.layers) for j, st in enumerate(pipe.stages)]
            out.append(_Row(r, m, fwd_c, bwd_c, sends, opt, desc, ends, ready))
        return out

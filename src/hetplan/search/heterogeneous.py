"""Heterogeneous search: asymmetric pipelines over device classes, ranked by ``estimate``.

The plan space: device classes (same GPU type, GPUs per node and links) with one
tensor-parallel degree each; a micro-batch of 1, 2, 4 or 8; recomputation none, selective
or full; 1F1B, or Interleaved1F1B with 2-8 chunks where every stage's layers split into
them (each pipelined replica then runs a multiple of its stages in micro-batches); ZeRO 0-3
(ZeRO only from two pipelines on: one replica shards nothing); sequence parallelism where
a stage has TP > 1; any number of pipelines on disjoint TP groups, each a sequence of
stages whose classes form contiguous blocks in any class order, any contiguous layer
split, any placement of stages on nodes and any batch share. The best single-type plan
(the homogeneous search on each class) and the best uniform plan join the ranking.

Plans are found two ways and ranked one way:

* generation (every instance), a coordinate search over knob settings (TP degrees,
  micro-batch, recomputation, schedule), each visited only while its lower bound
  (``band_bound_s``: work and fixed costs over the TP groups, pipeline fill) beats the
  best estimate: pipeline templates and their layer splits (partition.py, from the
  ``stage_times`` of every class) and the pipeline-selection MILP (grouping.py) per band
  of data-parallel degrees, with memory caps of ZeRO-1, or of ZeRO-2/3 at the best
  settings; each plan then with every ZeRO stage and chunk count it allows (its "twins");
* enumeration (where the space is small enough for a work budget): every pipeline,
  split, selection, batch share, ZeRO stage and placement whose proven lower bound beats
  the best estimate so far. When it completes, the first plan is the best of the whole
  space (``HeteroResult.proven``); otherwise a note says it is not proven.

Sequence parallelism is off unless a plan needs it to fit: without overlapped TP
collectives (this search's plans) it changes memory only (``stage_times`` reads it for
the overlap alone). Every candidate carries a proven lower bound of ``estimate``
(``PlanBounds``: the replay of ``stage_times`` with its transfers, waits and optimizer
steps; gradient reduction and ZeRO-2/3's collectives only add) and candidates are
estimated in bound order until the bound passes the k-th best estimate: no candidate
whose bound is below the best estimate found is dropped.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate import Estimate, estimate, p2p_wait_s
from hetplan.cost.memory import stage_params, state_bytes
from hetplan.cost.params import CostParams, default_params
from hetplan.cost.schedule import peak_in_flight
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import RECOMPUTE, Pipeline, Plan, Stage
from hetplan.search.grouping import (
    DeviceClass,
    MilpMemo,
    device_classes,
    select_pipelines,
)
from hetplan.search.het_baselines import best_single_type, best_uniform
from hetplan.search.het_tables import (
    ClassTable,
    FrontierCache,
    Knobs,
    PlanBounds,
    Template,
    chunk_times,
    class_table,
    closed_bound_s,
    per_layer_floor_s,
    pipeline_bound_s,
    stage_state_bytes,
)
from hetplan.search.het_variants import (
    MAX_STAGES,
    Variants,
    build_plan,
    build_templates,
    count_pipelines,
    layer_splits,
    pipeline_shapes,
    placements,
    variants,
)
from hetplan.search.homogeneous import divisors

Scored = tuple[Plan, Estimate]
MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL_STAGES = 8
ENUMERATION_BUDGET = 5_000_000
"""Work units the enumeration may spend before it gives up proving the first plan optimal
(about a microsecond each: a step of the selection search; ``PIPE_UNITS`` a pipeline, 5 a
placement, ``ESTIMATE_UNITS`` an estimate)."""
ESTIMATE_UNITS = 300
PIPE_UNITS = 2
ENUMERATION_SPLITS = 20_000
"""The most (shape, layer split) pipelines one knob setting may enumerate."""
LEADERS = 1
"""(TP degrees, micro-batch) settings whose every recomputation, schedule and ZeRO memory
setting is generated."""
MULTI_ZERO = ((1,), (2, 3))
"""Memory settings of the multi-pipeline bands: ZeRO-1's caps (plans whose twins need no
per-micro-batch collectives), then ZeRO-2/3's where they hold more layers."""


@dataclass
class HeteroResult:
    """The best plans found, the two baselines, and what the search saw."""

    ranked: list[tuple[Plan, Estimate]]
    baselines: dict[str, tuple[Plan, Estimate] | None]
    search_time_s: float
    notes: list[str] = field(default_factory=list)
    min_memory_bytes: float = math.inf
    proven: bool = False
    """Whether the enumeration completed: the first plan is the best of the whole space."""
    evaluated: int = 0
    """Plans estimated (the rest were ruled out by their lower bound)."""


def tp_options(model: ModelSpec, cls: DeviceClass) -> list[int]:
    """Returns the tensor-parallel degrees a class may use (divide its nodes and the heads)."""
    return [
        t
        for t in divisors(cls.gpus_per_node)
        if not (model.heads % t or model.ffn % t or (model.kv_heads % t and t % model.kv_heads))
    ]


def tp_configs(
    model: ModelSpec, classes: list[DeviceClass], around: int | None = None
) -> list[tuple[int, ...]]:
    """Returns per-class TP degrees: the symmetric ones (``around`` None), or those with one
    class off the symmetric degree ``around`` (all combinations when there are few)."""
    opts = [tp_options(model, c) for c in classes]
    common = sorted(set.intersection(*(set(o) for o in opts)))
    if around is None:
        return [tuple([t] * len(classes)) for t in common]
    if math.prod(len(o) for o in opts) <= 16:
        return [c for c in itertools.product(*opts) if len(set(c)) > 1]
    out = []
    for k, o in enumerate(opts):
        for alt in o:
            if alt != around:
                cfg = [around] * len(classes)
                cfg[k] = alt
                out.append(tuple(cfg))
    return out


def dp_bands(max_pipelines: int) -> list[tuple[int, int]]:
    """Returns data-parallel bands [1,1], [2,3], [4,7], ... up to ``max_pipelines``."""
    out, lo = [], 1
    while lo <= max_pipelines:
        out.append((lo, min(2 * lo - 1, max_pipelines)))
        lo *= 2
    return out


def schedule_options(layers: int) -> list[tuple[str, int]]:
    """Returns (schedule, chunks per stage): 1F1B, and Interleaved1F1B with every chunk
    count that splits the layers (each stage's layers must split into them)."""
    out = [("1F1B", 1)]
    out += [("Interleaved1F1B", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if layers % v == 0]
    return out


def zero_choices(dp: int) -> tuple[int, ...]:
    """Returns the ZeRO stages a plan of ``dp`` pipelines may use (one pipeline: none, as
    any stage would shard nothing)."""
    return (0,) if dp == 1 else (0, 1, 2, 3)


def _pipeline_key(p: Pipeline) -> tuple[object, ...]:
    return (p.batch_size, tuple((s.layers, s.devices) for s in p.stages))


def canonical(plan: Plan) -> Plan:
    """Returns the plan with its pipelines in one order (``estimate`` does not depend on
    their order): the key of the search's set of plans seen."""
    return replace(plan, pipelines=tuple(sorted(plan.pipelines, key=_pipeline_key)))


def _tiebreak(plan: Plan) -> tuple[object, ...]:
    # on equal estimates prefer simpler plans: less recomputation, lower ZeRO, fewer
    # chunks, no sequence parallelism, fewer pipelines
    rc = RECOMPUTE.index(plan.recompute)
    return (rc, plan.zero_stage, plan.virtual_stages, plan.sequence_parallel, plan.dp)


@dataclass
class _Setting:
    """Cost tables, templates and their non-dominated variants under one set of knobs."""

    tables: list[ClassTable]
    templates: list[Template]
    variants: Variants | None


@dataclass(order=True)
class _Pending:
    bound_s: float
    order: int
    plan: Plan = field(compare=False)
    origin: tuple[tuple[int, ...], int] | None = field(default=None, compare=False)
    """The (TP degrees, micro-batch) setting that generated it."""
    exact: bool = field(default=False, compare=False)
    """Whether ``bound_s`` is the replay bound (else the closed form, tightened when
    the candidate comes up)."""


@dataclass
class _State:
    """The search's running best, its pending candidates, and the caches its passes share."""

    model: ModelSpec
    cluster: Cluster
    classes: list[DeviceClass]
    global_batch: int
    precision: str
    params: CostParams
    flash: bool
    top_k: int = 5
    pool: list[tuple[float, tuple[object, ...], Plan, Estimate]] = field(default_factory=list)
    best_s: float = math.inf
    min_mem: float = math.inf
    by_origin: dict[tuple[tuple[int, ...], int], float] = field(default_factory=dict)
    """Best estimate per generating (TP degrees, micro-batch) setting."""
    origin: tuple[tuple[int, ...], int] | None = None
    pending: list[_Pending] = field(default_factory=list)
    seen: set[Plan] = field(default_factory=set)
    memo: MilpMemo = field(default_factory=MilpMemo)
    frontiers: FrontierCache = field(default_factory=dict)
    tables: dict[tuple[int, int, Knobs], ClassTable] = field(default_factory=dict)
    bounds: PlanBounds | None = None
    work_memo: dict[tuple[object, ...], tuple[list[float], float]] = field(default_factory=dict)
    settings: dict[tuple[object, ...], _Setting] = field(default_factory=dict)
    evaluated: int = 0
    prune: bool = True
    """Skip knobs, bands and selections whose lower bound cannot win."""

    @property
    def cutoff_s(self) -> float:
        """Returns the time a lower bound must beat to be explored."""
        return self.best_s if self.prune else math.inf

    @property
    def kth_s(self) -> float:
        """Returns the k-th best estimate so far (inf with fewer)."""
        if len(self.pool) < self.top_k:
            return math.inf
        return sorted(t for t, _, _, _ in self.pool)[self.top_k - 1]

    def _tables(self, tps: tuple[int, ...], knobs: Knobs) -> list[ClassTable]:
        out = []
        for k, (c, t) in enumerate(zip(self.classes, tps, strict=True)):
            key = (k, t, knobs)
            if key not in self.tables:  # shared, so their memory caps are computed once
                self.tables[key] = class_table(self.model, c, t, knobs, self.params)
            out.append(self.tables[key])
        return out

    # ---------------------------------------------------------------- candidates
    def add(self, plan: Plan, est: Estimate) -> None:
        """Records an estimated plan."""
        if not est.fits:
            self.min_mem = min(self.min_mem, max(s.memory.total for s in est.stages))
            return
        t = est.iteration_time_s
        self.pool.append((t, _tiebreak(plan), plan, est))
        if t < self.best_s:
            self.best_s = t

    def offer(self, plan: Plan) -> float:
        """Queues a candidate that fits under its lower bound (returns the bound; inf when
        it does not fit or was seen)."""
        assert self.bounds is not None
        key = canonical(plan)
        if key in self.seen:
            return math.inf
        self.seen.add(key)
        ok, peak = self.bounds.fits(plan)
        if not ok:
            self.min_mem = min(self.min_mem, peak)
            return math.inf
        bound = self.bounds.bound_s(plan, exact=False)
        heapq.heappush(self.pending, _Pending(bound, len(self.seen), plan, self.origin))
        return bound

    def offer_twins(self, plan: Plan) -> None:
        """Queues a plan with every ZeRO stage it may take, each with sequence parallelism
        off, or on where it must be to fit (without overlapped TP collectives it changes
        memory only: ``stage_times`` reads it for the overlap alone); and, for a 1F1B plan,
        as Interleaved1F1B with every chunk count its stages and batch shares allow."""
        tp = any(s.tp > 1 for p in plan.pipelines for s in p.stages)
        forms = [plan]
        if plan.schedule == "1F1B":
            for _, v in schedule_options(self.model.layers)[1:]:
                if all(
                    all(s.layers % v == 0 for s in p.stages)
                    and (len(p.stages) == 1 or plan.num_micro_batches(p) % len(p.stages) == 0)
                    for p in plan.pipelines
                ):
                    forms.append(replace(plan, schedule="Interleaved1F1B", virtual_stages=v))
        # several pipelines: ZeRO-1 reduces as much as ZeRO-0 and shards the optimizer step
        # and its state, so generation leaves ZeRO-0 to the enumeration
        zeros = zero_choices(plan.dp)[1:] if plan.dp > 1 else (0,)
        for form in forms:
            for z in zeros:
                twin = replace(form, zero_stage=z, sequence_parallel=False)
                fits = self.offer(twin) < math.inf or self._fits(twin)
                if tp and (form.overlap_tp_comm or not fits):
                    self.offer(replace(twin, sequence_parallel=True))

    def _fits(self, plan: Plan) -> bool:
        assert self.bounds is not None
        return self.bounds.fits(plan)[0]

    def evaluate(self, plan: Plan, origin: tuple[tuple[int, ...], int] | None = None) -> Estimate:
        """Estimates one plan and records it."""
        est = estimate(plan, self.model, self.cluster, self.params, validate=False)
        self.evaluated += 1
        self.add(plan, est)
        if origin is not None and est.fits:
            t = est.iteration_time_s
            self.by_origin[origin] = min(self.by_origin.get(origin, math.inf), t)
        return est

    def drain(self, limit_s: float | None = None) -> None:
        """Estimates queued candidates in bound order while the bound beats ``limit_s``
        (default: the best estimate so far); the others stay queued."""
        while self.pending:
            cut = self.cutoff_s if limit_s is None else limit_s
            if self.pending[0].bound_s >= cut:
                return
            item = heapq.heappop(self.pending)
            if not item.exact:  # tighten: the replay bound, then back in line
                assert self.bounds is not None
                item.bound_s = max(item.bound_s, self.bounds.bound_s(item.plan))
                item.exact = True
                if item.bound_s < cut:
                    heapq.heappush(self.pending, item)
                continue
            self.evaluate(item.plan, item.origin)

    # ---------------------------------------------------------------- generation
    def combo_bound_s(self, tps: tuple[int, ...], knobs: Knobs) -> float:
        """Returns a lower bound of any plan under these knobs (``band_bound_s`` over every
        number of pipelines)."""
        total = self.global_batch // knobs.micro_batch
        groups = sum(len(c.groups(t)) for c, t in zip(self.classes, tps, strict=True))
        return self.band_bound_s(tps, knobs, 1, max(1, min(groups, total)))

    def _work(self, tps: tuple[int, ...], knobs: Knobs) -> tuple[list[float], float]:
        """Returns every TP group's least time per layer and micro-batch, fastest first,
        and the least fixed time one micro-batch costs its pipeline (``stage_times`` with
        no layers: one stage holding embedding and head, or a first and a last stage)."""
        hit = self.work_memo.get((tps, knobs))
        if hit is not None:
            return hit
        tables = self._tables(tps, knobs)
        taus = sorted(per_layer_floor_s(t) for t in tables for _ in range(t.groups))
        single = min(t.stage_s(0, True, True) for t in tables)
        split = min(t.stage_s(0, True, False) for t in tables) + min(
            t.stage_s(0, False, True) for t in tables
        )
        hit = self.work_memo[(tps, knobs)] = (taus, min(single, split))
        return hit

    def combos(
        self,
        tp_list: list[tuple[int, ...]],
        mbs: tuple[int, ...],
        recompute: tuple[str, ...],
        schedules: list[tuple[str, int]],
    ) -> list[tuple[float, tuple[int, ...], Knobs]]:
        """Returns every knob setting with its lower bound (``combo_bound_s``), smallest
        first."""
        out = []
        for tps in tp_list:
            for mb in mbs:
                if self.global_batch % mb:
                    continue
                for rc in recompute:
                    for sched, v in schedules:
                        knobs = Knobs(mb, rc, 0, 1, self.precision, self.flash, sched, v)
                        out.append((self.combo_bound_s(tps, knobs), tps, knobs))
        out.sort(key=lambda c: c[0])
        return out

    def explore(
        self,
        tp_list: list[tuple[int, ...]],
        mbs: tuple[int, ...],
        recompute: tuple[str, ...],
        schedules: list[tuple[str, int]],
        done: set[tuple[object, ...]] | None = None,
        zeros: tuple[tuple[int, ...], ...] = MULTI_ZERO[:1],
    ) -> None:
        """Generates plans for knob settings in order of their lower bound (settings
        in ``done`` are skipped, and the visited ones added to it); ``zeros``: the memory
        settings of the multi-pipeline bands."""
        for bound_s, tps, knobs in self.combos(tp_list, mbs, recompute, schedules):
            if bound_s >= self.cutoff_s:
                break
            if done is not None:
                if (tps, knobs, zeros) in done:
                    continue
                done.add((tps, knobs, zeros))
            if self._dominated(tps, knobs, zeros):
                continue
            self.origin = (tps, knobs.micro_batch)
            self._combo(tps, knobs, zeros)
            self.drain()
        self.origin = None

    def _setting(
        self, tps: tuple[int, ...], knobs0: Knobs, lo: int, zeros: tuple[int, ...]
    ) -> _Setting:
        """Returns the tables, templates and variants of one setting; memory caps are the
        least over ``zeros`` and the sequence-parallel choices at ``lo`` pipelines (one, or
        two for every band of more: their caps hold for them all)."""
        knobs = replace(knobs0, zero_stage=zeros[0], dp_assumed=lo, zero_choices=zeros)
        hit = self.settings.get((tps, knobs))
        if hit is not None:
            return hit
        hit = self.settings[(tps, knobs)] = self._build_setting(tps, knobs)
        return hit

    def _build_setting(self, tps: tuple[int, ...], knobs: Knobs) -> _Setting:
        tables = self._tables(tps, knobs)
        groups = sum(t.groups for t in tables)
        templates = build_templates(tables, self.model.layers, groups, self.frontiers)
        if not templates:
            self.min_mem = min(self.min_mem, *(t.stage_bytes(1, 0, 1) for t in tables))
            return _Setting(tables, templates, None)
        return _Setting(tables, templates, variants(templates, knobs.virtual_stages))

    def _dominated(
        self, tps: tuple[int, ...], knobs: Knobs, zeros: tuple[tuple[int, ...], ...]
    ) -> bool:
        """Returns whether a recomputation holds no more layers anywhere than a lighter one:
        its plans are then those of the lighter one with slower stages (each stage's times
        only grow, and a longer last backward hides no more gradient reduction than it
        delays), so it cannot win."""
        if knobs.recompute == "none":
            return False
        lighter = RECOMPUTE[: RECOMPUTE.index(knobs.recompute)]
        pairs = [(1, (0,))] + [(2, zs) for zs in zeros]
        for rc in lighter:
            other = replace(knobs, recompute=rc)
            same = True
            for lo, zs in pairs:
                mine = replace(knobs, zero_stage=zs[0], dp_assumed=lo, zero_choices=zs)
                theirs = replace(other, zero_stage=zs[0], dp_assumed=lo, zero_choices=zs)
                if not self._same_caps(self._tables(tps, mine), self._tables(tps, theirs)):
                    same = False
                    break
            if same:
                return True
        return False

    def _same_caps(self, a: list[ClassTable], b: list[ClassTable]) -> bool:
        most = min(self.model.layers, 32)
        return all(
            x.caps_row(p) == y.caps_row(p)
            for p in range(1, most + 1)
            for x, y in zip(a, b, strict=True)
        )

    def band_bound_s(self, tps: tuple[int, ...], knobs: Knobs, lo: int, hi: int) -> float:
        """Returns a lower bound of any plan of ``lo`` to ``hi`` pipelines under these knobs.

        Work: every micro-batch crosses every layer on some TP group (at no less than its
        class's least time per layer) and pays its pipeline's fixed costs (embedding, head,
        per-stage overheads), and no group works longer than the iteration; a pipeline has
        at most ``depth = min(layers / v, MAX_STAGES)`` stages, so at most ``hi * depth``
        groups compute layers, and one pipeline runs at least ``total / hi`` micro-batches
        on its own ``depth``. Pipelining: with d pipelines one runs m >= total / d
        micro-batches on p <= depth stages (the others need a group each) whose times sum
        to at least ``S`` (all layers once, and the fixed costs); the closed-form bound
        ``max_j (sum_{i<j} T_i / v + m T_j)`` is least, over stage times summing to S,
        when all its terms are equal: ``S / (v (1 - (1 - 1/(m v))^p))``."""
        total = self.global_batch // knobs.micro_batch
        taus, phi = self._work(tps, knobs)
        v = knobs.virtual_stages
        depth = min(self.model.layers // v, MAX_STAGES)
        layers = self.model.layers
        whole = capacity_bound_s(taus, total * layers, total * phi, hi * depth)
        one = math.ceil(total / hi)
        out = max(whole, capacity_bound_s(taus, one * layers, one * phi, depth))
        least = phi + layers * taus[0]
        piped = math.inf
        for d in range(lo, hi + 1):
            m, p = math.ceil(total / d), max(1, min(depth, len(taus) - d + 1))
            piped = min(piped, least / (v * (1.0 - (1.0 - 1.0 / (m * v)) ** p)))
        return max(out, piped * (1.0 - 1e-9))

    def _combo(
        self, tps: tuple[int, ...], knobs0: Knobs, zeros: tuple[tuple[int, ...], ...]
    ) -> None:
        total_micro = self.global_batch // knobs0.micro_batch
        groups = sum(len(c.groups(t)) for c, t in zip(self.classes, tps, strict=True))
        bands = [
            (lo, hi)
            for lo, hi in dp_bands(min(groups, total_micro))
            if self.band_bound_s(tps, knobs0, lo, hi) < self.cutoff_s
        ]
        single = bands[:1] if bands and bands[0][0] == 1 else []
        multi = bands[len(single) :]
        settings: list[_Setting] = []
        if multi:
            first = self._setting(tps, knobs0, 2, MULTI_ZERO[0])
            for zs in zeros:
                setting = self._setting(tps, knobs0, 2, zs)
                if setting is not first and self._same_caps(first.tables, setting.tables):
                    continue  # ZeRO-1's templates, with no cheaper twins
                settings.append(setting)
        if single:
            # one pipeline runs without ZeRO: the multi-pipeline tables have the same times
            # and more room, so any split it may use has a bottleneck no less than theirs
            var = settings[0].variants if settings else None
            if var is None or total_micro * np.min(var.bound[2]) < self.cutoff_s:
                self._bands(tps, [self._setting(tps, knobs0, 1, (0,))], single, total_micro)
        if multi:
            self._bands(tps, settings, multi, total_micro)

    def _bands(
        self,
        tps: tuple[int, ...],
        settings: list[_Setting],
        bands: list[tuple[int, int]],
        total_micro: int,
    ) -> None:
        """Selects pipelines per band and setting, and queues their plans' twins."""
        for setting in settings:
            if setting.variants is None:
                continue
            tables, templates, var = setting.tables, setting.templates, setting.variants
            knobs = tables[0].knobs
            v = knobs.virtual_stages
            avail = np.array([t.groups for t in tables], dtype=np.int64)
            steps = bsteps = None
            if v > 1:  # an interleaved pipeline runs a multiple of its stages
                steps = np.array([len(templates[i].classes) for i, _ in var.keys])
                bsteps = np.array(
                    [len(tpl.classes) for tpl in templates for _ in tpl.frontier], dtype=np.int64
                )
            for lo, hi in bands:
                sel = select_pipelines(
                    var.counts, var.fill, var.bott, avail, total_micro, (lo, hi), 1e-2,
                    self.cutoff_s, self.memo, var.bound, var.slack_s, steps, bsteps,
                )  # fmt: skip
                if sel is None:
                    continue
                for replica_major in (True, False):
                    plan = build_plan(
                        tables, templates, var.keys, sel, knobs, self.global_batch, replica_major
                    )
                    self.offer_twins(plan)

    # ---------------------------------------------------------------- enumeration
    def enumerate_all(self, budget: int = ENUMERATION_BUDGET) -> bool:
        """Estimates every plan of the space whose lower bound beats the best estimate,
        selections of pipelines in order of their bound; returns False (unproven) when the
        work passes ``budget``."""
        tp_list = list(itertools.product(*(tp_options(self.model, c) for c in self.classes)))
        for tps in tp_list:  # too many pipelines to list: give up before any work
            avail = [len(c.groups(t)) for c, t in zip(self.classes, tps, strict=True)]
            if count_pipelines(avail, self.model.layers) > ENUMERATION_SPLITS:
                return False
        combos = self.combos(tp_list, MICRO_BATCHES, RECOMPUTE,
                             schedule_options(self.model.layers))  # fmt: skip
        work = _Budget(budget)
        queue: list[tuple[float, int, _Enumeration, tuple[tuple[int, int], ...], int, bool]]
        queue = []
        for bound_s, tps, knobs in combos:
            if bound_s >= self.cutoff_s:
                break
            if not _Enumeration(self, tps, knobs, work, queue).run():
                return False
        heapq.heapify(queue)
        while queue and queue[0][0] < self.cutoff_s:
            bound, _, enum, sel, z, sp = heapq.heappop(queue)
            if not enum.place(bound, sel, z, sp):
                return False
        return True


class _Budget:
    """Work units left to the enumeration."""

    def __init__(self, units: int) -> None:
        self.left = units

    def spend(self, units: int = 1) -> bool:
        """Spends units; returns False once none are left."""
        self.left -= units
        return self.left >= 0


@dataclass
class _Pipe:
    """One enumerated pipeline: class per stage, layers per stage, and its per-stage
    times with the least transfers the cluster allows."""

    classes: tuple[int, ...]
    layers: tuple[int, ...]
    counts: np.ndarray
    fwd_c: list[list[float]]
    bwd_c: list[list[float]]
    """Per stage and chunk, forward and backward side per micro-batch (waits included)."""
    sends: list[float]
    state_floor: list[float]
    """Per stage: the least weights, gradients and optimizer bytes of any ZeRO choice."""


class _Enumeration:
    """Every plan of one knob setting (TP degrees, micro-batch, recomputation, schedule)
    whose lower bound beats the best estimate, estimated; the ZeRO and sequence-parallel
    choices and the placements are enumerated per selection of pipelines."""

    def __init__(
        self,
        state: _State,
        tps: tuple[int, ...],
        knobs: Knobs,
        work: _Budget,
        queue: list[tuple[float, int, _Enumeration, tuple[tuple[int, int], ...], int, bool]],
    ):
        self.s = state
        self.queue = queue
        self.tps = tps
        self.knobs = knobs
        self.work = work
        self.tables = state._tables(tps, knobs)
        self.total = state.global_batch // knobs.micro_batch
        self.avail = np.array([t.groups for t in self.tables], dtype=np.int64)
        self.most = int(min(self.avail.sum(), self.total))
        self.pipes: list[_Pipe] = []
        self.items: list[tuple[int, tuple[int, ...], list[tuple[int, float]]]] = []
        self._cover: dict[tuple[int, ...], int] = {}
        self._fit: dict[tuple[int, ...], list[int]] = {}
        """Per vector of free TP groups: the items whose pipeline fits in them."""
        self._opt: dict[tuple[object, ...], float] = {}
        self._bound: dict[tuple[object, ...], float] = {}
        self._acts: dict[tuple[object, ...], float] = {}

    def opt_s(
        self, k: int, layers: int, first: bool, last: bool, single: bool, shards: int
    ) -> float:
        key = (k, layers, first, last, single, shards)
        hit = self._opt.get(key)
        if hit is None:
            hit = self._opt[key] = self.tables[k].optimizer_s(layers, first, last, single, shards)
        return hit

    def opts(self, pipe: _Pipe, shards: int) -> list[float]:
        p = len(pipe.classes)
        return [
            self.opt_s(k, x, j == 0, j == p - 1, p == 1, shards)
            for j, (k, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True))
        ]

    def step(self, pipe: _Pipe) -> int:
        """Returns the multiple a pipeline's micro-batches must be."""
        p = len(pipe.classes)
        return p if self.knobs.virtual_stages > 1 and p > 1 else 1

    def fits(self, pipe: _Pipe, m: int, state: list[float], sps: tuple[bool, ...]) -> bool:
        """Returns whether every stage fits with ``m`` micro-batches and these state bytes
        under some sequence-parallel choice of ``sps``."""
        k = self.knobs
        p = len(pipe.classes)
        for sp in sps:
            ok = True
            for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True)):
                t = self.tables[c]
                units = peak_in_flight(k.schedule, p, m, k.virtual_stages, j)
                key = (c, x, j == 0, j == p - 1, units, sp and t.tp > 1)
                acts = self._acts.get(key)
                if acts is None:
                    acts = self._acts[key] = t.activation_bytes(x, *key[2:])
                if state[j] + acts + t.reserve_bytes > t.cls.gpu.memory_bytes:
                    ok = False
                    break
            if ok:
                return True
        return False

    def pipe_bound_s(self, i: int, m: int, shards: int) -> float:
        """Returns the replay bound of pipeline ``i`` running ``m`` micro-batches."""
        key = (i, m, shards)
        hit = self._bound.get(key)
        if hit is None:
            pipe = self.pipes[i]
            hit = self._bound[key] = pipeline_bound_s(
                self.knobs.schedule, m, pipe.fwd_c, pipe.bwd_c, pipe.sends, self.opts(pipe, shards)
            )
        return hit

    def build_pipes(self) -> bool:
        """Enumerates every (shape, split) pipeline that fits somewhere; False when there
        are too many."""
        s, k = self.s, self.knobs
        v = k.virtual_stages
        layers = s.model.layers
        avail = [int(a) for a in self.avail]
        n = count_pipelines(avail, layers // v)
        if n > ENUMERATION_SPLITS or not self.work.spend(PIPE_UNITS * n):
            return False
        shapes = pipeline_shapes(avail, layers // v)
        zs = zero_choices(self.most)
        cut = s.cutoff_s
        chunks: dict[tuple[object, ...], tuple[list[float], list[float], float, float]] = {}
        floors: dict[tuple[object, ...], float] = {}
        for seq in shapes:
            p = len(seq)
            counts = np.array([seq.count(c) for c in range(len(self.tables))], dtype=np.int64)
            sends = [0.0] if p == 1 else [
                self.tables[seq[j]].min_send_s(self.tables[seq[(j + 1) % p]]) for j in range(p)
            ]  # fmt: skip
            waits = [p2p_wait_s(sends, j, v, self.tables[c].p2p_exposed) for j, c in enumerate(seq)]
            m = p if v > 1 and p > 1 else 1  # the fewest micro-batches it may run
            for split in layer_splits(layers, p, v):
                hits = []
                f_acc = b_acc = low = 0.0
                for j, (c, x) in enumerate(zip(seq, split, strict=True)):
                    first, last = j == 0, j == p - 1
                    key = (c, x, first, last, waits[j])
                    hit = chunks.get(key)
                    if hit is None:
                        t = self.tables[c]
                        f, b = t.stage_fb(x, first, last)
                        fc, bc = chunk_times(f, b, waits[j], v, t.parts(first, last))
                        hit = chunks[key] = (fc, bc, sum(fc), sum(bc))
                    hits.append(hit)
                    # the closed-form bound at the fewest micro-batches, optimizer left out
                    low = max(low, f_acc + m * (hit[2] + hit[3]) + b_acc)
                    f_acc += hit[0][0] + sends[j]
                    b_acc += hit[1][0] + sends[j]
                if low * (1.0 - 1e-9) >= cut:
                    continue
                floor: list[float] = []
                for j, (c, x) in enumerate(zip(seq, split, strict=True)):
                    first, last = j == 0, j == p - 1
                    fkey = (c, x, first, last, p == 1)
                    least = floors.get(fkey)
                    if least is None:
                        t = self.tables[c]
                        least = floors[fkey] = min(
                            stage_state_bytes(s.model, x, t.tp, first, last, p == 1,
                                              k.precision, z, self.most if z else 1)
                            for z in zs
                        )  # fmt: skip
                    floor.append(least)
                fwd = [h[0] for h in hits]
                bwd = [h[1] for h in hits]
                self.pipes.append(_Pipe(seq, split, counts, fwd, bwd, sends, floor))
        return True

    def build_items(self) -> None:
        """Lists, per pipeline, the micro-batch counts at which it fits under the least
        memory of any ZeRO choice and its bound, with the least optimizer step, beats the
        cutoff (both only grow with the count)."""
        sps = (False, True)
        cut = self.s.cutoff_s
        for i, pipe in enumerate(self.pipes):
            step = self.step(pipe)
            opt = [
                min(self.opt_s(c, x, j == 0, j == len(pipe.classes) - 1,
                               len(pipe.classes) == 1, sh) for sh in (1, self.most))
                for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True))
            ]  # fmt: skip
            ms: list[tuple[int, float]] = []
            for m in range(step, self.total + 1, step):
                if not self.fits(pipe, m, pipe.state_floor, sps):
                    break  # memory only grows with more micro-batches in flight
                b = closed_bound_s(m, pipe.fwd_c, pipe.bwd_c, pipe.sends, opt)
                if b >= cut:
                    break  # and so does the closed-form bound
                ms.append((m, b))
            if ms:
                self.items.append((i, tuple(int(c) for c in pipe.counts), ms))

    def run(self) -> bool:
        """Enumerates the setting; False when the budget ran out."""
        if not self.build_pipes():
            return False
        self.build_items()
        if not self.items:
            return True
        avail = tuple(int(a) for a in self.avail)
        states = math.prod(a + 1 for a in avail)
        if not self.work.spend(states * len(self.items)):
            return False
        self._cover = self._cover_table(avail)
        return self._dfs(0, 0, self.total, avail, [])

    def _cover_table(self, avail: tuple[int, ...]) -> dict[tuple[int, ...], int]:
        """Returns, per vector of free TP groups, the most micro-batches pipelines built
        from them can run while each one's bound beats the cutoff (a knapsack)."""
        out: dict[tuple[int, ...], int] = {}
        for free in itertools.product(*(range(a + 1) for a in avail)):
            best = 0
            fit = []
            for idx, (_, counts, ms) in enumerate(self.items):
                rest = tuple(f - c for f, c in zip(free, counts, strict=True))
                if min(rest) >= 0:
                    best = max(best, ms[-1][0] + out[rest])
                    fit.append(idx)
            out[free] = best
            self._fit[free] = fit
        return out

    def _dfs(
        self, start: int, m0: int, left: int, free: tuple[int, ...], chosen: list[tuple[int, int]]
    ) -> bool:
        """Extends a multiset of (pipeline, micro-batches), in canonical order, until the
        micro-batches are all placed; False when the budget ran out."""
        if left == 0:
            return self._complete(chosen)
        if len(chosen) >= self.most or self._cover[free] < left:
            return True
        fit = self._fit[free]
        for pos in range(bisect.bisect_left(fit, start), len(fit)):
            if not self.work.spend():
                return False
            idx = fit[pos]
            i, counts, ms = self.items[idx]
            rest = tuple(f - c for f, c in zip(free, counts, strict=True))
            for m, b in ms:
                if idx == start and m < m0:
                    continue
                if m > left or b >= self.s.cutoff_s:
                    break
                chosen.append((i, m))
                ok = self._dfs(idx, m, left - m, rest, chosen)
                chosen.pop()
                if not ok:
                    return False
        return True

    def _complete(self, chosen: list[tuple[int, int]]) -> bool:
        """Queues a selection of pipelines under every ZeRO choice that fits and whose
        bound beats the best estimate; sequence parallelism off, or on where it must be
        to fit (without overlapped TP collectives it changes memory only)."""
        s = self.s
        d = len(chosen)
        sel = tuple(chosen)
        any_tp = any(self.tables[c].tp > 1 for i, _ in sel for c in self.pipes[i].classes)
        for z in zero_choices(d):
            shards = d if z else 1
            bound = max(self.pipe_bound_s(i, m, shards) for i, m in sel)
            if bound >= s.cutoff_s:
                continue
            for sp in (False, True) if any_tp else (False,):
                states = [self._state(i, z, d) for i, _ in sel]
                if all(
                    self.fits(self.pipes[i], m, st, (sp,))
                    for (i, m), st in zip(sel, states, strict=True)
                ):
                    self.queue.append((bound, len(self.queue), self, sel, z, sp))
                    break
        return self.work.spend()

    def place(self, bound_s: float, sel: tuple[tuple[int, int], ...], z: int, sp: bool) -> bool:
        """Estimates a queued selection (whose bound ``bound_s`` holds for every placement)
        on every placement whose own bound, with its actual transfers, beats the best
        estimate; False when the budget ran out."""
        s, k = self.s, self.knobs
        assert s.bounds is not None
        for layout in placements(self.tables, [self.pipes[i].classes for i, _ in sel]):
            if not self.work.spend(5):
                return False
            pipelines = []
            for r, (i, m) in enumerate(sel):
                pipe = self.pipes[i]
                stages = tuple(Stage(x, layout[(r, j)]) for j, x in enumerate(pipe.layers))
                pipelines.append(Pipeline(m * k.micro_batch, stages))
            # estimate does not depend on the order of the pipelines: one order each
            pipelines.sort(key=_pipeline_key)
            plan = Plan(
                global_batch_size=s.global_batch,
                micro_batch_size=k.micro_batch,
                pipelines=tuple(pipelines),
                precision=k.precision,
                recompute=k.recompute,
                zero_stage=z,
                schedule=k.schedule,
                virtual_stages=k.virtual_stages,
                sequence_parallel=sp,
                flash_attention=k.flash_attention,
            )
            if plan in s.seen:
                continue
            s.seen.add(plan)
            if s.bounds.bound_s(plan) >= s.cutoff_s:
                continue
            if not self.work.spend(ESTIMATE_UNITS):
                return False
            s.evaluate(plan)
        return True

    def _state(self, i: int, z: int, d: int) -> list[float]:
        pipe = self.pipes[i]
        p = len(pipe.classes)
        return [
            stage_state_bytes(
                self.s.model,
                x,
                self.tables[c].tp,
                j == 0,
                j == p - 1,
                p == 1,
                self.knobs.precision,
                z,
                d,
            )
            for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True))
        ]


def capacity_bound_s(taus: list[float], layer_work: float, fixed_s: float, most: int) -> float:
    """Returns the least iteration time in which TP groups with per-layer times ``taus``
    (fastest first) can run ``layer_work`` layer-micro-batches and ``fixed_s`` seconds of
    fixed costs, at most ``most`` groups computing layers: with time T, a group spending
    F on fixed costs runs (T - F) / tau layers; the fixed costs go to the slowest groups
    (any group may absorb them), the layers to the ``most`` fastest. A lower bound of any
    plan's time, since no group works longer than the iteration.

    The room left for layers, ``T * rate - cost(T)``, grows with T and is linear between
    the points where one more slow group is filled with fixed costs: solved per piece."""
    rate = sum(1.0 / t for t in taus[:most])
    slow = sorted(taus, reverse=True)
    n = len(slow)
    if fixed_s <= 0:
        return layer_work / rate * (1.0 - 1e-9)
    best = math.inf
    prefix = [0.0]  # sum of 1/tau over the q slowest groups
    for tau in slow:
        prefix.append(prefix[-1] + 1.0 / tau)
    for q in range(n):
        # q groups filled, group q takes the rest: T in [fixed / (q + 1), fixed / q]
        used = prefix[q]
        tau = slow[q]
        t = (layer_work + fixed_s / tau) / (rate - used + q / tau)
        lo = fixed_s / (q + 1)
        hi = fixed_s / q if q else math.inf
        if t <= hi:
            best = min(best, max(t, lo))
    return best * (1.0 - 1e-9)


def _state_floor_bytes(model: ModelSpec, precision: str, dp: int) -> float:
    w, g, o = state_bytes(stage_params(model, model.layers, 1, True, True, True), precision, 1, dp)
    return w + g + o


def search_heterogeneous(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    top_k: int = 5,
    params: CostParams | None = None,
    flash_attention: bool = True,
) -> HeteroResult:
    """Returns the top-k plans on a mixed cluster, best first, with both baselines."""
    return search_with(model, cluster, global_batch, precision, top_k, params, flash_attention)


def search_with(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    top_k: int = 5,
    params: CostParams | None = None,
    flash_attention: bool = True,
    prune: bool = True,
    enumerate_budget: int = ENUMERATION_BUDGET,
) -> HeteroResult:
    """Returns what ``search_heterogeneous`` does; ``prune=False`` turns off every bound
    (to check that pruning loses nothing); ``enumerate_budget=0`` skips the enumeration."""
    start = time.perf_counter()
    params = params or default_params()
    notes: list[str] = []
    classes = []
    for cls in device_classes(cluster):
        if cls.gpu.supports(precision):
            classes.append(cls)
        else:
            notes.append(f"{cls.gpu.name} has no {precision} support; its GPUs are left out")
    if not classes:
        raise InputError("--precision", f"no GPU of the cluster supports {precision}")
    single, more = best_single_type(
        model, cluster, global_batch, precision, params, flash_attention
    )
    notes += more
    uniform = best_uniform(model, cluster, global_batch, precision, params, flash_attention)
    baselines = {"single_type": single, "uniform": uniform}
    total_mem = sum(c.gpu.memory_bytes * c.num_gpus for c in classes)
    floor = _state_floor_bytes(model, precision, cluster.num_gpus)
    if floor > total_mem:
        notes.append(
            f"{model.name} needs at least {floor / 1e9:.1f} GB for weights, gradients and "
            f"optimizer state, but the usable GPUs hold {total_mem / 1e9:.1f} GB together"
        )
        elapsed = time.perf_counter() - start
        return HeteroResult([], baselines, elapsed, notes, floor / cluster.num_gpus)
    state = _State(model, cluster, classes, global_batch, precision, params, flash_attention,
                   top_k)  # fmt: skip
    state.prune = prune
    state.bounds = PlanBounds(model, cluster, params)
    for b in (single, uniform):
        if b is not None:
            state.add(*b)
            state.seen.add(canonical(b[0]))
    # generation, a coordinate search over settings in order of their bound: every
    # symmetric TP degree and micro-batch without recomputation on 1F1B; with selective
    # and full recomputation (where they hold more layers); every recomputation, schedule
    # and ZeRO memory setting at the best (TP degrees, micro-batch); then one class off
    # the best symmetric degree at the best knobs
    schedules = schedule_options(model.layers)
    symmetric = tp_configs(model, classes)
    done: set[tuple[object, ...]] = set()
    base = [("1F1B", 1)]
    state.explore(symmetric, MICRO_BATCHES, ("none",), base, done)
    state.explore(symmetric, MICRO_BATCHES, RECOMPUTE[1:], base, done)
    leaders = sorted(state.by_origin, key=lambda o: state.by_origin[o])[:LEADERS]
    for tps, mb in leaders:
        state.explore([tps], (mb,), RECOMPUTE, base, done, MULTI_ZERO[1:])
        state.explore([tps], (mb,), RECOMPUTE, schedules[1:], done)
    if leaders:
        tps, mb = leaders[0]
        best = min(state.pool, key=lambda x: (x[0], x[1]))[2]
        if len(set(tps)) == 1:
            around = tp_configs(model, classes, around=tps[0])
            state.explore(around, (mb,), (best.recompute,),
                          [(best.schedule, best.virtual_stages)], done)  # fmt: skip
    proven = False
    if enumerate_budget > 0:
        proven = state.enumerate_all(enumerate_budget)
        if not proven:
            notes.append(
                "the space is too large to enumerate: the first plan is the best of those the "
                "pipeline-selection MILP generated, not proven the best of all"
            )
    state.drain(state.kth_s if prune else math.inf)
    pool = sorted(state.pool, key=lambda x: (x[0], x[1]))
    if not pool:
        notes.append("no plan fits in memory (try a smaller micro-batch or more GPUs)")
    return HeteroResult(
        ranked=[(plan, est) for _, _, plan, est in pool[:top_k]],
        baselines=baselines,
        search_time_s=time.perf_counter() - start,
        notes=notes,
        min_memory_bytes=state.min_mem,
        proven=proven and bool(pool),
        evaluated=state.evaluated,
    )

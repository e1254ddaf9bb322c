"""The candidate pool both passes of the heterogeneous search share: the plans estimated
so far (ranked by ``estimate``, with the running best and the k-th best), the candidates
queued under their proven lower bounds (``PlanBounds``) and estimated in bound order, the
plans seen, and the cost tables per class and knob setting."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams
from hetplan.cost.schedule import interleave_fits
from hetplan.cost.sharding import deferred
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.constraints import PlanConstraints, narrow
from hetplan.search.grouping import DeviceClass
from hetplan.search.hashed import Hashed
from hetplan.search.het_bounds import PlanBounds
from hetplan.search.het_cache import SearchCache
from hetplan.search.het_space import (
    MICRO_BATCHES,
    schedule_options,
    seen_key,
    tiebreak,
    zero_choices,
)
from hetplan.search.het_tables import ClassTable, Knobs, class_table
from hetplan.search.progress import ProgressHook, SearchProgress


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
class CandidatePool:
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
    seen: set[object] = field(default_factory=set)
    order: dict[int, Hashed] = field(default_factory=dict)
    tables: dict[tuple[int, int, Knobs], ClassTable] = field(default_factory=dict)
    acts: dict[tuple[object, ...], float] = field(default_factory=dict)
    """Peak activations, shared by every table (``class_table``)."""
    bounds: PlanBounds | None = None
    evaluated: int = 0
    prune: bool = True
    """Skip knobs, bands and selections whose lower bound cannot win."""
    constraints: PlanConstraints = field(default_factory=PlanConstraints)
    """The user's limits: knob domains are narrowed to them, and no plan that breaks one
    is queued or recorded."""
    progress: ProgressHook | None = None
    """Told after every estimate (candidates estimated, best so far)."""
    shared: SearchCache | None = None
    """Caches shared with other searches of the model (``het_cache``), or None."""
    ceiling_s: float = math.inf
    """Only plans faster than this are wanted (the caller has better ones): no candidate
    whose lower bound reaches it is explored, as if a plan that fast were already found."""
    spans: int = 0
    """Only plans with devices on at least this many nodes are queued or recorded (the
    mixes of provisioning need only those using every node: ``explore_mixes``)."""

    # ---------------------------------------------------------------- knob domains
    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Returns the micro-batches to try: the user's, else the search's own."""
        return self.constraints.micro_batch or MICRO_BATCHES

    def tps_allowed(self, tp_list: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Returns the per-class TP degrees whose every degree the constraints allow."""
        allowed = self.constraints.tp
        return [t for t in tp_list if allowed is None or all(x in allowed for x in t)]

    def recompute_allowed(self, options: tuple[str, ...]) -> tuple[str, ...]:
        return narrow(self.constraints.recompute, options)

    def schedules_allowed(self, options: list[tuple[str, int]]) -> list[tuple[str, int]]:
        c = self.constraints
        return [
            (name, v)
            for name, v in options
            if (c.schedule is None or name in c.schedule)
            and (c.virtual_stages is None or v in c.virtual_stages)
        ]

    def zeros_allowed(self, options: tuple[int, ...]) -> tuple[int, ...]:
        return narrow(self.constraints.zero_stage, options)

    def sequence_parallel_for(self, any_tp: bool) -> bool:
        """Returns sequence parallelism for a plan (on wherever a stage has TP > 1, unless
        the user pinned it)."""
        pinned = self.constraints.sequence_parallel
        return any_tp if pinned is None else pinned

    @property
    def cutoff_s(self) -> float:
        """Returns the time a lower bound must beat to be explored."""
        return min(self.best_s, self.ceiling_s) if self.prune else math.inf

    @property
    def kth_s(self) -> float:
        """Returns the k-th best estimate so far (inf with fewer)."""
        if len(self.pool) < self.top_k:
            return math.inf
        return sorted(t for t, _, _, _ in self.pool)[self.top_k - 1]

    def class_tables(self, tps: tuple[int, ...], knobs: Knobs) -> list[ClassTable]:
        """Returns the cost table of every class at its TP degree under these knobs."""
        out = []
        for k, (c, t) in enumerate(zip(self.classes, tps, strict=True)):
            key = (k, t, knobs)
            if key not in self.tables:  # shared, so their memory caps are computed once
                caches = (
                    None if self.shared is None else self.shared.table_caches(c.nodes[0], t, knobs)
                )
                self.tables[key] = class_table(self.model, c, t, knobs, self.params, self.acts,
                                               caches)  # fmt: skip
            out.append(self.tables[key])
        return out

    # ---------------------------------------------------------------- candidates
    def wanted(self, plan: Plan) -> bool:
        """Returns whether the search may return ``plan``: the constraints allow it and it
        spans the nodes asked for."""
        if not self.constraints.allows(plan):
            return False
        return self.spans <= 1 or len(plan.node_names()) >= self.spans

    def add(self, plan: Plan, est: Estimate) -> None:
        """Records an estimated plan (one the search may return: ``wanted``)."""
        if not self.wanted(plan):
            return
        if not est.fits:
            self.min_mem = min(self.min_mem, est.max_memory_bytes)
            return
        t = est.iteration_time_s
        self.pool.append((t, tiebreak(plan), plan, est))
        if t < self.best_s:
            self.best_s = t

    def first_seen(self, key: object) -> bool:
        """Adds a plan's ``seen_key`` to the plans seen; returns whether it was new (the
        key hashed once)."""
        before = len(self.seen)
        self.seen.add(key)
        return len(self.seen) > before

    def offer(self, plan: Plan) -> float:
        """Queues a candidate that fits under its lower bound (returns the bound; inf when
        it does not fit or was seen)."""
        assert self.bounds is not None
        if not self.wanted(plan):
            return math.inf
        if not self.first_seen(seen_key(plan, self.order)):
            return math.inf
        ok, peak = self.bounds.fits(plan)
        if not ok:
            self.min_mem = min(self.min_mem, peak)
            return math.inf
        bound = self.bounds.bound_s(plan, exact=False)
        heapq.heappush(self.pending, _Pending(bound, len(self.seen), plan, self.origin))
        return bound

    def twin_schedules(
        self, schedule: str, v: int, shapes: set[tuple[tuple[int, ...], int]]
    ) -> list[tuple[str, int]]:
        """Returns the schedules ``offer_twins`` queues a plan in (``schedule`` with ``v``
        chunks; a 1F1B plan also as Interleaved1F1B with every chunk count its stages and
        batch shares allow), from its pipelines' distinct (layers per stage, micro-batches)
        ``shapes``."""
        out = [(schedule, v)]
        if schedule == "1F1B":
            for _, u in self.schedules_allowed(schedule_options(self.model.layers)[1:]):
                if all(
                    all(n % u == 0 for n in layers)
                    and (len(layers) == 1 or interleave_fits(len(layers), m))
                    for layers, m in shapes
                ):
                    out.append(("Interleaved1F1B", u))
        return out

    def offer_twins(self, plan: Plan, schedules: list[tuple[str, int]] | None = None) -> None:
        """Queues a plan with every ZeRO stage it may take, with sequence parallelism on
        wherever a stage has TP > 1 (it only removes forward work and activation memory, so
        the plan with it off is never better), in every schedule of ``twin_schedules``
        (``schedules``: those of them the caller has not ruled out)."""
        sp = self.sequence_parallel_for(any(s.tp > 1 for p in plan.pipelines for s in p.stages))
        # what the forms and ZeRO stages read of the pipelines, each distinct shape once
        shapes = {(tuple(s.layers for s in p.stages), plan.num_micro_batches(p))
                  for p in plan.pipelines}  # fmt: skip
        if schedules is None:
            schedules = self.twin_schedules(plan.schedule, plan.virtual_stages, shapes)
        forms = [
            plan
            if (name, v) == (plan.schedule, plan.virtual_stages)
            else replace(plan, schedule=name, virtual_stages=v)
            for name, v in schedules
        ]
        # several pipelines: ZeRO-1 reduces as much as ZeRO-0 and shards the optimizer step
        # and its state, so generation leaves ZeRO-0 to the enumeration
        zeros = zero_choices(plan.dp)[1:] if plan.dp > 1 else (0,)
        if self.constraints.zero_stage is not None and plan.dp > 1:
            zeros = self.zeros_allowed(zero_choices(plan.dp))  # ZeRO-0 too, if it is asked
        # a ZeRO stage deferred to ZeRO-1's traffic (``deferred_sync``) takes ZeRO-1's time
        # with more memory: dominated
        pipelined = any(len(layers) > 1 for layers, _ in shapes)
        uneven = len({m for _, m in shapes}) > 1
        for form in forms:
            for z in zeros:
                if not deferred(z, plan.dp, pipelined, uneven):
                    self.offer(replace(form, zero_stage=z, sequence_parallel=sp))

    def evaluate(self, plan: Plan, origin: tuple[tuple[int, ...], int] | None = None) -> Estimate:
        """Estimates one plan and records it."""
        est = estimate(plan, self.model, self.cluster, self.params, validate=False)
        self.evaluated += 1
        self.add(plan, est)
        if self.progress is not None:
            best = None if math.isinf(self.best_s) else self.best_s
            self.progress(SearchProgress(self.evaluated, None, best))
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

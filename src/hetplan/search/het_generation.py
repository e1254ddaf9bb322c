"""Generation, the heterogeneous search's first pass (every instance): a coordinate search
over knob settings (TP degrees, micro-batch, recomputation, schedule), each visited only
while its lower bound (``band_bound_s``) beats the best estimate; per band of data-parallel
degrees, pipeline templates and their layer splits (partition.py) and the
pipeline-selection MILP (grouping.py), each selected plan queued with its twins."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cost.dp_sync import reduction_floor_s
from hetplan.plan import RECOMPUTE
from hetplan.search.grouping import MilpMemo, Selection, identical_pipelines, select_pipelines
from hetplan.search.het_pool import CandidatePool
from hetplan.search.het_space import dp_bands, schedule_options, tp_configs
from hetplan.search.het_tables import ClassTable, Knobs, cap_positions, per_layer_floor_s
from hetplan.search.het_templates import FrontierCache, Template
from hetplan.search.het_variants import (
    MAX_STAGES,
    Variants,
    bound_fill_s,
    build_plan,
    build_templates,
    variants,
)
from hetplan.search.partition import Partition, best_on_frontier

LEADERS = 1
"""(TP degrees, micro-batch) settings whose every recomputation, schedule and ZeRO memory
setting is generated."""
MULTI_ZERO = ((1,), (2, 3))
"""Memory settings of the multi-pipeline bands: ZeRO-1's caps (plans whose twins need no
per-micro-batch collectives), then ZeRO-2/3's where they hold more layers."""


@dataclass
class _Setting:
    """Cost tables, templates and their non-dominated variants under one set of knobs."""

    tables: list[ClassTable]
    templates: list[Template]
    variants: Variants | None


@dataclass(frozen=True)
class Rates:
    """TP groups' least times per layer and micro-batch, fastest first, with the sums
    ``capacity_bound_s`` reads of them (each summed in the order it states, once)."""

    taus: list[float]
    fast: list[float]
    """``fast[k]``: the sum of 1 / tau over the k fastest groups."""
    slow: np.ndarray
    """The times, slowest first."""
    used: np.ndarray
    """``used[q]``: the sum of 1 / tau over the q slowest groups (q < n)."""
    filled: np.ndarray
    """0, 1, ..., n - 1 (as floats)."""

    @classmethod
    def of(cls, taus: list[float]) -> Rates:
        """Returns the rates of times ``taus`` (fastest first)."""
        slow = sorted(taus, reverse=True)
        fast = list(itertools.accumulate((1.0 / t for t in taus), initial=0.0))
        used = list(itertools.accumulate((1.0 / t for t in slow), initial=0.0))[:-1]
        return cls(taus, fast, np.array(slow), np.array(used), np.arange(len(taus), dtype=float))


def capacity_bound_s(rates: Rates, layer_work: float, fixed_s: float, most: int) -> float:
    """Returns the least iteration time in which TP groups with per-layer times
    ``rates.taus`` (fastest first) can run ``layer_work`` layer-micro-batches and
    ``fixed_s`` seconds of fixed costs, at most ``most`` groups computing layers: with time
    T, a group spending F on fixed costs runs (T - F) / tau layers; the fixed costs go to the
    slowest groups (any group may absorb them), the layers to the ``most`` fastest. A lower
    bound of any plan's time, since no group works longer than the iteration.

    The room left for layers, ``T * rate - cost(T)``, grows with T and is linear between
    the points where one more slow group is filled with fixed costs: solved per piece (q
    groups filled, group q takes the rest: T in [fixed / (q + 1), fixed / q]), all pieces at
    once."""
    rate = rates.fast[min(max(most, 0), len(rates.taus))]
    if fixed_s <= 0:
        return layer_work / rate * (1.0 - 1e-9)
    tau, q = rates.slow, rates.filled
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (layer_work + fixed_s / tau) / (rate - rates.used + q / tau)
        lo = fixed_s / (q + 1)
        hi = np.where(q > 0, fixed_s / q, math.inf)
    ok = t <= hi
    if not ok.any():
        return math.inf
    return float(np.maximum(t, lo)[ok].min()) * (1.0 - 1e-9)


def pipeline_shapes_of(
    total: int, groups: int, depth: int, lo: int, hi: int
) -> list[tuple[int, int]]:
    """Returns every distinct (m, p) over d = lo..hi pipelines (``band_bound_s``): one of
    them runs m = ceil(total / d) micro-batches on at most p = max(1, min(depth,
    groups - d + 1)) stages. Both fall as d grows, so each pair holds over a run of d: the
    first d of each run is taken (m stays until d passes (total - 1) // (m - 1); p stays at
    ``depth`` while d <= groups - depth + 1, then falls by one a step down to 1)."""
    out: list[tuple[int, int]] = []
    d = lo
    while d <= hi:
        m = math.ceil(total / d)
        p = max(1, min(depth, groups - d + 1))
        if not out or out[-1] != (m, p):  # a run can end where neither changes
            out.append((m, p))
        end = hi if m <= 1 else (total - 1) // (m - 1)  # the last d with this m
        if groups - d + 1 > depth:
            end = min(end, groups - depth + 1)  # the last d with p = depth
        elif groups - d + 1 > 1:
            end = d  # p falls with the next d
        d = max(d, min(end, hi)) + 1
    return out


@dataclass
class SearchState(CandidatePool):
    """The search's state: the candidate pool, the generation pass with its caches, and
    the lower bounds of whole knob settings (``combos``), which order the enumeration's
    settings too."""

    memo: MilpMemo = field(default_factory=MilpMemo)
    frontiers: FrontierCache = field(default_factory=dict)
    work_memo: dict[tuple[object, ...], tuple[Rates, float]] = field(default_factory=dict)
    settings: dict[tuple[object, ...], _Setting] = field(default_factory=dict)
    ratio_memo: dict[tuple[object, ...], float] = field(default_factory=dict)

    def generate(self) -> None:
        """Runs the generation pass, a coordinate search over settings in order of their
        bound: every symmetric TP degree and micro-batch without recomputation on 1F1B;
        with selective and full recomputation (where they hold more layers); every
        recomputation, schedule and ZeRO memory setting at the best (TP degrees,
        micro-batch); then one class off the best symmetric degree at the best knobs."""
        schedules = schedule_options(self.model.layers)
        symmetric = tp_configs(self.model, self.classes)
        done: set[tuple[object, ...]] = set()
        base = [("1F1B", 1)]
        mbs = self.micro_batches
        self.explore(symmetric, mbs, ("none",), base, done)
        self.explore(symmetric, mbs, RECOMPUTE[1:], base, done)
        if not self.schedules_allowed(base):  # 1F1B ruled out: start from the interleaved
            self.explore(symmetric, mbs, RECOMPUTE, schedules[1:], done)
        leaders = sorted(self.by_origin, key=lambda o: self.by_origin[o])[:LEADERS]
        for tps, mb in leaders:
            self.explore([tps], (mb,), RECOMPUTE, base, done, MULTI_ZERO[1:])
            self.explore([tps], (mb,), RECOMPUTE, schedules[1:], done)
        if leaders:
            tps, mb = leaders[0]
            best = min(self.pool, key=lambda x: (x[0], x[1]))[2]
            if len(set(tps)) == 1:
                around = tp_configs(self.model, self.classes, around=tps[0])
                self.explore(around, (mb,), (best.recompute,),
                             [(best.schedule, best.virtual_stages)], done)  # fmt: skip

    def combo_bound_s(self, tps: tuple[int, ...], knobs: Knobs) -> float:
        """Returns a lower bound of any plan under these knobs (``band_bound_s`` over every
        number of pipelines)."""
        total = self.global_batch // knobs.micro_batch
        groups = sum(c.group_count(t) for c, t in zip(self.classes, tps, strict=True))
        return self.band_bound_s(tps, knobs, 1, max(1, min(groups, total)))

    def _work(self, tps: tuple[int, ...], knobs: Knobs) -> tuple[Rates, float]:
        """Returns every TP group's least time per layer and micro-batch, fastest first
        (``Rates``), and the least fixed time one micro-batch costs its pipeline
        (``stage_times`` with no layers: one stage holding embedding and head, or a first
        and a last stage)."""
        hit = self.work_memo.get((tps, knobs))
        if hit is not None:
            return hit
        tables = self.class_tables(tps, knobs)
        taus = sorted(tau for t in tables for tau in [per_layer_floor_s(t)] * t.groups)
        single = min(t.stage_s(0, True, True) for t in tables)
        split = min(t.stage_s(0, True, False) for t in tables) + min(
            t.stage_s(0, False, True) for t in tables
        )
        hit = self.work_memo[(tps, knobs)] = (Rates.of(taus), min(single, split))
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
        for tps in self.tps_allowed(tp_list):
            for mb in mbs:
                if self.global_batch % mb or mb not in self.micro_batches:
                    continue
                for rc in self.recompute_allowed(recompute):
                    for sched, v in self.schedules_allowed(schedules):
                        knobs = Knobs(mb, rc, 0, 1, self.precision, self.flash, sched, v,
                                      overlap_tp_comm=self.constraints.overlap_tp_comm)  # fmt: skip
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
        tables = self.class_tables(tps, knobs)
        groups = sum(t.groups for t in tables)
        templates = build_templates(tables, self.model.layers, groups, self.frontiers)
        if not templates:  # no plan to weigh: one layer's stage is no plan's need
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
        lighter = self.recompute_allowed(RECOMPUTE[: RECOMPUTE.index(knobs.recompute)])
        pairs = [(1, (0,))] + [(2, zs) for zs in zeros]
        for rc in lighter:
            other = replace(knobs, recompute=rc)
            # the same activations (flash attention leaves selective recomputation nothing
            # to drop): the same memory on every stage, so the same caps at every position
            if all(
                a.same_activations(b)
                for a, b in zip(
                    self.class_tables(tps, knobs), self.class_tables(tps, other), strict=True
                )
            ):
                return True
            same = True
            for lo, zs in pairs:
                mine = replace(knobs, zero_stage=zs[0], dp_assumed=lo, zero_choices=zs)
                theirs = replace(other, zero_stage=zs[0], dp_assumed=lo, zero_choices=zs)
                if not self._same_caps(
                    self.class_tables(tps, mine), self.class_tables(tps, theirs)
                ):
                    same = False
                    break
            if same:
                return True
        return False

    def _same_caps(self, a: list[ClassTable], b: list[ClassTable]) -> bool:
        """Returns whether the tables hold the same layers at every position of up to 32
        stages (``caps_row``), compared where the memory caps can differ
        (``cap_positions``)."""
        most = min(self.model.layers, 32)
        for x, y in zip(a, b, strict=True):
            kx, ky = x.knobs, y.knobs
            if (kx.schedule, kx.virtual_stages) != (ky.schedule, ky.virtual_stages):
                if any(x.caps_row(p) != y.caps_row(p) for p in range(1, most + 1)):
                    return False
                continue
            for j, p in cap_positions(kx.schedule, kx.virtual_stages, most):
                if x.max_layers(j, p) != y.max_layers(j, p):
                    return False
        return True

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
        when all its terms are equal: ``S / (v (1 - (1 - 1/(m v))^p))``. Density: the
        pipelines' stages number at most the groups, so some pipeline runs at least
        ``total / groups`` micro-batches per stage, and the same form with that many
        (rounded up to whole ones) holds for it at its depth, whatever it is."""
        total = self.global_batch // knobs.micro_batch
        rates, phi = self._work(tps, knobs)
        taus = rates.taus
        v = knobs.virtual_stages
        depth = min(self.model.layers // v, MAX_STAGES)
        layers = self.model.layers
        # every pipeline holds every layer: with lo or more, each reduces its gradients
        held = layers * self._reduction_ratio(tps, knobs, lo)
        whole = capacity_bound_s(rates, total * layers + lo * held, total * phi, hi * depth)
        one = math.ceil(total / hi)
        out = max(whole, capacity_bound_s(rates, (one * layers) + held, one * phi, depth))
        least = phi + layers * taus[0]

        def fill(m: int, p: int) -> float:  # the closed form: m micro-batches, p stages
            return least / (v * (1.0 - (1.0 - 1.0 / (m * v)) ** p))

        piped = min(fill(m, p) for m, p in pipeline_shapes_of(total, len(taus), depth, lo, hi))
        # some pipeline runs at least total / groups micro-batches per stage (the stages of
        # all pipelines are at most the TP groups): with p stages it runs m >= that x p
        # whole micro-batches, and the closed form grows with m
        dense = min(
            fill(max(1, math.ceil(total * p / len(taus) * (1.0 - 1e-12))), p)
            for p in range(1, depth + 1)
        )
        return max(out, max(piped, dense) * (1.0 - 1e-9))

    def _reduction_ratio(self, tps: tuple[int, ...], knobs: Knobs, members: int) -> float:
        """Returns the least, over the classes, of what a layer's gradient reduction among
        ``members`` holders costs a TP group holding it (``dp_sync.reduction_floor_s``,
        whatever the ZeRO stage: its devices reduce their shards at once) in layer-micro-
        batches of its work (``per_layer_floor_s``); 0 for one holder."""
        if members <= 1:
            return 0.0
        key = (tps, knobs, members)
        hit = self.ratio_memo.get(key)
        if hit is not None:
            return hit
        largest = max(n.gpus for n in self.cluster.nodes)
        out = math.inf
        for t in self.class_tables(tps, knobs):
            tau = per_layer_floor_s(t)
            if t.node is None or tau <= 0:
                out = 0.0
                break
            sigma = reduction_floor_s(self.model, knobs.precision, t.tp, t.node, members,
                                      largest, self.params)  # fmt: skip
            out = min(out, sigma / tau)
        out = 0.0 if not math.isfinite(out) else out
        self.ratio_memo[key] = out
        return out

    def _combo(
        self, tps: tuple[int, ...], knobs0: Knobs, zeros: tuple[tuple[int, ...], ...]
    ) -> None:
        total_micro = self.global_batch // knobs0.micro_batch
        groups = sum(c.group_count(t) for c, t in zip(self.classes, tps, strict=True))
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
                if sel is None:  # none beats the best estimate, identical replicas neither
                    continue
                same = identical_pipelines(
                    var.counts, var.fill, var.bott, avail, total_micro, (lo, hi), steps
                )
                picks = [sel]
                # offered only where its proven floor (table fills less the most they
                # exceed the replay's bound) could beat the best estimate
                if (
                    same is not None
                    and same.variants != sel.variants
                    and same.time_s - var.slack_s < self.cutoff_s
                ):
                    picks.append(same)
                for pick in picks:
                    schedules = self._open_schedules(templates, var.keys, pick, knobs)
                    if not schedules:
                        continue
                    # the two layouts differ only where a pipeline holds two stages of one
                    # class (else both place its stages in node order alike)
                    seqs = [templates[var.keys[u][0]].classes for u in pick.variants]
                    repeats = any(len(set(seq)) < len(seq) for seq in seqs)
                    for replica_major in (True, False) if repeats else (True,):
                        plan = build_plan(
                            tables, templates, var.keys, pick, knobs, self.global_batch,
                            replica_major,
                        )  # fmt: skip
                        self.offer_twins(plan, schedules)

    def _open_schedules(
        self,
        templates: list[Template],
        keys: list[tuple[int, int]],
        pick: Selection,
        knobs: Knobs,
    ) -> list[tuple[str, int]]:
        """Returns the schedules (``twin_schedules``) in which a selection's plans could
        still be estimated: those whose ``schedule_bounds`` is below the k-th best estimate
        and the ceiling. A plan whose bound reaches both is never estimated (the last drain
        stops at them too), so none is built for them."""
        limit = min(self.kth_s, self.ceiling_s) if self.prune else math.inf
        return [form for form, bound in schedule_bounds(self, templates, keys, pick, knobs)
                if bound < limit]  # fmt: skip


def schedule_bounds(
    pool: CandidatePool,
    templates: list[Template],
    keys: list[tuple[int, int]],
    pick: Selection,
    knobs: Knobs,
) -> list[tuple[tuple[str, int], float]]:
    """Returns each schedule ``pool.twin_schedules`` would queue a selection's plans in,
    with a lower bound of their estimates: over its pipelines, ``bound_fill_s`` of the split
    ``build_plan`` takes (its template's stage times) with the schedule's chunks, plus the
    bottleneck for every further micro-batch. Every placement, ZeRO stage and chunk count
    of a pipeline takes at least its template's stage times (transfers at the least the
    cluster allows; ZeRO's collectives and the chunks' transfers and overheads only add; a
    stage's first chunk holds a v-th of its layers and whole fixed costs), so this bounds
    the replay as it bounds a template's (``variants``)."""
    parts: dict[tuple[int, int], Partition] = {}
    for v, m in zip(pick.variants, pick.micro_batches, strict=True):
        i = keys[v][0]
        if (i, m) not in parts:
            parts[(i, m)] = best_on_frontier(list(templates[i].frontier), m)
    shapes = {(q.layers, m) for (_, m), q in parts.items()}
    return [
        ((name, u), max(bound_fill_s(q.stage_s, u) + (m - 1) * max(q.stage_s)
                        for (_, m), q in parts.items()))
        for name, u in pool.twin_schedules(knobs.schedule, knobs.virtual_stages, shapes)
    ]  # fmt: skip

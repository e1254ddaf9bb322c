"""Heterogeneous search: asymmetric pipelines over device classes, scored by ``estimate``.

For each set of knobs (tensor-parallel degree per class, micro-batch, recomputation),
visited in order of a throughput lower bound: build pipeline templates (stage sequences
of classes) and their exact layer splits (partition.py), choose how many pipelines of
each template and their batch shares with the MILP (grouping.py) per band of
data-parallel degrees, map stages to devices two ways, and score every result with the
one cost model. The modelled time (fill + (m-1) * bottleneck, no gradient sync or
optimizer) is a lower bound of ``estimate``'s, so a setting or band is skipped exactly
when its bound cannot beat the best plan so far: knobs by aggregate throughput, the
single-replica band by the ZeRO-1 tables (same times, more room), every other band by
one MILP at the incumbent's time. ``search_with(prune=False)`` turns the bounds off.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost.estimate import Estimate, estimate
from hetplan.cost.memory import stage_params, state_bytes
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.grouping import (
    DeviceClass,
    MilpMemo,
    Selection,
    device_classes,
    select_pipelines,
)
from hetplan.search.het_baselines import best_single_type, best_uniform
from hetplan.search.het_tables import ClassTable, FrontierCache, Knobs, Template, class_table
from hetplan.search.het_variants import (
    Variants,
    bound_fill_s,
    build_plan,
    build_templates,
    variants,
)
from hetplan.search.homogeneous import divisors
from hetplan.search.partition import best_on_frontier

Scored = tuple[Plan, Estimate]
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass
class HeteroResult:
    """The best plans found, the two baselines, and what the search saw."""

    ranked: list[tuple[Plan, Estimate]]
    baselines: dict[str, tuple[Plan, Estimate] | None]
    search_time_s: float
    notes: list[str] = field(default_factory=list)
    min_memory_bytes: float = math.inf


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


@dataclass
class _Setting:
    """Cost tables, templates and their non-dominated variants under one set of knobs."""

    tables: list[ClassTable]
    templates: list[Template]
    variants: Variants | None


@dataclass
class _State:
    """The search's running best, shared by the passes over knob combinations."""

    model: ModelSpec
    cluster: Cluster
    classes: list[DeviceClass]
    global_batch: int
    precision: str
    params: CostParams
    flash: bool
    pool: list[Scored] = field(default_factory=list)
    best_s: float = math.inf
    min_mem: float = math.inf
    best_tp: int | None = None
    best_knobs: Knobs | None = None
    fitted: set[tuple[tuple[int, ...], int]] = field(default_factory=set)
    """(TP degrees, micro-batch) pairs for which some plan fits without recomputation."""
    seen: set[str] = field(default_factory=set)
    memo: MilpMemo = field(default_factory=MilpMemo)
    frontiers: FrontierCache = field(default_factory=dict)
    tables: dict[tuple[int, int, Knobs], ClassTable] = field(default_factory=dict)
    prune: bool = True
    """Skip knobs, bands and selections whose modelled time (a lower bound) cannot win."""

    @property
    def cutoff_s(self) -> float:
        """Returns the time a setting's lower bound must beat to be explored."""
        return self.best_s if self.prune else math.inf

    def _tables(self, tps: tuple[int, ...], knobs: Knobs) -> list[ClassTable]:
        out = []
        for k, (c, t) in enumerate(zip(self.classes, tps, strict=True)):
            key = (k, t, knobs)
            if key not in self.tables:  # shared, so their memory caps are computed once
                self.tables[key] = class_table(self.model, c, t, knobs, self.params)
            out.append(self.tables[key])
        return out

    def explore(
        self, tp_list: list[tuple[int, ...]], mbs: tuple[int, ...], recompute: tuple[str, ...]
    ) -> None:
        """Visits knob combinations in order of their throughput bound, pruning by it."""
        combos = []
        for tps in tp_list:
            for mb in mbs:
                if self.global_batch % mb:
                    continue
                for rc in recompute:
                    knobs = Knobs(mb, rc, 0, 1, self.precision, self.flash)
                    rate = sum(t.groups / t.layer_s for t in self._tables(tps, knobs))
                    combos.append((self.global_batch // mb * self.model.layers / rate, tps, knobs))
        combos.sort(key=lambda c: c[0])
        for bound_s, tps, knobs in combos:
            if bound_s >= self.cutoff_s:
                break
            if self._combo(tps, knobs):
                self.fitted.add((tps, knobs.micro_batch))

    def _setting(self, tps: tuple[int, ...], knobs0: Knobs, zero: int) -> _Setting:
        """Returns the tables, templates and variants of one setting (ZeRO-1 from two
        replicas on; its memory saving is counted for two, a lower bound)."""
        knobs = replace(knobs0, zero_stage=zero, dp_assumed=2 if zero else 1)
        tables = self._tables(tps, knobs)
        groups = sum(t.groups for t in tables)
        templates = build_templates(tables, self.model.layers, groups, self.frontiers)
        if not templates:
            self.min_mem = min(self.min_mem, *(t.stage_bytes(1, 0, 1) for t in tables))
            return _Setting(tables, templates, None)
        return _Setting(tables, templates, variants(templates))

    @staticmethod
    def _bound_s(templates: list[Template], keys: list[tuple[int, int]], sel: Selection) -> float:
        """Returns a lower bound of the time of the plan built from a selection."""
        out = 0.0
        for v, m in zip(sel.variants, sel.micro_batches, strict=True):
            part = best_on_frontier(list(templates[keys[v][0]].frontier), m)
            out = max(out, bound_fill_s(part.stage_s) + (m - 1) * part.bottleneck_s)
        return out

    def _combo(self, tps: tuple[int, ...], knobs0: Knobs) -> bool:
        total_micro = self.global_batch // knobs0.micro_batch
        groups = sum(len(c.groups(t)) for c, t in zip(self.classes, tps, strict=True))
        bands = dp_bands(min(groups, total_micro))
        multi = self._setting(tps, knobs0, 1) if len(bands) > 1 else None
        any_fit = False
        for lo, hi in bands:
            if lo > 1:
                setting = multi
            else:
                # one replica runs without ZeRO; the ZeRO-1 tables have the same times and
                # more room, so every split it may use has a bottleneck no less than theirs
                var = multi.variants if multi is not None else None
                if var is not None and total_micro * np.min(var.bound[2]) >= self.cutoff_s:
                    continue
                setting = self._setting(tps, knobs0, 0)
            if setting is None or setting.variants is None:
                continue
            tables, templates = setting.tables, setting.templates
            knobs = tables[0].knobs
            var = setting.variants
            avail = np.array([t.groups for t in tables], dtype=np.int64)
            sel = select_pipelines(
                var.counts, var.fill, var.bott, avail, total_micro, (lo, hi), 2e-3,
                self.cutoff_s, self.memo, var.bound, var.slack_s,
            )  # fmt: skip
            if sel is None or self._bound_s(templates, var.keys, sel) >= self.cutoff_s:
                continue
            keys = var.keys
            for replica_major in (True, False):
                plan = build_plan(
                    tables, templates, keys, sel, knobs, self.global_batch, replica_major
                )
                sig = repr(plan.to_dict())
                if sig in self.seen:
                    continue
                self.seen.add(sig)
                est = estimate(plan, self.model, self.cluster, self.params, validate=False)
                if not est.fits:
                    self.min_mem = min(self.min_mem, max(s.memory.total for s in est.stages))
                    continue
                self.pool.append((plan, est))
                any_fit = True
                if est.iteration_time_s < self.best_s:
                    self.best_s = est.iteration_time_s
                    self.best_knobs = knobs0
                    if len(set(tps)) == 1:
                        self.best_tp = tps[0]
        return any_fit


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
) -> HeteroResult:
    """Returns what ``search_heterogeneous`` does; ``prune=False`` turns off every bound
    (to check that pruning loses nothing)."""
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
    pool: list[Scored] = [b for b in (single, uniform) if b is not None]
    best_s = min((e.iteration_time_s for _, e in pool), default=math.inf)
    total_mem = sum(c.gpu.memory_bytes * c.num_gpus for c in classes)
    floor = _state_floor_bytes(model, precision, cluster.num_gpus)
    min_mem = math.inf
    if floor > total_mem:
        notes.append(
            f"{model.name} needs at least {floor / 1e9:.1f} GB for weights, gradients and "
            f"optimizer state, but the usable GPUs hold {total_mem / 1e9:.1f} GB together"
        )
        baselines = {"single_type": single, "uniform": uniform}
        elapsed = time.perf_counter() - start
        return HeteroResult([], baselines, elapsed, notes, floor / cluster.num_gpus)
    state = _State(model, cluster, classes, global_batch, precision, params, flash_attention)
    state.pool, state.best_s, state.min_mem, state.prune = pool, best_s, min_mem, prune
    # coordinate search: symmetric TP without recomputation; recomputation where nothing
    # fitted; then one class off the best symmetric degree, at the best knobs
    symmetric = tp_configs(model, classes)
    state.explore(symmetric, MICRO_BATCHES, ("none",))
    heavy = ("full",) if flash_attention else ("selective", "full")
    for tps in symmetric:
        need = tuple(mb for mb in MICRO_BATCHES if (tps, mb) not in state.fitted)
        state.explore([tps], need, heavy)
    if state.best_tp is not None and state.best_knobs is not None:
        k = state.best_knobs
        around = tp_configs(model, classes, around=state.best_tp)
        state.explore(around, (k.micro_batch,), (k.recompute,))
    pool, min_mem = state.pool, state.min_mem
    pool.sort(key=lambda pe: pe[1].iteration_time_s)
    if not pool:
        notes.append("no plan fits in memory (try a smaller micro-batch or more GPUs)")
    return HeteroResult(
        ranked=pool[:top_k],
        baselines={"single_type": single, "uniform": uniform},
        search_time_s=time.perf_counter() - start,
        notes=notes,
        min_memory_bytes=min_mem,
    )

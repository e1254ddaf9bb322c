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
  of data-parallel degrees, next to the fastest copies of one pipeline (identical
  replicas sync stage by stage, which the MILP does not see), with memory caps of ZeRO-1,
  or of ZeRO-2/3 at the best settings; each plan then with every ZeRO stage and chunk
  count it allows (its "twins");
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

The parts: ``het_space`` (the knob space, plan identity and tie-break), ``het_pool``
(the ranked plans and the bound-ordered queue of candidates), ``het_generation`` (the
generation pass and the bounds of whole knob settings), ``het_enumeration`` (the
enumeration pass), ``het_result`` (``HeteroResult``); ``het_tables`` (class tables),
``het_templates`` (pipeline templates), ``het_bounds`` (``PlanBounds``), ``het_variants``,
``partition``, ``grouping`` and ``het_baselines`` below them. This module runs them.
"""

from __future__ import annotations

import math
import time

from hetplan.cluster import Cluster
from hetplan.cost.memory import stage_params, state_bytes
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.search.constraints import PlanConstraints, require_mixed_schedule
from hetplan.search.grouping import device_classes
from hetplan.search.het_baselines import best_single_type, best_uniform
from hetplan.search.het_bounds import PlanBounds
from hetplan.search.het_cache import SearchCache
from hetplan.search.het_enumeration import ENUMERATION_BUDGET, Enumeration, enumerate_all
from hetplan.search.het_generation import SearchState
from hetplan.search.het_result import HeteroResult
from hetplan.search.het_space import seen_key
from hetplan.search.progress import ProgressHook

__all__ = ["HeteroResult", "search_heterogeneous", "search_with"]

# the search's state and one knob setting's enumeration, under the names tests patch
_State = SearchState
_Enumeration = Enumeration


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
    constraints: PlanConstraints | None = None,
    progress: ProgressHook | None = None,
    cache: SearchCache | None = None,
    ceiling_s: float = math.inf,
    single_type: bool = True,
    every_node: bool = False,
) -> HeteroResult:
    """Returns the top-k plans on a mixed cluster, best first, with both baselines (only
    plans the constraints allow); ``progress`` is told after every estimate; ``cache``:
    work shared with other searches of the model (``het_cache``; the same answer);
    ``ceiling_s``: only plans faster than this are sought (the caller has better ones): the
    top-k of those, and none where the bounds prove that none is; ``single_type`` False:
    without the single-type baseline (a caller that plans every single-type configuration
    on its own: provisioning's mixes); ``every_node``: only plans with a device on every
    node of the cluster (a caller that plans every smaller configuration on its own)."""
    return search_with(model, cluster, global_batch, precision, top_k, params, flash_attention,
                       constraints=constraints, progress=progress, cache=cache,
                       ceiling_s=ceiling_s, single_type=single_type,
                       every_node=every_node)  # fmt: skip


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
    constraints: PlanConstraints | None = None,
    progress: ProgressHook | None = None,
    cache: SearchCache | None = None,
    ceiling_s: float = math.inf,
    single_type: bool = True,
    every_node: bool = False,
) -> HeteroResult:
    """Returns what ``search_heterogeneous`` does; ``prune=False`` turns off every bound
    (to check that pruning loses nothing); ``enumerate_budget=0`` skips the enumeration."""
    start = time.perf_counter()
    params = params or default_params()
    if cache is not None and not cache.serves(model, params):
        cache = None
    notes: list[str] = []
    classes = []
    for cls in device_classes(cluster):
        if cls.gpu.supports(precision):
            classes.append(cls)
        else:
            notes.append(f"{cls.gpu.name} has no {precision} support; its GPUs are left out")
    if not classes:
        raise InputError("--precision", f"no GPU of the cluster supports {precision}")
    constraints = constraints or PlanConstraints()
    require_mixed_schedule(constraints, "mixed clusters")
    if constraints.flash_attention is not None:
        flash_attention = constraints.flash_attention
    single = None
    if single_type:
        single, more = best_single_type(
            model, cluster, global_batch, precision, params, flash_attention, constraints, cache
        )
        notes += more
    uniform = best_uniform(model, cluster, global_batch, precision, params, flash_attention,
                           constraints, ceiling_s if prune else math.inf)  # fmt: skip
    baselines = {"single_type": single, "uniform": uniform}
    total_mem = sum(c.gpu.memory_bytes * c.num_gpus for c in classes)
    floor = _state_floor_bytes(model, precision, cluster.num_gpus)
    if floor > total_mem:
        notes.append(
            f"{model.name} needs at least {floor / 1e9:.1f} GB for weights, gradients and "
            f"optimizer state, but the usable GPUs hold {total_mem / 1e9:.1f} GB together"
        )
        elapsed = time.perf_counter() - start
        return HeteroResult([], baselines, elapsed, notes, math.inf, floor / cluster.num_gpus)
    state = SearchState(
        model, cluster, classes, global_batch, precision, params, flash_attention, top_k
    )
    state.prune = prune
    state.ceiling_s = ceiling_s
    state.spans = len(cluster.nodes) if every_node else 0
    state.constraints = constraints
    state.progress = progress
    if cache is not None:
        state.shared, state.acts, state.frontiers = cache, cache.acts, cache.frontiers
    state.bounds = PlanBounds(model, cluster, params, None if cache is None else cache.pipes)
    for b in (single, uniform):
        if b is not None:
            state.add(*b)
            state.seen.add(seen_key(b[0]))
    state.generate()
    proven = False
    if enumerate_budget > 0:
        proven = enumerate_all(state, enumerate_budget)
        if not proven:
            notes.append(
                "the space is too large to enumerate: the first plan is the best of those the "
                "pipeline-selection MILP generated, not proven the best of all"
            )
    state.drain(min(state.kth_s, ceiling_s) if prune else math.inf)
    pool = sorted(state.pool, key=lambda x: (x[0], x[1]))
    if not pool:
        notes.append("no plan fits in memory (try a smaller micro-batch or more GPUs)")
    if prune:  # the baselines join the pool whatever their time: none above the ceiling
        pool = [x for x in pool if x[3].iteration_time_s <= ceiling_s]
    return HeteroResult(
        ranked=[(plan, est) for _, _, plan, est in pool[:top_k]],
        baselines=baselines,
        search_time_s=time.perf_counter() - start,
        notes=notes,
        min_memory_bytes=state.min_mem,
        state_floor_bytes=floor / cluster.num_gpus,
        proven=proven and bool(pool),
        evaluated=state.evaluated,
    )

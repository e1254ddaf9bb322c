"""Enumeration, the heterogeneous search's second pass (where the space is small enough
for a work budget): every pipeline, layer split, selection, batch share, ZeRO stage and
placement whose proven lower bound beats the best estimate so far is estimated, knob
settings in order of their bound, selections in order of theirs. When it completes, the
first plan is the best of the whole space."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from hetplan.cost.comm import group_floor_s_per_byte, spread_floor_s_per_byte
from hetplan.cost.dp_sync import Slot, holder_floors, segment_holders
from hetplan.cost.estimate import p2p_wait_s
from hetplan.cost.memory import stage_state
from hetplan.cost.schedule import full_warmup, in_flight, interleave_fits, peak_in_flight
from hetplan.cost.sharding import deferred, dominated_by_zero1
from hetplan.plan import RECOMPUTE, Pipeline, Plan, Stage
from hetplan.search.het_bounds import (
    chunk_times,
    closed_bound_at,
    closed_terms,
    last_backward_spans,
    pipeline_bound_s,
    reduction_kind_of,
    replay_is_exact,
    stage_reduction_floors,
    tailed_bound_s,
)
from hetplan.search.het_generation import SearchState
from hetplan.search.het_pool import CandidatePool
from hetplan.search.het_space import (
    pipeline_key,
    schedule_options,
    seen_key,
    tp_options,
    zero_choices,
)
from hetplan.search.het_tables import Knobs
from hetplan.search.het_variants import count_pipelines, layer_splits, pipeline_shapes, placements

Queued = tuple[float, int, "Enumeration", tuple[tuple[int, int], ...], int, bool, bool]
"""A selection in line to be placed: its bound, its place in line, its enumeration, the
selection, its ZeRO stage, sequence parallelism, and whether its bound holds its
reductions (``Enumeration.spread_bound_s``) yet."""

ENUMERATION_BUDGET = 5_000_000
"""Work units the enumeration may spend before it gives up proving the first plan optimal
(about a microsecond each: a step of the selection search; ``PIPE_UNITS`` a pipeline,
``PLACE_UNITS`` a placement, ``ESTIMATE_UNITS`` an estimate)."""
ESTIMATE_UNITS = 300
PIPE_UNITS = 2
TIGHTEN_UNITS = 20
"""A queued selection's units per pipeline when its reductions are bounded."""
PLACE_UNITS = 100
"""A placement's units: its devices and its own reductions' bound (about 0.1 ms)."""
COMPLETE_UNITS = 2
"""A complete selection's units per pipeline and ZeRO choice (its bound and memory check)."""
ENUMERATION_SPLITS = 20_000
"""The most (shape, layer split) pipelines one knob setting may enumerate."""
LAYOUT_MEMO = 4096
"""The most placements of one selection's shape kept for the selections of that shape."""
LAYOUT_MEMO_TOTAL = 200_000
"""The most placements kept in all (past it the memo starts again)."""

LayoutMemo = dict[tuple[object, ...], list[dict[tuple[int, int], tuple[str, ...]]]]
"""Placements (``het_variants.placements``) by TP degrees, stage classes per pipeline and
which pipelines are copies of which."""


def enumerate_all(state: SearchState, budget: int = ENUMERATION_BUDGET) -> bool:
    """Estimates every plan of the space whose lower bound beats the best estimate,
    selections of pipelines in order of their bound; returns False (unproven) when the
    work passes ``budget``."""
    tp_list = state.tps_allowed(
        list(itertools.product(*(tp_options(state.model, c) for c in state.classes)))
    )
    for tps in tp_list:  # too many pipelines to list: give up before any work
        avail = [c.group_count(t) for c, t in zip(state.classes, tps, strict=True)]
        if count_pipelines(avail, state.model.layers) > ENUMERATION_SPLITS:
            return False
    combos = state.combos(tp_list, state.micro_batches, RECOMPUTE,
                          schedule_options(state.model.layers))  # fmt: skip
    work = _Budget(budget)
    queue: list[Queued] = []
    layouts: LayoutMemo = {}  # settings of the same TP degrees place alike
    for bound_s, tps, knobs in combos:
        if bound_s >= state.cutoff_s:
            break
        if not Enumeration(state, tps, knobs, work, queue, layouts).run():
            return False
    heapq.heapify(queue)
    while queue and queue[0][0] < state.cutoff_s:
        bound, n, enum, sel, z, sp, tight = heapq.heappop(queue)
        if not tight:  # its reductions wherever placed, then back in line
            if not work.spend(TIGHTEN_UNITS * len(sel)):
                return False
            bound = max(bound, enum.spread_bound_s(sel, z))
            if bound < state.cutoff_s:
                heapq.heappush(queue, (bound, n, enum, sel, z, sp, True))
            continue
        if not enum.place(bound, sel, z, sp):
            return False
    return True


VECTOR_SPLITS = 64
"""Splits of one pipeline shape from which ``build_pipes`` screens them with numpy first."""


@lru_cache(maxsize=256)
def split_table(layers: int, stages: int, unit: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Returns ``layer_splits(layers, stages, unit)`` and the same as an array (a row a
    split), kept for the searches that ask again."""
    splits = layer_splits(layers, stages, unit)
    return splits, np.array(splits, dtype=np.int64).reshape(len(splits), stages)


def held_units(gpipe: bool, interleaved: bool, v: int, warm: list[int], m: int) -> list[int]:
    """Returns ``peak_in_flight`` of every stage at ``m`` micro-batches from the stages'
    uncapped warm-up forwards ``warm`` (``Enumeration._warmups``; ``schedule.in_flight``)."""
    schedule = "GPipe" if gpipe else "Interleaved1F1B" if interleaved else "1F1B"
    return [in_flight(schedule, m, v, w) for w in warm]


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
    opts: dict[int, list[float]] = field(default_factory=dict)
    """Per optimizer shard count: each stage's optimizer step (``Enumeration.opts``)."""


class Enumeration:
    """Every plan of one knob setting (TP degrees, micro-batch, recomputation, schedule)
    whose lower bound beats the best estimate, estimated; the ZeRO and sequence-parallel
    choices and the placements are enumerated per selection of pipelines."""

    def __init__(
        self,
        state: CandidatePool,
        tps: tuple[int, ...],
        knobs: Knobs,
        work: _Budget,
        queue: list[Queued],
        layouts: LayoutMemo | None = None,
    ):
        self.s = state
        self.queue = queue
        self.layouts: LayoutMemo = {} if layouts is None else layouts
        self.tps = tps
        self.knobs = knobs
        self.work = work
        self.tables = state.class_tables(tps, knobs)
        self.total = state.global_batch // knobs.micro_batch
        self.avail = np.array([t.groups for t in self.tables], dtype=np.int64)
        self.most = int(min(self.avail.sum(), self.total))
        self.pipes: list[_Pipe] = []
        self.items: list[tuple[int, tuple[int, ...], list[tuple[int, float]]]] = []
        self._cover: list[int] = []
        """Per vector of free TP groups (its index): the most micro-batches they can run."""
        self._fit: dict[int, list[int]] = {}
        """Per vector of free TP groups (its index): the items whose pipeline fits in them."""
        self._fits: np.ndarray = np.zeros((0, 0), dtype=bool)
        self._offset: list[int] = []
        """Per item: the index its pipeline's TP groups take off a free vector's."""
        self._opt: dict[tuple[object, ...], float] = {}
        self._bound: dict[tuple[object, ...], float] = {}
        self._acts: dict[tuple[object, ...], float] = {}
        self._warm: dict[int, list[int]] = {}
        self._count_lists: dict[tuple[int, int], list[int]] = {}
        self._fit_memo: dict[tuple[int, int, int, int], bool] = {}
        self._tails: dict[tuple[object, ...], tuple[float, float]] = {}
        self._spans: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self._segs: dict[tuple[int, ...], list[tuple[float, list[Slot]]]] = {}
        self._spread: dict[tuple[int, ...], float] = {}
        self._groups: dict[tuple[str, ...], float] = {}
        """``group_floor_s_per_byte`` by its members' node names (in order)."""
        self._placed: dict[tuple[object, ...], float] = {}
        """``_placed_bound_s`` by selection, shards, reduction kind and segments' floors."""
        self._tailed: dict[tuple[object, ...], float] = {}
        """``tailed_bound_s`` of a pipeline by its micro-batches, shards, reduction kind,
        pipeline count and its stages' placed floors (placements repeat them)."""
        self._largest = max((n.gpus for n in state.cluster.nodes), default=1)

    def opt_s(
        self, k: int, layers: int, first: bool, last: bool, single: bool, shards: int
    ) -> float:
        key = (k, layers, first, last, single, shards)
        hit = self._opt.get(key)
        if hit is None:
            hit = self._opt[key] = self.tables[k].optimizer_s(layers, first, last, single, shards)
        return hit

    def opts(self, pipe: _Pipe, shards: int) -> list[float]:
        hit = pipe.opts.get(shards)
        if hit is None:
            hit = pipe.opts[shards] = self._opts(pipe, shards)
        return hit

    def _opts(self, pipe: _Pipe, shards: int) -> list[float]:
        p = len(pipe.classes)
        return [
            self.opt_s(k, x, j == 0, j == p - 1, p == 1, shards)
            for j, (k, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True))
        ]

    def step(self, pipe: _Pipe) -> int:
        """Returns the multiple of which a pipeline's micro-batch counts run in groups of
        its stages: p interleaved (other counts that run in equal groups are ``_counts``'s
        too), else 1."""
        p = len(pipe.classes)
        return p if self.knobs.virtual_stages > 1 and p > 1 else 1

    def _counts(self, p: int, step: int) -> list[int]:
        """Returns the micro-batch counts a pipeline of ``p`` stages may run, ascending:
        every one, or interleaved those PyTorch's and Megatron-Core's schedules run in
        equal groups (``interleave_fits``: the multiples of p and others)."""
        hit = self._count_lists.get((p, step))
        if hit is None:
            every = range(1, self.total + 1)
            hit = self._count_lists[(p, step)] = (
                list(every) if step == 1 else [m for m in every if interleave_fits(p, m)]
            )
        return hit

    def fits(self, pipe: _Pipe, m: int, state: list[float]) -> bool:
        """Returns whether every stage fits with ``m`` micro-batches and these state bytes,
        sequence parallelism on wherever TP > 1 (it never adds memory)."""
        k = self.knobs
        p = len(pipe.classes)
        units = [peak_in_flight(k.schedule, p, m, k.virtual_stages, j) for j in range(p)]
        return self.fits_held(pipe, units, state)

    def fits_held(self, pipe: _Pipe, units: list[int], state: list[float]) -> bool:
        """Returns whether every stage fits holding ``units[j]`` chunk-micro-batches of
        activations at its peak (``peak_in_flight``) and these state bytes."""
        p = len(pipe.classes)
        for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True)):
            t = self.tables[c]
            key = (c, x, j == 0, j == p - 1, units[j], t.tp > 1)
            acts = self._acts.get(key)
            if acts is None:
                acts = self._acts[key] = t.activation_bytes(x, *key[2:])
            if state[j] + acts + t.reserve_bytes > t.cls.gpu.memory_bytes:
                return False
        return True

    def _warmups(self, p: int) -> list[int]:
        """Returns each of ``p`` stages' warm-up forwards before the count caps them
        (``schedule.full_warmup``; GPipe's are not read)."""
        hit = self._warm.get(p)
        if hit is None:
            k = self.knobs
            hit = self._warm[p] = [full_warmup(k.schedule, p, k.virtual_stages, j)
                                   for j in range(p)]  # fmt: skip
        return hit

    def pipe_bound_s(self, i: int, m: int, shards: int) -> float:
        """Returns the replay bound of pipeline ``i`` running ``m`` micro-batches (on the
        replay ``_spans_of`` keeps for the reductions' bounds too)."""
        key = (i, m, shards)
        hit = self._bound.get(key)
        if hit is None:
            pipe = self.pipes[i]
            hit = self._bound[key] = pipeline_bound_s(
                self.knobs.schedule, m, pipe.fwd_c, pipe.bwd_c, pipe.sends,
                self.opts(pipe, shards), self._spans_of(i, m),
            )  # fmt: skip
        return hit

    def _spans_of(self, i: int, m: int) -> tuple[list[float], list[float]] | None:
        """Returns pipeline ``i``'s last backward ends and gradient-ready times at ``m``
        micro-batches in the proven replay (``het_bounds.last_backward_spans``), or None
        where ``estimate`` does not replay it exactly (the closed form)."""
        pipe = self.pipes[i]
        if not replay_is_exact(len(pipe.classes), m, self.knobs.virtual_stages):
            return None
        hit = self._spans.get((i, m))
        if hit is None:
            hit = self._spans[(i, m)] = last_backward_spans(
                self.knobs.schedule, m, pipe.fwd_c, pipe.bwd_c, pipe.sends
            )
        return hit

    def _segments(self, sel: tuple[tuple[int, int], ...]) -> list[tuple[float, list[Slot]]]:
        """Returns the selection's layer segments as ``estimate`` reduces them
        (``dp_sync.segment_holders``), each with its parameters over its holders' least TP
        degree, and its holders (position in ``sel``, stage)."""
        key = tuple(i for i, _ in sel)
        hit = self._segs.get(key)
        if hit is None:
            ranges = []
            for i, _ in sel:
                ends = list(itertools.accumulate(self.pipes[i].layers))
                ranges.append(tuple(zip([0, *ends[:-1]], ends, strict=True)))
            hit = []
            for n_params, holders in segment_holders(ranges, self.s.model):
                if len(holders) > 1 and n_params > 0:
                    tp = min(self.tables[self.pipes[sel[r][0]].classes[j]].tp for r, j in holders)
                    hit.append((n_params / tp, holders))
            self._segs[key] = hit
        return hit

    def _spread_floors(self, sel: tuple[tuple[int, int], ...]) -> dict[Slot, float]:
        """Returns, per stage of the selection, its reductions' floor per byte an all-reduce
        moves per parameter wherever the stages are placed (``dp_sync.holder_floors``): per
        segment, ``comm.spread_floor_s_per_byte`` of its holders by class (each class's
        nodes, and the TP groups a node holds)."""

        def by_class(holders: Sequence[Slot]) -> float:
            count = [0] * len(self.tables)
            for r, j in holders:
                count[self.pipes[sel[r][0]].classes[j]] += 1
            key = tuple(count)
            f = self._spread.get(key)
            if f is None:
                parts = [(t.cls.nodes[0], n, len(t.cls.nodes), t.cls.gpus_per_node // t.tp)
                         for t, n in zip(self.tables, count, strict=True)]  # fmt: skip
                f = self._spread[key] = spread_floor_s_per_byte(parts, self.s.params)
            return f

        return holder_floors(self._segments(sel), by_class)

    def _placed_bound_s(
        self,
        sel: tuple[tuple[int, int], ...],
        shards: int,
        kind: tuple[float, bool],
        layout: dict[Slot, tuple[str, ...]],
        segments: list[tuple[float, list[Slot]]],
    ) -> float:
        """Returns ``selection_bound_s`` of the selection placed so, with the reductions'
        floors of ``dp_sync.placed_reduction_floors``: per segment (``segments``: the
        selection's ``_segments``), ``comm.group_floor_s_per_byte`` of its holders' first
        devices' nodes. A stage's floor is the sum of its segments' (``holder_floors``), so
        the bound is kept by the segments' floors: placements that move holders between
        alike nodes share it."""
        node = self.s.bounds.node  # type: ignore[union-attr]
        memo = self._groups
        at = {h: node(devices[0]) for h, devices in layout.items()}
        per_byte = []
        for _, holders in segments:
            names = tuple(at[h].name for h in holders)
            f = memo.get(names)
            if f is None:
                f = memo[names] = group_floor_s_per_byte([at[h] for h in holders], self.s.params)
            per_byte.append(f)
        key = (sel, shards, kind, tuple(per_byte))
        hit = self._placed.get(key)
        if hit is None:
            of = {id(holders): f for (_, holders), f in zip(segments, per_byte, strict=True)}
            floors = holder_floors(segments, lambda holders: of[id(holders)])
            if len(self._placed) >= 65536:
                self._placed.clear()
            hit = self._placed[key] = self.selection_bound_s(sel, shards, kind, floors)
        return hit

    def spread_bound_s(self, sel: tuple[tuple[int, int], ...], z: int) -> float:
        """Returns ``selection_bound_s`` of the selection under ZeRO stage ``z`` with its
        reductions wherever it is placed (``_spread_floors``): a bound of every placement."""
        kind = self._kind(sel, z)
        floors = {} if kind is None else self._spread_floors(sel)
        return self.selection_bound_s(sel, len(sel) if z else 1, kind, floors)

    def selection_bound_s(
        self,
        sel: tuple[tuple[int, int], ...],
        shards: int,
        kind: tuple[float, bool] | None,
        floors: dict[Slot, float],
    ) -> float:
        """Returns a lower bound of ``estimate`` of the selection's plans: every pipeline's
        replay bound (``pipe_bound_s``) with each stage's once-a-step gradient reductions
        (``kind``: ``reduction_kind``'s; None: none) among the selection's pipelines, at
        ``het_bounds.stage_reduction_floors`` with ``floors`` per stage (per byte an
        all-reduce moves per parameter: ``_spread_floors`` for every placement,
        ``_placed_bound_s`` for one), as ``PlanBounds`` charges them."""
        if kind is None:
            return max(self.pipe_bound_s(i, m, shards) for i, m in sel)
        s, d = self.s, len(sel)
        out = 0.0
        memo = self._tailed
        for r, (i, m) in enumerate(sel):
            pipe = self.pipes[i]
            p = len(pipe.classes)
            placed_t = tuple(floors.get((r, j), 0.0) for j in range(p))
            pkey = (i, m, shards, kind, d, placed_t)
            hit = memo.get(pkey)
            if hit is not None:
                out = max(out, hit)
                continue
            tails = []
            for j, (c, x, placed) in enumerate(
                zip(pipe.classes, pipe.layers, placed_t, strict=True)
            ):
                tkey = (c, x, j == 0, j == p - 1, p == 1, kind, d, placed)
                tail = self._tails.get(tkey)
                if tail is None:
                    if len(self._tails) >= 65536:
                        self._tails.clear()
                    t = self.tables[c]
                    tail = self._tails[tkey] = stage_reduction_floors(
                        s.model, self.knobs.precision, t.tp, t.cls.nodes[0], x, d,
                        self._largest, s.params, kind, (j == 0, j == p - 1, p == 1), placed,
                    )  # fmt: skip
                tails.append(tail)
            b = tailed_bound_s(m, pipe.fwd_c, pipe.bwd_c, pipe.sends, self.opts(pipe, shards),
                               tails, self._spans_of(i, m))  # fmt: skip
            if len(memo) >= 65536:
                memo.clear()
            memo[pkey] = b
            out = max(out, b)
        return out

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

        def hit_of(c: int, x: int, j: int, p: int, wait: float) -> tuple[Any, ...]:
            key = (c, x, j == 0, j == p - 1, wait)
            hit = chunks.get(key)
            if hit is None:
                t = self.tables[c]
                f, b = t.stage_fb(x, j == 0, j == p - 1)
                fc, bc = chunk_times(f, b, wait, v, t.parts(j == 0, j == p - 1))
                hit = chunks[key] = (fc, bc, sum(fc), sum(bc))
            return hit

        def floor_of(c: int, x: int, j: int, p: int) -> float:
            fkey = (c, x, j == 0, j == p - 1, p == 1)
            least = floors.get(fkey)
            if least is None:
                t = self.tables[c]
                least = floors[fkey] = min(
                    sum(stage_state(s.model, x, t.tp, j == 0, j == p - 1, p == 1, k.precision,
                                    z, self.most if z else 1))
                    for z in zs
                )  # fmt: skip
            return least

        for seq in shapes:
            p = len(seq)
            counts = np.array([seq.count(c) for c in range(len(self.tables))], dtype=np.int64)
            sends = [0.0] if p == 1 else [
                self.tables[seq[j]].min_send_s(self.tables[seq[(j + 1) % p]]) for j in range(p)
            ]  # fmt: skip
            waits = [p2p_wait_s(sends, j, v, self.tables[c].p2p_exposed) for j, c in enumerate(seq)]
            m = p if v > 1 and p > 1 else 1  # the fewest micro-batches it may run
            splits, grid = split_table(layers, p, v)
            screened = len(splits) >= VECTOR_SPLITS  # many: all at once, with numpy
            keep: list[int] | range = range(len(splits))
            if screened:
                keep = self._fast_splits(seq, grid, waits, sends, m, cut, hit_of)
            for q in keep:
                split = splits[q]
                pairs = list(enumerate(zip(seq, split, strict=True)))
                hits = [hit_of(c, x, j, p, waits[j]) for j, (c, x) in pairs]
                if not screened:
                    # the closed-form bound at the fewest micro-batches, optimizer left out
                    f_acc = b_acc = low = 0.0
                    for j, hit in enumerate(hits):
                        low = max(low, f_acc + m * (hit[2] + hit[3]) + b_acc)
                        f_acc += hit[0][0] + sends[j]
                        b_acc += hit[1][0] + sends[j]
                    if low * (1.0 - 1e-9) >= cut:
                        continue
                floor = [floor_of(c, x, j, p) for j, (c, x) in pairs]
                fwd = [h[0] for h in hits]
                bwd = [h[1] for h in hits]
                self.pipes.append(_Pipe(seq, split, counts, fwd, bwd, sends, floor))
        return True

    def _fast_splits(
        self,
        seq: tuple[int, ...],
        grid: np.ndarray,
        waits: list[float],
        sends: list[float],
        m: int,
        cut: float,
        hit_of: Any,
    ) -> list[int]:
        """Returns the splits (rows of ``grid``, layers per stage) of pipeline shape ``seq``
        whose closed-form bound at ``m`` micro-batches beats ``cut``, all at once: the same
        operations as ``build_pipes``' loop over fewer splits, so the same numbers."""
        p = len(seq)
        f_acc: Any = 0.0
        b_acc: Any = 0.0
        low: Any = 0.0
        for j, c in enumerate(seq):
            xs = np.unique(grid[:, j])
            first = np.zeros(xs[-1] + 1)
            back = np.zeros(xs[-1] + 1)
            both = np.zeros(xs[-1] + 1)
            for x in xs.tolist():
                hit = hit_of(c, x, j, p, waits[j])
                first[x], back[x], both[x] = hit[0][0], hit[1][0], hit[2] + hit[3]
            col = grid[:, j]
            low = np.maximum(low, f_acc + m * both[col] + b_acc)
            f_acc = f_acc + (first[col] + sends[j])
            b_acc = b_acc + (back[col] + sends[j])
        return np.flatnonzero(low * (1.0 - 1e-9) < cut).tolist()

    def build_items(self) -> None:
        """Lists, per pipeline, the micro-batch counts at which it fits under the least
        memory of any ZeRO choice and its bound, with the least optimizer step, beats the
        cutoff (both only grow with the count)."""
        cut = self.s.cutoff_s
        k = self.knobs
        v, gpipe = k.virtual_stages, k.schedule == "GPipe"
        interleaved = k.schedule == "Interleaved1F1B" and v > 1
        least_opt: dict[tuple[int, int, bool, bool, bool], float] = {}
        held_at: dict[tuple[int, int], list[int]] = {}
        for i, pipe in enumerate(self.pipes):
            step = self.step(pipe)
            p = len(pipe.classes)
            opts = []
            for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True)):
                key = (c, x, j == 0, j == p - 1, p == 1)
                opt = least_opt.get(key)
                if opt is None:
                    opt = least_opt[key] = min(self.opt_s(*key, sh) for sh in (1, self.most))
                opts.append(opt)
            terms = closed_terms(pipe.fwd_c, pipe.bwd_c, pipe.sends, opts)  # once, not per m
            ms: list[tuple[int, float]] = []
            held: list[int] = []
            saturated = False
            warm = self._warmups(p)
            for m in self._counts(p, step):
                if m % step:
                    # interleaved in groups other than p (``interleave_group``): a longer
                    # warm-up than the multiples of p around it, asked on its own; one that
                    # does not fit says nothing of the next multiple of p, which holds less
                    units = [peak_in_flight(k.schedule, p, m, v, j) for j in range(p)]
                    if not self.fits_held(pipe, units, pipe.state_floor):
                        continue
                # memory reads the count only through each stage's micro-batches in flight
                # (``peak_in_flight``) and only grows with them along the multiples of p;
                # GPipe holds all m v, the others at most their warm-up + 1, which they
                # keep once they reach it (a count grouped otherwise holds more than the
                # multiple of p below it: past a multiple that does not fit none does)
                elif not saturated:
                    now = held_at.get((p, m))  # every pipeline of p stages holds the same
                    if now is None:
                        now = held_at[(p, m)] = held_units(gpipe, interleaved, v, warm, m)
                    if now != held:
                        if not self.fits_held(pipe, now, pipe.state_floor):
                            break  # memory only grows with more micro-batches in flight
                        held = now
                    else:
                        saturated = not gpipe
                b = closed_bound_at(m, terms)
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
        self._cover_table(avail)
        return self._dfs(0, 0, self.total, states - 1, [])

    def _cover_table(self, avail: tuple[int, ...]) -> None:
        """Tabulates, per vector of free TP groups (by its index in row-major order of the
        vectors up to ``avail``), the pipelines that fit in them and the most micro-batches
        pipelines built from them can run while each one's bound beats the cutoff (a
        knapsack: a vector's value from those of smaller vectors, which come before it)."""
        shape = [a + 1 for a in avail]
        strides = np.array([math.prod(shape[c + 1 :]) for c in range(len(shape))], np.int64)
        counts = np.array([c for _, c, _ in self.items], dtype=np.int64)
        most = np.array([ms[-1][0] for _, _, ms in self.items], dtype=np.int64)
        self._offset = (counts @ strides).tolist()
        free = np.array(list(itertools.product(*(range(n) for n in shape))), dtype=np.int64)
        fits: np.ndarray = np.all(counts[None, :, :] <= free[:, None, :], axis=2)
        cover = np.zeros(len(free), dtype=np.int64)
        offset = np.asarray(self._offset, dtype=np.int64)
        for k in range(1, len(free)):
            idx = np.flatnonzero(fits[k])
            if idx.size:
                cover[k] = (most[idx] + cover[k - offset[idx]]).max()
        self._cover = cover.tolist()
        self._fits = fits
        self._fit = {}

    def _fit_of(self, free: int) -> list[int]:
        """Returns the items whose pipeline fits in free vector ``free``, ascending."""
        hit = self._fit.get(free)
        if hit is None:
            hit = self._fit[free] = np.flatnonzero(self._fits[free]).tolist()
        return hit

    def _dfs(
        self, start: int, m0: int, left: int, free: int, chosen: list[tuple[int, int]]
    ) -> bool:
        """Extends a multiset of (pipeline, micro-batches), in canonical order, until the
        micro-batches are all placed (``free``: the index of the free TP groups' vector);
        False when the budget ran out."""
        if left == 0:
            return self._complete(chosen)
        if len(chosen) >= self.most or self._cover[free] < left:
            return True
        fit = self._fit_of(free)
        cut = self.s.cutoff_s  # it only falls: a stale one prunes less, never wrongly
        for pos in range(bisect.bisect_left(fit, start), len(fit)):
            if not self.work.spend():
                return False
            idx = fit[pos]
            i, _, ms = self.items[idx]
            rest = free - self._offset[idx]
            for m, b in ms:
                if idx == start and m < m0:
                    continue
                if m > left or b >= cut:
                    break
                if not self.work.spend():  # each extension is a step of the search
                    return False
                chosen.append((i, m))
                ok = self._dfs(idx, m, left - m, rest, chosen)
                chosen.pop()
                if not ok:
                    return False
        return True

    def _complete(self, chosen: list[tuple[int, int]]) -> bool:
        """Queues a selection of pipelines under every ZeRO choice that fits and whose
        bound beats the best estimate; sequence parallelism on wherever a stage has TP > 1
        (less forward work and memory: off is never better)."""
        s = self.s
        d = len(chosen)
        sel = tuple(chosen)
        # what is read of each pipeline depends on (pipeline, micro-batches) alone: copies once
        kinds = tuple(dict.fromkeys(sel))
        any_tp = any(self.tables[c].tp > 1 for i, _ in kinds for c in self.pipes[i].classes)
        pipelined = any(len(self.pipes[i].layers) > 1 for i, _ in kinds)
        uneven = len({m for _, m in kinds}) > 1
        zeros = s.zeros_allowed(zero_choices(d))
        for z in zeros:
            if dominated_by_zero1(z, d, pipelined, uneven, zeros):
                continue
            shards = d if z else 1
            bound = max(self.pipe_bound_s(i, m, shards) for i, m in kinds)
            if bound >= s.cutoff_s:
                continue
            if all(self._fits_at(i, m, z, d) for i, m in kinds):
                sp = s.sequence_parallel_for(any_tp)
                # its reductions are charged when it comes first in line (``spread_bound_s``)
                tight = self._kind(sel, z) is None
                self.queue.append((bound, len(self.queue), self, sel, z, sp, tight))
        # a bound and a memory check per pipeline and ZeRO choice
        return self.work.spend(COMPLETE_UNITS * d * len(zeros))

    def place(self, bound_s: float, sel: tuple[tuple[int, int], ...], z: int, sp: bool) -> bool:
        """Estimates a queued selection (whose bound ``bound_s`` holds for every placement)
        on every placement whose own bound, with its actual transfers, beats the best
        estimate; False when the budget ran out."""
        s, k = self.s, self.knobs
        assert s.bounds is not None
        seqs = [self.pipes[i].classes for i, _ in sel]
        shards = len(sel) if z else 1
        kind = self._kind(sel, z)
        segments = self._segments(sel)
        for layout in self._layouts(seqs, sel):  # copies: same (pipe, m)
            if not self.work.spend(PLACE_UNITS):
                return False
            # its own reductions first, before any plan is built
            if (
                kind is not None
                and self._placed_bound_s(sel, shards, kind, layout, segments) >= s.cutoff_s
            ):
                continue
            pipelines = []
            for r, (i, m) in enumerate(sel):
                pipe = self.pipes[i]
                stages = tuple(Stage(x, layout[(r, j)]) for j, x in enumerate(pipe.layers))
                pipelines.append(Pipeline(m * k.micro_batch, stages))
            # estimate does not depend on the order of the pipelines: one order each
            pipelines.sort(key=pipeline_key)
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
                overlap_tp_comm=k.overlap_tp_comm,
            )
            if not s.first_seen(seen_key(plan, ordered=True)):
                continue
            if not s.wanted(plan):
                continue
            if s.bounds.bound_s(plan) >= s.cutoff_s:
                continue
            if not self.work.spend(ESTIMATE_UNITS):
                return False
            s.evaluate(plan)
        return True

    def _layouts(
        self, seqs: list[tuple[int, ...]], sel: tuple[tuple[int, int], ...]
    ) -> Iterable[dict[tuple[int, int], tuple[str, ...]]]:
        """Returns ``placements`` of the selection's stages, copies being the same (pipeline,
        micro-batches): kept by TP degrees, stage classes and which pipelines are copies of
        which (all ``placements`` reads of the selection), as selections of one shape
        recur (other layer splits, micro-batch counts and knob settings)."""
        kinds = list(sel)
        copies = tuple(kinds.index(x) for x in kinds)  # each pipeline's first copy
        key = (self.tps, tuple(seqs), copies)
        memo = self.layouts
        hit = memo.get(key)
        if hit is not None:
            return hit
        found = placements(self.tables, seqs, kinds)
        head = list(itertools.islice(found, LAYOUT_MEMO + 1))
        if len(head) > LAYOUT_MEMO:  # too many to keep
            return itertools.chain(head, found)
        if sum(len(x) for x in memo.values()) + len(head) > LAYOUT_MEMO_TOTAL:
            memo.clear()
        memo[key] = head
        return head

    def _kind(self, sel: tuple[tuple[int, int], ...], z: int) -> tuple[float, bool] | None:
        """Returns ``het_bounds.reduction_kind`` of the selection's plans under ZeRO stage
        ``z`` (they overlap their reductions: the ``Plan`` default)."""
        d = len(sel)
        pipelined = any(len(self.pipes[i].layers) > 1 for i, _ in sel)
        late = z >= 2 and deferred(z, d, pipelined, len({m for _, m in sel}) > 1)
        return reduction_kind_of(z, d, self.knobs.precision, True, late)

    def _fits_at(self, i: int, m: int, z: int, d: int) -> bool:
        """Returns ``fits`` of pipeline ``i`` at ``m`` micro-batches with its state under
        ZeRO stage ``z`` among ``d`` pipelines (memoised: selections share their pipelines)."""
        key = (i, m, z, d)
        hit = self._fit_memo.get(key)
        if hit is None:
            hit = self._fit_memo[key] = self.fits(self.pipes[i], m, self._state(i, z, d))
        return hit

    def _state(self, i: int, z: int, d: int) -> list[float]:
        pipe = self.pipes[i]
        p = len(pipe.classes)
        return [
            sum(
                stage_state(
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
            )
            for j, (c, x) in enumerate(zip(pipe.classes, pipe.layers, strict=True))
        ]

"""Pipeline templates of one setting, their non-dominated variants, and the plan of a
selection of variants (stages mapped to tensor-parallel groups in node order); and, for
the exhaustive part of the search, every pipeline shape, layer split and placement."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.plan import Pipeline, Plan, Stage
from hetplan.search.grouping import Selection
from hetplan.search.het_tables import ClassTable, Knobs
from hetplan.search.het_templates import (
    FrontierCache,
    StageArrays,
    Template,
    class_orders,
    compositions,
    make_templates,
)
from hetplan.search.partition import Partition, best_on_frontier

MAX_STAGES = 32
TEMPLATE_BUDGET = 400


@dataclass
class Variants:
    """Non-dominated (template, frontier point) pairs with group counts, fill, bottleneck;
    and for every frontier point, its counts, bottleneck and a fill that bounds the
    replay from below (``bound``): a plan's pipeline may use any point of a template."""

    keys: list[tuple[int, int]]
    counts: np.ndarray
    fill: np.ndarray
    bott: np.ndarray
    bound: tuple[np.ndarray, np.ndarray, np.ndarray]
    slack_s: float
    """The most any point's fill exceeds its bound's fill."""


def bound_fill_s(stage_s: tuple[float, ...], v: int = 1) -> float:
    """Returns a fill whose ``fill + (m-1) * bottleneck`` bounds any schedule's time from
    below: the last slowest stage runs m micro-batches after every earlier stage's first
    forward chunk and before their last backward chunk (later stages may overlap it);
    ``v`` chunks per stage."""
    top = max(stage_s)
    last = len(stage_s) - 1 - stage_s[::-1].index(top)  # the last slowest
    return float(sum(stage_s[:last])) / v + top


def build_templates(
    tables: list[ClassTable],
    layers: int,
    max_pipelines: int,
    cache: FrontierCache | None = None,
) -> list[Template]:
    """Returns the pipeline templates that fit: class counts per pipeline (all of them when
    few, else near-even shares) in every tried class order, with their layer frontiers."""
    avail = [t.groups for t in tables]
    arrays = StageArrays(tables)
    seqs: dict[tuple[int, ...], None] = {}
    orders = class_orders(tables)
    most = min(MAX_STAGES, layers // arrays.unit)
    for counts in compositions(avail, most, TEMPLATE_BUDGET, max_pipelines):
        for order in orders:
            seqs[tuple(k for k in order for _ in range(counts[k]))] = None
    return [t for t in make_templates(arrays, list(seqs), layers, cache) if t is not None]


def pareto_rows(c: np.ndarray, f: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Returns the rows no other row beats on groups of every class, fill and bottleneck
    (the first of exact duplicates): a staircase per count vector, then across them."""
    vecs, gid = np.unique(c, axis=0, return_inverse=True)
    gid = gid.reshape(-1)
    order = np.lexsort((b, f, gid))
    g, bb = gid[order], b[order]
    w = g * (2.0 * float(np.ptp(bb)) + 1.0) - bb  # groups never overlap in w
    prev = np.concatenate([[-np.inf], np.maximum.accumulate(w)[:-1]])
    new_group = np.concatenate([[True], g[1:] != g[:-1]])
    idx = order[new_group | (w > prev)]  # bottleneck below all of less fill: a staircase
    gs, bs = gid[idx], b[idx]
    # a row falls to a staircase of strictly fewer groups with a point of no more fill
    # and no more bottleneck: its last point of no more fill (bottlenecks fall along it)
    fewer = np.all(vecs[:, None, :] <= vecs[None, :, :], axis=2)
    np.fill_diagonal(fewer, False)
    h, v = np.nonzero(fewer[:, gs])
    if h.size:
        rank = np.unique(f[idx], return_inverse=True)[1].reshape(-1).astype(np.int64)
        key = gs.astype(np.int64) * (int(rank.max()) + 1) + rank
        pos = np.searchsorted(key, h * (int(rank.max()) + 1) + rank[v], side="right") - 1
        hit = (pos >= 0) & (gs[np.maximum(pos, 0)] == h) & (bs[np.maximum(pos, 0)] <= bs[v])
        dead = np.zeros(idx.size, dtype=bool)
        dead[v[hit]] = True
        idx = idx[~dead]
    return np.sort(idx)


def variants(templates: list[Template], v: int = 1) -> Variants:
    """Returns the non-dominated (template, frontier point) pairs and every point's bound
    (``v`` chunks per stage)."""
    keys = [(i, j) for i, tpl in enumerate(templates) for j in range(len(tpl.frontier))]
    c = np.array([tpl.counts for tpl in templates for _ in tpl.frontier], dtype=np.int64)
    f = np.array([q.fill_s + tpl.extra_s for tpl in templates for q in tpl.frontier])
    b = np.array([q.bottleneck_s for tpl in templates for q in tpl.frontier])
    lb = np.array([bound_fill_s(q.stage_s, v) for tpl in templates for q in tpl.frontier])
    bound = (c, lb, b)
    slack = float(np.max(f - lb))
    if len(keys) > 1:  # drop variants another beats on resources, fill and bottleneck
        idx = pareto_rows(c, f, b)
        keys = [keys[i] for i in idx]
        c, f, b = c[idx], f[idx], b[idx]
    return Variants(keys, c, f, b, bound, slack)


def build_plan(
    tables: list[ClassTable],
    templates: list[Template],
    keys: list[tuple[int, int]],
    sel: Selection,
    knobs: Knobs,
    global_batch: int,
    replica_major: bool,
) -> Plan:
    """Returns the plan of a selection, mapping stages to TP groups in node order; with
    ``replica_major`` the same stage of every replica sits side by side (gradient sync
    inside nodes), otherwise each pipeline's stages do (sends inside nodes)."""
    pipes = sorted(
        zip(sel.variants, sel.micro_batches, strict=True), key=lambda x: (keys[x[0]][0], -x[1])
    )
    seqs = [templates[keys[v][0]].classes for v, _ in pipes]
    slots: list[tuple[int, int, int, int]] = []  # (class, rank within class, pipeline, stage)
    for r, seq in enumerate(seqs):
        seen: dict[int, int] = {}
        for j, k in enumerate(seq):
            q = seen.get(k, 0)
            seen[k] = q + 1
            slots.append((k, q, r, j))
    slots.sort(key=lambda s: (s[0], s[1], s[2]) if replica_major else (s[0], s[2], s[1]))
    pools = {k: iter(t.cls.groups(t.tp)) for k, t in enumerate(tables)}
    devices: dict[tuple[int, int], tuple[str, ...]] = {
        (r, j): next(pools[k]) for k, _, r, j in slots
    }
    pipelines = []
    parts: dict[tuple[int, int], Partition] = {}  # copies of one (template, m): looked up once
    for r, (v, m) in enumerate(pipes):
        i = keys[v][0]
        part = parts.get((i, m))
        if part is None:
            part = parts[(i, m)] = best_on_frontier(list(templates[i].frontier), m)
        stages = tuple(Stage(part.layers[j], devices[(r, j)]) for j in range(len(seqs[r])))
        pipelines.append(Pipeline(m * knobs.micro_batch, stages))
    sp = knobs.sequence_parallel
    return Plan(
        global_batch_size=global_batch,
        micro_batch_size=knobs.micro_batch,
        pipelines=tuple(pipelines),
        precision=knobs.precision,
        recompute=knobs.recompute,
        zero_stage=knobs.zero_stage,
        schedule=knobs.schedule,
        virtual_stages=knobs.virtual_stages,
        sequence_parallel=any(s.tp > 1 for p in pipelines for s in p.stages) if sp is None else sp,
        flash_attention=knobs.flash_attention,
        overlap_tp_comm=knobs.overlap_tp_comm,
    )


# ----------------------------------------------------------------- enumeration helpers


def pipeline_shapes(avail: list[int], max_stages: int) -> list[tuple[int, ...]]:
    """Returns every class sequence of one pipeline whose classes form contiguous blocks,
    in any class order, using at most ``avail[k]`` groups of class k and ``max_stages``
    stages."""
    k = len(avail)
    out: list[tuple[int, ...]] = []
    for size in range(1, k + 1):
        for order in itertools.permutations(range(k), size):
            ranges = [range(1, min(avail[c], max_stages) + 1) for c in order]
            for counts in itertools.product(*ranges):
                if sum(counts) <= max_stages:
                    out.append(tuple(c for c, n in zip(order, counts, strict=True)
                                     for _ in range(n)))  # fmt: skip
    return out


def count_pipelines(avail: list[int], units: int) -> int:
    """Returns how many (shape, split) pipelines ``pipeline_shapes`` and ``layer_splits``
    give for ``units`` layer units, without listing them: per ordered set of classes, the
    number of ways to give each a positive count, by total stage count, times the splits
    of that many stages."""
    k = len(avail)
    total = 0
    for size in range(1, k + 1):
        for members in itertools.combinations(range(k), size):
            ways = [1] + [0] * units  # ways[p]: counts over the members summing to p
            for c in members:
                nxt = [0] * (units + 1)
                for p, w in enumerate(ways):
                    if w:
                        for n in range(1, min(avail[c], units - p) + 1):
                            nxt[p + n] += w
                ways = nxt
            orders = math.factorial(size)
            total += orders * sum(w * math.comb(units - 1, p - 1) for p, w in enumerate(ways) if p)
    return total


def layer_splits(layers: int, stages: int, unit: int = 1) -> list[tuple[int, ...]]:
    """Returns every split of ``layers`` into ``stages`` contiguous positive parts, each a
    multiple of ``unit``."""
    if layers % unit:
        return []
    units = layers // unit
    out = []
    for cuts in itertools.combinations(range(1, units), stages - 1):
        bounds = (0, *cuts, units)
        out.append(tuple((b - a) * unit for a, b in itertools.pairwise(bounds)))
    return out


def _blocks(
    items: list[tuple[int, int]], most_blocks: int, size: int
) -> Iterator[list[list[tuple[int, int]]]]:
    """Yields every partition of ``items`` into at most ``most_blocks`` unlabelled blocks of
    at most ``size`` items (stages on interchangeable nodes)."""
    blocks: list[list[tuple[int, int]]] = []

    def rec(i: int) -> Iterator[list[list[tuple[int, int]]]]:
        if i == len(items):
            yield [list(b) for b in blocks]
            return
        for b in blocks:
            if len(b) < size:
                b.append(items[i])
                yield from rec(i + 1)
                b.pop()
        if len(blocks) < most_blocks:
            blocks.append([items[i]])
            yield from rec(i + 1)
            blocks.pop()

    yield from rec(0)


def _spread(
    blocks: list[list[tuple[int, int]]],
    alike: list[list[tuple[int, int]]],
    most_blocks: int,
    size: int,
) -> Iterator[list[list[tuple[int, int]]]]:
    """Yields every way to add the interchangeable items of ``alike`` (lists of items any
    two of which may trade places: single-stage copies of one pipeline) to the blocks of
    one partition of the other items, and to new blocks up to ``most_blocks`` in all, each
    block at most ``size`` items: how many of each list every block takes, once each (the
    copies taken in order; new blocks, which hold copies only, in non-increasing order of
    their counts, as blocks are unlabelled)."""
    kinds = len(alike)
    fixed = len(blocks)
    spare = most_blocks - fixed
    counts: list[list[int]] = [[0] * kinds for _ in range(fixed)]
    extra: list[list[int]] = []

    def emit() -> list[list[tuple[int, int]]]:
        taken = [0] * kinds
        out = []
        for b, row in zip(blocks + [[] for _ in extra], counts + extra, strict=True):
            block = list(b)
            for t, n in enumerate(row):
                block.extend(alike[t][taken[t] : taken[t] + n])
                taken[t] += n
            out.append(block)
        return out

    def rec(b: int, t: int, left: list[int], room: int) -> Iterator[list[list[tuple[int, int]]]]:
        if t == kinds:  # block b done: the next one
            yield from rec(b + 1, 0, left, -1)
            return
        if b < fixed:
            if room < 0:
                room = size - len(blocks[b])
            for n in range(min(left[t], room), -1, -1):
                counts[b][t] = n
                left[t] -= n
                yield from rec(b, t + 1, left, room - n)
                left[t] += n
            counts[b][t] = 0
            return
        if not any(left):
            yield emit()
            return
        # a new block: at most as many of each list as the one before, lexicographically
        k = b - fixed
        if k >= spare:
            return
        if t == 0:
            extra.append([0] * kinds)
            room = size
        row, prev = extra[k], extra[k - 1] if k else None
        same = prev is not None and all(row[u] == prev[u] for u in range(t))
        top = min(left[t], room)
        if same and prev is not None:
            top = min(top, prev[t])
        for n in range(top, -1, -1):
            row[t] = n
            left[t] -= n
            if t + 1 < kinds or any(row):  # an empty new block adds nothing
                yield from rec(b, t + 1, left, room - n)
            left[t] += n
        row[t] = 0
        if t == 0:
            extra.pop()

    yield from rec(0, 0, [len(a) for a in alike], -1)


def placements(
    tables: list[ClassTable],
    seqs: list[tuple[int, ...]],
    kinds: Sequence[object] | None = None,
) -> Iterator[dict[tuple[int, int], tuple[str, ...]]]:
    """Yields every placement of the pipelines' stages (``seqs[r][j]``: class of stage j of
    pipeline r) on TP groups, up to the order of a class's interchangeable nodes and of
    the groups inside a node: per (pipeline, stage), its devices. ``kinds``: per pipeline,
    what makes it what it is (equal kinds: copies); then up to the order of single-stage
    copies too (swapping two gives the same plan), each such placement once."""
    by_class: dict[int, list[tuple[int, int]]] = {}
    copies: dict[tuple[int, object], list[tuple[int, int]]] = {}
    for r, seq in enumerate(seqs):
        if kinds is not None and len(seq) == 1:
            copies.setdefault((seq[0], kinds[r]), []).append((r, 0))
            continue
        for j, c in enumerate(seq):
            by_class.setdefault(c, []).append((r, j))
    for (c, _), items in copies.items():
        if len(items) == 1:  # no copy: placed as any other stage
            by_class.setdefault(c, []).extend(items)
    keys = sorted({c for c, _ in copies} | set(by_class))
    options = []
    for c in keys:
        t = tables[c]
        per_node = t.cls.gpus_per_node // t.tp
        most = len(t.cls.nodes)
        alike = [items for (k, _), items in copies.items() if k == c and len(items) > 1]
        labelled = _blocks(by_class.get(c, []), most, per_node)
        if alike:
            options.append(
                [x for blocks in labelled for x in _spread(blocks, alike, most, per_node)]
            )
        else:
            options.append(list(labelled))
    for choice in itertools.product(*options):
        out: dict[tuple[int, int], tuple[str, ...]] = {}
        for c, parts in zip(keys, choice, strict=True):
            t = tables[c]
            for node, block in zip(t.cls.nodes, parts, strict=False):
                devs = node.devices()
                for g, slot in enumerate(block):
                    out[slot] = tuple(devs[g * t.tp : (g + 1) * t.tp])
        yield out

"""Pipeline templates of the heterogeneous search: the class orders and group counts a
pipeline may take, the per-stage arrays of a class sequence built from the class tables
(``het_tables``) and each sequence's best layer splits within per-stage memory (the
frontiers of ``partition.uniform_frontiers``, computed together for sequences of one
length and shared through a cache).

Nothing here models time on its own: per-layer and fixed times are the class tables'
differences of ``stage_times``, transfers their ``comm.p2p_s`` figures and each stage's wait
in its transfers ``estimate``'s ``p2p_wait_s``, vectorised.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hetplan.search.het_tables import ClassTable
from hetplan.search.partition import Partition, uniform_frontiers


@dataclass(frozen=True)
class Template:
    """One pipeline shape: class index per stage (in order) and its best layer splits."""

    classes: tuple[int, ...]
    counts: tuple[int, ...]
    frontier: tuple[Partition, ...]
    extra_s: float
    """Send latency added to the fill (forward and backward crossings)."""


class StageArrays:
    """Per-class arrays of a list of tables, to build stage arrays without Python loops.

    Splits are generated in units of the knobs' virtual stages (an interleaved stage
    holds a multiple of them): ``tau`` is per unit, ``caps`` in units."""

    def __init__(self, tables: list[ClassTable]) -> None:
        self.tables = tables
        self.unit = tables[0].knobs.virtual_stages if tables else 1
        u = self.unit
        self.layer_s = np.array([t.layer_s * u for t in tables])
        self.embedding_s = np.array([t.embedding_s for t in tables])
        self.head_s = np.array([t.head_s for t in tables])
        self.overhead_s = np.array([t.overhead_s for t in tables])
        self.p2p_exposed = np.array([t.p2p_exposed for t in tables])
        self.pair_in_node = np.array([t.pair_in_node for t in tables])
        n = len(tables)
        # transfers between stages of two classes: the least the cluster allows (inside a
        # node or between two), so that every split's times bound any placement's
        self.hop = np.array([[a.min_send_s(b) for b in tables] for a in tables]).reshape(n, n)
        self._caps: dict[int, np.ndarray] = {}
        self._wait_counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def caps(self, p: int) -> np.ndarray:
        """Returns the most units each class holds at each position of ``p`` stages."""
        if p not in self._caps:
            rows = [t.caps_row(p) for t in self.tables]
            self._caps[p] = np.array(rows, dtype=np.int64).reshape(len(self.tables), p) // self.unit
        return self._caps[p]

    def of(self, seq: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Returns per-stage (time per unit, fixed time, max units) and the send total."""
        tau, fixed, caps, sends = self.of_many([seq])
        return tau[0], fixed[0], caps[0], float(sends[0])

    def of_many(
        self, seqs: list[tuple[int, ...]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Returns ``of`` for sequences of one length, a row each (sends: one per row)."""
        k = np.array(seqs, dtype=np.int64)
        p = k.shape[1]
        tau = self.layer_s[k]
        fixed = self.overhead_s[k].astype(float)
        fixed[:, 0] += self.embedding_s[k[:, 0]]
        fixed[:, -1] += self.head_s[k[:, -1]]
        caps = self.caps(p)[k, np.arange(p)[None, :]]
        # stage j to j+1, the last to the first
        hop = self.hop[k, np.concatenate([k[:, 1:], k[:, :1]], axis=1)]
        if p > 1:
            # estimate.p2p_wait_s, vectorised: each chunk receives from the previous stage
            # (not the very first chunk) and sends to the next (not the very last)
            before, after = self._counts(p)
            prev = np.concatenate([hop[:, -1:], hop[:, :-1]], axis=1)
            fixed += 2.0 * self.p2p_exposed[k] * (before * prev + after * hop)
        return tau, fixed, caps, 2.0 * hop[:, : p - 1].sum(axis=1)

    def _counts(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._wait_counts.get(p)
        if hit is None:
            before = np.full(p, float(self.unit))
            before[0] -= 1
            after = np.full(p, float(self.unit))
            after[-1] -= 1
            hit = self._wait_counts[p] = (before, after)
        return hit


def stage_arrays(
    tables: list[ClassTable], seq: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Returns per-stage (time per layer unit, fixed time, max units) and the send total."""
    return StageArrays(tables).of(seq)


FrontierCache = dict[bytes, tuple[Partition, ...]]


def make_template(
    tables: list[ClassTable] | StageArrays,
    seq: tuple[int, ...],
    layers: int,
    cache: FrontierCache | None = None,
) -> Template | None:
    """Returns the template of a stage sequence, or None if the layers cannot fit; equal
    stage arrays share one frontier through ``cache``. Splits are in layers."""
    return make_templates(tables, [seq], layers, cache)[0]


def make_templates(
    tables: list[ClassTable] | StageArrays,
    seqs: list[tuple[int, ...]],
    layers: int,
    cache: FrontierCache | None = None,
) -> list[Template | None]:
    """Returns ``make_template`` of every sequence, the frontiers of sequences of one
    length computed together (``uniform_frontiers``)."""
    arrays = tables if isinstance(tables, StageArrays) else StageArrays(tables)
    u = arrays.unit
    out: list[Template | None] = [None] * len(seqs)
    if layers % u:
        return out
    units = layers // u
    cache = cache if cache is not None else {}
    tail = units.to_bytes(4, "little")
    by_len: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        by_len.setdefault(len(seq), []).append(i)
    for idx in by_len.values():
        tau, fixed, caps, sends = arrays.of_many([seqs[i] for i in idx])
        keys = [
            b"".join((tau[r].tobytes(), fixed[r].tobytes(), caps[r].tobytes(), tail))
            for r in range(len(idx))
        ]
        todo: dict[bytes, int] = {}
        for r, key in enumerate(keys):
            if key not in cache and key not in todo:
                todo[key] = r
        if todo:
            rows = np.array(list(todo.values()), dtype=np.int64)
            fronts = uniform_frontiers(tau[rows], fixed[rows], caps[rows], units)
            for key, front in zip(todo, fronts, strict=True):
                if u > 1:
                    front = [Partition(tuple(x * u for x in q.layers), q.stage_s) for q in front]
                cache[key] = tuple(front)
        for r, i in enumerate(idx):
            frontier = cache[keys[r]]
            if frontier:
                seq = seqs[i]
                counts = tuple(seq.count(k) for k in range(len(arrays.tables)))
                out[i] = Template(seq, counts, frontier, float(sends[r]))
    return out


def class_orders(tables: list[ClassTable]) -> list[tuple[int, ...]]:
    """Returns the class orders tried along a pipeline: large memory first, fast first."""
    ks = range(len(tables))
    by_mem = tuple(sorted(ks, key=lambda k: (-tables[k].cls.gpu.memory_bytes, tables[k].layer_s)))
    by_speed = tuple(sorted(ks, key=lambda k: (tables[k].layer_s, -tables[k].cls.gpu.memory_bytes)))
    out = [by_mem, by_speed]
    if len(tables) <= 3:
        out += list(itertools.permutations(ks))
    return list(dict.fromkeys(out))


def compositions(
    avail: list[int], max_stages: int, budget: int, max_share: int | None = None
) -> list[tuple[int, ...]]:
    """Returns group counts per class for one pipeline: all of them when few, else the
    near-even shares ``floor/ceil(n_k / d)`` over subsets of classes, for d up to
    ``max_share`` (the most pipelines that share one subset)."""
    k = len(avail)
    total = math.prod(min(a, max_stages) + 1 for a in avail)
    if total <= budget:
        ranges = [range(min(a, max_stages) + 1) for a in avail]
        return [c for c in itertools.product(*ranges) if 1 <= sum(c) <= max_stages]
    out: set[tuple[int, ...]] = set()
    for mask in range(1, 2**k):
        members = [i for i in range(k) if mask >> i & 1]
        most = sum(avail[i] for i in members)
        for d in range(1, min(most, max_share or most) + 1):
            options = [
                sorted({avail[i] // d, -(-avail[i] // d)}) if i in members else [0]
                for i in range(k)
            ]
            for c in itertools.product(*options):
                if 1 <= sum(c) <= max_stages:
                    out.add(c)
    return sorted(out)

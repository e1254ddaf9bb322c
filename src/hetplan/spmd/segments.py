"""Exact search by segments: cut the graph where one tensor is live, solve each distinct
segment once per entry layout, and join the segments by dynamic programming.

A *cut* is a position in the search order before which the only live tensor is the one
the previous node just produced, so the state there is that tensor in a single layout
(or nothing). Between two cuts the search state depends on nothing outside the segment,
so the least cost from an entry layout to every exit layout is a property of the segment
alone. Segments with the same *signature* (operators, shapes, rules, inputs relative to
the segment) have the same transitions and costs up to node names: transformer layers
are solved once and reused. Within a segment every reachable state is enumerated layer
by layer (each step moves from node i to i+1), which is exact without a heuristic.

Joining the segments' tables gives the least-time program of the whole space. Memory is
not part of the join; when the resulting program does not fit the devices, the caller
falls back to A* (which enforces the limit on every partial program).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from hetplan.spmd.layout import Layout
from hetplan.spmd.program import Instr
from hetplan.spmd.search import SearchResult
from hetplan.spmd.space import Space, State

Entry = frozenset[Layout] | None
"""The layouts of the single live tensor at a cut (None: no tensor is live)."""
Path = tuple[object, tuple[Instr, ...]] | None
Table = dict[Entry, tuple[float, float, float, Path]]
"""Per exit: (time, replicated bytes, sharded bytes, instruction chunks)."""


@dataclass(frozen=True)
class Segment:
    """Search positions ``start`` (inclusive) to ``stop`` (exclusive) between two cuts."""

    start: int
    stop: int
    signature: Hashable


def cuts(space: Space) -> list[int]:
    """Returns the cut positions, 0 and ``len(space.nodes)`` included, in order."""
    nodes, last_use = space.nodes, space.last_use
    out = [0]
    live: set[str] = set()
    for i, node in enumerate(nodes):
        live = {t for t in live if last_use[t] > i}
        if last_use[node.name] > i:
            live.add(node.name)
        if i + 1 < len(nodes) and live <= {node.name}:
            out.append(i + 1)
    out.append(len(nodes))
    return out


def _signature(space: Space, start: int, stop: int) -> Hashable:
    """Returns everything the segment's transitions and costs depend on, names left out."""
    sp = space
    nodes = sp.nodes
    cap, inline, sfb = sp.cap, sp.inline, sp.sfb
    pos = {nodes[j].name: j - start for j in range(start, stop)}
    entry = nodes[start - 1].name if start > 0 else None

    def tensor(name: str) -> Hashable:
        t = cap.node(name)
        return (t.op, t.shape, t.itemsize, t.requires_grad, t.is_tuple, name in sfb)

    def ref(name: str) -> Hashable:
        if name in pos:
            return ("n", pos[name])
        if name == entry:
            return ("e", tensor(name))
        if name in inline:
            return ("i", tensor(name))
        return ("x", name)

    desc = []
    for j in range(start, stop):
        node = nodes[j]
        last = sp.last_use[node.name]
        desc.append(
            (
                tensor(node.name),
                node.label(),
                node.call,
                node.spec,
                tuple(ref(t) for t in node.inputs),
                tuple(sp.rules[j]),
                last - start if last < stop else "out",
            )
        )
    return tuple(desc)


def segments(space: Space) -> list[Segment]:
    """Returns the segments between consecutive cuts with their signatures."""
    cs = cuts(space)
    return [Segment(a, b, _signature(space, a, b)) for a, b in pairwise(cs)]


def _enumerate(space: Space, seg: Segment, entry: Entry) -> tuple[Table, int]:
    """Returns the least-time path from ``entry`` to every exit of ``seg``, and the count
    of states enumerated."""
    sp = space
    nodes = sp.nodes
    start: State = () if entry is None else ((nodes[seg.start - 1].name, entry),)
    layer: dict[State, tuple[float, float, float, Path]] = {start: (0.0, 0.0, 0.0, None)}
    count = 0
    for i in range(seg.start, seg.stop):
        nxt: dict[State, tuple[float, float, float, Path]] = {}
        for state, (g, rep, shd, path) in layer.items():
            count += 1
            for step, ns in sp.successors(i, state):
                ng = g + step.cost_s
                cur = nxt.get(ns)
                if cur is None or ng < cur[0]:
                    nxt[ns] = (
                        ng,
                        rep + step.rep_bytes,
                        shd + step.shard_bytes,
                        (path, step.instrs),
                    )
        layer = nxt
    table: Table = {}
    for state, value in layer.items():
        key: Entry = state[0][1] if state else None
        table[key] = value
    return table, count


def _unwind(path: Path) -> list[Instr]:
    chunks: list[tuple[Instr, ...]] = []
    while path is not None:
        path, instrs = path  # type: ignore[assignment]
        chunks.append(instrs)
    return [x for chunk in reversed(chunks) for x in chunk]


def _renamer(space: Space, template: Segment, seg: Segment) -> dict[str, str]:
    """Returns the map from the template segment's tensor names to ``seg``'s."""
    nodes = space.nodes
    out: dict[str, str] = {}
    if template.start > 0:
        out[nodes[template.start - 1].name] = nodes[seg.start - 1].name
    for k in range(template.stop - template.start):
        a, b = nodes[template.start + k], nodes[seg.start + k]
        out[a.name] = b.name
        out.update(zip(a.inputs, b.inputs, strict=True))
    return out


def segment_search(space: Space, min_repeats: int = 2) -> SearchResult | None:
    """Returns the least-time program by segments, or None when no segment repeats
    ``min_repeats`` times, or the program does not fit the devices' memory."""
    segs = segments(space)
    counts: dict[Hashable, int] = {}
    for seg in segs:
        counts[seg.signature] = counts.get(seg.signature, 0) + 1
    if max(counts.values(), default=0) < min_repeats:
        return None
    templates: dict[Hashable, Segment] = {}
    tables: dict[tuple[Hashable, Entry], Table] = {}
    expanded = 0
    # per entry: (time, rep bytes, shard bytes, list of (segment, template, path) pieces)
    front: dict[Entry, tuple[float, float, float, Any]] = {None: (0.0, 0.0, 0.0, ())}
    for seg in segs:
        template = templates.setdefault(seg.signature, seg)
        nxt: dict[Entry, tuple[float, float, float, Any]] = {}
        for entry, (g, rep, shd, pieces) in front.items():
            key = (seg.signature, entry)
            if key not in tables:
                tables[key], n = _enumerate(space, template, entry)
                expanded += n
            for exit_, (t, r, s, path) in tables[key].items():
                ng = g + t
                cur = nxt.get(exit_)
                if cur is None or ng < cur[0]:
                    nxt[exit_] = (ng, rep + r, shd + s, (pieces, (seg, template, path)))
        front = nxt
    if not front:
        return None
    cost, rep, shd, pieces = min(front.values(), key=lambda v: v[0])
    if not space.fits(rep, shd):
        return None
    parts: list[list[Instr]] = []
    while pieces:
        pieces, (seg, template, path) = pieces
        instrs = _unwind(path)
        if seg != template:
            names = _renamer(space, template, seg)
            instrs = [dataclasses.replace(x, node=names[x.node]) for x in instrs]
        parts.append(instrs)
    instrs = [x for part in reversed(parts) for x in part]
    return SearchResult(cost, instrs, expanded, rep_bytes=rep, shard_bytes=shd)

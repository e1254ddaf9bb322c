"""A* over partial programs, with a greedy incumbent and an exhaustive reference search.

g is the time of the instructions chosen so far; h sums, over the nodes still to run,
the cheapest cost any of their rules has before input conversions (compute at the
given ratios, gradient all-reduce of a parameter that must stay replicated, ...).
Every step costs at least that, so h is admissible and consistent; it is non-zero
whenever compute remains. States reached twice are merged (duplicate detection), and
nodes whose f exceeds the incumbent's cost are pruned. Device memory is a constraint:
a state whose allocations exceed some device's capacity is dropped; with a limit, a
state is a duplicate only when dominated in both time and memory.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hetplan.spmd.program import Instr
from hetplan.spmd.space import Space, State

EPS = 1e-12


@dataclass
class SearchResult:
    """The best program found and counters of the search."""

    cost_s: float
    instrs: list[Instr]
    expanded: int = 0
    generated: int = 0
    pruned: int = 0
    rep_bytes: float = 0.0
    shard_bytes: float = 0.0
    """Per device memory: rep_bytes + ratio x shard_bytes."""
    stats: dict[str, float] = field(default_factory=dict)


def _unwind(path: Any) -> list[Instr]:
    chunks: list[tuple[Instr, ...]] = []
    while path is not None:
        path, instrs = path
        chunks.append(instrs)
    return [x for chunk in reversed(chunks) for x in chunk]


def greedy(space: Space) -> SearchResult | None:
    """Returns the program taking the cheapest step at every node, or None if stuck."""
    state: State = ()
    g = rep = shd = 0.0
    instrs: list[Instr] = []
    for i in range(len(space.nodes)):
        options = [
            s
            for s in space.steps(i, dict(state))
            if space.fits(rep + s.rep_bytes, shd + s.shard_bytes)
        ]
        if not options:
            return None
        best = min(options, key=lambda s: s.cost_s)
        g += best.cost_s
        rep, shd = rep + best.rep_bytes, shd + best.shard_bytes
        instrs += best.instrs
        state = space.advance(i, state, best)
    return SearchResult(g, instrs, rep_bytes=rep, shard_bytes=shd)


def astar(
    space: Space,
    incumbent: SearchResult | None = None,
    on_expand: Callable[[int, State, float, float], None] | None = None,
) -> SearchResult:
    """Returns an optimal program of ``space`` (raises ValueError if none fits memory).

    States are re-opened when reached again more cheaply, so the result is optimal for
    any admissible heuristic (``space.h``), consistent or not.
    """
    n_nodes = len(space.nodes)
    bound = incumbent.cost_s if incumbent is not None else math.inf
    tie = itertools.count()
    heap: list[tuple[float, int, int, float, float, float, State, object]] = [
        (space.h(0, ()), 0, next(tie), 0.0, 0.0, 0.0, (), None)
    ]
    seen: dict[tuple[int, State], list[tuple[float, float, float]]] = {}
    limit = space.capacity is not None and space.exact_memory
    expanded = generated = pruned = 0
    while heap:
        f, neg_i, _, g, rep, shd, state, path = heapq.heappop(heap)
        i = -neg_i
        if f > bound + EPS:
            pruned += 1
            break
        if i == n_nodes:
            instrs = _unwind(path)
            return SearchResult(g, instrs, expanded, generated, pruned, rep, shd)
        marks = seen.get((i, state), [])
        if any(m[0] < g - EPS and (not limit or (m[1] <= rep and m[2] <= shd)) for m in marks):
            continue
        expanded += 1
        if on_expand is not None:
            on_expand(i, state, g, f - g)
        for step in space.steps(i, dict(state)):
            ng = g + step.cost_s
            nrep, nshd = rep + step.rep_bytes, shd + step.shard_bytes
            if not space.fits(nrep, nshd):
                pruned += 1
                continue
            nstate = space.advance(i, state, step)
            nf = ng + space.h(i + 1, nstate)
            if nf > bound + EPS:
                pruned += 1
                continue
            marks = seen.setdefault((i + 1, nstate), [])
            if any(
                m[0] <= ng + EPS and (not limit or (m[1] <= nrep and m[2] <= nshd)) for m in marks
            ):
                continue
            if not limit:
                marks.clear()
            marks.append((ng, nrep, nshd))
            generated += 1
            heapq.heappush(
                heap, (nf, -(i + 1), next(tie), ng, nrep, nshd, nstate, (path, step.instrs))
            )
    if incumbent is not None:
        incumbent.expanded, incumbent.generated, incumbent.pruned = expanded, generated, pruned
        return incumbent
    raise ValueError("no program fits the devices' memory")


def search(
    space: Space, on_expand: Callable[[int, State, float, float], None] | None = None
) -> SearchResult:
    """Returns the optimal program: by segments when layers repeat, else A* (greedy bound);
    under a memory limit, if A* finds nothing that fits, A* again with states merged only
    when dominated in both time and memory.

    ``on_expand`` (called on every A* expansion) forces A*.
    """
    if on_expand is None:
        from hetplan.spmd.segments import segment_search

        res = segment_search(space)
        if res is not None:
            return res
    try:
        return astar(space, greedy(space), on_expand)
    except ValueError:
        # merging states by time alone can keep only a path that later overflows memory:
        # search again keeping every state not dominated in both time and memory
        if space.capacity is None or space.exact_memory:
            raise
        space.use_exact_memory()
        return astar(space, greedy(space), on_expand)


def exhaustive(
    space: Space, i: int = 0, state: State = (), rep: float = 0.0, shd: float = 0.0
) -> float:
    """Returns the least cost-to-go from a state by enumerating every rule choice."""
    if i == len(space.nodes):
        return 0.0
    best = math.inf
    for step in space.steps(i, dict(state)):
        nrep, nshd = rep + step.rep_bytes, shd + step.shard_bytes
        if not space.fits(nrep, nshd):
            continue
        rest = exhaustive(space, i + 1, space.advance(i, state, step), nrep, nshd)
        best = min(best, step.cost_s + rest)
    return best

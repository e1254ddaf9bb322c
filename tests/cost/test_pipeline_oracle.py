"""An independent event-driven simulation of pipeline schedules, used as an oracle for
hetplan's replay (``hetplan.cost.schedule``).

The oracle is written from first principles, not from schedule.py's sweep:

* each stage owns a list of actions ``(kind, micro-batch, chunk)`` and runs them one at a
  time, in order; chunk ``c`` of stage ``j`` is virtual stage ``k = c * p + j``;
* an action's input is a message: the forward of virtual stage ``k`` for micro-batch ``i``
  needs the activation that virtual stage ``k - 1`` produced for ``i`` (sent over link
  ``(k - 1) % p``); the backward of ``k`` needs the gradient from ``k + 1`` (sent over link
  ``k % p``); the backward of the last virtual stage needs only its own forward;
* link ``j`` joins stage ``j`` and stage ``(j + 1) % p`` and costs ``sends[j]`` either way;
  a message is delivered that long after the action producing it ends (no contention);
* a global clock walks a heap of events (an action ends, a message is delivered); each
  event lets the stage concerned start its next action if it is idle and has the input.

The orders of GPipe and 1F1B (and Interleaved1F1B) are written here independently too,
following Huang et al. 2019 (GPipe), Narayanan et al. 2021 (1F1B: ``p - rank - 1``
warm-up forwards; interleaved: micro-batches in groups of ``p``, chunk by chunk, with
``2 (p - rank - 1) + (v - 1) p`` warm-up forwards) and PyTorch's schedules of those names.
Expected values in the closed-form and hand-computed tests never come from hetplan.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import pytest

from hetplan.cost import schedule as sched
from hetplan.cost.schedule import (
    peak_in_flight,
    pipeline_replay,
    replay,
    stage_order,
    warmup_forwards,
)

REL = 1e-9
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B"]

# --------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------


def textbook_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple]:
    """Actions of stage ``rank`` as ``(kind, micro-batch, chunk)``, from the papers."""
    if schedule == "GPipe":
        # all forwards of the mini-batch, then all backwards (Huang et al. 2019)
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "Interleaved1F1B" and v > 1:
        assert m % p == 0, "interleaving runs micro-batches in groups of p"
        # forwards: group by group, chunk 0 of the group's p micro-batches, then chunk 1...;
        # backwards: the same groups, chunks last to first
        forwards = [("F", g * p + i, c) for g in range(m // p) for c in range(v) for i in range(p)]
        backwards = [
            ("B", g * p + i, c) for g in range(m // p) for c in reversed(range(v)) for i in range(p)
        ]
        warm = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
    else:
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
        warm = min(p - rank - 1, m)
    # warm-up forwards, then one forward / one backward, then cool-down backwards
    out = []
    nf = nb = 0
    while nf < warm:
        out.append(forwards[nf])
        nf += 1
    while nf < len(forwards):
        out.append(forwards[nf])
        nf += 1
        out.append(backwards[nb])
        nb += 1
    while nb < len(backwards):
        out.append(backwards[nb])
        nb += 1
    return out


@dataclass
class Sim:
    makespan: float
    last_b_start: list[float]
    last_b_end: list[float]
    busy: list[float]
    timeline: list[list[tuple[str, int, int, float, float]]]
    """Per stage, in execution order: (kind, micro-batch, chunk, start, end)."""


def simulate(
    orders: list[list[tuple]],
    m: int,
    v: int,
    fwd: list[list[float]],
    bwd: list[list[float]],
    sends: list[float],
) -> Sim:
    """Event-driven run of per-stage action lists; raises on deadlock."""
    p = len(orders)
    last_vs = p * v - 1
    delivered: set[tuple[str, int, int]] = set()  # inputs present: (kind, virtual stage, mb)
    nxt = [0] * p
    idle = [True] * p
    timeline: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(p)]
    heap: list[tuple] = []
    tie = itertools.count()

    def deliver(at: float, kind: str, vs: int, mb: int) -> None:
        heapq.heappush(heap, (at, next(tie), "deliver", (kind, vs, mb)))

    def try_start(s: int, now: float) -> None:
        if not idle[s] or nxt[s] == len(orders[s]):
            return
        kind, mb, c = orders[s][nxt[s]]
        vs = c * p + s
        if (kind, vs, mb) not in delivered:
            return
        dur = fwd[s][c] if kind == "F" else bwd[s][c]
        end = now + dur
        timeline[s].append((kind, mb, c, now, end))
        nxt[s] += 1
        idle[s] = False
        heapq.heappush(heap, (end, next(tie), "finish", (s, kind, vs, mb)))

    for mb in range(m):
        deliver(0.0, "F", 0, mb)  # the first virtual stage reads its inputs from the loader
    while heap:
        now, _, what, data = heapq.heappop(heap)
        if what == "deliver":
            delivered.add(data)
            try_start(data[1] % p, now)
            continue
        s, kind, vs, mb = data
        idle[s] = True
        if kind == "F" and vs < last_vs:
            deliver(now + sends[vs % p], "F", vs + 1, mb)
        elif kind == "F":
            deliver(now, "B", vs, mb)  # the loss is on this stage: no transfer
        elif vs > 0:
            deliver(now + sends[(vs - 1) % p], "B", vs - 1, mb)
        try_start(s, now)
    if any(nxt[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError("oracle: deadlock")
    last_b = [[e for e in tl if e[0] == "B"][-1] for tl in timeline]
    return Sim(
        makespan=max(tl[-1][4] for tl in timeline),
        last_b_start=[e[3] for e in last_b],
        last_b_end=[e[4] for e in last_b],
        busy=[sum(e[4] - e[3] for e in tl) for tl in timeline],
        timeline=timeline,
    )


def oracle(schedule, m, v, fwd, bwd, sends, orders_from_hetplan=False) -> Sim:
    p = len(fwd)
    order = stage_order if orders_from_hetplan else textbook_order
    return simulate([order(schedule, p, m, v, j) for j in range(p)], m, v, fwd, bwd, sends)


def held_peak(sim_stage: list[tuple[str, int, int, float, float]]) -> int:
    """Most (micro-batch, chunk) pairs whose forward has started and whose backward has not
    finished at any instant, from the simulated timeline of one stage."""
    marks = []
    for kind, mb, c, start, end in sim_stage:
        if kind == "F":
            marks.append((start, 1, (mb, c)))
        else:
            marks.append((end, 0, (mb, c)))  # at equal times a release comes first
    held = peak = 0
    for _, up, _ in sorted(marks, key=lambda x: (x[0], x[1])):
        held += 1 if up else -1
        peak = max(peak, held)
    assert held == 0
    return peak


# --------------------------------------------------------------------------------------
# the oracle checks itself: orders are valid and the textbook orders equal hetplan's
# --------------------------------------------------------------------------------------

ORDER_CASES = [
    (sch, p, m, v)
    for p in range(1, 7)
    for m in range(1, 15)
    for sch, v in [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 1)]
    + [("Interleaved1F1B", v) for v in (2, 3, 4) if m % p == 0]
]


@pytest.mark.parametrize("schedule,p,m,v", ORDER_CASES)
def test_textbook_order_equals_stage_order(schedule, p, m, v):
    for rank in range(p):
        mine = textbook_order(schedule, p, m, v, rank)
        assert stage_order(schedule, p, m, v, rank) == mine
        # each (micro-batch, chunk) runs forward once and backward once
        pairs = {(i, c) for i in range(m) for c in range(v if v > 1 else 1)}
        assert sorted((i, c) for k, i, c in mine if k == "F") == sorted(pairs)
        assert sorted((i, c) for k, i, c in mine if k == "B") == sorted(pairs)
        # warm-up forwards as Megatron/PyTorch count them: the forwards before the first
        # one-forward-one-backward pair (all of them when there is no such pair)
        first_b = next(n for n, a in enumerate(mine) if a[0] == "B")
        warm = warmup_forwards(schedule, p, m, v, rank)
        assert min(warm + 1, len(mine) // 2) == first_b


# --------------------------------------------------------------------------------------
# 1. uniform stages, free transfers: textbook closed forms
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(
    "p,m", [(2, 2), (2, 4), (3, 3), (3, 6), (3, 7), (4, 4), (4, 8), (4, 5), (5, 2), (6, 1)]
)
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)])
def test_uniform_closed_form(schedule, p, m, f, b):
    """(m + p - 1)(f + b); the bubble is (p - 1)/m of the ideal m (f + b)."""
    fwd, bwd, sends = [[f]] * p, [[b]] * p, [0.0] * p
    expect = (m + p - 1) * (f + b)
    sim = oracle(schedule, m, 1, fwd, bwd, sends)
    assert sim.makespan == pytest.approx(expect, rel=REL)
    for got in (
        replay(schedule, m, 1, fwd, bwd, sends),
        pipeline_replay(schedule, m, 1, fwd, bwd, sends),
    ):
        assert got.makespan_s == pytest.approx(expect, rel=REL)
        bubble = got.makespan_s - m * (f + b)
        assert bubble / (m * (f + b)) == pytest.approx((p - 1) / m, rel=REL)
        assert got.busy_s == pytest.approx([m * (f + b)] * p, rel=REL)
        # stage j's last backward ends j * b before stage 0's (the gradient walks back)
        assert got.last_backward_end_s == pytest.approx([expect - j * b for j in range(p)], rel=REL)


@pytest.mark.parametrize(
    "p,m,v",
    [
        (2, 2, 2),
        (2, 4, 2),
        (2, 6, 3),
        (3, 3, 2),
        (3, 6, 2),
        (3, 9, 3),
        (4, 4, 2),
        (4, 8, 2),
        (4, 8, 4),
        (4, 12, 3),
        (5, 10, 2),
    ],
)
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_uniform_interleaved_closed_form(p, m, v, f, b):
    """Narayanan et al. 2021: chunks of f/v and b/v give m (f + b) + (p - 1)(f + b)/v, a
    bubble of (p - 1)/(v m) of the ideal."""
    fwd, bwd, sends = [[f / v] * v] * p, [[b / v] * v] * p, [0.0] * p
    expect = m * (f + b) + (p - 1) * (f + b) / v
    sim = oracle("Interleaved1F1B", m, v, fwd, bwd, sends)
    assert sim.makespan == pytest.approx(expect, rel=REL)
    for fn in (replay, pipeline_replay):
        got = fn("Interleaved1F1B", m, v, fwd, bwd, sends)
        assert got.makespan_s == pytest.approx(expect, rel=REL)
        bubble = got.makespan_s - m * (f + b)
        assert bubble / (m * (f + b)) == pytest.approx((p - 1) / (v * m), rel=REL)
        assert got.busy_s == pytest.approx([m * (f + b)] * p, rel=REL)


# --------------------------------------------------------------------------------------
# 2. tiny cases by hand
# --------------------------------------------------------------------------------------

# p = 2, m = 2; stage 0: f = 1, b = 2; stage 1: f = 3, b = 4; link 0 (0 <-> 1) = 0.5
# (link 1, the wrap, is never used without interleaving).
HAND_1F1B = [
    # stage 0 (1 warm-up forward): F0 F1 B0 B1
    [
        ("F", 0, 0, 0.0, 1.0),
        ("F", 1, 0, 1.0, 2.0),
        ("B", 0, 0, 9.0, 11.0),  # stage 1's B0 ends 8.5, + 0.5 send
        ("B", 1, 0, 16.0, 18.0),  # stage 1's B1 ends 15.5, + 0.5
    ],
    # stage 1 (no warm-up): F0 B0 F1 B1
    [
        ("F", 0, 0, 1.5, 4.5),  # stage 0's F0 ends 1, + 0.5
        ("B", 0, 0, 4.5, 8.5),  # own F0
        ("F", 1, 0, 8.5, 11.5),  # input since 2.5, but busy with B0 until 8.5
        ("B", 1, 0, 11.5, 15.5),
    ],
]
HAND_GPIPE = [
    # stage 0: F0 F1 B0 B1
    [
        ("F", 0, 0, 0.0, 1.0),
        ("F", 1, 0, 1.0, 2.0),
        ("B", 0, 0, 12.0, 14.0),  # stage 1's B0 ends 11.5, + 0.5
        ("B", 1, 0, 16.0, 18.0),  # stage 1's B1 ends 15.5, + 0.5
    ],
    # stage 1: F0 F1 B0 B1
    [
        ("F", 0, 0, 1.5, 4.5),
        ("F", 1, 0, 4.5, 7.5),  # input since 2.5, busy until 4.5
        ("B", 0, 0, 7.5, 11.5),
        ("B", 1, 0, 11.5, 15.5),
    ],
]


def _events_by_stage(rep, p):
    out = [[] for _ in range(p)]
    for s, kind, mb, c, t0, t1 in rep.events:
        out[s].append((kind, mb, c, t0, t1))
    return [sorted(x, key=lambda e: e[3]) for x in out]


@pytest.mark.parametrize("schedule,timeline", [("1F1B", HAND_1F1B), ("GPipe", HAND_GPIPE)])
def test_hand_two_stages(schedule, timeline):
    fwd, bwd, sends = [[1.0], [3.0]], [[2.0], [4.0]], [0.5, 0.75]
    sim = oracle(schedule, 2, 1, fwd, bwd, sends)
    assert sim.timeline == timeline
    rep = replay(schedule, 2, 1, fwd, bwd, sends, record=True)
    assert _events_by_stage(rep, 2) == timeline
    for got in (rep, pipeline_replay(schedule, 2, 1, fwd, bwd, sends)):
        assert got.makespan_s == pytest.approx(18.0, rel=REL)
        assert got.last_backward_start_s == pytest.approx([16.0, 11.5], rel=REL)
        assert got.last_backward_end_s == pytest.approx([18.0, 15.5], rel=REL)
        assert got.busy_s == pytest.approx([6.0, 14.0], rel=REL)


# p = 2, m = 2, v = 2. Virtual stages: 0 = (stage 0, chunk 0), 1 = (stage 1, chunk 0),
# 2 = (stage 0, chunk 1), 3 = (stage 1, chunk 1). Stage 0: f = (1, 2), b = (2, 3) per chunk;
# stage 1: f = (1.5, 1), b = (2.5, 2). Link 0 (0 <-> 1) = 0.5, link 1 (1 -> 0 wrap) = 0.25.
# Warm-up: stage 0 min(2 + 2, 4) = 4 (all forwards), stage 1 min(0 + 2, 4) = 2.
HAND_INTERLEAVED = [
    [
        ("F", 0, 0, 0.0, 1.0),
        ("F", 1, 0, 1.0, 2.0),
        ("F", 0, 1, 3.25, 5.25),  # vs1 F0 ends 3, + 0.25 over the wrap link
        ("F", 1, 1, 5.25, 7.25),  # vs1 F1 ends 4.5, + 0.25 = 4.75; busy until 5.25
        ("B", 0, 1, 9.25, 12.25),  # vs3 B0 ends 8.75, + 0.5
        ("B", 1, 1, 12.25, 15.25),  # vs3 B1 ends 11.75, + 0.5 = 12.25
        ("B", 0, 0, 15.5, 17.5),  # vs1 B0 ends 15, + 0.5
        ("B", 1, 0, 18.5, 20.5),  # vs1 B1 ends 18, + 0.5
    ],
    [
        ("F", 0, 0, 1.5, 3.0),  # vs0 F0 ends 1, + 0.5
        ("F", 1, 0, 3.0, 4.5),  # input since 2.5, busy until 3
        ("F", 0, 1, 5.75, 6.75),  # vs2 F0 ends 5.25, + 0.5
        ("B", 0, 1, 6.75, 8.75),  # last virtual stage: own forward
        ("F", 1, 1, 8.75, 9.75),  # vs2 F1 ends 7.25, + 0.5 = 7.75; busy until 8.75
        ("B", 1, 1, 9.75, 11.75),
        ("B", 0, 0, 12.5, 15.0),  # vs2 B0 ends 12.25, + 0.25
        ("B", 1, 0, 15.5, 18.0),  # vs2 B1 ends 15.25, + 0.25
    ],
]


def test_hand_two_stages_interleaved():
    fwd, bwd, sends = [[1.0, 2.0], [1.5, 1.0]], [[2.0, 3.0], [2.5, 2.0]], [0.5, 0.25]
    sim = oracle("Interleaved1F1B", 2, 2, fwd, bwd, sends)
    assert sim.timeline == HAND_INTERLEAVED
    rep = replay("Interleaved1F1B", 2, 2, fwd, bwd, sends, record=True)
    assert _events_by_stage(rep, 2) == HAND_INTERLEAVED
    for got in (rep, pipeline_replay("Interleaved1F1B", 2, 2, fwd, bwd, sends)):
        assert got.makespan_s == pytest.approx(20.5, rel=REL)
        assert got.last_backward_start_s == pytest.approx([18.5, 15.5], rel=REL)
        assert got.last_backward_end_s == pytest.approx([20.5, 18.0], rel=REL)
        assert got.busy_s == pytest.approx([16.0, 14.0], rel=REL)


def test_single_stage_runs_back_to_back():
    """p = 1: m (f + b), whatever the schedule (pipeline_replay's shortcut included)."""
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        for m in (1, 2, 5):
            sim = oracle(schedule, m, 1, [[0.7]], [[1.9]], [0.3])
            assert sim.makespan == pytest.approx(m * 2.6, rel=REL)
            for fn in (replay, pipeline_replay):
                got = fn(schedule, m, 1, [[0.7]], [[1.9]], [0.3])
                assert got.makespan_s == pytest.approx(m * 2.6, rel=REL)
                assert got.last_backward_start_s == pytest.approx([m * 2.6 - 1.9], rel=REL)
                assert got.last_backward_end_s == pytest.approx([m * 2.6], rel=REL)
                assert got.busy_s == pytest.approx([m * 2.6], rel=REL)


# --------------------------------------------------------------------------------------
# 3. random heterogeneous cases: hetplan == oracle, event by event
# --------------------------------------------------------------------------------------


def _random_case(seed: int, schedule: str):
    rng = random.Random(1000 * seed + SCHEDULES.index(schedule))
    p = rng.randint(1 if seed % 10 == 0 else 2, 5)
    if schedule == "Interleaved1F1B":
        v = rng.randint(1, 3)
        m = p * rng.randint(1, 12 // p)
    else:
        v = 1
        m = rng.randint(1, 12)

    def t() -> float:
        # mostly moderate, sometimes tiny or large, to stress waiting in both directions
        return rng.choice([rng.uniform(0.1, 5.0), rng.uniform(0.01, 0.1), rng.uniform(5, 40)])

    fwd = [[t() for _ in range(v)] for _ in range(p)]
    bwd = [[t() for _ in range(v)] for _ in range(p)]
    sends = [rng.choice([0.0, rng.uniform(0.0, 1.0), rng.uniform(1.0, 20.0)]) for _ in range(p)]
    return p, m, v, fwd, bwd, sends


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(60))
def test_random_heterogeneous_matches_oracle(schedule, seed):
    p, m, v, fwd, bwd, sends = _random_case(seed, schedule)
    sim = oracle(schedule, m, v, fwd, bwd, sends)
    # the oracle on hetplan's own order must give the very same timeline
    assert (
        oracle(schedule, m, v, fwd, bwd, sends, orders_from_hetplan=True).timeline == sim.timeline
    )
    rep = replay(schedule, m, v, fwd, bwd, sends, record=True)
    got_tl = _events_by_stage(rep, p)
    for s in range(p):
        assert [e[:3] for e in got_tl[s]] == [e[:3] for e in sim.timeline[s]]
        got_t = [t for e in got_tl[s] for t in e[3:]]
        assert got_t == pytest.approx([t for e in sim.timeline[s] for t in e[3:]], rel=REL)
    for got in (rep, pipeline_replay(schedule, m, v, fwd, bwd, sends)):
        assert got.makespan_s == pytest.approx(sim.makespan, rel=REL)
        assert got.busy_s == pytest.approx(sim.busy, rel=REL)
        assert got.last_backward_start_s == pytest.approx(sim.last_b_start, rel=REL)
        assert got.last_backward_end_s == pytest.approx(sim.last_b_end, rel=REL)


# --------------------------------------------------------------------------------------
# 4. activations held: peak_in_flight against the simulated timeline
# --------------------------------------------------------------------------------------

PEAK_CASES = [
    (sch, p, m, v)
    for p in range(1, 6)
    for m in range(1, 13)
    for sch, v in [("GPipe", 1), ("1F1B", 1)]
    + [("Interleaved1F1B", v) for v in (1, 2, 3) if m % p == 0]
]


@pytest.mark.parametrize("schedule,p,m,v", PEAK_CASES)
def test_peak_in_flight_matches_simulated_timeline(schedule, p, m, v):
    rng = random.Random(p * 1000 + m * 10 + v)
    fwd = [[rng.uniform(0.1, 3.0) for _ in range(v)] for _ in range(p)]
    bwd = [[rng.uniform(0.1, 3.0) for _ in range(v)] for _ in range(p)]
    sends = [rng.uniform(0.0, 1.0) for _ in range(p)]
    sim = oracle(schedule, m, v, fwd, bwd, sends)
    for rank in range(p):
        peak = held_peak(sim.timeline[rank])
        assert peak_in_flight(schedule, p, m, v, rank) == peak
        # and the textbook numbers: GPipe holds all m, 1F1B min(p - rank, m)
        if schedule == "GPipe":
            assert peak == m
        elif v == 1:
            assert peak == min(p - rank, m)


# --------------------------------------------------------------------------------------
# extrapolated long runs: pipeline_replay against the exact oracle, within its 1 %
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(3))
def test_extrapolated_long_run_close_to_oracle(schedule, seed, monkeypatch):
    rng = random.Random(seed + 77)
    p = rng.randint(2, 4)
    v = 2 if schedule == "Interleaved1F1B" else 1
    m = p * rng.randint(40, 60) + (0 if v > 1 else rng.randint(0, p - 1))
    fwd = [[rng.uniform(0.5, 3.0) for _ in range(v)] for _ in range(p)]
    bwd = [[rng.uniform(0.5, 5.0) for _ in range(v)] for _ in range(p)]
    sends = [rng.uniform(0.0, 0.5) for _ in range(p)]
    monkeypatch.setattr(sched, "EXACT_ACTION_LIMIT", 2 * p * v * 30 * p)
    fast = pipeline_replay(schedule, m, v, fwd, bwd, sends)
    exact = oracle(schedule, m, v, fwd, bwd, sends)
    assert fast.makespan_s == pytest.approx(exact.makespan, rel=0.01)
    assert fast.busy_s == pytest.approx(exact.busy, rel=0.01)


# --------------------------------------------------------------------------------------
# uneven chunks: per-chunk layer counts (issue 14 item 5)
# --------------------------------------------------------------------------------------


def held_mix_peak(sim_stage, chunks, w_layer: float, w_embed: float) -> float:
    """Most activation weight held at any instant of a simulated stage: each held
    (micro-batch, chunk) weighs ``chunks[c] * w_layer``, plus ``w_embed`` for chunk 0."""
    marks = []
    for kind, _mb, c, start, end in sim_stage:
        w = chunks[c] * w_layer + (w_embed if c == 0 else 0.0)
        marks.append((start, 1, w) if kind == "F" else (end, 0, -w))
    held = peak = 0.0
    for _, _, w in sorted(marks, key=lambda x: (x[0], x[1])):
        held += w
        peak = max(peak, held)
    return peak


UNEVEN_CASES = [(p, m, v) for p in range(2, 5) for m in (p, 2 * p, 3 * p) for v in (2, 3, 4)]


@pytest.mark.parametrize("p,m,v", UNEVEN_CASES)
def test_uneven_chunks_replay_and_held_layers_match_the_oracle(p, m, v):
    """Chunks of 0 to 4 layers at a per-layer cost plus a fixed cost per chunk, as the
    estimate splits a stage: the replay equals the event-by-event simulation, and the
    held (layers, chunk-0) pairs give the simulated peak for any weights."""
    rng = random.Random(7 * p + 31 * m + v)
    chunks = [tuple(rng.randint(0, 4) for _ in range(v)) for _ in range(p)]
    per_f = [rng.uniform(0.5, 2.0) for _ in range(p)]
    fwd = [[0.1 + n * per_f[s] for n in chunks[s]] for s in range(p)]
    bwd = [[0.2 + 2 * n * per_f[s] for n in chunks[s]] for s in range(p)]
    sends = [rng.uniform(0.0, 0.5) for _ in range(p)]
    sim = oracle("Interleaved1F1B", m, v, fwd, bwd, sends)
    got = replay("Interleaved1F1B", m, v, fwd, bwd, sends)
    assert got.makespan_s == pytest.approx(sim.makespan, rel=REL)
    assert got.busy_s == pytest.approx(sim.busy, rel=REL)
    for rank in range(p):
        held = sched.held_layers("Interleaved1F1B", p, m, rank, chunks[rank])
        for w_layer, w_embed in ((1.0, 0.0), (1.0, 3.5), (0.2, 1.0)):
            want = held_mix_peak(sim.timeline[rank], chunks[rank], w_layer, w_embed)
            assert max(a * w_layer + b * w_embed for a, b in held) == pytest.approx(want)

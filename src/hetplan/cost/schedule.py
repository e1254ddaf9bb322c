"""Pipeline schedules: each stage's action order, and a replay of it with per-stage times.

Action orders follow PyTorch's schedule names: GPipe (all forwards, then all backwards),
1F1B (warm-up forwards, one-forward-one-backward, cool-down) and Interleaved1F1B
(Narayanan et al. 2021: ``v`` model chunks per stage, micro-batches in groups of ``p``).
Heterogeneous stages are simulated with their own times, never averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Action = tuple[str, int, int]
"""('F' or 'B', micro-batch, chunk)."""


def warmup_forwards(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Returns how many forwards stage ``rank`` runs before its first backward."""
    if schedule == "GPipe":
        return m * v
    if schedule == "Interleaved1F1B" and v > 1:
        return min((p - rank - 1) * 2 + (v - 1) * p, m * v)
    return min(p - rank - 1, m)


def peak_in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Returns the most chunk-micro-batches whose activations stage ``rank`` holds at once."""
    if schedule == "GPipe":
        return m * v
    return min(warmup_forwards(schedule, p, m, v, rank) + 1, m * v)


def stage_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[Action]:
    """Returns the actions of stage ``rank`` in execution order."""
    if schedule == "GPipe" or (schedule != "Interleaved1F1B" or v == 1):
        fwd = [("F", i, 0) for i in range(m)]
        bwd = [("B", i, 0) for i in range(m)]
        if schedule == "GPipe":
            return fwd + bwd
        w = warmup_forwards(schedule, p, m, 1, rank)
        out: list[Action] = fwd[:w]
        for i in range(m - w):
            out += [fwd[w + i], bwd[i]]
        return out + bwd[m - w :]
    total = m * v

    def f_action(k: int) -> Action:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def b_action(k: int) -> Action:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    w = warmup_forwards(schedule, p, m, v, rank)
    out = [f_action(k) for k in range(w)]
    for i in range(total - w):
        out += [f_action(w + i), b_action(i)]
    return out + [b_action(k) for k in range(total - w, total)]


@dataclass
class Replay:
    """The outcome of replaying one pipeline's schedule."""

    makespan_s: float
    last_backward_start_s: list[float]
    """Per stage: when its last backward began."""
    last_backward_end_s: list[float]
    busy_s: list[float]
    """Per stage: time spent computing."""
    events: list[tuple[int, str, int, int, float, float]] = field(default_factory=list)
    """(stage, kind, micro-batch, chunk, start, end) when recorded."""


def replay(
    schedule: str,
    m: int,
    v: int,
    fwd_s: list[list[float]],
    bwd_s: list[list[float]],
    send_s: list[float],
    record: bool = False,
) -> Replay:
    """Replays the schedule of ``len(fwd_s)`` stages on ``m`` micro-batches.

    ``fwd_s[s][c]``/``bwd_s[s][c]``: time of chunk ``c`` of stage ``s`` for one micro-batch.
    ``send_s[s]``: transfer time from stage ``s`` to stage ``(s + 1) % p`` (either way).
    """
    p = len(fwd_s)
    nv = p * v
    done_f = [[math.nan] * m for _ in range(nv)]
    done_b = [[math.nan] * m for _ in range(nv)]
    orders = [stage_order(schedule, p, m, v, r) for r in range(p)]
    ptr = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    last_b_start = [0.0] * p
    last_b_end = [0.0] * p
    events: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            order = orders[s]
            while ptr[s] < len(order):
                kind, mb, c = order[ptr[s]]
                vs = c * p + s
                if kind == "F":
                    if vs == 0:
                        ready = 0.0
                    else:
                        dep = done_f[vs - 1][mb]
                        if dep != dep:  # not done yet
                            break
                        ready = dep + send_s[(vs - 1) % p]
                    dur = fwd_s[s][c]
                else:
                    if vs == nv - 1:
                        dep = done_f[vs][mb]
                        if dep != dep:
                            break
                        ready = dep
                    else:
                        dep = done_b[vs + 1][mb]
                        if dep != dep:
                            break
                        ready = dep + send_s[vs % p]
                    dur = bwd_s[s][c]
                start = max(clock[s], ready)
                end = start + dur
                clock[s] = end
                busy[s] += dur
                if kind == "F":
                    done_f[vs][mb] = end
                else:
                    done_b[vs][mb] = end
                    last_b_start[s], last_b_end[s] = start, end
                if record:
                    events.append((s, kind, mb, c, start, end))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked (p={p}, m={m}, v={v})")
    return Replay(max(clock), last_b_start, last_b_end, busy, events)


EXACT_ACTION_LIMIT = 60_000


def pipeline_replay(
    schedule: str,
    m: int,
    v: int,
    fwd_s: list[list[float]],
    bwd_s: list[list[float]],
    send_s: list[float],
) -> Replay:
    """Returns the replay for ``m`` micro-batches, extrapolated for very long runs.

    The makespan of a schedule is a convex, piecewise-linear function of ``m`` that ends in
    a periodic regime; runs of more than EXACT_ACTION_LIMIT actions are replayed up to the
    limit and continued at the slope of the last group of ``p`` micro-batches.
    """
    p = len(fwd_s)
    if 2 * p * m * v <= EXACT_ACTION_LIMIT or m <= 3 * p:
        return replay(schedule, m, v, fwd_s, bwd_s, send_s)
    m1 = max(3 * p, (EXACT_ACTION_LIMIT // (2 * p * v)) // p * p)
    if schedule != "Interleaved1F1B":
        m1 -= (m1 - m) % p
    r0 = replay(schedule, m1 - p, v, fwd_s, bwd_s, send_s)
    r1 = replay(schedule, m1, v, fwd_s, bwd_s, send_s)
    k = (m - m1) / p

    def ext(a: float, b: float) -> float:
        return b + (b - a) * k

    return Replay(
        ext(r0.makespan_s, r1.makespan_s),
        [
            ext(a, b)
            for a, b in zip(r0.last_backward_start_s, r1.last_backward_start_s, strict=True)
        ],
        [ext(a, b) for a, b in zip(r0.last_backward_end_s, r1.last_backward_end_s, strict=True)],
        [ext(a, b) for a, b in zip(r0.busy_s, r1.busy_s, strict=True)],
    )

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost.schedule import peak_in_flight, pipeline_replay, replay, stage_order


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_equal_stages_makespan(schedule):
    """Identical stages, free transfers: (m + p - 1) * (f + b)."""
    p, m, f, b = 4, 8, 1.0, 2.0
    rep = replay(schedule, m, 1, [[f]] * p, [[b]] * p, [0.0] * p)
    assert rep.makespan_s == pytest.approx((m + p - 1) * (f + b))


def test_interleaving_shrinks_the_bubble():
    p, m, v = 4, 8, 2
    plain = replay("1F1B", m, 1, [[1.0]] * p, [[2.0]] * p, [0.0] * p)
    inter = replay("Interleaved1F1B", m, v, [[0.5] * v] * p, [[1.0] * v] * p, [0.0] * p)
    ideal = m * 3.0
    assert inter.makespan_s < plain.makespan_s
    # Narayanan et al. 2021: bubble (p - 1)(f + b) / v
    assert inter.makespan_s == pytest.approx(ideal + (p - 1) * 3.0 / v)


def test_heterogeneous_stages_are_simulated():
    """A slow middle stage is busy from the first stage's first forward to the first stage's
    last backward: m * (f1 + b1) + f0 + b0, not the average of the stages."""
    f = [[1.0], [3.0], [1.0]]
    b = [[2.0], [6.0], [2.0]]
    rep = replay("1F1B", 10, 1, f, b, [0.0] * 3)
    assert rep.makespan_s == pytest.approx(10 * 9.0 + 1.0 + 2.0)
    assert rep.busy_s == pytest.approx([30.0, 90.0, 30.0])


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 5),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
    schedule=st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B"]),
)
def test_in_flight_closed_form_matches_order(p, k, v, schedule):
    if schedule != "Interleaved1F1B":
        v = 1
    m = p * k
    for rank in range(p):
        held = peak = 0
        for kind, _, _ in stage_order(schedule, p, m, v, rank):
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == peak_in_flight(schedule, p, m, v, rank)
        assert held == 0


@settings(max_examples=25, deadline=None)
@given(
    times=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6),
    p=st.integers(2, 3),
    k=st.integers(40, 60),
    schedule=st.sampled_from(["1F1B", "Interleaved1F1B"]),
    send=st.floats(0.0, 0.5),
)
def test_extrapolated_replay_equals_exact(times, p, k, schedule, send):
    v = 2 if schedule == "Interleaved1F1B" else 1
    fwd = [[times[i]] * v for i in range(p)]
    bwd = [[times[3 + i]] * v for i in range(p)]
    m = p * k
    exact = replay(schedule, m, v, fwd, bwd, [send] * p)
    import hetplan.cost.schedule as sched

    old = sched.EXACT_ACTION_LIMIT
    sched.EXACT_ACTION_LIMIT = 2 * p * v * 30 * p
    try:
        fast = pipeline_replay(schedule, m, v, fwd, bwd, [send] * p)
    finally:
        sched.EXACT_ACTION_LIMIT = old
    # continuing the steady-state slope lands close to the exact replay
    assert fast.makespan_s == pytest.approx(exact.makespan_s, rel=0.01)


@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(2, 12),
    layers=st.lists(st.integers(1, 3), min_size=12, max_size=12),
    sends=st.lists(st.floats(0.0, 0.6), min_size=12, max_size=12),
    ends=st.tuples(st.floats(1.0, 1.6), st.floats(1.0, 2.0)),
    extra=st.integers(1, 400),
)
def test_long_1f1b_run_continues_its_period_exactly(p, layers, sends, ends, extra):
    # stages of 1-3 layers (an uneven split), the first and last heavier, any transfers:
    # past the action limit a 1F1B run is continued from the period its replayed part
    # shows; it must equal the stage-by-stage replay of the whole run, to rounding
    import hetplan.cost.schedule as sched

    fwd = [[0.1 * x] for x in layers[:p]]
    bwd = [[0.2 * x] for x in layers[:p]]
    fwd[0][0] *= ends[0]
    bwd[-1][0] *= ends[1]
    send = [*sends[: p - 1], 0.0]
    m = 40 * p + extra
    old = sched.EXACT_ACTION_LIMIT
    sched.EXACT_ACTION_LIMIT = 2 * p * 12 * p
    try:
        fast = pipeline_replay("1F1B", m, 1, fwd, bwd, send)
        periodic, _ = sched._periodic_replay(m, 12 * p, fwd, bwd, send)
    finally:
        sched.EXACT_ACTION_LIMIT = old
    exact = replay("1F1B", m, 1, fwd, bwd, send, record=True)  # stage by stage
    if periodic is not None:  # (where no period shows by then, the slope continues it)
        for got in (periodic, fast):
            assert got.makespan_s == pytest.approx(exact.makespan_s, rel=1e-9)
            assert got.last_backward_start_s == pytest.approx(exact.last_backward_start_s, rel=1e-9)
            assert got.last_backward_end_s == pytest.approx(exact.last_backward_end_s, rel=1e-9)
            assert got.busy_s == pytest.approx(exact.busy_s, rel=1e-9)
    else:  # the slope: hypothesis finds runs (round transfers, equal stages) 2.5% off
        assert fast.makespan_s == pytest.approx(exact.makespan_s, rel=0.03)


def test_periods_longer_than_two_keys_are_found():
    # 5 stages of 1, 2, 1, 2, 1 layers with transfers: the steady state repeats only every
    # few micro-batches, yet the continued run equals the whole replay
    import hetplan.cost.schedule as sched

    fwd = [[0.1 * x] for x in (1, 2, 1, 2, 1)]
    bwd = [[0.2 * x] for x in (1, 2, 1, 2, 1)]
    send = [0.05, 0.3, 0.05, 0.3, 0.0]
    found = 0
    for m in range(300, 340):
        periodic, _ = sched._periodic_replay(m, 60, fwd, bwd, send)
        exact = replay("1F1B", m, 1, fwd, bwd, send, record=True)
        if periodic is not None:
            found += 1
            assert periodic.makespan_s == pytest.approx(exact.makespan_s, rel=1e-12)
            assert periodic.last_backward_end_s == pytest.approx(exact.last_backward_end_s)
    assert found == 40


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_single_stage_shortcut_equals_replay(schedule):
    fast = pipeline_replay(schedule, 7, 1, [[0.3]], [[0.5]], [0.0])
    slow = replay(schedule, 7, 1, [[0.3]], [[0.5]], [0.0])
    assert fast.makespan_s == pytest.approx(slow.makespan_s)
    assert fast.last_backward_start_s == pytest.approx(slow.last_backward_start_s)
    assert fast.busy_s == pytest.approx(slow.busy_s)


@settings(max_examples=200, deadline=None)
@given(
    p=st.integers(1, 7),
    m=st.integers(1, 30),
    schedule=st.sampled_from(["GPipe", "1F1B"]),
    seed=st.integers(0, 2**31),
)
def test_one_pass_replay_equals_the_stage_by_stage_replay(p, m, schedule, seed):
    """GPipe and 1F1B replay in one pass over a topological order of the actions (a key that
    grows along every dependency): every figure equals the stage-by-stage simulation's,
    which visits the stages in turn until each action's dependency is done, on stages of
    any times and transfers (some equal, some zero: ties in the order)."""
    import random

    from hetplan.cost.schedule import _flat_replay, _stagewise_replay

    rng = random.Random(seed)
    f = [[rng.choice([1.0, rng.uniform(0.1, 3.0)])] for _ in range(p)]
    b = [[rng.choice([2.0, rng.uniform(0.1, 6.0)])] for _ in range(p)]
    send = [rng.choice([0.0, 0.5, rng.uniform(0.0, 4.0)]) for _ in range(p)]
    fast = _flat_replay(schedule, m, f, b, send)
    slow = _stagewise_replay(schedule, m, 1, f, b, send)
    assert fast.makespan_s == pytest.approx(slow.makespan_s, rel=1e-12)
    for name in ("last_backward_start_s", "last_backward_end_s", "busy_s", "grads_ready_from_s"):
        assert getattr(fast, name) == pytest.approx(getattr(slow, name), rel=1e-12), name
    # and replay() takes the one-pass path for them (the events need the stage-by-stage one)
    assert replay(schedule, m, 1, f, b, send).makespan_s == fast.makespan_s
    assert replay(schedule, m, 1, f, b, send, record=True).makespan_s == slow.makespan_s

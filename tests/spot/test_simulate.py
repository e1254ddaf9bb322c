"""The replay on a three-event trace, against every policy's tokens and dollars worked out by
hand from the plans' throughputs (read once from estimate), the prices, and the recovery and
replan times the replay states."""

from __future__ import annotations

import math

import pytest

from hetplan.cluster import cluster_from_dict
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.spot.planner import Planner
from hetplan.spot.pool import key_of, layout, pool_from_cluster
from hetplan.spot.simulate import Settings, simulate
from hetplan.spot.traces import parse_trace

# 16 GPUs at $1.00; node 1 preempted at 1000 s; back at 2000 s; spot price $2.50 from 3000 s
TRACE = """time_s,gpu_type,count,usd_per_hour
0,A100-80GB,16,1.0
1000,A100-80GB,8,1.0
2000,A100-80GB,16,1.0
3000,A100-80GB,16,2.5
4000,A100-80GB,16,2.5
"""
ON_DEMAND = 3.0
RESTART, INTERVAL, CKPT = 20.0, 300.0, 10.0
CYCLE = INTERVAL + CKPT


def trained(span: float) -> float:
    """Training seconds in ``span`` seconds of checkpoint cycles started at a resume."""
    k = math.floor(span / CYCLE)
    return k * INTERVAL + min(span - k * CYCLE, INTERVAL)


@pytest.fixture(scope="module")
def replay():
    cluster = cluster_from_dict(
        {"nodes": [{"gpu": "A100-80GB", "gpus": 8, "count": 2, "price_per_gpu_hour": ON_DEMAND}]}
    )
    pool = pool_from_cluster(cluster)
    planner = Planner(
        load_model("gpt3-1.3b"), pool, "bf16", 512, default_params(), 1.25e9, replan_search=False
    )
    trace = parse_trace(TRACE, "three.csv")
    settings = Settings(restart_s=RESTART, interval_s=INTERVAL, checkpoint_s=CKPT)
    result = simulate(trace, planner, settings)
    by = {p["name"]: p for p in result.policies}
    return result, by, planner, pool


def test_trace_reads_three_changes(replay):
    result, _, _, _ = replay
    assert result.changes == 3 and result.preemption_points == 1
    assert result.horizon_s == pytest.approx(4000 / 3)


def test_every_policy_in_closed_form(replay):
    result, by, planner, pool = replay
    full = planner.plans[key_of(layout(pool, {"A100-80GB": 16}))]
    half = planner.plans[key_of(layout(pool, {"A100-80GB": 8}))]
    assert full is not None and half is not None
    r16, r8 = full.rate, half.rate  # read once from estimate()
    assert r16 == result.first_tokens_per_s and r16 > r8 > 0
    node0 = frozenset({"a100-80gb-0"})
    to_half = planner.recovery(full, half, node0)
    back = planner.recovery(half, full, node0)
    same = planner.recovery(full, full, node0)

    # before the preemption, three cycles commit 900 s of training; 70 s are lost at 1000 s
    committed = 3 * INTERVAL * r16
    assert math.floor(1000 / CYCLE) == 3

    # hetplan: replan onto node 0 (peers: node 0 holds what it needs), train, join at 2000 s
    d1 = RESTART + half.replan_time_s + to_half.predicted_recovery_s
    at_join = committed + r8 * trained(1000 - d1)
    d2 = RESTART + full.replan_time_s + back.predicted_recovery_s + CKPT  # commit first
    assert r16 * (4000 / 3 - d2) > r8 * 4000 / 3  # the arrival pays
    het = at_join + r16 * trained(2000 - d2)
    usd = (16 * 1000 + 8 * 1000 + 16 * 1000) * 1.0 / 3600 + 16 * 1000 * 2.5 / 3600
    assert by["hetplan"]["tokens"] == pytest.approx(het, rel=1e-9)
    assert by["hetplan"]["dollars"] == pytest.approx(usd, rel=1e-9)
    assert by["hetplan"]["gpu_hours"] == pytest.approx((16 + 8 + 16 + 16) * 1000 / 3600)
    assert by["hetplan"]["redone_s"] == pytest.approx(1000 - 3 * CYCLE)
    assert by["hetplan"]["recovery_s"] == pytest.approx(d1 + d2)

    # restart: the same moves, every node downloading all it needs from storage
    e1 = RESTART + half.replan_time_s + to_half.baseline_recovery_s
    e2 = RESTART + full.replan_time_s + back.baseline_recovery_s + CKPT
    restart = committed + r8 * trained(1000 - e1) + r16 * trained(2000 - e2)
    assert by["restart"]["tokens"] == pytest.approx(restart, rel=1e-9)
    assert by["restart"]["dollars"] == pytest.approx(usd, rel=1e-9)
    assert to_half.baseline_recovery_s > to_half.predicted_recovery_s

    # wait: hold node 0 idle from 1000 s to 2000 s, then recover node 1 from its peer
    w = RESTART + same.predicted_recovery_s
    wait = committed + r16 * trained(2000 - w)
    assert by["wait"]["tokens"] == pytest.approx(wait, rel=1e-9)
    assert by["wait"]["dollars"] == pytest.approx(usd, rel=1e-9)
    assert by["wait"]["waiting_s"] == pytest.approx(1000)

    # on-demand: 16 GPUs all along at the on-demand price, no checkpoints
    assert by["on-demand"]["tokens"] == pytest.approx(r16 * 4000, rel=1e-12)
    assert by["on-demand"]["dollars"] == pytest.approx(16 * ON_DEMAND * 4000 / 3600)
    for p in by.values():
        assert p["reached_target"] is False and p["time_to_target_s"] is None


def test_token_target_stops_the_clock_and_the_bill(replay):
    _, by0, planner, _ = replay
    r16 = by0["on-demand"]["tokens"] / 4000
    settings = Settings(
        restart_s=RESTART, interval_s=INTERVAL, checkpoint_s=CKPT, target_tokens=600 * r16
    )
    result = simulate(parse_trace(TRACE, "three.csv"), planner, settings)
    by = {p["name"]: p for p in result.policies}
    # 300 s trained, 10 s writing, 300 s more: the spot runs finish at 610 s
    for name in ("hetplan", "restart", "wait"):
        assert by[name]["time_to_target_s"] == pytest.approx(610)
        assert by[name]["dollars"] == pytest.approx(16 * 1.0 * 610 / 3600)
        assert by[name]["preemptions"] == 0
    assert by["on-demand"]["time_to_target_s"] == pytest.approx(600)
    assert by["on-demand"]["dollars"] == pytest.approx(16 * ON_DEMAND * 600 / 3600)


def test_an_arrival_that_does_not_pay_is_left_alone(replay):
    _, _, planner, pool = replay
    # node 1 comes back 100 s after its loss; with a 25-minute restart, joining it cannot pay
    # within the mean time between changes (2000 s): hetplan stays on node 0, while restart
    # (which takes any faster plan) moves back to 16 GPUs
    text = (
        "time_s,gpu_type,count\n0,A100-80GB,16\n1000,A100-80GB,8\n"
        "1100,A100-80GB,16\n4000,A100-80GB,16\n"
    )
    restart = 1500.0
    settings = Settings(restart_s=restart, interval_s=INTERVAL, checkpoint_s=CKPT)
    result = simulate(parse_trace(text, "late.csv"), planner, settings)
    assert result.horizon_s == pytest.approx(2000)
    by = {p["name"]: p for p in result.policies}
    full = planner.plans[key_of(layout(pool, {"A100-80GB": 16}))]
    half = planner.plans[key_of(layout(pool, {"A100-80GB": 8}))]
    assert full is not None and half is not None
    node0 = frozenset({"a100-80gb-0"})
    to_half = planner.recovery(full, half, node0)
    back = planner.recovery(half, full, node0)
    d1 = restart + half.replan_time_s + to_half.predicted_recovery_s
    d2 = restart + full.replan_time_s + back.predicted_recovery_s  # still down: no commit
    assert full.rate * (2000 - d2) < half.rate * 2000  # the join does not pay
    het = by["hetplan"]
    assert het["joins"] == 0 and het["replans"] == 1
    committed = 3 * INTERVAL * full.rate
    assert het["tokens"] == pytest.approx(committed + half.rate * trained(3000 - d1))
    gpu_hours = (16 * 1000 + 8 * 3000) / 3600
    assert het["gpu_hours"] == pytest.approx(gpu_hours)
    # no price in the trace: the catalog's A100-80GB spot price, $1.1640 per GPU-hour
    assert het["dollars"] == pytest.approx(gpu_hours * 1.1640)
    rst = by["restart"]
    e2 = restart + full.replan_time_s + back.baseline_recovery_s
    assert rst["joins"] == 1
    assert rst["tokens"] == pytest.approx(committed + full.rate * trained(2900 - e2))
    assert rst["recovery_s"] == pytest.approx(100 + e2)
    assert rst["gpu_hours"] == pytest.approx((16 * 1000 + 8 * 100 + 16 * 2900) / 3600)

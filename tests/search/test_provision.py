import math

import pytest

from hetplan.errors import InputError
from hetplan.market import load_market, market_from_dict
from hetplan.model import load_model
from hetplan.search.provision import Point, pareto_front, provision_single_type
from hetplan.search.spot import SpotTerms, spot_slowdown


def _market(rate=0.0):
    return market_from_dict(
        {
            "offers": [
                {
                    "gpu": "A100-80GB",
                    "gpus_per_node": 8,
                    "max_nodes": 2,
                    "on_demand_usd_per_gpu_hour": 3.43,
                    "spot_usd_per_gpu_hour": 1.16,
                    "preemption_rate_per_node_hour": rate,
                },
                {
                    "gpu": "T4",
                    "gpus_per_node": 4,
                    "max_nodes": 3,
                    "on_demand_usd_per_gpu_hour": 0.526,
                    "spot_usd_per_gpu_hour": 0.21,
                    "preemption_rate_per_node_hour": rate,
                },
            ]
        }
    )


def test_pareto_front_against_brute_force():
    pts = [
        Point({"x": i}, False, t, c, 1.0)
        for i, (t, c) in enumerate([(1, 9), (2, 5), (3, 5), (4, 1), (2.5, 7), (5, 1)])
    ]
    front = pareto_front(pts)
    brute = [
        p
        for p in pts
        if not any(
            q is not p
            and q.time_to_train_s <= p.time_to_train_s
            and q.total_cost_usd <= p.total_cost_usd
            and (q.time_to_train_s, q.total_cost_usd) != (p.time_to_train_s, p.total_cost_usd)
            for q in pts
        )
    ]
    assert sorted(id(p) for p in front) == sorted(id(p) for p in brute)


def test_pruned_front_equals_exhaustive_front():
    model = load_model("gpt2-medium")
    fast = provision_single_type(model, _market(), 1e9, 64, "fp16", prune=True)
    full = provision_single_type(model, _market(), 1e9, 64, "fp16", prune=False)
    key = [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in fast.front]
    assert key == [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in full.front]
    assert fast.planned + fast.pruned == full.planned


def test_spot_against_on_demand():
    model = load_model("gpt2-medium")
    on_demand = provision_single_type(model, _market(0.0), 1e9, 64, "fp16")
    free_spot = provision_single_type(model, _market(0.0), 1e9, 64, "fp16", spot=True)
    # no preemptions: same times, lower prices
    assert min(p.total_cost_usd for p in free_spot.front) < min(
        p.total_cost_usd for p in on_demand.front
    )
    assert min(p.time_to_train_s for p in free_spot.front) == pytest.approx(
        min(p.time_to_train_s for p in on_demand.front)
    )
    # preemptions every few minutes: a spot run never finishes
    doomed = provision_single_type(model, _market(30.0), 1e9, 64, "fp16", spot=True)
    assert doomed.front == []
    offer = _market(0.1).offers[0]
    assert spot_slowdown(offer, 2, SpotTerms()) > spot_slowdown(offer, 1, SpotTerms()) > 1
    assert math.isinf(spot_slowdown(_market(30.0).offers[0], 1, SpotTerms()))


def test_default_market_and_errors():
    market = load_market(None)
    assert {"A100-80GB", "H100-80GB", "T4"} <= {o.gpu.name for o in market.offers}
    with pytest.raises(InputError) as info:
        market_from_dict(
            {"offers": [{"gpu": "T4", "max_nodes": 1, "on_demand_usd_per_gpu_hour": -1}]}
        )
    assert info.value.field == "offers[0].on_demand_usd_per_gpu_hour"
    with pytest.raises(InputError, match="unknown GPU type"):
        market_from_dict(
            {"offers": [{"gpu": "Z80", "max_nodes": 1, "on_demand_usd_per_gpu_hour": 1}]}
        )
    with pytest.raises(InputError, match="offers"):
        market_from_dict({"nodes": []})


def _front(**kw):
    from hetplan.search.provision import provision

    return provision(load_model("gpt2-medium"), _market(), 1e9, 64, "fp16", **kw)


def test_more_budget_is_never_slower_and_tighter_deadline_never_cheaper():
    from hetplan.search.provision import Constraints, recommend

    res = _front()
    costs = sorted(p.total_cost_usd for p in res.front)
    times = sorted(p.time_to_train_s for p in res.front)
    prev_time = math.inf
    for budget in costs:
        best, _ = recommend(res.front, "time", Constraints(budget_usd=budget))
        assert best is not None and best.time_to_train_s <= prev_time
        prev_time = best.time_to_train_s
    prev_cost = 0.0
    for deadline in reversed(times):
        best, _ = recommend(res.front, "cost", Constraints(deadline_s=deadline))
        assert best is not None and best.total_cost_usd >= prev_cost
        prev_cost = best.total_cost_usd


def test_objectives_and_binding_constraint():
    from hetplan.search.provision import Constraints, recommend

    res = _front()
    fastest, _ = recommend(res.front, "time", Constraints())
    cheapest, _ = recommend(res.front, "cost", Constraints())
    assert fastest is not None and cheapest is not None
    assert fastest.time_to_train_s == min(p.time_to_train_s for p in res.front)
    assert cheapest.total_cost_usd == min(p.total_cost_usd for p in res.front)
    none, why = recommend(res.front, "cost", Constraints(deadline_s=1.0))
    assert none is None and "deadline binds" in why
    none, why = recommend(res.front, "time", Constraints(budget_usd=1e-6))
    assert none is None and "budget binds" in why
    for p in res.front:
        assert p.plan is not None and p.estimate is not None and p.estimate.fits


def test_provision_cli(tmp_path):
    import json
    import subprocess
    import sys

    market = tmp_path / "m.yaml"
    market.write_text(
        "offers:\n"
        "  - {gpu: A100-80GB, gpus_per_node: 8, max_nodes: 2, on_demand_usd_per_gpu_hour: 3.43}\n"
        "  - {gpu: T4, gpus_per_node: 4, max_nodes: 4, on_demand_usd_per_gpu_hour: 0.526}\n"
    )
    png = tmp_path / "front.png"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "provision",
            "--model",
            "gpt2-medium",
            "--market",
            str(market),
            "--tokens",
            "2e9",
            "--objective",
            "cost",
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["front"] and data["recommended"]["reason"] and data["search_time_s"] >= 0
    for key in ("gpus", "time_to_train_s", "total_cost_usd", "usd_per_hour", "plan"):
        assert key in data["front"][0]
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.yaml"
    bad.write_text("offers:\n  - {gpu: T4, max_nodes: 1, on_demand_usd_per_gpu_hour: -2}\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "provision",
            "--model",
            "gpt2-medium",
            "--market",
            str(bad),
            "--tokens",
            "2e9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "on_demand_usd_per_gpu_hour" in res.stderr


def test_mixes_front_equals_exhaustive_front():
    """Two-type mixes through the heterogeneous planner: bounding loses no front point."""
    from hetplan.search.provision import provision

    market = market_from_dict(
        {
            "offers": [
                {
                    "gpu": "A100-80GB",
                    "gpus_per_node": 2,
                    "max_nodes": 1,
                    "on_demand_usd_per_gpu_hour": 3.43,
                },
                {
                    "gpu": "T4",
                    "gpus_per_node": 2,
                    "max_nodes": 2,
                    "on_demand_usd_per_gpu_hour": 0.526,
                },
            ]
        }
    )
    model = load_model("gpt2")
    fast = provision(model, market, 1e9, 16, "fp16", mixes=True, prune=True)
    full = provision(model, market, 1e9, 16, "fp16", mixes=True, prune=False)
    key = [(p.gpus, round(p.time_to_train_s, 6), round(p.total_cost_usd, 6)) for p in fast.front]
    assert key == [
        (p.gpus, round(p.time_to_train_s, 6), round(p.total_cost_usd, 6)) for p in full.front
    ]
    assert any(len(p.gpus) == 2 for p in full.points)


def test_spot_recovery_term_uses_peer_first_model():
    """More state to recover, or a slower network, stretches a spot run more."""
    from hetplan.search.spot import recovery_s

    offer = _market(0.1).offers[0]
    small = SpotTerms(state_bytes=1e9)
    large = SpotTerms(state_bytes=100e9)
    assert recovery_s(offer, 2, large) > recovery_s(offer, 2, small) > 0
    assert spot_slowdown(offer, 2, large) > spot_slowdown(offer, 2, small)
    # with more surviving peers the replacement's share is smaller
    assert recovery_s(offer, 8, large) < recovery_s(offer, 2, large)


def test_limits_hold_on_every_point_and_each_point_is_the_constrained_best():
    from hetplan.search.constraints import PlanConstraints, homogeneous_space
    from hetplan.search.homogeneous import search_homogeneous
    from hetplan.search.provision import PROVISION_SPACE, provision

    model = load_model("gpt2-medium")
    limits = PlanConstraints(tp=(2,), micro_batch=(2,), gpu_types=("a100-80gb",), max_gpus=8)
    res = provision(model, _market(), 1e9, 64, "fp16", prune=False, limits=limits)
    assert res.points
    for p in res.points:
        assert set(p.gpus) == {"A100-80GB"} and sum(p.gpus.values()) <= 8
        stages = [s for q in p.plan.pipelines for s in q.stages]
        assert all(s.tp == 2 for s in stages) and p.plan.micro_batch_size == 2
        # the same as the unconstrained search's best among plans with tp 2 and micro-batch 2
        every = search_homogeneous(model, p.cluster, 64, "fp16", 100_000,
                                   space=PROVISION_SPACE)  # fmt: skip
        ok = [e for q, e in every.ranked
              if all(s.tp == 2 for r in q.pipelines for s in r.stages)
              and q.micro_batch_size == 2]  # fmt: skip
        assert p.estimate.iteration_time_s == pytest.approx(ok[0].iteration_time_s, rel=1e-12)
        assert homogeneous_space(limits, PROVISION_SPACE).zero_stages == (1, 2, 3)
    with pytest.raises(InputError) as info:
        provision(model, _market(), 1e9, 64, "fp16", limits=PlanConstraints(gpu_types=("H100",)))
    assert info.value.field == "--gpu-types"


def test_max_gpus_below_an_offers_node_leaves_that_offer_out():
    from hetplan.search.constraints import PlanConstraints
    from hetplan.search.provision import provision

    # A100 nodes hold 8 GPUs: at most 4 GPUs leaves only T4 configurations (4 per node)
    res = provision(load_model("gpt2-medium"), _market(), 1e9, 64, "fp16", prune=False,
                    limits=PlanConstraints(max_gpus=4))  # fmt: skip
    assert res.points and all(p.gpus == {"T4": 4} for p in res.points)

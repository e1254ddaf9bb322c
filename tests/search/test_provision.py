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

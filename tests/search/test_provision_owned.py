"""Owned nodes first, rented ones only where they pay off: against exhaustive enumeration."""

import pytest

from hetplan.cluster import Cluster, cluster_from_dict
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision import PROVISION_SPACE, provision

FIG = {"purchase_usd_per_gpu": 20_000, "lifetime_years": 4, "utilisation": 0.5,
       "board_power_w": 400, "power_factor": 0.75, "pue": 1.2, "usd_per_kwh": 0.1}  # fmt: skip
# per owned GPU-hour: 20,000 / (4 x 8,760 x 0.5) + 0.4 x 0.75 x 1.2 x 0.1
OWNED_HOURLY = 20_000 / 17_520 + 0.036


def _hand_pareto(rows):
    out = []
    for i, (k, t, c) in enumerate(rows):
        if not any(
            (t2 <= t and c2 <= c and (t2 < t or c2 < c)) or (t2 == t and c2 == c and j < i)
            for j, (_, t2, c2) in enumerate(rows)
            if j != i
        ):
            out.append((k, t, c))
    return sorted(out, key=lambda r: r[1])


def test_owned_a100_plus_rented_h100_front_equals_exhaustive_enumeration():
    owned = cluster_from_dict({"nodes": [{"gpu": "A100-40GB", "gpus": 2, "owned": True, **FIG}]})
    market = market_from_dict(
        {"offers": [{"gpu": "H100-80GB", "gpus_per_node": 2, "max_nodes": 2,
                     "on_demand_usd_per_gpu_hour": 6.88}]}
    )  # fmt: skip
    model, tokens, batch = load_model("gpt2"), 1e9, 16
    offer = market.offers[0]
    rows = []
    alone = search_homogeneous(model, owned, batch, "fp16", top_k=1, space=PROVISION_SPACE)
    t = tokens / alone.ranked[0][1].tokens_per_s
    rows.append(({}, t, t / 3600 * 2 * OWNED_HOURLY))
    for n in (1, 2):
        cluster = Cluster(owned.nodes + offer.cluster(n).nodes)
        res = search_heterogeneous(model, cluster, batch, "fp16", 1)
        t = tokens / res.ranked[0][1].tokens_per_s
        rows.append(({"H100-80GB": 2 * n}, t, t / 3600 * (2 * OWNED_HOURLY + 2 * n * 6.88)))
    want = _hand_pareto(rows)
    got = provision(model, market, tokens, batch, "fp16", owned=owned, objective="cost")
    assert got.front and [p.gpus for p in got.front] == [k for k, _, _ in want]
    for p, (_, t, c) in zip(got.front, want, strict=True):
        assert p.owned == {"A100-40GB": 2}
        assert p.time_to_train_s == pytest.approx(t, rel=1e-9)
        assert p.total_cost_usd == pytest.approx(c, rel=1e-9)
    assert got.planned + got.pruned == 3
    # the owned GPUs are never charged rental: the owned-only plan has none at all
    only = next(p for p in got.points if not p.gpus)
    assert only.estimate.cost_parts.rental == 0.0
    assert only.usd_per_hour == pytest.approx(2 * OWNED_HOURLY, rel=1e-12)
    assert "owned" in got.reason


def test_gpu_types_limit_what_is_rented_beside_owned_nodes():
    """--gpu-types names GPU types to rent; the owned nodes are the user's own, of whatever
    type (every value was once refused: 'the cluster has no A100-80GB', or 'the market
    sells no A100-40GB' for the owned type)."""
    from hetplan.search.constraints import PlanConstraints

    owned = cluster_from_dict({"nodes": [{"gpu": "A100-40GB", "gpus": 2, "owned": True, **FIG}]})
    offer = {"gpus_per_node": 2, "max_nodes": 1}
    market = market_from_dict({"offers": [
        {"gpu": "H100-80GB", **offer, "on_demand_usd_per_gpu_hour": 6.88},
        {"gpu": "T4", **offer, "on_demand_usd_per_gpu_hour": 0.53},
    ]})  # fmt: skip
    model = load_model("gpt2")

    def rented(types):
        res = provision(model, market, 1e9, 16, "fp16", owned=owned,
                        limits=PlanConstraints(gpu_types=types))  # fmt: skip
        assert res.points and all(p.owned == {"A100-40GB": 2} for p in res.points)
        return {g for p in res.points for g in p.gpus}

    assert rented(("H100-80GB",)) == {"H100-80GB"}
    assert rented(("A100-40GB", "T4")) == {"T4"}
    assert rented(("A100-40GB",)) == set()
    assert rented(None) == {"H100-80GB", "T4"}

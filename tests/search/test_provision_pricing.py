"""Reserved prices in provisioning, and owned nodes as a choice: against hand enumeration."""

import pytest

from hetplan.cluster import Cluster, cluster_from_dict
from hetplan.errors import InputError
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision import PROVISION_SPACE, provision
from hetplan.search.provision_owned import owned_subsets

OFFERS = [
    {"name": "a100", "gpu": "A100-80GB", "gpus_per_node": 2, "max_nodes": 2,
     "on_demand_usd_per_gpu_hour": 3.0, "reserved_usd_per_gpu_hour": 2.4},
    {"name": "h100", "gpu": "H100-80GB", "gpus_per_node": 2, "max_nodes": 1,
     "on_demand_usd_per_gpu_hour": 6.88, "reserved_usd_per_gpu_hour": 2.2},
    {"name": "v100-no-commit", "gpu": "V100-32GB", "gpus_per_node": 2, "max_nodes": 1,
     "on_demand_usd_per_gpu_hour": 2.48},
]  # fmt: skip
RESERVED = {"A100-80GB": 2.4, "H100-80GB": 2.2}
MODEL, TOKENS, BATCH = "gpt2", 1e9, 16


def _hand_pareto(rows):
    """Rows (key, time, cost) no other row beats on both, fastest first (brute force)."""
    out = [
        r
        for i, r in enumerate(rows)
        if not any(
            (q[1] <= r[1] and q[2] <= r[2] and (q[1] < r[1] or q[2] < r[2]))
            or (q[1] == r[1] and q[2] == r[2] and j < i)
            for j, q in enumerate(rows)
            if j != i
        )
    ]
    return sorted(out, key=lambda r: r[1])


def _times(market, names):
    """Every node count of the named offers: (offer, GPUs, time to train), each planned by
    the homogeneous search on its own."""
    model = load_model(MODEL)
    out = []
    for offer in market.offers:
        if offer.name in names:
            for n in range(1, offer.max_nodes + 1):
                found = search_homogeneous(model, offer.cluster(n), BATCH, "fp16", top_k=1,
                                           space=PROVISION_SPACE)  # fmt: skip
                t = TOKENS / found.ranked[0][1].tokens_per_s
                out.append((offer, n * offer.gpus_per_node, t))
    return out


def test_reserved_prices_change_the_cheapest_offer_and_name_offers_without_one():
    market = market_from_dict({"offers": OFFERS})
    times = _times(market, {"a100", "h100"})
    # hand prices: on demand, an A100 run is the cheapest; reserved, the H100 run is
    demand = [(o.gpu.name, g, t, t / 3600 * g * o.on_demand_usd_per_gpu_hour)
              for o, g, t in times]  # fmt: skip
    committed = [(o.gpu.name, g, t, t / 3600 * g * o.reserved_usd_per_gpu_hour)
                 for o, g, t in times]  # fmt: skip
    assert min(demand, key=lambda r: r[3])[0] == "A100-80GB"
    assert min(committed, key=lambda r: r[3])[0] == "H100-80GB"
    want = _hand_pareto([({name: g}, t, c) for name, g, t, c in committed])

    got = provision(load_model(MODEL), market, TOKENS, BATCH, "fp16", objective="cost",
                    pricing="reserved")  # fmt: skip
    assert got.pricing == "reserved" and got.left_out == ["v100-no-commit"]
    assert [p.gpus for p in got.front] == [k for k, _, _ in want]
    for p, (_, t, c) in zip(got.front, want, strict=True):
        assert p.pricing == "reserved"
        assert p.time_to_train_s == pytest.approx(t, rel=1e-9)
        assert p.total_cost_usd == pytest.approx(c, rel=1e-9)
        # the money parts call it rental of kind reserved, at the reserved rate
        parts = p.estimate.cost_parts
        assert parts.rental_kind == "reserved" and parts.amortisation == 0 == parts.energy
        ((name, gpus),) = p.gpus.items()
        assert p.usd_per_hour == pytest.approx(gpus * RESERVED[name], rel=1e-12)
        assert parts.rental == pytest.approx(gpus * RESERVED[name], rel=1e-12)
    cheapest = min(committed, key=lambda r: r[3])
    assert got.recommended.gpus == {cheapest[0]: cheapest[1]}

    # on demand, the same market's cheapest run is on A100s, and no offer is left out
    od = provision(load_model(MODEL), market, TOKENS, BATCH, "fp16", objective="cost")
    assert od.pricing == "on-demand" and od.left_out == []
    assert od.recommended.gpus == {"A100-80GB": 2}
    assert od.recommended.estimate.cost_parts.rental_kind == "on-demand"


def test_spot_contradicting_pricing_is_refused():
    market = market_from_dict({"offers": OFFERS})
    with pytest.raises(InputError) as err:
        provision(load_model(MODEL), market, TOKENS, BATCH, "fp16", spot=True, pricing="reserved")
    assert err.value.field == "--spot"


FIG = {"purchase_usd_per_gpu": 20_000, "lifetime_years": 4, "utilisation": 0.5,
       "board_power_w": 400, "power_factor": 0.75, "pue": 1.2, "usd_per_kwh": 0.1}  # fmt: skip
# per owned GPU-hour: 20,000 / (4 x 8,760 x 0.5) + 0.4 x 0.75 x 1.2 x 0.1
OWNED_HOURLY = 20_000 / 17_520 + 0.036


@pytest.mark.slow
def test_owned_node_counts_are_a_choice_against_exhaustive_enumeration():
    """Three owned A100 nodes and one rentable H100 node: every count of owned nodes (1 to
    3, first ones first), alone and with the H100s, planned one by one here; the search's
    front must equal this enumeration's, each owned choice charged for its own nodes only."""
    owned = cluster_from_dict(
        {"nodes": [{"gpu": "A100-40GB", "gpus": 2, "count": 3, "owned": True, **FIG}]}
    )
    market = market_from_dict(
        {"offers": [{"gpu": "H100-80GB", "gpus_per_node": 2, "max_nodes": 1,
                     "on_demand_usd_per_gpu_hour": 6.88}]}
    )  # fmt: skip
    model = load_model(MODEL)
    offer = market.offers[0]
    rows = []
    for k in (1, 2, 3):
        mine = Cluster(owned.nodes[:k])
        alone = search_homogeneous(model, mine, BATCH, "fp16", top_k=1, space=PROVISION_SPACE)
        t = TOKENS / alone.ranked[0][1].tokens_per_s
        rows.append((2 * k, {}, t, t / 3600 * 2 * k * OWNED_HOURLY))
        res = search_heterogeneous(model, Cluster(mine.nodes + offer.cluster(1).nodes), BATCH,
                                   "fp16", 1)  # fmt: skip
        t = TOKENS / res.ranked[0][1].tokens_per_s
        rows.append((2 * k, {"H100-80GB": 2}, t, t / 3600 * (2 * k * OWNED_HOURLY + 2 * 6.88)))
    want = _hand_pareto([((k, tuple(g.items())), t, c) for k, g, t, c in rows])
    # the case is meant to make a subset of the owned nodes worth choosing
    assert any(k < 6 for (k, _), _, _ in want)

    got = provision(model, market, TOKENS, BATCH, "fp16", owned=owned, objective="cost")
    assert [(p.owned["A100-40GB"], tuple(p.gpus.items())) for p in got.front] == [
        key for key, _, _ in want
    ]
    for p, (_, t, c) in zip(got.front, want, strict=True):
        assert p.time_to_train_s == pytest.approx(t, rel=1e-9)
        assert p.total_cost_usd == pytest.approx(c, rel=1e-9)
    assert got.planned + got.pruned == 6
    cheapest = min(rows, key=lambda r: r[3])
    assert (got.recommended.owned["A100-40GB"], got.recommended.gpus) == cheapest[:2]
    if cheapest[0] < 6:
        assert f"uses {cheapest[0]} of the 6 owned GPUs ({cheapest[0]} x A100-40GB)" in got.reason
        assert "not charged" in got.owned_choice


def test_owned_subsets_take_each_type_first_nodes_in_file_order():
    owned = cluster_from_dict(
        {"nodes": [{"name": "a", "gpu": "A100-40GB", "gpus": 2, "count": 2, "owned": True},
                   {"name": "h", "gpu": "H100-80GB", "gpus": 4, "owned": True}]}
    )  # fmt: skip
    subsets = [[n.name for n in c.nodes] for c in owned_subsets(owned)]
    # per type 0..all (A100: 0, 1, 2 nodes; H100: 0, 1), not all zero: 5 choices, most GPUs first
    names = [n.name for n in owned.nodes]
    assert len(subsets) == 5 and subsets[0] == names
    assert sorted(map(tuple, subsets)) == sorted(
        [tuple(names[:1]), tuple(names[:2]), (names[2],), (names[0], names[2]), tuple(names)]
    )

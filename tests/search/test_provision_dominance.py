"""Offers another offer dominates (``provision_dominance``): which ones, by the datasheet
figures; the premise, plan by plan (every plan of small mixes and single types, swapped
onto the dominating type, fits and is no slower, and its spot slowdown no larger); and the
front, against provisioning that prunes nothing."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hetplan.cluster import Cluster, Node
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.errors import InputError
from hetplan.hardware import get_gpu
from hetplan.market import Offer, load_market, market_from_dict
from hetplan.model import ModelSpec
from hetplan.search.constraints import PlanConstraints
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision import provision
from hetplan.search.provision_dominance import dominators, swap_cap
from hetplan.search.provision_points import ProvisionJob
from hetplan.search.spot import SpotTerms, mixed_load, offer_load, slowdowns

MODEL = ModelSpec("gpt-4L-1024", "gpt", 4, 1024, 16, 16, 4096, 50257, 1024)
SMALL = ModelSpec("gpt-2L-512", "gpt", 2, 512, 8, 8, 2048, 50257, 512)


def _job(pricing: str, precision: str = "fp16", prune: bool = True) -> ProvisionJob:
    return ProvisionJob(MODEL, 1e9, 16, precision, pricing == "spot", default_params(),
                        SpotTerms(), prune, True, PlanConstraints(), pricing=pricing)  # fmt: skip


def _names(by: dict[str, list[Offer]]) -> dict[str, list[str]]:
    return {k: [o.name for o in v] for k, v in by.items()}


@pytest.mark.parametrize("pricing", ["spot", "on-demand"])
def test_default_market_dominated_offers_by_hand(pricing):
    """From the shipped figures: the RTX 4090 (165.2 TFLOP/s fp16, 1,008 GB/s, 24 GB, one GPU
    a node on 100 Gbit/s, $0.34 spot / $0.60 on demand) is at least the L4 (121, 300 GB/s, 24
    GB, same node, $0.375 / $0.80) and, on demand, the A10 (125, 600 GB/s, 24 GB, $1.29; no
    spot price); the H200 (same GH100 fit as the H100, 4.8 against 3.35 TB/s, 141 against
    80 GB, same 8-GPU node on 3,200 Gbit/s, $3.59 / $6.35) the H100 ($4.54 / $6.88). Every
    other pair differs the wrong way in some figure or in price."""
    offers = [o for o in load_market(None).offers if o.has_price(pricing)]
    expected = {"l4": ["rtx-4090"], "h100-80gb": ["h200-141gb"]}
    if pricing == "on-demand":
        expected["a10"] = ["rtx-4090"]
    assert _names(dominators(_job(pricing), offers)) == expected


def _market(*offers: dict[str, object]) -> list[Offer]:
    return list(market_from_dict({"offers": list(offers)}).offers)


BASE = {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 1.0,
        "spot_usd_per_gpu_hour": 0.5, "preemption_rate_per_node_hour": 0.1,
        "restart_time": "5m"}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "dominated"),
    [
        ({}, True),  # identical: the first listed stands in for the second
        ({"on_demand_usd_per_gpu_hour": 1.01}, False),
        ({"gpus_per_node": 2}, False),
        ({"network_bandwidth": "50Gbit/s"}, False),
        ({"intra_node_bandwidth": "10GB/s"}, False),
        ({"gpu": "T4"}, False),  # less HBM bandwidth and memory (and default terms both)
        ({"gpu": "A100-80GB"}, False),  # another fitted set of efficiencies
    ],
)
def test_a_figure_the_wrong_way_keeps_an_offer(change, dominated):
    """The first offer, the second's figures but one, stands in for the second only when
    nothing of it is worse (a dearer first may itself be the one dominated)."""
    first, second = _market({**BASE, "name": "first", **change}, {**BASE, "name": "second"})
    by = _names(dominators(_job("on-demand"), [first, second]))
    assert by.get("second") == (["first"] if dominated else None)


def test_identical_offers_keep_the_first_whatever_the_order():
    a, b = _market({**BASE, "name": "a"}, {**BASE, "name": "b"})
    assert _names(dominators(_job("on-demand"), [a, b])) == {"b": ["a"]}
    assert _names(dominators(_job("on-demand"), [b, a])) == {"a": ["b"]}


@pytest.mark.parametrize("change", [{"preemption_rate_per_node_hour": 0.2}, {"restart_time": "6m"}])
def test_on_spot_more_preemptions_or_a_longer_restart_keep_an_offer(change):
    better = {**BASE, "gpu": "RTX 4090", "spot_usd_per_gpu_hour": 0.4}
    strong, weak = _market({**better, "name": "strong", **change}, {**BASE, "name": "weak"})
    assert _names(dominators(_job("on-demand"), [strong, weak])) == {"weak": ["strong"]}
    assert _names(dominators(_job("spot"), [strong, weak])) == {}


def test_without_pruning_nothing_is_dominated():
    a, b = _market({**BASE, "name": "a"}, {**BASE, "name": "b"})
    assert dominators(_job("on-demand", prune=False), [a, b]) == {}


def test_the_swap_cap_is_the_largest_dominator_other_than_the_partner():
    big = {**BASE, "gpu": "RTX 4090", "on_demand_usd_per_gpu_hour": 0.9}
    a, c, b = _market({**big, "name": "a", "max_nodes": 2}, {**big, "name": "c", "max_nodes": 3},
                      {**BASE, "name": "b"})  # fmt: skip
    by = dominators(_job("on-demand"), [a, c, b])
    assert swap_cap(by, b) == 3
    assert swap_cap(by, b, partner=c) == 2  # a mix of b and c maps onto a and c
    assert swap_cap(by, a) == 0


# ----------------------------------------------------------------- the premise, plan by plan


def _cluster(spec: list[tuple[str, str, int, int]]) -> Cluster:
    """Nodes (name, GPU type, GPUs, network Gbit/s) at their catalog links."""
    nodes = []
    for name, gpu_name, gpus, gbit in spec:
        gpu = get_gpu(gpu_name)
        nodes.append(Node(name, gpu, gpus, gpu.intra_node_bytes_per_s, gbit * 1e9 / 8, 1.0))
    return Cluster(tuple(nodes))


KNOBS = [
    {},
    {"zero_stage": 1},
    {"zero_stage": 2},
    {"zero_stage": 3},
    {"recompute": "full"},
    {"recompute": "selective", "overlap_grad_reduce": False},
    {"flash_attention": False, "zero_stage": 1},
]


def _variants(plans):
    for plan in plans:
        for knobs in KNOBS:
            yield dataclasses.replace(plan, **knobs)


def _swapped_no_worse(plans, weak: Cluster, strong: Cluster) -> int:
    params = default_params()
    checked = 0
    for plan in _variants(plans):
        try:
            before = estimate(plan, MODEL, weak, params)
        except (InputError, ValueError):
            continue  # a knob this plan cannot take (ZeRO with one replica)
        after = estimate(plan, MODEL, strong, params)
        assert after.iteration_time_s <= before.iteration_time_s * (1 + 1e-9), plan
        assert after.fits or not before.fits, plan
        checked += 1
    return checked


SWAPS = [  # (weak type, its dominator, a third type beside them, GPUs a node)
    ("L4", "RTX 4090", "T4", 1),
    ("H100-80GB", "H200-141GB", "A100-80GB", 2),
    ("A10", "RTX 4090", "V100-16GB", 1),
]


@pytest.mark.parametrize("swap", SWAPS, ids=lambda s: f"{s[0]}->{s[1]}")
def test_every_mixed_plan_swapped_onto_the_dominator_fits_and_is_no_slower(swap):
    """Every plan the heterogeneous search ranks on two nodes of the weak type beside a
    node of a third type (up to 400, with ZeRO 0-3, recomputation, no flash attention),
    estimated again with the weak nodes swapped for the dominating type's."""
    weak, strong, other, per = swap
    spec = [("x-0", other, 2, 100), ("m-0", weak, per, 100), ("m-1", weak, per, 100)]
    before = _cluster(spec)
    after = _cluster([(n, strong if g == weak else g, k, b) for n, g, k, b in spec])
    plans = [p for p, _ in search_heterogeneous(MODEL, before, 16, "fp16", top_k=400).ranked]
    assert len(plans) >= 50
    assert _swapped_no_worse(plans, before, after) >= 300


@pytest.mark.parametrize("swap", SWAPS, ids=lambda s: f"{s[0]}->{s[1]}")
def test_every_single_type_plan_swapped_onto_the_dominator_fits_and_is_no_slower(swap):
    weak, strong, _, per = swap
    spec = [(f"m-{i}", weak, 2 * per, 100) for i in range(2)]
    before = _cluster(spec)
    after = _cluster([(n, strong, k, b) for n, _, k, b in spec])
    plans = [p for p, _ in search_homogeneous(MODEL, before, 16, "fp16", top_k=200).ranked]
    assert len(plans) >= 20
    assert _swapped_no_worse(plans, before, after) >= 100


def test_the_spot_slowdown_of_a_swapped_mix_is_no_larger():
    """A preemption of either offer stops the run: with the dominator's no higher rate and
    no longer restart (and a no slower network for the recovery) the slowdown of every
    checkpoint time is no larger, alone and beside a third offer."""
    weak, strong, other = _market(
        {**BASE, "name": "weak", "preemption_rate_per_node_hour": 0.3, "restart_time": "9m"},
        {**BASE, "name": "strong", "gpu": "RTX 4090", "preemption_rate_per_node_hour": 0.2},
        {**BASE, "name": "other", "gpu": "T4", "preemption_rate_per_node_hour": 0.05},
    )
    terms = dataclasses.replace(SpotTerms(), state_bytes=12.0 * MODEL.total_params())
    for n in (1, 3, 8):
        for c in (0.0, 5.0, 60.0):
            for beside in ([], [offer_load(other, 4, terms)]):
                w = slowdowns(*mixed_load([offer_load(weak, n, terms), *beside]), terms, c)
                s = slowdowns(*mixed_load([offer_load(strong, n, terms), *beside]), terms, c)
                assert s <= w
                assert s < w or math.isinf(w)


# ------------------------------------------------------------------------- the front


SPOT_MARKET = market_from_dict(
    {
        "offers": [
            {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 3, "on_demand_usd_per_gpu_hour": 0.8,
             "spot_usd_per_gpu_hour": 0.375, "preemption_rate_per_node_hour": 0.05},
            {"gpu": "RTX 4090", "gpus_per_node": 1, "max_nodes": 2,
             "on_demand_usd_per_gpu_hour": 0.6, "spot_usd_per_gpu_hour": 0.34,
             "preemption_rate_per_node_hour": 0.05},
            {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 1, "on_demand_usd_per_gpu_hour": 0.1,
             "spot_usd_per_gpu_hour": 0.05, "preemption_rate_per_node_hour": 0.05},
        ]
    }
)  # fmt: skip
"""The L4 is dominated by the RTX 4090 for up to two nodes; its third node is not."""


@pytest.mark.parametrize("pricing", ["spot", "on-demand"])
def test_the_front_is_the_one_found_without_pruning(pricing):
    """Provisioning with mixes leaves out the L4 configurations the RTX 4090 stands in for
    (one or two L4 nodes alone, or beside T4 nodes) and finds the same front, point for
    point, as provisioning that prunes nothing and plans every configuration."""
    kw = dict(pricing=pricing, mixes=True)
    pruned = provision(SMALL, SPOT_MARKET, 2e9, 16, "fp16", **kw)
    full = provision(SMALL, SPOT_MARKET, 2e9, 16, "fp16", prune=False, **kw)
    assert pruned.dominated_by == {"l4": "rtx-4090"}
    # L4 alone x1 and x2; L4 x1 and x2 beside the T4 node; never beside the RTX 4090 (the
    # stand-in would be the RTX 4090 alone, whose search does not hold every mixed plan)
    assert pruned.dominated == 2 + 2
    assert full.dominated == 0 and full.dominated_by == {}
    key = [(round(p.time_to_train_s, 9), round(p.total_cost_usd, 9)) for p in pruned.front]
    assert key == [(round(p.time_to_train_s, 9), round(p.total_cost_usd, 9))
                   for p in full.front]  # fmt: skip
    assert len(key) >= 3  # the T4 node is the cheap end

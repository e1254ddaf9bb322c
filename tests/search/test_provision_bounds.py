"""The provisioning bounds are true lower bounds of what the searches' plans are estimated at."""

import random

import numpy as np
import pytest

from hetplan.cluster import Cluster
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_bounds import iteration_floor_s, path_floor_s, type_floor

MARKET = market_from_dict(
    {
        "offers": [
            {"gpu": "A100-80GB", "gpus_per_node": 4, "max_nodes": 2,
             "on_demand_usd_per_gpu_hour": 3.43},
            {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 0.53},
            {"gpu": "V100-32GB", "gpus_per_node": 4, "max_nodes": 2,
             "on_demand_usd_per_gpu_hour": 0.9},
        ]
    }
)  # fmt: skip


def _floor(model, offer, batch, precision="fp16"):
    return type_floor(model, offer.gpu, offer.gpus_per_node, batch, default_params(),
                      precision, True)  # fmt: skip


@pytest.mark.parametrize("name,batch", [("gpt2", 16), ("gpt2-medium", 64), ("gpt2", 128)])
def test_single_type_bound_below_every_ranked_plan(name, batch):
    model = load_model(name)
    for offer in MARKET.offers:
        for nodes in range(1, offer.max_nodes + 1):
            cluster = offer.cluster(nodes)
            found = search_homogeneous(model, cluster, batch, "fp16", top_k=40)
            assert found.ranked, (offer.name, nodes)
            lb = float(iteration_floor_s(model, batch, [_floor(model, offer, batch)],
                                         [np.array(cluster.num_gpus)]))  # fmt: skip
            assert lb > 0
            for plan, est in found.ranked:
                # every plan of the space, not only the best, is at least the bound
                assert lb <= est.iteration_time_s * (1 + 1e-12), (offer.name, nodes, plan)


def test_mix_bound_below_the_heterogeneous_plans_on_sampled_mixes():
    rng = random.Random(7)
    model = load_model("gpt2")
    offers = MARKET.offers
    checked = 0
    for _ in range(6):
        a, b = rng.sample(offers, 2)
        na, nb = rng.randint(1, a.max_nodes), rng.randint(1, b.max_nodes)
        cluster = Cluster(a.cluster(na).nodes + b.cluster(nb).nodes)
        res = search_heterogeneous(model, cluster, 32, "fp16", top_k=5)
        lb = float(iteration_floor_s(model, 32, [_floor(model, a, 32), _floor(model, b, 32)],
                                     [np.array(na * a.gpus_per_node),
                                      np.array(nb * b.gpus_per_node)]))  # fmt: skip
        for _, est in res.ranked:
            assert lb <= est.iteration_time_s * (1 + 1e-12)
            checked += 1
    assert checked >= 6


def test_critical_path_by_hand_on_one_gpu():
    """One GPU, the global batch one micro-batch: the plan's forward and backward of all
    layers, embedding and head are the whole iteration but for the optimizer step, and the
    floor is that sum at micro-batch 1 (computed here from the layer times directly)."""
    model = load_model("gpt2")
    offer = market_from_dict(
        {"offers": [{"gpu": "A100-80GB", "gpus_per_node": 1, "max_nodes": 1,
                     "on_demand_usd_per_gpu_hour": 3.43}]}
    ).offers[0]  # fmt: skip
    params = default_params()
    src = params.compute
    floor = _floor(model, offer, 1)
    assert floor.micro_batches == (1,)
    by_hand = float("inf")
    lt = src.layer(model, offer.gpu, params, 1, 1, "fp16", True, False).times
    by_hand = lt.forward_s + lt.backward_s
    assert floor.layer_s[0] == pytest.approx(by_hand, rel=1e-12)
    path = path_floor_s(model, [floor], 0)
    # the stage's fixed cost per micro-batch (no runtime profile, so no per-action cost)
    fixed = params.gpu("A100-80GB").microbatch_overhead_s
    assert fixed > 0
    assert path == pytest.approx(
        model.layers * by_hand + floor.embed_s[0] + floor.head_s[0] + fixed, rel=1e-12
    )
    one = search_homogeneous(model, offer.cluster(1), 1, "fp16", top_k=1)
    est = one.ranked[0][1]
    assert path <= est.iteration_time_s
    # one stage, one micro-batch: its forward and backward are exactly the path
    b = est.breakdown
    assert b["microbatch_overhead_s"] == pytest.approx(fixed, rel=1e-12)
    assert b["forward_s"] + b["backward_s"] == pytest.approx(path, rel=1e-9)


def test_fixed_costs_in_the_throughput_floor_by_hand():
    """Two micro-batch sizes on 4 GPUs of one type: the throughput floor is (all FLOPs +
    global / micro-batch x rate x fixed cost) / (4 x rate), the critical path the layers,
    embedding, head and one fixed cost, and the bound the least over the sizes of the
    larger (a hand sum of the floor's own per-size figures)."""
    model = load_model("gpt2")
    offer = MARKET.offers[0]  # A100-80GB, 4 per node
    floor = _floor(model, offer, 4)
    assert floor.micro_batches == (1, 2, 4)
    fixed = default_params().gpu("A100-80GB").microbatch_overhead_s
    assert floor.fixed_s == pytest.approx(fixed, rel=1e-12)
    flops = 4 * model.model_flops_per_sequence()
    want = min(
        max(
            (flops + 4 // mb * r * fixed) / (4 * r),
            model.layers * layer + embed + head + fixed,
        )
        for mb, r, layer, embed, head in zip(
            floor.micro_batches, floor.rate_flops, floor.layer_s, floor.embed_s,
            floor.head_s, strict=True,
        )
    )  # fmt: skip
    got = float(iteration_floor_s(model, 4, [floor], [np.array(4)]))
    assert got == pytest.approx(want, rel=1e-12)

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


@pytest.mark.slow
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
    embedding, head and one fixed cost; the bound at each size is at least the larger (a
    hand sum of the floor's own per-size figures), and exactly the largest of that and the
    coupled floor, least over the sizes."""
    model = load_model("gpt2")
    offer = MARKET.offers[0]  # A100-80GB, 4 per node
    floor = _floor(model, offer, 4)
    assert floor.micro_batches == (1, 2, 4)
    fixed = default_params().gpu("A100-80GB").microbatch_overhead_s
    assert floor.fixed_s == pytest.approx(fixed, rel=1e-12)
    flops = 4 * model.model_flops_per_sequence()
    old = [
        max(
            (flops + 4 // mb * r * fixed) / (4 * r),
            model.layers * layer + embed + head + fixed,
        )
        for mb, r, layer, embed, head in zip(
            floor.micro_batches, floor.rate_flops, floor.layer_s, floor.embed_s,
            floor.head_s, strict=True,
        )
    ]  # fmt: skip
    got = float(iteration_floor_s(model, 4, [floor], [np.array(4)]))
    assert got >= min(old) * (1 - 1e-12)
    coupled = [_lp_floor(model, 4 // mb, [floor], i, [4]) for i, mb in enumerate((1, 2, 4))]
    assert got == pytest.approx(min(map(max, zip(old, coupled, strict=True))), rel=1e-9)


def _lp_floor(model, m, floors, i, counts):
    """The coupled floor solved as the linear program it is the dual of (HiGHS, by scipy):
    minimise T over fractional choices of a GPU type and TP degree for every layer, the
    embedding, the head and one fixed cost of one micro-batch, such that their times sum to
    at most T (the path) and m x their weighted device-seconds are at most T x the GPUs'
    summed rates (every device busy at most T)."""
    from scipy.optimize import linprog

    cols, groups = [], []  # per variable: (time, TP x rate x time, group)
    for g, (count, attr) in enumerate(
        [(model.layers, "layer_tp"), (1, "embed_tp"), (1, "head_tp")]
    ):
        for f in floors:
            for t, x in zip(f.tps, getattr(f, attr)[i], strict=True):
                cols.append((x, t * f.rate_flops[i] * x, g))
        groups.append(count)
    for f in floors:
        cols.append((f.fixed_s, f.rate_flops[i] * f.fixed_s, 3))
    groups.append(1)
    w = sum(f.rate_flops[i] * n for f, n in zip(floors, counts, strict=True))
    n = len(cols)  # the busy row divided by the summed rates (well scaled for HiGHS)
    c = np.zeros(n + 1)
    c[-1] = 1.0  # variables: the fractions, then T
    a_ub = np.array([[x for x, _, _ in cols] + [-1.0], [m * a / w for _, a, _ in cols] + [-1.0]])
    a_eq = np.array([[1.0 if grp == k else 0.0 for _, _, grp in cols] + [0.0]
                     for k in range(len(groups))])  # fmt: skip
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(2), A_eq=a_eq, b_eq=np.array(groups, float),
                  bounds=[(0, None)] * (n + 1), method="highs")  # fmt: skip
    assert res.status == 0
    return float(res.fun)


@pytest.mark.parametrize(
    "name,batch,counts",
    [("gpt2", 16, (64, 8)), ("gpt2-medium", 64, (4, 24)), ("gpt2", 128, (1, 2))],
)
def test_coupled_floor_is_its_linear_program(name, batch, counts):
    """The coupled floor (max over the multiplier of m H(lambda) / (rate + lambda m)) equals
    the optimum of the linear program it relaxes, solved independently by HiGHS."""
    from hetplan.search.provision_bounds import coupled_floor_s

    model = load_model(name)
    a, b = MARKET.offers[0], MARKET.offers[1]
    floors = [_floor(model, a, batch), _floor(model, b, batch)]
    for i, mb in enumerate(floors[0].micro_batches):
        rate = sum(f.rate_flops[i] * n for f, n in zip(floors, counts, strict=True))
        got = float(coupled_floor_s(model, batch // mb, floors, i, np.array(rate)))
        assert got == pytest.approx(_lp_floor(model, batch // mb, floors, i, counts), rel=1e-9)


def test_coupling_beats_throughput_and_path_where_gpus_outnumber_micro_batches():
    """64 A100s, a global batch of 16: the throughput floor lets every GPU compute at its
    most efficient TP degree and the path floor lets one micro-batch run at its fastest;
    no plan does both, and the coupled floor is above either by more than 5% (and still below the
    best plan the homogeneous search finds)."""
    from hetplan.search.provision_bounds import coupled_floor_s

    model = load_model("gpt2")
    offer = market_from_dict(
        {"offers": [{"gpu": "A100-80GB", "gpus_per_node": 8, "max_nodes": 8,
                     "on_demand_usd_per_gpu_hour": 3.43}]}
    ).offers[0]  # fmt: skip
    floor = _floor(model, offer, 16)
    i = 0  # micro-batch 1: 16 micro-batches, 64 GPUs
    rate = np.array(64 * floor.rate_flops[i])
    thr = 16 * model.model_flops_per_sequence() / float(rate)
    path = path_floor_s(model, [floor], i)
    coupled = float(coupled_floor_s(model, 16, [floor], i, rate))
    assert coupled > 1.05 * max(thr, path)
    lb = float(iteration_floor_s(model, 16, [floor], [np.array(64)]))
    best = search_homogeneous(model, offer.cluster(8), 16, "fp16", top_k=1).ranked[0][1]
    assert lb <= best.iteration_time_s

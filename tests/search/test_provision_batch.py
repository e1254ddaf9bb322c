"""The batch floor (whole micro-batches, layers and GPUs) is a true lower bound of what the
searches' plans are estimated at, and its parts match hand sums and brute force."""

import itertools
import random

import numpy as np
import pytest

from hetplan.cluster import Cluster
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_batch import STEP, batch_floor_s, least_gpus
from hetplan.search.provision_bounds import iteration_floor_s, type_floor

MARKET = market_from_dict(
    {
        "offers": [
            {"gpu": "A100-80GB", "gpus_per_node": 4, "max_nodes": 4,
             "on_demand_usd_per_gpu_hour": 3.43},
            {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 0.53},
            {"gpu": "V100-32GB", "gpus_per_node": 4, "max_nodes": 2,
             "on_demand_usd_per_gpu_hour": 0.9},
        ]
    }
)  # fmt: skip


def _floor(model, offer, batch):
    return type_floor(model, offer.gpu, offer.gpus_per_node, batch, default_params(), "fp16",
                      True)  # fmt: skip


def _least(layers, tps, times, fixed, stage_s, path_s):
    return float(least_gpus(layers, np.array(tps, float), np.array(times), fixed,
                            np.array([stage_s]), np.array([path_s]))[0])  # fmt: skip


def test_least_gpus_by_hand():
    """Six layers; TP1 runs a layer in 1 s, TP2 in 0.6 s, no fixed cost; stages of at most
    2 s hold 2 layers at TP1 (0.5 GPU a layer) and 3 at TP2 (2/3 GPU a layer). With 4.8 s
    of path, all at TP1 is too slow (6 s), all at TP2 takes 4 GPUs (3.6 s), and 3 layers at
    TP2 with 3 at TP1 take 3 x 2/3 + 3 x 1/2 = 3.5 GPUs on a path of 1.8 + 3 = 4.8 s."""
    assert _least(6, [1, 2], [1.0, 0.6], 0.0, 2.0, 4.8) == pytest.approx(3.5, rel=1e-9)
    assert _least(6, [1, 2], [1.0, 0.6], 0.0, 2.0, 6.0) == pytest.approx(3.0, rel=1e-9)
    assert _least(6, [1, 2], [1.0, 0.6], 0.0, 2.0, 3.5) == np.inf  # 3.6 s at the fastest
    # a fixed 0.5 s per stage: 2 layers per TP1 stage (2.5 s), paths 1.25 s a layer
    assert _least(4, [1], [1.0], 0.5, 2.6, 5.0) == pytest.approx(2.0, rel=1e-9)
    assert _least(4, [1], [1.0], 0.5, 2.6, 4.9) == np.inf


def _brute_pipeline_gpus(layers, tps, times, fixed, stage_s, path_s):
    """The fewest GPUs of any real pipeline: every sequence of stages (TP degree, layers >= 1)
    holding all layers, each stage within ``stage_s``, their sum within ``path_s``."""
    best = np.inf
    options = [(t, n) for t in tps for n in range(1, layers + 1)]
    for p in range(1, layers + 1):
        for stages in itertools.combinations_with_replacement(options, p):
            if sum(n for _, n in stages) != layers:
                continue
            times_ = [n * times[tps.index(t)] + fixed for t, n in stages]
            if max(times_) <= stage_s and sum(times_) <= path_s:
                best = min(best, sum(t for t, _ in stages))
    return best


def test_least_gpus_never_exceeds_any_real_pipeline():
    """Random small cases against every pipeline there is: the linear program's GPUs are
    at most the fewest of any real pipeline, and reach it in some cases."""
    rng = random.Random(3)
    tight = 0
    for _ in range(60):
        layers = rng.randint(1, 6)
        tps = [1, 2, 4]
        base = rng.uniform(0.5, 2.0)
        times = [base, base * rng.uniform(0.5, 0.9), base * rng.uniform(0.3, 0.6)]
        times[2] = min(times[2], times[1])
        fixed = rng.uniform(0.0, 0.5)
        stage_s = rng.uniform(0.5, 4.0) * base
        path_s = rng.uniform(0.5, 1.5) * layers * base
        real = _brute_pipeline_gpus(layers, tps, times, fixed, stage_s, path_s)
        got = _least(layers, tps, times, fixed, stage_s, path_s)
        assert got <= real * (1 + 1e-9), (layers, times, fixed, stage_s, path_s)
        tight += bool(np.isfinite(real) and np.ceil(got - 1e-9) == real)
    assert tight >= 10


def test_one_gpu_runs_every_micro_batch_by_hand():
    """One GPU (TP 1 only): every plan runs all global / b micro-batches on it, each through
    every layer, the embedding, the head and the stage's fixed cost; the floor counts the
    embedding and the head in whole layers (gpt2's head is 3.7 to 6.4 layers: 3 to 6 whole
    ones) and the path whole. It is, to the grid's step, the least over b of the larger
    (a hand sum of the type's own per-layer, embedding and head times), and below the real
    time of every micro-batch size, M x (layers + embedding + head + fixed)."""
    model = load_model("gpt2")
    offer = market_from_dict(
        {"offers": [{"gpu": "A100-80GB", "gpus_per_node": 1, "max_nodes": 1,
                     "on_demand_usd_per_gpu_hour": 3.43}]}
    ).offers[0]  # fmt: skip
    floor = _floor(model, offer, 8)
    hand, real = [], []
    for i, b in enumerate(floor.micro_batches):
        layer, embed, head = floor.layer_tp[i][0], floor.embed_tp[i][0], floor.head_tp[i][0]
        whole = model.layers + int(embed // layer) + int(head // layer)
        path = model.layers * layer + floor.fixed_s + embed + head
        hand.append(max(8 // b * (whole * layer + floor.fixed_s), path))
        real.append(8 // b * path)
    assert [int(floor.head_tp[i][0] // floor.layer_tp[i][0]) for i in range(4)] == [3, 4, 5, 6]
    got = float(batch_floor_s(model, 8, [floor], np.array(1)))
    assert min(hand) / STEP <= got <= min(hand)
    assert got <= min(real)
    best = search_homogeneous(model, offer.cluster(1), 8, "fp16", top_k=1).ranked[0][1]
    assert got <= best.iteration_time_s


@pytest.mark.parametrize("name,batch", [("gpt2", 8), ("gpt2", 16), ("gpt2-medium", 32)])
def test_batch_floor_below_every_ranked_plan(name, batch):
    """Up to 16 GPUs of one type on global batches of 8 to 32 (more GPUs than micro-batches
    at the larger sizes): every plan the homogeneous search ranks, not only the best, is
    at least the floor."""
    model = load_model(name)
    for offer in MARKET.offers:
        floor = _floor(model, offer, batch)
        for nodes in range(1, offer.max_nodes + 1):
            cluster = offer.cluster(nodes)
            found = search_homogeneous(model, cluster, batch, "fp16", top_k=40)
            n = np.array(cluster.num_gpus)
            lb = float(batch_floor_s(model, batch, [floor], n))
            for plan, est in found.ranked:
                assert lb <= est.iteration_time_s * (1 + 1e-12), (offer.name, nodes, plan)


def test_batch_floor_binds_where_gpus_do_not_divide_the_batch():
    """15 single-GPU A100 nodes, a global batch of 16: the throughput floor spreads the 16
    sequences over 15 GPUs as if each ran 16/15 of a sequence at its best rate; whole
    micro-batches cannot be split so (16 on 15 GPUs, or a pipeline whose stages hold whole
    layers and wait for each other), and the batch floor is above the throughput floors by
    more than 5%, and at most the best plan."""
    model = load_model("gpt2")
    offer = market_from_dict(
        {"offers": [{"gpu": "A100-80GB", "gpus_per_node": 1, "max_nodes": 15,
                     "on_demand_usd_per_gpu_hour": 3.43}]}
    ).offers[0]  # fmt: skip
    floor = _floor(model, offer, 16)
    n = np.array(15)
    lb = float(batch_floor_s(model, 16, [floor], n))
    assert lb > 1.05 * float(iteration_floor_s(model, 16, [floor], [n]))
    found = search_homogeneous(model, offer.cluster(15), 16, "fp16", top_k=40)
    for _, est in found.ranked:
        assert lb <= est.iteration_time_s


def test_batch_floor_below_the_heterogeneous_plans_on_sampled_mixes():
    rng = random.Random(11)
    model = load_model("gpt2")
    checked = 0
    for _ in range(6):
        a, b = rng.sample(MARKET.offers, 2)
        na, nb = rng.randint(1, a.max_nodes), rng.randint(1, b.max_nodes)
        cluster = Cluster(a.cluster(na).nodes + b.cluster(nb).nodes)
        res = search_heterogeneous(model, cluster, 16, "fp16", top_k=5)
        floors = [_floor(model, a, 16), _floor(model, b, 16)]
        lb = float(batch_floor_s(model, 16, floors, np.array(cluster.num_gpus)))
        for _, est in res.ranked:
            assert lb <= est.iteration_time_s * (1 + 1e-12)
            checked += 1
    assert checked >= 6


def test_more_gpus_never_raise_the_floor():
    model = load_model("gpt2")
    floor = _floor(model, MARKET.offers[0], 64)
    got = batch_floor_s(model, 64, [floor], np.arange(1, 200))
    assert np.all(np.diff(got) <= 0)
    assert np.isinf(batch_floor_s(model, 64, [floor], np.array([0]))).all()

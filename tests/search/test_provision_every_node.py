"""Provisioning's mixes need only plans with a device on every node (a plan leaving a node
idle is the smaller configuration's, whose point dominates it): the heterogeneous search
asked for those (``every_node``) against the independent exhaustive enumeration filtered
to them, and the bound those plans add (the step's scalar all-reduces across every node,
``provision_mixes.spread_floor_s``) by hand and against what ``estimate`` charges."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hetplan.cluster import Cluster, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import ModelSpec, load_model
from hetplan.search import provision_mixes as mixes_mod
from hetplan.search import provision_points as pts
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.provision_stages import mix_iteration_floor_s
from hetplan.search.spot import SpotTerms

from .test_het_exhaustive import TOL, exhaustive

ONE_GPU_NODES = {"offers": [
    {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 0.8,
     "spot_usd_per_gpu_hour": 0.37, "preemption_rate_per_node_hour": 0.05,
     "restart_time": "10m"},
    {"gpu": "RTX 4090", "gpus_per_node": 1, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 0.6,
     "spot_usd_per_gpu_hour": 0.34, "preemption_rate_per_node_hour": 0.05,
     "restart_time": "10m"},
]}  # fmt: skip


def _job(model):
    return pts.ProvisionJob(model, 1e9, 16, "fp16", True, default_params(),
                            SpotTerms(state_bytes=12.0 * model.total_params()), True, True,
                            pricing="spot")  # fmt: skip


def test_spread_floor_by_hand():
    """Two all-reduces of one number, each over a binary tree of the nodes: 2 ceil(log2 K)
    steps at the slower type's latency between nodes. 5 nodes: 2 x 6 steps; 2 nodes:
    2 x 2; 8 nodes: 2 x 6."""
    model = load_model("gpt2")
    a, b = market_from_dict(ONE_GPU_NODES).offers
    params = default_params()
    lat = max(params.inter_latency_of("L4"), params.inter_latency_of("RTX 4090"))
    assert lat > 0
    got = mixes_mod.spread_floor_s(_job(model), a, b, np.array([5, 2, 8, 5]))
    assert got == pytest.approx([12 * lat, 4 * lat, 12 * lat, 12 * lat], rel=1e-12)


def test_spread_floor_is_what_estimate_charges_a_plan_on_one_gpu_nodes():
    """On single-GPU nodes a plan using every node has one device on each, so ``estimate``'s
    step collectives are exactly the floor (no steps inside a node), and every plan using
    every node of the mix pays at least the mix's iteration floor plus it."""
    model = load_model("gpt2")
    a, b = market_from_dict(ONE_GPU_NODES).offers
    job = _job(model)
    cluster = Cluster(a.cluster(2, "spot").nodes + b.cluster(1, "spot").nodes)
    res = search_heterogeneous(model, cluster, 16, "fp16", 5, every_node=True)
    assert res.ranked
    step = float(mixes_mod.spread_floor_s(job, a, b, np.array([3]))[0])
    floors = (pts.offer_floor(job, a), pts.offer_floor(job, b))
    it = float(mix_iteration_floor_s(model, 16, floors, np.array([2]), np.array([1]))[0])
    for plan, est in res.ranked:
        assert len(plan.node_names()) == 3
        assert est.breakdown["step_collectives_s"] == pytest.approx(step, rel=1e-12)
        assert it + step <= est.iteration_time_s * (1 + 1e-12)


@pytest.mark.parametrize(("layers", "hidden", "seq", "spec", "batch"), [
    (4, 4096, 1024, "L4:2x1,V100-32GB:1x1", 4),
    (3, 2048, 2048, "V100-32GB:2x1,T4:1x1", 8),
    (4, 1024, 512, "A100-40GB:1x2,V100-16GB:1x2", 4),
])  # fmt: skip
def test_every_node_search_is_the_exhaustive_best_of_plans_using_every_node(
    layers, hidden, seq, spec, batch
):
    """The search asked for plans using every node returns only those, at least as good as
    the best of them the exhaustive enumeration finds; where the unrestricted best leaves a
    node idle the two differ (the restriction is seen)."""
    model = ModelSpec("tiny", "gpt", layers, hidden, 16, 16, 4 * hidden, 32000, seq)
    cluster = parse_inline_cluster(spec)
    params = default_params()
    nodes = {n.name for n in cluster.nodes}
    want = exhaustive(model, cluster, batch, "fp16", params, keep=lambda p: p.node_names() == nodes)
    assert want.plan is not None
    res = search_heterogeneous(model, cluster, batch, "fp16", 3, params, every_node=True)
    assert res.proven, res.notes
    for plan, _ in res.ranked:
        assert plan.node_names() == nodes
    got = estimate(res.ranked[0][0], model, cluster, params)
    assert got.fits and got.iteration_time_s <= want.time_s * (1 + TOL), (res.ranked[0][0], want)
    # and it is one of the plans using every node, so it cannot beat their best either
    assert got.iteration_time_s >= want.time_s * (1 - TOL)
    free = search_heterogeneous(model, cluster, batch, "fp16", 1, params).ranked[0]
    if len(free[0].node_names()) < len(cluster.nodes):
        assert free[1].iteration_time_s < got.iteration_time_s


def test_mix_bounds_lie_below_plans_using_every_node_on_sampled_mixes():
    """Seeded mixes of a small spot market: each mix's time bound (``mix_grid``, then the
    tightened one) is below the time to train of every plan using every node the search
    returns, and the spread floor is part of it (the bound without it is lower)."""
    model = load_model("gpt2")
    market = market_from_dict({"offers": [{**o, "max_nodes": 3} for o in ONE_GPU_NODES["offers"]]})
    job = _job(model)
    grid, pairs, _ = mixes_mod.mix_grid(job, list(market.offers))
    mixes_mod.tighten(job, grid, pairs, np.arange(grid.t_lb.size))
    rng = random.Random(3)
    checked = 0
    for q in rng.sample(range(grid.t_lb.size), 4):
        a, b = pairs[int(grid.pair[q])]
        na, nb = int(grid.na[q]), int(grid.nb[q])
        cluster = mixes_mod.mix_cluster(a, na, b, nb, "spot")
        for _, est in search_heterogeneous(model, cluster, 16, "fp16", 3,
                                           every_node=True).ranked:  # fmt: skip
            # the slowdown's floor (grid.slow) times the iterations: no plan trains faster
            t = pts.iterations(job) * est.iteration_time_s * float(grid.slow[q])
            assert grid.t_lb[q] <= t * (1 + 1e-12)
            checked += 1
    assert checked >= 4

"""Provisioning's spot terms: the checkpoint time of the plan's largest node at the local-disk
rate and Young's interval from the offer's preemption rate (the replay's blocks), a floor of
the slowdown that holds for every plan, and agreement with the replay of a Poisson trace."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetplan.cluster import cluster_from_dict
from hetplan.cost.params import default_params
from hetplan.elastic.placement import shard_bytes
from hetplan.market import Offer, market_from_dict
from hetplan.model import load_model
from hetplan.search.spot import (
    LOCAL_WRITE_BYTES_PER_S,
    SpotTerms,
    checkpoint_floor_s,
    checkpoint_time_s,
    mixed_load,
    offer_load,
    slowdowns,
    spot_slowdown,
)
from hetplan.spot.planner import Planner
from hetplan.spot.pool import layout, pool_from_cluster
from hetplan.spot.simulate import Settings, simulate
from hetplan.spot.traces import PoolType, synthesize


def test_mixed_slowdown_by_hand():
    # offer a: 1 preemption an hour costing 300 s; offer b: 2 an hour costing 150 s each
    a, b = (1 / 3600, 300.0), (2 / 3600, 150.0)
    load = mixed_load([a, b])
    # fixed interval 1200 s, no checkpoint stall: lost work 600 s per preemption;
    # lost share (300 + 600) / 3600 + 2 (150 + 600) / 3600 = 2400 / 3600
    assert slowdowns(*load, SpotTerms(1200.0), 0.0) == pytest.approx(3.0)
    # C = 60 s: lost work 630 s; kept 1 - 930/3600 - 1560/3600, of which 1200/1260 trains
    useful = (1 - 930 / 3600 - 1560 / 3600) * 1200 / 1260
    assert slowdowns(*load, SpotTerms(1200.0), 60.0) == pytest.approx(1 / useful)
    # Young's interval from the run's rate: M = 1200 s, C = 6 s -> sqrt(2 * 6 * 1200) = 120 s
    kept = 1 - (300 + 63) / 3600 - 2 * (150 + 63) / 3600  # lost work (120 + 6) / 2 = 63 s
    assert slowdowns(*load, SpotTerms(), 6.0) == pytest.approx(1 / (kept * 120 / 126))
    # 50% and 60% of the time lost: the run never progresses
    assert math.isinf(slowdowns(*mixed_load([(1 / 3600, 1800.0), (1 / 3600, 2160.0)]),
                                SpotTerms(0.0), 0.0))  # fmt: skip


def test_floor_is_below_every_interval_and_larger_checkpoint():
    """Brute force: the floor at C0 with no interval stated is at most the slowdown at any
    interval on a fine grid and any C >= C0, and it equals the grid's minimum at C0."""
    per_s, fixed = 3 / 3600, 200.0
    for c0 in (2.0, 30.0, 120.0):
        floor = slowdowns(per_s, fixed, SpotTerms(), c0, floor=True)
        grid = np.linspace(1.0, 3000.0, 300_000)
        at_c0 = [slowdowns(per_s, fixed, SpotTerms(float(i)), c0) for i in grid[::997]]
        dense = 1 / (
            (1 - per_s * (fixed + (grid + c0) / 2)) * grid / (grid + c0)
        )  # the slowdown by hand on the whole grid
        assert floor <= min(at_c0) * (1 + 1e-12)
        assert floor == pytest.approx(float(dense[dense > 0].min()), rel=1e-6)
        for c in (c0, 2 * c0, 10 * c0):  # Young's interval at the plan's C is never better
            assert floor <= slowdowns(per_s, fixed, SpotTerms(), c) * (1 + 1e-12)


def test_checkpoint_time_is_the_largest_node_and_the_floor_is_below_it():
    model = load_model("gpt2-medium")
    cluster = cluster_from_dict({"nodes": [{"gpu": "A100-80GB", "gpus": 2, "count": 2}]})
    planner = Planner(model, pool_from_cluster(cluster), "bf16", 32, default_params(), 1.25e9,
                      replan_search=False)  # fmt: skip
    plan = planner.first(layout(planner.pool, {"A100-80GB": 4})).plan
    total = sum(shard_bytes(model).values())
    c = checkpoint_time_s(plan, model)
    # every node holds at least one shard and at most all: between the mean and the whole
    assert total / 2 / LOCAL_WRITE_BYTES_PER_S <= c <= total / LOCAL_WRITE_BYTES_PER_S
    assert float(checkpoint_floor_s(model, 2)) == pytest.approx(total / 2 / 2e9)
    # gpt2-medium: 12 bytes per parameter (fp32 weights and both Adam moments)
    assert total == 12 * model.total_params()


RATE, OUTAGE, RESTART, STORAGE = 0.25, 900.0, 60.0, 1.25e9


@pytest.mark.parametrize("nodes", [1, 2])
def test_provisioning_slowdown_equals_the_replay_long_run(nodes):
    """Provisioning's figure for an offer (its plan's checkpoint time, Young's interval from
    the offer's rate, both chosen by provisioning) against the replay of a long Poisson
    trace at that rate, the replay choosing C and the interval itself (``wait``: the run
    provisioning prices)."""
    model = load_model("gpt2-medium")
    cluster = cluster_from_dict({"nodes": [{"gpu": "A100-80GB", "gpus": 8, "count": nodes}]})
    pool = pool_from_cluster(cluster)
    planner = Planner(model, pool, "bf16", 64, default_params(), STORAGE, replan_search=False)
    trace = synthesize([PoolType("A100-80GB", 8, nodes, RATE, OUTAGE)], 3000 * 3600.0,
                       seed=5 + nodes)  # fmt: skip
    result = simulate(trace, planner, Settings(restart_s=RESTART))  # interval and C: its own
    by = {p["name"]: p for p in result.policies}
    replay = trace.duration_s / (by["wait"]["tokens"] / result.first_tokens_per_s)
    node = pool.types["A100-80GB"].template
    offer = Offer("a100", node.gpu, 8, nodes, 3.0, 1.0, node.network_bytes_per_s,
                  node.intra_node_bytes_per_s, RATE, restart_s=OUTAGE + RESTART)  # fmt: skip
    plan = planner.first(layout(pool, {"A100-80GB": 8 * nodes})).plan
    terms = SpotTerms(state_bytes=12.0 * model.total_params(), storage_bytes_per_s=STORAGE)
    closed = spot_slowdown(offer, nodes, terms, checkpoint_time_s(plan, model))
    assert result.checkpoint_s == pytest.approx(checkpoint_time_s(plan, model))
    assert closed > 1.05  # preemptions matter here
    assert replay == pytest.approx(closed, rel=0.03)


def _a100_t4_spot_market(nodes: int, rates: tuple[float, float]):
    """Two-GPU nodes of A100 80GB and T4, up to ``nodes`` each, at spot prices and these
    preemptions per node-hour."""
    return market_from_dict(
        {
            "offers": [
                {"gpu": "A100-80GB", "gpus_per_node": 2, "max_nodes": nodes,
                 "on_demand_usd_per_gpu_hour": 3.43, "spot_usd_per_gpu_hour": 1.2,
                 "preemption_rate_per_node_hour": rates[0]},
                {"gpu": "T4", "gpus_per_node": 2, "max_nodes": nodes,
                 "on_demand_usd_per_gpu_hour": 0.526, "spot_usd_per_gpu_hour": 0.2,
                 "preemption_rate_per_node_hour": rates[1]},
            ]
        }
    )  # fmt: skip


@pytest.mark.slow
def test_spot_provisioning_bounds_hold_and_use_the_plan_checkpoint():
    """Every planned spot point (single types and mixes, nothing pruned) is at least the
    bound the search held for it, and its time is the on-demand time stretched by the
    slowdown of its own plan's checkpoint time at Young's interval."""
    from hetplan.search.provision import provision

    market = _a100_t4_spot_market(2, (0.5, 0.3))
    model = load_model("gpt2")
    res = provision(model, market, 1e9, 16, "fp16", spot=True, mixes=True, prune=False)
    assert len(res.points) == 8
    offers = {o.gpu.name: o for o in market.offers}
    terms = SpotTerms(state_bytes=12.0 * model.total_params())
    for p in res.points:
        assert 0 < p.bound_s <= p.time_to_train_s * (1 + 1e-12), p.gpus
        loads = [offer_load(offers[g], n // 2, terms) for g, n in p.gpus.items()]
        slow = slowdowns(*mixed_load(loads), terms, checkpoint_time_s(p.plan, model))
        assert p.estimate is not None and slow > 1.0
        assert p.time_to_train_s == pytest.approx(1e9 / p.estimate.tokens_per_s * slow)


def test_checkpoint_floor_by_hand_and_below_every_ranked_plan():
    """gpt2: 12 layers, the embedding and the head are 14 shards. On n nodes the fullest
    node holds at least the mean over the nodes; one pipeline spreads every shard over at
    most 14 stages, each stage's shards all on each of its nodes, so some node holds at
    least the total over 14, and at least the largest shard (the embedding)."""
    from hetplan.search.homogeneous import search_homogeneous

    model = load_model("gpt2")
    sizes = shard_bytes(model)
    total, largest = sum(sizes.values()), max(sizes.values())
    assert len(sizes) == 14
    assert largest > total / 14  # gpt2's embedding (50257 x 768) outweighs a mean shard
    for nodes, want in ((1, total), (2, total / 2), (30, largest), (1000, largest)):
        assert float(checkpoint_floor_s(model, nodes)) == pytest.approx(want / 2e9, rel=1e-12)
    cluster = cluster_from_dict({"nodes": [{"gpu": "T4", "gpus": 2, "count": 4}]})
    found = search_homogeneous(model, cluster, 32, "fp16", top_k=40)
    assert len(found.ranked) >= 10
    floor = float(checkpoint_floor_s(model, 4))
    assert floor == pytest.approx(total / 4 / 2e9, rel=1e-12)
    from hetplan.elastic.placement import stage_units

    for plan, _ in found.ranked:
        # every plan holds every shard once (uneven interleaved chunks included)
        held = set().union(*(us for pipe in stage_units(plan, model) for us in pipe))
        assert len(held) == len(sizes)
        assert floor <= checkpoint_time_s(plan, model) * (1 + 1e-12)


def test_a_limit_never_trains_faster_on_spot():
    """The best plan under limits is the best of the plans that satisfy them, so the
    unlimited search is at least as fast at every GPU count. On spot the plan with the
    fastest iteration need not train fastest (more stages, a smaller checkpoint per node):
    the search once kept the fastest iteration's plan, and --pp 2 beat it (32 A100: 2.69
    against 3.05 days at 2 preemptions a node-hour)."""
    from hetplan.search.constraints import PlanConstraints
    from hetplan.search.provision import provision

    market = market_from_dict({"offers": [{
        "name": "a100", "gpu": "A100-80GB", "gpus_per_node": 8, "max_nodes": 4,
        "on_demand_usd_per_gpu_hour": 3.43, "spot_usd_per_gpu_hour": 1.16,
        "preemption_rate_per_node_hour": 2.0, "restart_time": "1m"}]})  # fmt: skip
    model = load_model("gpt3-6.7b")

    def times(limits):
        res = provision(model, market, 2e10, 512, "bf16", spot=True, prune=False,
                        limits=limits)  # fmt: skip
        return {sum(p.gpus.values()): p.time_to_train_s for p in res.points}

    free = times(None)
    beaten = 0
    for pp in (1, 2, 4):
        limited = times(PlanConstraints(pp=(pp,)))
        for n, t in limited.items():
            assert free[n] <= t * (1 + 1e-9), (pp, n, free[n], t)
            beaten += free[n] < t * (1 - 1e-6)
    assert beaten >= 1


def test_idle_nodes_never_lower_the_slowdown_by_hand():
    """A plan on one offer's nodes of a two-offer mix trains no faster there than on those
    nodes alone: the other nodes' preemptions stop the run too. By hand, a: 1 preemption an
    hour costing 300 s, b adds 2 costing 150 s; fixed interval 1200 s, no stall: a alone
    loses (300 + 600) / 3600 of the time (slowdown 4/3), the mix 2400 / 3600 (slowdown 3).
    And over random loads, checkpoint times and Young's interval, the mix's is never less."""
    a, b = (1 / 3600, 300.0), (2 / 3600, 150.0)
    assert slowdowns(*a, SpotTerms(1200.0), 0.0) == pytest.approx(4 / 3)
    assert slowdowns(*mixed_load([a, b]), SpotTerms(1200.0), 0.0) == pytest.approx(3.0)
    rng = np.random.default_rng(5)
    for _ in range(500):
        a = (rng.uniform(0, 3) / 3600, rng.uniform(0, 900))
        b = (rng.uniform(0, 3) / 3600, rng.uniform(0, 900))
        c = rng.uniform(0, 120)
        terms = SpotTerms() if rng.random() < 0.5 else SpotTerms(rng.uniform(60, 3600))
        alone = slowdowns(*a, terms, c)
        both = slowdowns(*mixed_load([a, b]), terms, c)
        assert both >= alone * (1 - 1e-12) or math.isinf(both)


@pytest.mark.slow
def test_spot_mixes_front_is_the_same_with_every_plan_of_every_mix(monkeypatch):
    """Provisioning's mixes are searched only for plans using every node, without the
    single-type baseline (a plan leaving a node idle, a whole type included, is the smaller
    configuration's, which dominates it): the spot front with mixes, every mix planned, is
    the same as with every plan of every mix searched (the baseline too), though the mixes'
    own points differ (their best plans leave nodes idle)."""
    from hetplan.search import heterogeneous
    from hetplan.search.provision import provision

    market = _a100_t4_spot_market(2, (0.2, 0.05))
    model = load_model("gpt2")

    def planned():
        got = provision(model, market, 1e9, 16, "fp16", spot=True, mixes=True, prune=False)
        assert sum(len(p.gpus) == 2 for p in got.points) == 4  # every mix has a plan
        front = [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in got.front]
        mixes = [p.time_to_train_s for p in got.points if len(p.gpus) == 2]
        return front, mixes

    front, mixes = planned()
    assert len(front) >= 2
    search = heterogeneous.search_heterogeneous

    def every_plan(*args, **kwargs):
        kwargs["single_type"], kwargs["every_node"] = True, False
        return search(*args, **kwargs)

    monkeypatch.setattr(heterogeneous, "search_heterogeneous", every_plan)
    front_all, mixes_all = planned()
    assert front_all == front
    assert mixes_all != mixes

"""Provisioning's closed-form spot model and the event-by-event replay agree: the replay of a
long synthetic Poisson trace (the ``wait`` policy, the run provisioning prices: wait for the
replacement, recover its state, redo the lost work) converges to ``spot_slowdown``."""

from __future__ import annotations

import pytest

from hetplan.cluster import cluster_from_dict
from hetplan.cost.params import default_params
from hetplan.elastic.placement import shard_bytes
from hetplan.market import Offer
from hetplan.model import load_model
from hetplan.search.spot import (
    SpotTerms,
    preemption_loss_s,
    spot_slowdown,
    useful_fraction,
    young_daly_interval_s,
)
from hetplan.spot.planner import Planner
from hetplan.spot.pool import pool_from_cluster
from hetplan.spot.simulate import Settings, simulate
from hetplan.spot.traces import PoolType, synthesize

STORAGE = 1.25e9
RATE = 0.25  # preemptions per node-hour
OUTAGE = 900.0  # mean seconds a preempted node stays away
RESTART = 60.0
CKPT = 8.0


@pytest.mark.parametrize("nodes", [1, 2])
def test_replay_converges_to_spot_slowdown(nodes):
    model = load_model("gpt2-medium")
    cluster = cluster_from_dict({"nodes": [{"gpu": "A100-80GB", "gpus": 8, "count": nodes}]})
    pool = pool_from_cluster(cluster)
    planner = Planner(model, pool, "bf16", 64, default_params(), STORAGE, replan_search=False)
    hours = 3000.0
    trace = synthesize(
        [PoolType("A100-80GB", 8, nodes, RATE, OUTAGE)], hours * 3600, seed=11 + nodes
    )
    interval = young_daly_interval_s(CKPT, 3600 / (RATE * nodes))
    result = simulate(
        trace, planner, Settings(restart_s=RESTART, interval_s=interval, checkpoint_s=CKPT)
    )
    by = {p["name"]: p for p in result.policies}
    rate = result.first_tokens_per_s
    replay = trace.duration_s / (by["wait"]["tokens"] / rate)  # wall time / useful time
    node = pool.types["A100-80GB"].template
    offer = Offer(
        "a100", node.gpu, 8, nodes, 3.0, 1.0, node.network_bytes_per_s,
        node.intra_node_bytes_per_s, RATE, restart_s=OUTAGE + RESTART,
    )  # fmt: skip
    terms = SpotTerms(interval, float(sum(shard_bytes(model).values())), STORAGE, CKPT)
    closed = spot_slowdown(offer, nodes, terms)
    assert closed > 1.05  # preemptions matter here
    assert replay == pytest.approx(closed, rel=0.03)


def test_building_blocks_by_hand():
    # Young: C = 8 s, M = 900 s -> sqrt(2 * 8 * 900) = 120 s
    assert young_daly_interval_s(8.0, 900.0) == pytest.approx(120.0)
    assert young_daly_interval_s(8.0, float("inf")) == float("inf")
    # one preemption an hour, each costing 600 s restart + 40 s recovery + (120 + 8) / 2 lost:
    # 704 s an hour lost; of the rest, 120 / 128 trains
    loss = preemption_loss_s(600.0, 40.0, 120.0, 8.0)
    assert loss == pytest.approx(704.0)
    assert useful_fraction(1 / 3600, loss, 120.0, 8.0) == pytest.approx(
        (1 - 704 / 3600) * 120 / 128
    )
    assert useful_fraction(1 / 60, loss, 120.0, 8.0) == 0.0  # never progresses
    # without checkpoint stalls spot_slowdown keeps its earlier closed form
    node = (
        pool_from_cluster(cluster_from_dict({"nodes": [{"gpu": "A100-80GB", "gpus": 8}]}))
        .types["A100-80GB"]
        .template
    )
    offer = Offer("a", node.gpu, 8, 4, 3.0, 1.0, 25e9, 300e9, 0.1, restart_s=600.0)
    terms = SpotTerms(1800.0, 0.0)
    assert spot_slowdown(offer, 4, terms) == pytest.approx(1 / (1 - 0.4 / 3600 * (600 + 900)))

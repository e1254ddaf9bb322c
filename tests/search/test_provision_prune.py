"""Pruning of spot mixes against an independent brute force: every configuration of a small
market planned by the searches directly, its spot slowdown from its own plan, the Pareto set
taken by hand. The bounded search must return that set, each configuration's proven bounds
must lie below what its plan reaches, and bounds made 20% too tight must lose a front point
(the brute force sees the bounds matter)."""

from __future__ import annotations

import numpy as np
import pytest

from hetplan.cluster import Cluster
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search import provision as prov
from hetplan.search import provision_mixes as mixes_mod
from hetplan.search import provision_points as pts
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_stages import mix_time_floor_s, stage_grid
from hetplan.search.spot import SpotTerms, checkpoint_time_s, mixed_load, offer_load, slowdowns

MARKETS = [
    [
        {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 1, "on_demand_usd_per_gpu_hour": 0.684,
         "spot_usd_per_gpu_hour": 0.373, "preemption_rate_per_node_hour": 0.5,
         "restart_time": "10m"},
        {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 0.674,
         "spot_usd_per_gpu_hour": 0.192, "preemption_rate_per_node_hour": 0.05,
         "restart_time": "10m"},
    ],
    [
        {"gpu": "A100-80GB", "gpus_per_node": 2, "max_nodes": 1,
         "on_demand_usd_per_gpu_hour": 3.144, "spot_usd_per_gpu_hour": 0.93,
         "preemption_rate_per_node_hour": 0.5, "restart_time": "10m"},
        {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 0.851,
         "spot_usd_per_gpu_hour": 0.394, "preemption_rate_per_node_hour": 0.05,
         "restart_time": "10m"},
    ],
]  # fmt: skip
MODEL, TOKENS, BATCH = "gpt2", 1e9, 16


def _brute_force(market, every_node=False):
    """Every configuration planned directly: (GPUs by type, time to train in seconds, cost
    in dollars), None for both where the search finds no plan; ``every_node``: the mixes
    planned with a device on every node (what their bounds bound)."""
    model = load_model(MODEL)
    terms = SpotTerms(state_bytes=12.0 * model.total_params())
    rows = []
    for offer in market.offers:
        for n in range(1, offer.max_nodes + 1):
            found = search_homogeneous(model, offer.cluster(n, "spot"), BATCH, "fp16", top_k=1,
                                       space=prov.PROVISION_SPACE)  # fmt: skip
            if not found.ranked:  # e.g. one GPU: the provisioning space has no ZeRO-0
                rows.append(({offer.gpu.name: n * offer.gpus_per_node}, None, None))
                continue
            plan, est = found.ranked[0]
            slow = slowdowns(*offer_load(offer, n, terms), terms, checkpoint_time_s(plan, model))
            t = TOKENS / est.tokens_per_s * slow
            gpus = n * offer.gpus_per_node
            rows.append(({offer.gpu.name: gpus}, t, t / 3600 * gpus * offer.price("spot")))
    a, b = market.offers
    for na in range(1, a.max_nodes + 1):
        for nb in range(1, b.max_nodes + 1):
            cluster = Cluster(a.cluster(na, "spot").nodes + b.cluster(nb, "spot").nodes)
            ranked = search_heterogeneous(model, cluster, BATCH, "fp16", 1,
                                          every_node=every_node).ranked  # fmt: skip
            ga, gb = na * a.gpus_per_node, nb * b.gpus_per_node
            if not ranked:
                rows.append(({a.gpu.name: ga, b.gpu.name: gb}, None, None))
                continue
            plan, est = ranked[0]
            load = mixed_load([offer_load(a, na, terms), offer_load(b, nb, terms)])
            t = TOKENS / est.tokens_per_s * slowdowns(*load, terms, checkpoint_time_s(plan, model))
            usd = ga * a.price("spot") + gb * b.price("spot")
            rows.append(({a.gpu.name: ga, b.gpu.name: gb}, t, t / 3600 * usd))
    return rows


def _pareto(rows):
    rows = [r for r in rows if r[1] is not None]
    out = [r for r in rows if not any(q[1] <= r[1] and q[2] <= r[2] and (q[1], q[2]) != (r[1], r[2])
                                      for q in rows)]  # fmt: skip
    return sorted(out, key=lambda r: r[1])


def _front(res):
    return [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in res.front]


def _same(front, want):
    return len(front) == len(want) and all(
        g == h and t == pytest.approx(u, rel=1e-9) and c == pytest.approx(d, rel=1e-9)
        for (g, t, c), (h, u, d) in zip(front, want, strict=True)
    )


@pytest.mark.parametrize("offers", MARKETS)
def test_spot_mixes_front_and_bounds_against_brute_force(offers):
    market = market_from_dict({"offers": offers})
    model = load_model(MODEL)
    rows = _brute_force(market)
    want = _pareto(rows)
    got = prov.provision(model, market, TOKENS, BATCH, "fp16", spot=True, mixes=True)
    assert any(len(g) == 2 for g, _, _ in rows)
    assert _same(_front(got), want)
    assert got.planned + got.pruned + got.impossible == len(rows)
    # every mix's proven bounds lie below what its best plan using every node reaches (time
    # and cost): the plans the bounds are of (a plan leaving a node idle is the smaller
    # configuration's, whose point dominates it: the front above is all plans')
    job = pts.ProvisionJob(model, TOKENS, BATCH, "fp16", True, default_params(),
                           SpotTerms(state_bytes=12.0 * model.total_params()), True, True,
                           pricing="spot")  # fmt: skip
    grid, pairs, impossible = mixes_mod.mix_grid(job, list(market.offers))
    assert impossible == 0 and grid.t_lb.size == sum(len(g) == 2 for g, _, _ in rows)
    spanning = _brute_force(market, every_node=True)
    reached = {tuple(sorted(g.items())): (t, c) for g, t, c in spanning
               if len(g) == 2 and t is not None}  # fmt: skip
    assert reached
    for q in range(grid.t_lb.size):
        a, b = pairs[int(grid.pair[q])]
        key = tuple(sorted({a.gpu.name: int(grid.na[q]) * a.gpus_per_node,
                            b.gpu.name: int(grid.nb[q]) * b.gpus_per_node}.items()))  # fmt: skip
        if key not in reached:  # no plan uses every node of this mix
            continue
        t, c = reached[key]
        assert grid.t_lb[q] <= t * (1 + 1e-12)
        assert grid.c_lb[q] <= c * (1 + 1e-12)
        # the bound over the fewest stages of any pipeline, at least the first and below t
        na, nb = np.array([grid.na[q]]).astype(int), np.array([grid.nb[q]]).astype(int)
        floors = (pts.offer_floor(job, a), pts.offer_floor(job, b))
        step = mixes_mod.spread_floor_s(job, a, b, na + nb)
        tight = float(mix_time_floor_s(model, BATCH, pts.iterations(job), job.terms, (a, b),
                                       floors, na, nb, step)[0])  # fmt: skip
        assert tight >= grid.t_lb[q] * (1 - 1e-12)
        assert tight <= t * (1 + 1e-12)
    # and every planned point's own bound, single types included
    assert any(len(p.gpus) == 1 for p in got.points)
    for p in got.points:
        assert 0 < p.bound_s <= p.time_to_train_s * (1 + 1e-12)


def test_bounds_made_too_tight_lose_a_front_point(monkeypatch):
    """The same search with every floor (single types, mixes, the spot mixes' stage bound)
    doubled prunes a mix the brute force puts on the front: the front test above can tell a
    true bound from a false one. (Planned cheapest first, the single types' points are the
    slow end of the front; the mixes beside them are what a false bound loses.)"""
    market = market_from_dict({"offers": MARKETS[0]})
    model = load_model(MODEL)
    want = _pareto(_brute_force(market))
    floor, mix, spot = (
        prov.iteration_floor_s,
        mixes_mod.mix_iteration_floor_s,
        mixes_mod.mix_time_floor_s,
    )
    monkeypatch.setattr(prov, "iteration_floor_s", lambda *a, **k: 2.0 * floor(*a, **k))
    monkeypatch.setattr(mixes_mod, "mix_iteration_floor_s", lambda *a, **k: 2.0 * mix(*a, **k))
    monkeypatch.setattr(mixes_mod, "mix_time_floor_s", lambda *a, **k: 2.0 * spot(*a, **k))
    got = prov.provision(model, market, TOKENS, BATCH, "fp16", spot=True, mixes=True)
    assert not _same(_front(got), want)
    missing = [g for g, _, _ in want if g not in [p.gpus for p in got.front]]
    assert missing and all(len(g) == 2 for g in missing), missing  # mixes, as said


def test_impossible_configurations_are_counted_by_reason(tmp_path):
    """GPT-3 13B's Adam states alone take 12 bytes x 13e9 parameters = 156 GB; every mix of
    up to 2 T4 nodes of 2 (64 GB) and 2 L4s (48 GB) holds at most 112 GB: none can train.
    With --max-gpus 5, the mix of 4 T4s and 2 L4s is over the cap first (counted once, for
    that reason); the other three mixes lack memory. Single types are planned (the
    homogeneous search finds nothing that fits)."""
    import json
    import subprocess
    import sys

    from hetplan.search.constraints import PlanConstraints

    offers = {"offers": [
        {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 0.53},
        {"gpu": "L4", "gpus_per_node": 1, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 0.8},
    ]}  # fmt: skip
    model = load_model("gpt3-13b")
    assert 12 * model.total_params() > 112e9 * 1.3
    got = prov.provision(model, market_from_dict(offers), 1e9, 16, "fp16", mixes=True,
                         limits=PlanConstraints(max_gpus=5))  # fmt: skip
    assert got.impossible_by_reason == {"max_gpus": 1, "memory": 3}
    assert got.impossible == 4 and not got.front
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(offers))  # JSON is YAML
    run = subprocess.run(
        [sys.executable, "-m", "hetplan", "provision", "--model", "gpt3-13b", "--market",
         str(path), "--tokens", "1e9", "-b", "16", "--precision", "fp16", "--mixes",
         "--max-gpus", "5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "no possible plan: 1 more GPUs than --max-gpus; 3 too little memory" in text


def test_stage_grid_and_the_stage_bound_tighten_where_nodes_are_many():
    """gpt2: 14 shards, the embedding (50257 x 768 + 1024 x 768 parameters, 12 bytes each)
    the largest; C's floor stops falling at ceil(state / embedding) stages. On 8 single-L4
    nodes + 1 T4 node, at 0.5 preemptions a node-hour, the plain bound takes C at the state
    over 9 nodes; the stage bound knows that short pipelines checkpoint more per node and
    long ones pay more fixed costs: it is higher, and still below what the heterogeneous
    search's best plan using every node reaches (what the mixes' bounds are of)."""
    import math

    from hetplan.elastic.placement import shard_bytes

    model = load_model(MODEL)
    sizes = shard_bytes(model)
    embed = (50257 * 768 + 1024 * 768) * 12
    assert max(sizes.values()) == embed and len(sizes) == 14
    last = math.ceil(sum(sizes.values()) / embed)
    assert stage_grid(model) == [g for g in (1, 2, 3, 4, 5, 6, 8, 10, 12) if g < last] + [last]
    market = market_from_dict({"offers": [
        {**MARKETS[0][0], "max_nodes": 8, "preemption_rate_per_node_hour": 0.5},
        {**MARKETS[0][1], "max_nodes": 1, "preemption_rate_per_node_hour": 0.5},
    ]})  # fmt: skip
    a, b = market.offers
    terms = SpotTerms(state_bytes=12.0 * model.total_params())
    job = pts.ProvisionJob(model, TOKENS, BATCH, "fp16", True, default_params(), terms,
                           True, True, pricing="spot")  # fmt: skip
    grid, _, _ = mixes_mod.mix_grid(job, [a, b])
    q = int(np.nonzero((grid.na == 8) & (grid.nb == 1))[0][0])
    floors = (pts.offer_floor(job, a), pts.offer_floor(job, b))
    step = mixes_mod.spread_floor_s(job, a, b, np.array([9]))
    tight = float(mix_time_floor_s(model, BATCH, pts.iterations(job), terms, (a, b), floors,
                                   np.array([8]), np.array([1]), step)[0])  # fmt: skip
    assert tight > 1.02 * grid.t_lb[q]
    cluster = Cluster(a.cluster(8, "spot").nodes + b.cluster(1, "spot").nodes)
    plan, est = search_heterogeneous(model, cluster, BATCH, "fp16", 1, every_node=True).ranked[0]
    load = mixed_load([offer_load(a, 8, terms), offer_load(b, 1, terms)])
    t = TOKENS / est.tokens_per_s * slowdowns(*load, terms, checkpoint_time_s(plan, model))
    assert tight <= t


def _point(t, usd):
    return pts.Point({"T4": 1}, False, t, usd, 0.0)


def test_dominated_from_by_hand():
    """Points (10 s, $100) and (20 s, $50), a configuration at $3,600 an hour ($1 a second):
    at t it costs $t, so the second point dominates it from t = 50 (20 <= 50, 50 <= 50), the
    first only from t = 100; just below 50 nothing does."""
    points = [_point(10.0, 100.0), _point(20.0, 50.0)]
    assert pts.dominated_from_s(3600.0, points) == pytest.approx(50.0)
    assert pts.dominated(50.0, 50.0, points)
    assert not pts.dominated(49.9, 49.9, points)
    # faster than every point: never dominated below the fastest point's time
    assert pts.dominated_from_s(3600.0 * 1000, points) == pytest.approx(10.0)
    assert pts.dominated_from_s(3600.0, []) == np.inf


def test_homogeneous_cutoff_returns_the_best_below_it_and_nothing_above():
    """``cutoff``: with the best plan's time a hair above it the search returns nothing; a
    hair below, that same plan (the provisioning search's cut of dominated plans)."""
    model = load_model("gpt3-350m")
    cluster = market_from_dict(
        {
            "offers": [
                {"gpu": "T4", "gpus_per_node": 4, "max_nodes": 3, "on_demand_usd_per_gpu_hour": 0.5}
            ]
        }
    ).offers[0]
    cl = cluster.cluster(3)
    best = search_homogeneous(model, cl, 64, "fp16", top_k=1).ranked[0]
    t = best[1].iteration_time_s
    assert search_homogeneous(model, cl, 64, "fp16", top_k=1, cutoff=t * (1 - 1e-6)).ranked == []
    again = search_homogeneous(model, cl, 64, "fp16", top_k=1, cutoff=t * (1 + 1e-6)).ranked
    assert again[0][1].iteration_time_s == t


def test_past_the_time_limit_mixes_keep_their_cheap_bounds():
    """Once --time-limit has passed no mix is planned, so the mixes' costlier bounds, which
    only list the mixes left, are not computed either: every pair of offers gets the
    throughput, path and coupled floors alone (``mix_grid`` without the batch floor, exactly)
    and ``tighten`` leaves them as they are. Without a limit the same mixes get bounds at least
    those and, on some, more than 1% higher: the limit is what kept them low."""
    import time

    model = load_model(MODEL)
    market = market_from_dict({"offers": [
        {**MARKETS[0][0], "max_nodes": 8}, {**MARKETS[0][1], "max_nodes": 2},
    ]})  # fmt: skip
    offers = list(market.offers)
    terms = SpotTerms(state_bytes=12.0 * model.total_params())

    def job(stop_at: float | None) -> pts.ProvisionJob:
        return pts.ProvisionJob(model, TOKENS, BATCH, "fp16", True, default_params(), terms,
                                True, True, pricing="spot", stop_at=stop_at)  # fmt: skip

    late = job(time.monotonic() - 1.0)
    assert late.out_of_time() and not job(None).out_of_time()
    grid, pairs, _ = mixes_mod.mix_grid(late, offers)
    cheap, _, _ = mixes_mod.mix_grid(job(None), offers, batch=False)
    assert grid.t_lb.size > 4
    np.testing.assert_array_equal(grid.na, cheap.na)
    np.testing.assert_array_equal(grid.nb, cheap.nb)
    np.testing.assert_array_equal(grid.t_lb, cheap.t_lb)
    kept = grid.t_lb.copy()
    mixes_mod.tighten(late, grid, pairs, np.arange(grid.t_lb.size))
    np.testing.assert_array_equal(grid.t_lb, kept)
    full, full_pairs, _ = mixes_mod.mix_grid(job(None), offers)
    np.testing.assert_array_equal(full.na, cheap.na)
    np.testing.assert_array_equal(full.nb, cheap.nb)
    mixes_mod.tighten(job(None), full, full_pairs, np.arange(full.t_lb.size))
    assert np.all(full.t_lb >= cheap.t_lb)
    assert np.any(full.t_lb > 1.01 * cheap.t_lb)

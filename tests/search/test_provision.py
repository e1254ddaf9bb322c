import math

import pytest

from hetplan.errors import InputError
from hetplan.market import load_market, market_from_dict
from hetplan.model import load_model
from hetplan.search.provision import provision_single_type
from hetplan.search.provision_points import Point, pareto_front
from hetplan.search.spot import SpotTerms, spot_slowdown


def _market(rate=0.0):
    return market_from_dict(
        {
            "offers": [
                {
                    "gpu": "A100-80GB",
                    "gpus_per_node": 8,
                    "max_nodes": 2,
                    "on_demand_usd_per_gpu_hour": 3.43,
                    "spot_usd_per_gpu_hour": 1.16,
                    "preemption_rate_per_node_hour": rate,
                },
                {
                    "gpu": "T4",
                    "gpus_per_node": 4,
                    "max_nodes": 3,
                    "on_demand_usd_per_gpu_hour": 0.526,
                    "spot_usd_per_gpu_hour": 0.21,
                    "preemption_rate_per_node_hour": rate,
                },
            ]
        }
    )


def test_pareto_front_against_brute_force():
    pts = [
        Point({"x": i}, False, t, c, 1.0)
        for i, (t, c) in enumerate([(1, 9), (2, 5), (3, 5), (4, 1), (2.5, 7), (5, 1)])
    ]
    front = pareto_front(pts)
    brute = [
        p
        for p in pts
        if not any(
            q is not p
            and q.time_to_train_s <= p.time_to_train_s
            and q.total_cost_usd <= p.total_cost_usd
            and (q.time_to_train_s, q.total_cost_usd) != (p.time_to_train_s, p.total_cost_usd)
            for q in pts
        )
    ]
    assert sorted(id(p) for p in front) == sorted(id(p) for p in brute)


def test_pruned_front_equals_exhaustive_front():
    model = load_model("gpt2-medium")
    fast = provision_single_type(model, _market(), 1e9, 64, "fp16", prune=True)
    full = provision_single_type(model, _market(), 1e9, 64, "fp16", prune=False)
    key = [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in fast.front]
    assert key == [(p.gpus, p.time_to_train_s, p.total_cost_usd) for p in full.front]
    assert fast.planned + fast.pruned == full.planned


def test_spot_against_on_demand():
    model = load_model("gpt2-medium")
    on_demand = provision_single_type(model, _market(0.0), 1e9, 64, "fp16")
    free_spot = provision_single_type(model, _market(0.0), 1e9, 64, "fp16", spot=True)
    # no preemptions: same times, lower prices
    assert min(p.total_cost_usd for p in free_spot.front) < min(
        p.total_cost_usd for p in on_demand.front
    )
    assert min(p.time_to_train_s for p in free_spot.front) == pytest.approx(
        min(p.time_to_train_s for p in on_demand.front)
    )
    # preemptions every few minutes: a spot run never finishes
    doomed = provision_single_type(model, _market(30.0), 1e9, 64, "fp16", spot=True)
    assert doomed.front == []
    offer = _market(0.1).offers[0]
    assert spot_slowdown(offer, 2, SpotTerms()) > spot_slowdown(offer, 1, SpotTerms()) > 1
    assert math.isinf(spot_slowdown(_market(30.0).offers[0], 1, SpotTerms()))


def test_default_market_and_errors():
    market = load_market(None)
    assert {"A100-80GB", "H100-80GB", "T4"} <= {o.gpu.name for o in market.offers}
    with pytest.raises(InputError) as info:
        market_from_dict(
            {"offers": [{"gpu": "T4", "max_nodes": 1, "on_demand_usd_per_gpu_hour": -1}]}
        )
    assert info.value.field == "offers[0].on_demand_usd_per_gpu_hour"
    with pytest.raises(InputError, match="unknown GPU type"):
        market_from_dict(
            {"offers": [{"gpu": "Z80", "max_nodes": 1, "on_demand_usd_per_gpu_hour": 1}]}
        )
    with pytest.raises(InputError, match="offers"):
        market_from_dict({"nodes": []})
    offer = {"name": "a", "gpu": "T4", "max_nodes": 1, "on_demand_usd_per_gpu_hour": 1}
    with pytest.raises(InputError) as info:
        market_from_dict({"offers": [offer, {**offer, "name": "b"}, offer]})
    assert info.value.field == "offers[2].name" and "offers[0]'s name" in info.value.reason


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("on_demand_usd_per_gpu_hour", float("nan"), "on_demand_usd_per_gpu_hour"),
        ("on_demand_usd_per_gpu_hour", float("inf"), "on_demand_usd_per_gpu_hour"),
        ("spot_usd_per_gpu_hour", float("nan"), "spot_usd_per_gpu_hour"),
        ("reserved_usd_per_gpu_hour", float("inf"), "reserved_usd_per_gpu_hour"),
        ("preemption_rate_per_node_hour", float("nan"), "preemption_rate_per_node_hour"),
        ("max_nodes", 2.5, "max_nodes"),
        ("gpus_per_node", 2.5, "gpus_per_node"),
        ("max_nodes", 0, "max_nodes"),
        ("name", "a b", "name"),
    ],
)
def test_an_offer_value_no_cluster_could_hold_is_refused(key, value, field):
    """Prices are finite numbers, counts whole, names what a node name may be (as a cluster
    file's): a NaN price once gave NaN dollars and a 2.5-node offer 16 GPUs."""
    entry = {"gpu": "A100-80GB", "max_nodes": 2, "on_demand_usd_per_gpu_hour": 3.0, key: value}
    with pytest.raises(InputError) as info:
        market_from_dict({"offers": [entry]})
    assert info.value.field == f"offers[0].{field}"


def _front(**kw):
    from hetplan.search.provision import provision

    return provision(load_model("gpt2-medium"), _market(), 1e9, 64, "fp16", **kw)


def test_more_budget_is_never_slower_and_tighter_deadline_never_cheaper():
    from hetplan.search.provision import Constraints, recommend

    res = _front()
    assert len(res.front) >= 2
    costs = sorted(p.total_cost_usd for p in res.front)
    times = sorted(p.time_to_train_s for p in res.front)
    prev_time = math.inf
    for budget in costs:
        best, _ = recommend(res.front, "time", Constraints(budget_usd=budget))
        assert best is not None and best.time_to_train_s <= prev_time
        prev_time = best.time_to_train_s
    prev_cost = 0.0
    for deadline in reversed(times):
        best, _ = recommend(res.front, "cost", Constraints(deadline_s=deadline))
        assert best is not None and best.total_cost_usd >= prev_cost
        prev_cost = best.total_cost_usd


def test_objectives_and_binding_constraint():
    from hetplan.search.provision import Constraints, recommend

    res = _front()
    assert res.front
    fastest, _ = recommend(res.front, "time", Constraints())
    cheapest, _ = recommend(res.front, "cost", Constraints())
    assert fastest is not None and cheapest is not None
    assert fastest.time_to_train_s == min(p.time_to_train_s for p in res.front)
    assert cheapest.total_cost_usd == min(p.total_cost_usd for p in res.front)
    none, why = recommend(res.front, "cost", Constraints(deadline_s=1.0))
    assert none is None and "deadline binds" in why
    none, why = recommend(res.front, "time", Constraints(budget_usd=1e-6))
    assert none is None and "budget binds" in why
    for p in res.front:
        assert p.plan is not None and p.estimate is not None and p.estimate.fits


def test_provision_cli(tmp_path):
    import json
    import subprocess
    import sys

    market = tmp_path / "m.yaml"
    market.write_text(
        "offers:\n"
        "  - {gpu: A100-80GB, gpus_per_node: 8, max_nodes: 2, on_demand_usd_per_gpu_hour: 3.43}\n"
        "  - {gpu: T4, gpus_per_node: 4, max_nodes: 4, on_demand_usd_per_gpu_hour: 0.526}\n"
    )
    png = tmp_path / "front.png"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "provision",
            "--model",
            "gpt2-medium",
            "--market",
            str(market),
            "--tokens",
            "2e9",
            "--objective",
            "cost",
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["front"] and data["recommended"]["reason"] and data["search_time_s"] >= 0
    for key in ("gpus", "time_to_train_s", "total_cost_usd", "usd_per_hour", "plan"):
        assert key in data["front"][0]
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.yaml"
    bad.write_text("offers:\n  - {gpu: T4, max_nodes: 1, on_demand_usd_per_gpu_hour: -2}\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "provision",
            "--model",
            "gpt2-medium",
            "--market",
            str(bad),
            "--tokens",
            "2e9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "on_demand_usd_per_gpu_hour" in res.stderr


def _hand_pareto(rows):
    """Rows (key, time, cost) no other row beats: at least as fast and as cheap, better in
    one (ties on both: the first listed stays)."""
    out = []
    for i, (k, t, c) in enumerate(rows):
        beaten = any(
            (t2 <= t and c2 <= c and (t2 < t or c2 < c)) or (t2 == t and c2 == c and j < i)
            for j, (_, t2, c2) in enumerate(rows)
            if j != i
        )
        if not beaten:
            out.append((k, t, c))
    return sorted(out, key=lambda r: r[1])


def test_mixes_front_equals_an_independent_exhaustive_enumeration():
    """Every (offer, node count) and every pair of them planned by the searches directly,
    the Pareto set taken by hand: provisioning (bounded, mixes) returns exactly that set."""
    from hetplan.cluster import Cluster
    from hetplan.search.heterogeneous import search_heterogeneous
    from hetplan.search.homogeneous import search_homogeneous
    from hetplan.search.provision import PROVISION_SPACE, provision

    market = market_from_dict(
        {
            "offers": [
                {"gpu": "A100-80GB", "gpus_per_node": 2, "max_nodes": 2,
                 "on_demand_usd_per_gpu_hour": 3.43},
                {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 2,
                 "on_demand_usd_per_gpu_hour": 0.526},
            ]
        }
    )  # fmt: skip
    model, tokens, batch = load_model("gpt2"), 1e9, 16
    rows = []
    a, b = market.offers
    for offer in market.offers:
        for n in range(1, offer.max_nodes + 1):
            found = search_homogeneous(model, offer.cluster(n), batch, "fp16", top_k=1,
                                       space=PROVISION_SPACE)  # fmt: skip
            t = tokens / found.ranked[0][1].tokens_per_s
            gpus = n * offer.gpus_per_node
            rows.append(({offer.gpu.name: gpus}, t, t / 3600 * gpus * offer.price(False)))
    for na in range(1, a.max_nodes + 1):
        for nb in range(1, b.max_nodes + 1):
            cluster = Cluster(a.cluster(na).nodes + b.cluster(nb).nodes)
            res = search_heterogeneous(model, cluster, batch, "fp16", 1)
            t = tokens / res.ranked[0][1].tokens_per_s
            ga, gb = na * a.gpus_per_node, nb * b.gpus_per_node
            usd = ga * a.price(False) + gb * b.price(False)
            rows.append(({a.gpu.name: ga, b.gpu.name: gb}, t, t / 3600 * usd))
    want = _hand_pareto(rows)
    assert want and any(len(k) == 2 for k, _, _ in rows)
    got = provision(model, market, tokens, batch, "fp16", mixes=True, prune=True)
    assert got.front
    assert [p.gpus for p in got.front] == [k for k, _, _ in want]
    for p, (_, t, c) in zip(got.front, want, strict=True):
        assert p.time_to_train_s == pytest.approx(t, rel=1e-9)
        assert p.total_cost_usd == pytest.approx(c, rel=1e-9)
    # 4 single-type and 4 mixed configurations: each planned, pruned or impossible
    assert got.planned + got.pruned + got.impossible == 8


def test_time_limit_lists_every_mix_left_with_true_bounds():
    """A time limit of 0 plans no mix: every mix is pruned, impossible or listed as
    unexplored, and each listed bound is at most what the heterogeneous search then finds."""
    from hetplan.cluster import Cluster
    from hetplan.search.heterogeneous import search_heterogeneous
    from hetplan.search.provision import provision

    market = _market()
    model, tokens, batch = load_model("gpt2"), 1e9, 16
    got = provision(model, market, tokens, batch, "fp16", mixes=True, time_limit_s=0.0)
    every = provision(model, market, tokens, batch, "fp16", mixes=True)
    a, b = market.offers
    n_mixes = a.max_nodes * b.max_nodes
    assert got.unexplored  # a time limit of 0 leaves mixes
    # single types as without a limit; no mix planned
    assert [p.gpus for p in got.points] == [p.gpus for p in every.points if len(p.gpus) == 1]
    singles = a.max_nodes + b.max_nodes
    assert got.planned + got.pruned + got.impossible + len(got.unexplored) == singles + n_mixes
    times = [u.time_bound_s for u in got.unexplored]
    assert times == sorted(times)
    for u in got.unexplored:
        na, nb = u.gpus[a.gpu.name] // a.gpus_per_node, u.gpus[b.gpu.name] // b.gpus_per_node
        res = search_heterogeneous(model, Cluster(a.cluster(na).nodes + b.cluster(nb).nodes),
                                   batch, "fp16", 1)  # fmt: skip
        t = tokens / res.ranked[0][1].tokens_per_s
        usd = u.gpus[a.gpu.name] * a.price(False) + u.gpus[b.gpu.name] * b.price(False)
        assert u.time_bound_s <= t * (1 + 1e-12)
        assert u.cost_bound_usd <= t / 3600 * usd * (1 + 1e-12)
        assert u.cost_bound_usd == pytest.approx(u.time_bound_s / 3600 * usd)


def test_spot_recovery_term_uses_peer_first_model():
    """More state to recover, or a slower network, stretches a spot run more."""
    from hetplan.search.spot import recovery_s

    offer = _market(0.1).offers[0]
    small = SpotTerms(state_bytes=1e9)
    large = SpotTerms(state_bytes=100e9)
    assert recovery_s(offer, 2, large) > recovery_s(offer, 2, small) > 0
    assert spot_slowdown(offer, 2, large) > spot_slowdown(offer, 2, small)
    # with more surviving peers the replacement's share is smaller
    assert recovery_s(offer, 8, large) < recovery_s(offer, 2, large)


def test_limits_hold_on_every_point_and_each_point_is_the_constrained_best():
    from hetplan.search.constraints import PlanConstraints, homogeneous_space
    from hetplan.search.homogeneous import search_homogeneous
    from hetplan.search.provision import PROVISION_SPACE, provision

    model = load_model("gpt2-medium")
    limits = PlanConstraints(tp=(2,), micro_batch=(2,), gpu_types=("a100-80gb",), max_gpus=8)
    res = provision(model, _market(), 1e9, 64, "fp16", prune=False, limits=limits)
    assert res.points
    for p in res.points:
        assert set(p.gpus) == {"A100-80GB"} and sum(p.gpus.values()) <= 8
        stages = [s for q in p.plan.pipelines for s in q.stages]
        assert all(s.tp == 2 for s in stages) and p.plan.micro_batch_size == 2
        # the same as the unconstrained search's best among plans with tp 2 and micro-batch 2
        every = search_homogeneous(model, p.cluster, 64, "fp16", 100_000,
                                   space=PROVISION_SPACE)  # fmt: skip
        ok = [e for q, e in every.ranked
              if all(s.tp == 2 for r in q.pipelines for s in r.stages)
              and q.micro_batch_size == 2]  # fmt: skip
        assert p.estimate.iteration_time_s == pytest.approx(ok[0].iteration_time_s, rel=1e-12)
        space = homogeneous_space(limits, PROVISION_SPACE)  # ZeRO-0 only for one replica
        assert space.zero_stages == (0, 1, 2, 3) and space.zero0_has_twin
    with pytest.raises(InputError) as info:
        provision(model, _market(), 1e9, 64, "fp16", limits=PlanConstraints(gpu_types=("H100",)))
    assert info.value.field == "--gpu-types"


def test_max_gpus_below_an_offers_node_leaves_that_offer_out():
    from hetplan.search.constraints import PlanConstraints
    from hetplan.search.provision import provision

    # A100 nodes hold 8 GPUs: at most 4 GPUs leaves only T4 configurations (4 per node)
    res = provision(load_model("gpt2-medium"), _market(), 1e9, 64, "fp16", prune=False,
                    limits=PlanConstraints(max_gpus=4))  # fmt: skip
    assert res.points and all(p.gpus == {"T4": 4} for p in res.points)


def test_messages_name_gpus_mark_missed_limits_and_label_mixed_plans():
    """Issue 14: no Python repr in messages, points past the deadline marked, mixed plans
    labelled per GPU type."""
    from rich.console import Console

    from hetplan.cluster import parse_inline_cluster
    from hetplan.plan import Pipeline, Plan, Stage
    from hetplan.report.pareto import front_table, plan_label
    from hetplan.search.provision import Constraints, recommend

    res = _front()
    assert len(res.front) >= 2
    none, why = recommend(res.front, "cost", Constraints(deadline_s=1.0))
    assert none is None and "{" not in why and "'" not in why
    assert any(f"{n} x {g}" in why for p in res.front for g, n in p.gpus.items())
    # a deadline between the fastest and the slowest point: the slower ones are marked
    times = sorted(p.time_to_train_s for p in res.front)
    limit = Constraints(deadline_s=(times[0] + times[1]) / 2)
    res.recommended, _ = recommend(res.front, "cost", limit)
    console = Console(record=True, width=300)
    console.print(front_table(res, "t", limit))
    lines = [ln for ln in console.export_text().splitlines() if " x " in ln]
    assert len(lines) == len(res.front)
    marked = [ln for ln in lines if "past deadline" in ln]
    assert len(marked) == len(res.front) - 1  # all but the fastest
    from hetplan.report.pareto import result_json

    js = result_json(res, limit)["front"]
    assert js[0]["misses"] == [] and all(p["misses"] == ["past deadline"] for p in js[1:])
    # a mixed plan: 2 A100 in one tp2 stage, 2 T4 in two tp1 stages of another pipeline
    cluster = parse_inline_cluster("A100-80GB:1x2,T4:1x4")
    a, t = (n.name for n in cluster.nodes)
    plan = Plan(
        16,
        4,
        (
            Pipeline(12, (Stage(24, (f"{a}:0", f"{a}:1")),)),
            Pipeline(4, (Stage(12, (f"{t}:0",)), Stage(12, (f"{t}:1",)))),
        ),
        zero_stage=1,
    )
    assert plan_label(plan, cluster) == (
        "2 pipelines of 1-2 stages; A100-80GB: 2 GPUs, tp2, 1 stage; "
        "T4: 2 GPUs, tp1, 2 stages; mb4 none z1, 2 GPUs idle"
    )
    # a symmetric plan keeps the short form
    sym = Plan(16, 4, tuple(Pipeline(8, (Stage(24, (f"{t}:{2 * i}", f"{t}:{2 * i + 1}")),))
                            for i in range(2)))  # fmt: skip
    assert plan_label(sym, cluster) == "tp2 pp1 dp2 mb4 none z0, 2 GPUs idle"
    # one GPU type, one shape, uneven batch shares (3 replicas, 16 sequences): the degrees
    # and the shares (it read '3 pipelines of 2 stages; T4: 6 GPUs, tp1, 6 stages; ...')
    t6 = parse_inline_cluster("T4:1x6")
    (n,) = (x.name for x in t6.nodes)
    uneven = Plan(16, 2, tuple(
        Pipeline(b, (Stage(12, (f"{n}:{2 * i}",)), Stage(12, (f"{n}:{2 * i + 1}",))))
        for i, b in enumerate((6, 6, 4))))  # fmt: skip
    assert plan_label(uneven, t6) == "tp1 pp2 dp3 (batch shares 4-6) mb2 none z0"
    split = Plan(16, 2, (
        Pipeline(8, (Stage(12, (f"{n}:0",)), Stage(12, (f"{n}:1",)))),
        Pipeline(8, (Stage(10, (f"{n}:2",)), Stage(14, (f"{n}:3",))))))  # fmt: skip
    assert plan_label(split, t6) == "tp1 pp2 dp2 (layer splits differ) mb2 none z0, 2 GPUs idle"


def test_cli_time_limit_reports_the_mixes_left(tmp_path):
    import json
    import subprocess
    import sys

    market = tmp_path / "m.yaml"
    market.write_text(
        "offers:\n"
        "  - {gpu: A100-80GB, gpus_per_node: 2, max_nodes: 2, on_demand_usd_per_gpu_hour: 3.43}\n"
        "  - {gpu: T4, gpus_per_node: 2, max_nodes: 2, on_demand_usd_per_gpu_hour: 0.526}\n"
    )
    base = [sys.executable, "-m", "hetplan", "provision", "--model", "gpt2", "--market",
            str(market), "--tokens", "1e9", "-b", "16", "--precision", "fp16"]  # fmt: skip
    run = subprocess.run(
        [*base, "--mixes", "--time-limit", "0.001s", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    left = data["unexplored"]
    assert left  # single types alone take longer than a millisecond
    counted = (data["configurations_planned"] + data["configurations_pruned"]
               + data["configurations_impossible"] + len(left))  # fmt: skip
    assert counted == 4 + 4  # 2 + 2 single-type counts and 2 x 2 mixes
    assert all(set(u["gpus"]) == {"A100-80GB", "T4"} and u["time_bound_s"] > 0 for u in left)
    table = subprocess.run([*base, "--mixes", "--time-limit", "0.001s"], capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert f"{len(left)} mixes unexplored at the time limit" in " ".join(table.stdout.split())
    bad = subprocess.run([*base, "--time-limit", "10s"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert bad.returncode == 2
    assert "--time-limit" in bad.stderr and "--mixes" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_hourly_cap_answer_is_the_best_configuration_under_it():
    """Brute force: every configuration planned without pruning or cap; under each cap the
    recommendation is the fastest of those at most that much an hour, even where a point
    above the cap dominates it (it once recommended 16 A100 under a $90 cap where 24, at
    $82.32, were faster but dominated by 32)."""
    from hetplan.search.provision import Constraints, provision

    model, market = load_model("gpt2-medium"), _market()
    full = provision(model, market, 1e9, 64, "fp16", prune=False)
    assert len(full.points) >= 4
    checked = 0
    for cap in sorted({p.usd_per_hour for p in full.points}):
        under = [p for p in full.points if p.usd_per_hour <= cap]
        want = min(p.time_to_train_s for p in under)
        res = provision(model, market, 1e9, 64, "fp16", objective="time",
                        constraints=Constraints(max_usd_per_hour=cap))  # fmt: skip
        assert res.recommended is not None
        assert res.recommended.usd_per_hour <= cap
        assert res.recommended.time_to_train_s == pytest.approx(want, rel=1e-12)
        if any(p.time_to_train_s <= want and p.total_cost_usd < min(
                q.total_cost_usd for q in under if q.time_to_train_s == want)
               for p in full.points if p.usd_per_hour > cap):  # fmt: skip
            checked += 1  # the answer is dominated by a point above the cap
    assert checked >= 1


def test_limits_no_plan_meets_are_named():
    """Configurations were planned and none had a plan under the limits: an error naming
    them (it was an empty front, 'no configuration can train this model', exit 0)."""
    from hetplan.search.constraints import PlanConstraints
    from hetplan.search.provision import provision

    model, market = load_model("gpt2-medium"), _market()
    with pytest.raises(InputError) as info:
        provision(model, market, 1e9, 64, "fp16", limits=PlanConstraints(tp=(3,)))
    assert info.value.field == "--tp" and "--tp 3" in info.value.reason
    with pytest.raises(InputError) as info:
        provision(model, market, 1e9, 64, "fp16",
                  limits=PlanConstraints(tp=(3,), micro_batch=(1000,)))  # fmt: skip
    assert info.value.field == "--tp, --micro-batch-size"
    # no offer states a reserved price
    with pytest.raises(InputError) as info:
        provision(model, market, 1e9, 64, "fp16", pricing="reserved")
    assert info.value.field == "--pricing"

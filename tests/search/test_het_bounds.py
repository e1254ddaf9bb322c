"""The heterogeneous search prunes only by lower bounds of ``estimate``: each bound it uses,
against ``estimate`` itself, on random plans built here (not by the search)."""

from __future__ import annotations

import itertools
import random

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage, validate_plan
from hetplan.search import heterogeneous as het
from hetplan.search.grouping import device_classes
from hetplan.search.het_bounds import PlanBounds
from hetplan.search.het_tables import Knobs

GPUS = ["A100-80GB", "A100-40GB", "V100-32GB", "V100-16GB", "T4", "A10", "L4"]


def _random_case(rng: random.Random):
    types = rng.sample(GPUS, rng.choice([2, 3]))
    spec = ",".join(f"{t}:{rng.choice([1, 2])}x{rng.choice([1, 2, 4])}" for t in types)
    layers = rng.choice([2, 3, 4, 6, 8])
    hidden = rng.choice([1024, 2048, 4096])
    model = ModelSpec("rand", rng.choice(["gpt", "llama"]), layers, hidden, 16, 16, 4 * hidden,
                      rng.choice([8192, 32000, 50257]), rng.choice([512, 1024, 2048]))  # fmt: skip
    return model, parse_inline_cluster(spec), rng.choice([4, 8, 16])


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in itertools.pairwise([0, *cuts, total])]


def _random_plan(rng: random.Random, model: ModelSpec, cluster, batch: int) -> Plan | None:
    """A random plan of the heterogeneous space, devices placed at random."""
    by_type: dict[str, list] = {}
    for node in cluster.nodes:
        by_type.setdefault(node.gpu.name, []).append(node)
    tps = {t: rng.choice([d for d in (1, 2, 4) if nodes[0].gpus % d == 0])
           for t, nodes in by_type.items()}  # fmt: skip
    groups = {
        t: [tuple(f"{n.name}:{i + g}" for g in range(tps[t]))
            for n in nodes for i in range(0, n.gpus, tps[t])]
        for t, nodes in by_type.items()
    }  # fmt: skip
    for g in groups.values():
        rng.shuffle(g)
    mb = rng.choice([1, 2, 4])
    if batch % mb:
        return None
    total = batch // mb
    d = rng.randint(1, min(3, total))
    pipes = []
    for m in _split(rng, total, d) if d > 1 else [total]:
        order = rng.sample(sorted(groups), rng.randint(1, len(groups)))
        seq = [t for t in order for _ in range(rng.randint(1, 2))]
        if len(seq) > model.layers or any(seq.count(t) > len(groups[t]) for t in order):
            return None
        layers = _split(rng, model.layers, len(seq)) if len(seq) > 1 else [model.layers]
        stages = tuple(Stage(x, groups[t].pop()) for t, x in zip(seq, layers, strict=True))
        pipes.append(Pipeline(m * mb, stages))
    sched, v = "1F1B", 1
    options = [u for u in (2, 4) if all(s.layers % u == 0 for p in pipes for s in p.stages)
               and all(len(p.stages) == 1 or (p.batch_size // mb) % len(p.stages) == 0
                       for p in pipes)]  # fmt: skip
    if options and rng.random() < 0.5:
        sched, v = "Interleaved1F1B", rng.choice(options)
    plan = Plan(
        global_batch_size=batch,
        micro_batch_size=mb,
        pipelines=tuple(pipes),
        precision="fp16",
        recompute=rng.choice(["none", "selective", "full"]),
        zero_stage=0 if d == 1 else rng.choice([0, 1, 2, 3]),
        schedule=sched,
        virtual_stages=v,
        sequence_parallel=rng.random() < 0.5,
    )
    try:
        validate_plan(plan, model, cluster)
    except InputError:
        return None
    return plan


def _plans(seed: int, want: int):
    rng = random.Random(seed)
    model, cluster, batch = _random_case(rng)
    out = []
    for _ in range(40 * want):
        plan = _random_plan(rng, model, cluster, batch)
        if plan is not None:
            out.append(plan)
        if len(out) == want:
            break
    return model, cluster, batch, out


@pytest.mark.parametrize("seed", range(12))
def test_plan_bounds_never_exceed_estimate(seed):
    """The bound every candidate is queued and estimated by (replay of stage_times with
    its transfers, or the closed form), and the memory check it is queued by."""
    model, cluster, _, plans = _plans(seed, 25)
    assert plans
    params = default_params()
    bounds = PlanBounds(model, cluster, params)
    for plan in plans:
        est = estimate(plan, model, cluster, params)
        assert bounds.bound_s(plan) <= est.iteration_time_s
        assert bounds.bound_s(plan, exact=False) <= est.iteration_time_s
        assert bounds.fits(plan)[0] == est.fits
        # the floor the uniform baseline queues candidates by, under both forms
        floor = bounds.compute_floor_s(plan)
        assert 0 < floor <= min(bounds.bound_s(plan), bounds.bound_s(plan, exact=False))


@pytest.mark.parametrize("seed", range(6))
def test_plan_bounds_hold_where_reductions_dominate(seed):
    """The same random plans on networks 10 and 100 times slower, ZeRO 0 and 1, with and
    without overlapping the reduction: the reductions (the bound's whole floor from the
    first ready gradient, the embedding's and head's too) then make most of the
    iteration, and the bound still never exceeds ``estimate``."""
    from dataclasses import replace

    from hetplan.cluster import Cluster

    model, cluster, _, plans = _plans(seed, 12)
    assert plans
    params = default_params()
    for slow in (10.0, 100.0):
        nodes = [replace(n, network_bytes_per_s=n.network_bytes_per_s / slow)
                 for n in cluster.nodes]  # fmt: skip
        slowed = Cluster(nodes)
        bounds = PlanBounds(model, slowed, params)
        for plan in plans:
            for zero, overlap in ((0, True), (1, True), (1, False)):
                p = replace(plan, zero_stage=zero, overlap_grad_reduce=overlap)
                est = estimate(p, model, slowed, params, validate=False)
                assert bounds.bound_s(p) <= est.iteration_time_s


@pytest.mark.parametrize("seed", range(12))
def test_setting_bounds_never_exceed_estimate(seed):
    """The throughput bounds that skip whole knob settings and bands of pipelines."""
    model, cluster, batch, plans = _plans(seed, 25)
    params = default_params()
    classes = device_classes(cluster)
    state = het._State(model, cluster, classes, batch, "fp16", params, True)
    for plan in plans:
        tp_of = {cluster.device_node(s.devices[0]).gpu.name: s.tp
                 for p in plan.pipelines for s in p.stages}  # fmt: skip
        tps = tuple(tp_of.get(c.gpu.name, 1) for c in classes)
        knobs = Knobs(plan.micro_batch_size, plan.recompute, 0, 1, "fp16", True, plan.schedule,
                      plan.virtual_stages)  # fmt: skip
        t = estimate(plan, model, cluster, params).iteration_time_s
        assert state.combo_bound_s(tps, knobs) <= t
        assert state.band_bound_s(tps, knobs, plan.dp, plan.dp) <= t


CASES = [
    (4, 2048, "L4:1x1,T4:1x2", 8),
    (4, 1024, "A100-40GB:1x2,V100-16GB:1x2", 8),
    (3, 4096, "A10:1x1,T4:2x1", 8),
    (4, 2048, "V100-32GB:1x2,A10:1x1,T4:1x1", 8),
]


@pytest.mark.parametrize(("layers", "hidden", "spec", "batch"), CASES)
def test_enumeration_bounds_never_exceed_estimate(monkeypatch, layers, hidden, spec, batch):
    """The enumeration's bound of a selection of pipelines (the least transfers the
    cluster allows), against the estimate of every placement it goes on to estimate."""
    pairs = []
    place, evaluate = het._Enumeration.place, het._State.evaluate
    current = {}

    def recording_place(self, bound_s, *args):
        current["bound"] = bound_s
        try:
            return place(self, bound_s, *args)
        finally:
            current.pop("bound")

    def recording_evaluate(self, plan, origin=None):
        est = evaluate(self, plan, origin)
        if "bound" in current:
            pairs.append((current["bound"], est.iteration_time_s))
        return est

    monkeypatch.setattr(het._Enumeration, "place", recording_place)
    monkeypatch.setattr(het._State, "evaluate", recording_evaluate)
    model = ModelSpec("m", "gpt", layers, hidden, 16, 16, 4 * hidden, 32000, 1024)
    res = het.search_with(model, parse_inline_cluster(spec), batch, "fp16", 1, prune=True)
    assert res.proven
    assert pairs
    assert all(low <= t for low, t in pairs)


def test_density_bound_binds_where_groups_barely_outnumber_micro_batches():
    """Six TP-1 groups (four A100s, two T4s), eight micro-batches of one sequence, 1F1B,
    4 layers: the stages of all pipelines are at most the six groups, so some pipeline runs
    at least 8/6 micro-batches a stage: with p stages m >= ceil(8p/6), and its fill
    S / (1 - (1 - 1/m)^p) is least at p = 3, m = 4: 64/37 S (S: every layer and the fixed
    costs once on the fastest group). The plain pipelining bound lets the pipeline of the
    most micro-batches (two, of four pipelines) take three stages (8/7 S). No plan of these
    knobs is below the density bound: every split of the groups into d pipelines of p stages
    that fits, checked."""
    model = ModelSpec("m", "gpt", 4, 2048, 16, 16, 8192, 32000, 1024)
    cluster = parse_inline_cluster("A100-40GB:1x4,T4:1x2")
    params = default_params()
    state = het._State(model, cluster, device_classes(cluster), 8, "fp16", params, True)
    knobs = Knobs(1, "none", 0, 1, "fp16", True, "1F1B", 1)
    tps = tuple(1 for _ in state.classes)
    rates, phi = state._work(tps, knobs)
    least = phi + model.layers * rates.taus[0]
    bound = state.combo_bound_s(tps, knobs)
    assert bound >= least * 64 / 37 * (1 - 1e-9)
    devices = [f"a100-40gb-0:{i}" for i in range(4)] + ["t4-0:0", "t4-0:1"]
    checked = 0
    for p in range(1, 5):
        for d in range(1, len(devices) // p + 1):
            if d > 8:
                continue
            for split in itertools.product(range(1, 4), repeat=p):
                if sum(split) != 4:
                    continue
                shares = [8 // d + (1 if r < 8 % d else 0) for r in range(d)]
                pipes = tuple(
                    Pipeline(shares[r], tuple(Stage(n, (devices[r * p + j],))
                                              for j, n in enumerate(split)))
                    for r in range(d)
                )  # fmt: skip
                plan = Plan(8, 1, pipes, precision="fp16", zero_stage=1 if d > 1 else 0)
                est = estimate(plan, model, cluster, params)
                if est.fits:
                    checked += 1
                    assert bound <= est.iteration_time_s * (1 + 1e-12), plan
    assert checked >= 10


def test_plan_bound_charges_the_whole_reduction_after_the_first_gradients():
    """Four A100-80GB on four nodes joined by 1 Gbit/s, GPT-2-sized, one micro-batch each:
    every layer's gradients cross the network, and the reduction (4 x 0.5 GB of fp32
    gradients in a ring at 0.125 GB/s: seconds) dwarfs the backward that could hide it (tens
    of ms). ``estimate`` runs it whole from the last backward's start. The floor of what no
    overlap hides ((1 - 0.85) of the layers' reductions) alone gave 0.77 s of 9.9; with the
    whole floor charged from the first gradients on, 5.2 s; with the embedding's and head's
    reductions too (a third of GPT-2's parameters), within 1% of ``estimate``, never above."""
    from hetplan.cluster import cluster_from_dict

    nodes = [{"name": f"n{i}", "gpu": "A100-80GB", "gpus": 1, "network_bandwidth": "1Gbit/s"}
             for i in range(4)]  # fmt: skip
    cluster = cluster_from_dict({"nodes": nodes})
    model = ModelSpec("gpt2ish", "gpt", 12, 768, 12, 12, 3072, 50257, 1024)
    pipes = tuple(Pipeline(2, (Stage(12, (f"n{i}:0",)),)) for i in range(4))
    plan = Plan(global_batch_size=8, micro_batch_size=2, pipelines=pipes, zero_stage=0)
    validate_plan(plan, model, cluster)
    params = default_params()
    est = estimate(plan, model, cluster, params)
    bound = PlanBounds(model, cluster, params).bound_s(plan)
    total = est.breakdown["data_parallel_sync_total_s"]
    assert total > 10 * (est.breakdown["backward_s"])  # the case is what it claims
    assert bound <= est.iteration_time_s
    assert bound >= 0.99 * est.iteration_time_s


def test_memory_check_of_copies_on_smaller_gpus_agrees_with_estimate():
    """``PlanBounds.fits`` weighs pipelines of one shape once, at each stage against the
    least memory of its copies: copies of a GPT-3 2.7B replica (one stage, TP 1), one on an
    A100-80GB and one on an A100-40GB. Without ZeRO its weights, gradients and Adam state
    alone take 2.7e9 x 16 bytes = 43 GB: too much for the 40 GB copy only, and the peak
    reported is that stage's; ZeRO twins (which share the pipelines, and so the memo) fit
    or not as ``estimate`` says, stage by stage."""
    from dataclasses import replace

    from hetplan.model import load_model

    model = load_model("gpt3-2.7b")
    cluster = parse_inline_cluster("A100-80GB:1x1,A100-40GB:1x1")
    big, small = (f"{n.name}:0" for n in cluster.nodes)
    pipes = tuple(Pipeline(4, (Stage(model.layers, (dev,)),)) for dev in (big, small))
    plan = Plan(global_batch_size=8, micro_batch_size=1, pipelines=pipes, precision="bf16",
                recompute="full", zero_stage=0)  # fmt: skip
    params = default_params()
    bounds = PlanBounds(model, cluster, params)
    outcomes = set()
    for z in (0, 1, 2, 3):
        twin = replace(plan, zero_stage=z)
        est = estimate(twin, model, cluster, params)
        over = [s.memory.total for s in est.stages if s.memory.total > s.capacity_bytes]
        ok, worst = bounds.fits(twin)
        assert ok == est.fits == (not over)
        assert worst == pytest.approx(max(over, default=0.0), rel=1e-12)
        outcomes.add(ok)
    assert outcomes == {True, False}  # both answers occur
    alone = replace(plan, global_batch_size=4, pipelines=pipes[:1])
    assert bounds.fits(alone)[0] and not bounds.fits(plan)[0]


@pytest.mark.parametrize("seed", range(4))
def test_schedule_bounds_never_exceed_the_estimates_of_the_plans_built(seed, monkeypatch):
    """The generation skips a selection's plans in every schedule whose template bound
    (``het_generation.schedule_bounds``) reaches the k-th best estimate: every plan it builds
    for the selection (both layouts), in every such schedule and ZeRO stage, estimates at
    least that bound. Asked for every plan (a top-k larger than any pool), nothing is
    skipped, so every selection's bounds are held against its plans."""
    from dataclasses import replace

    from hetplan.search import het_generation as gen
    from hetplan.search.het_space import zero_choices

    rng = random.Random(100 + seed)
    model, cluster, batch = _random_case(rng)
    pairs: list[tuple[list, Plan]] = []
    last: list = []
    bounds_of, build = gen.schedule_bounds, gen.build_plan

    def recorded_bounds(*args):
        out = bounds_of(*args)
        last[:] = [out]
        return out

    def recorded_build(*args):
        plan = build(*args)
        pairs.append((last[0], plan))
        return plan

    monkeypatch.setattr(gen, "schedule_bounds", recorded_bounds)
    monkeypatch.setattr(gen, "build_plan", recorded_build)
    het.search_heterogeneous(model, cluster, batch, "fp16", top_k=10**6)
    assert pairs
    params = default_params()
    checked = 0
    for forms, plan in rng.sample(pairs, min(len(pairs), 12)):
        sp = any(s.tp > 1 for p in plan.pipelines for s in p.stages)
        for (name, v), bound in forms:
            for z in zero_choices(plan.dp) if plan.dp > 1 else (0,):
                twin = replace(plan, schedule=name, virtual_stages=v, zero_stage=z,
                               sequence_parallel=sp)  # fmt: skip
                est = estimate(twin, model, cluster, params, validate=False)
                assert bound <= est.iteration_time_s * (1 + 1e-9), (name, v, z)
                checked += 1
    assert checked > 0

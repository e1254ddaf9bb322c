"""The floors' tensor-parallel collectives and the schedule's drain (``provision_bounds``,
``provision_batch``): hand sums, brute force over real pipelines, cases where each binds,
and no plan either search ranks below them."""

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from hetplan.cluster import Cluster
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_batch import Drain, batch_floor_s, least_gpus
from hetplan.search.provision_bounds import iteration_floor_s, tp_comm_floor_s, type_floor

from .conftest import MIX_LARGEST as LARGEST
from .conftest import MIX_MARKET as MARKET
from .conftest import one_offer as _offer


def _floor(model, offer, batch, overlap=False):
    node = offer.cluster(1).nodes[0]
    return type_floor(model, offer.gpu, offer.gpus_per_node, batch, default_params(), "fp16",
                      True, node, overlap, LARGEST)  # fmt: skip


def test_tp_comm_floor_by_hand():
    """gpt2 (hidden 768, seq 1024), micro-batch 2, fp16 on a 4-GPU A100 node at TP 4: a layer
    runs 4 ring all-reduces of its activations (2 x 1024 x 768 x 2 bytes), each member
    sending 2 x 3/4 of them over the NVLink at the fitted efficiency, plus 2 x 3 steps of
    latency; with overlap (and sequence parallelism) the fitted share hides."""
    model = load_model("gpt2")
    node = _offer("A100-80GB", 4, 1).cluster(1).nodes[0]
    params = default_params()
    size = 2 * 1024 * 768 * 2
    bw = node.intra_node_bytes_per_s * params.link_efficiency_of("A100-80GB")
    one = 2 * 3 / 4 * size / bw + 2 * 3 * params.intra_latency_of("A100-80GB")
    got = tp_comm_floor_s(model, node, params, 4, 2, "fp16", True, False, False)
    assert got == pytest.approx(4 * one, rel=1e-12)
    hidden = min(max(params.gpu("A100-80GB").tp_overlap, 0.0), 1.0)
    got_sp = tp_comm_floor_s(model, node, params, 4, 2, "fp16", True, True, True)
    assert got_sp == pytest.approx(4 * one * (1 - hidden), rel=1e-12)
    assert tp_comm_floor_s(model, node, params, 1, 2, "fp16", True, False, False) == 0.0


def _drain_least(layers, times, back, fixed, stage_s, path_s, back_s, loose=0.0):
    drain = Drain(np.array([back_s]), np.array(back, float), fixed / 2, loose)
    return float(least_gpus(layers, np.array([1.0, 2.0][: len(times)]), np.array(times), fixed,
                            np.array([stage_s]), np.array([path_s]), drain=drain)[0])  # fmt: skip


def test_drain_cap_by_hand():
    """Four layers at TP 1 (1 s each, 0.6 s of it backward), no fixed cost, stages of at
    most 4 s: one GPU holds them all. Each stage's backward within 1.3 s holds 2 layers
    (1.2 s): two stages, 2 GPUs; a loose unit (the embedding's) lets 3 units share a stage:
    4/3 GPU; a backward budget below one layer's leaves no stage."""
    assert _drain_least(4, [1.0], [0.6], 0.0, 4.0, 4.0, np.inf) == pytest.approx(1.0)
    assert _drain_least(4, [1.0], [0.6], 0.0, 4.0, 4.0, 1.3) == pytest.approx(2.0)
    assert _drain_least(4, [1.0], [0.6], 0.0, 4.0, 4.0, 1.3, 1.0) == pytest.approx(4 / 3)
    assert _drain_least(4, [1.0], [0.6], 0.0, 4.0, 4.0, 0.5) == np.inf


def _replay_1f1b(f, b, m):
    """The makespan of 1F1B with stage times ``f``, ``b`` (lists), event by event: stage j
    runs min(p - j, m) forwards, then alternates backward and forward, then backwards."""
    p = len(f)
    order = []
    for j in range(p):
        warm = min(p - j, m)
        acts = [("F", i) for i in range(warm)]
        nf = warm
        for i in range(m):
            acts.append(("B", i))
            if nf < m:
                acts.append(("F", nf))
                nf += 1
        order.append(acts)
    done, free, pos = {}, [0.0] * p, [0] * p
    while any(pos[j] < len(order[j]) for j in range(p)):
        for j in range(p):
            while pos[j] < len(order[j]):
                kind, i = order[j][pos[j]]
                if kind == "F":
                    dep = done.get(("F", j - 1, i)) if j else 0.0
                else:
                    dep = done.get(("B", j + 1, i)) if j < p - 1 else done.get(("F", j, i))
                if dep is None:
                    break
                start = max(free[j], dep)
                free[j] = done[(kind, j, i)] = start + (f[j] if kind == "F" else b[j])
                pos[j] += 1
    return max(free)


def test_drain_below_an_event_replay():
    """Random stage times: the drain bound path + (m - 1) x b_k (every k) is at most an
    event-by-event 1F1B replay, and equal to it for equal stages: (m + p - 1) x (f + b)."""
    rng = random.Random(5)
    for _ in range(200):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        f = [rng.uniform(0.2, 2.0) for _ in range(p)]
        b = [x * rng.uniform(1.2, 2.5) for x in f]
        bound = sum(f) + sum(b) + (m - 1) * max(b)
        assert bound <= _replay_1f1b(f, b, m) * (1 + 1e-12)
    assert _replay_1f1b([1.0] * 3, [2.0] * 3, 4) == pytest.approx((4 + 3 - 1) * 3.0)


def test_drain_binds_on_three_t4():
    """Three single-T4 nodes, gpt2, a global batch of 8: whole micro-batches leave some GPU
    with 3 of them or a pipeline, whose drain the schedule bound counts, unless the pipeline
    interleaves. It did lift the batch floor by 2% while interleaving needed a multiple of
    the stages (3 micro-batches then took 3 stages, so 3 GPUs); PyTorch runs 3 on 2 stages
    interleaved (one group of 3), so 2 GPUs suffice and the drain no longer binds here. The
    floor never falls below the one without the schedule bound, and no plan of the
    homogeneous search is below it."""
    from hetplan.cost.schedule import interleave_fits

    assert interleave_fits(2, 3)
    model = load_model("gpt2")
    offer = _offer("T4", 1, 3)
    floor = _floor(model, offer, 8)
    n = np.array(3)
    with_drain = float(batch_floor_s(model, 8, [floor], n))
    without = float(batch_floor_s(model, 8, [replace(floor, layer_back_tp=())], n))
    assert with_drain >= without
    found = search_homogeneous(model, offer.cluster(3), 8, "fp16", top_k=40)
    assert found.ranked
    for _, est in found.ranked:
        assert with_drain <= est.iteration_time_s * (1 + 1e-12)


def test_tp_comm_binds_on_two_gpu_nodes():
    """Eight 2-GPU A100 nodes, gpt2, a global batch of 8: the fastest paths run TP 2, whose
    collectives the floors now count: the batch floor rises by more than 5%, and stays at
    most every ranked plan."""
    model = load_model("gpt2")
    offer = _offer("A100-80GB", 2, 8)
    bare = type_floor(model, offer.gpu, 2, 8, default_params(), "fp16", True)
    floor = _floor(model, offer, 8)
    n = np.array(16)
    got = float(batch_floor_s(model, 8, [floor], n))
    assert got > 1.05 * float(batch_floor_s(model, 8, [bare], n))
    assert float(iteration_floor_s(model, 8, [floor], [n])) >= float(
        iteration_floor_s(model, 8, [bare], [n])
    )
    found = search_homogeneous(model, offer.cluster(8), 8, "fp16", top_k=40)
    for _, est in found.ranked:
        assert got <= est.iteration_time_s * (1 + 1e-12)


@pytest.mark.parametrize("name,batch", [("gpt2", 8), ("gpt2", 16), ("gpt2-medium", 32)])
def test_floors_below_every_ranked_homogeneous_plan(name, batch):
    """Every plan the homogeneous search ranks (TP up to the node, interleaving, ZeRO) is at
    least both floors with collectives and drain."""
    model = load_model(name)
    for offer in MARKET.offers:
        floor = _floor(model, offer, batch)
        for nodes in range(1, offer.max_nodes + 1):
            cluster = offer.cluster(nodes)
            found = search_homogeneous(model, cluster, batch, "fp16", top_k=40)
            n = np.array(cluster.num_gpus)
            lb = max(float(batch_floor_s(model, batch, [floor], n)),
                     float(iteration_floor_s(model, batch, [floor], [n])))  # fmt: skip
            for plan, est in found.ranked:
                assert lb <= est.iteration_time_s * (1 + 1e-12), (offer.name, nodes, plan)


@pytest.mark.slow
def test_floors_below_the_heterogeneous_plans_on_sampled_mixes():
    """Two-type mixes of the small market: every ranked heterogeneous plan is at least the
    floors of its types (collectives and drain)."""
    rng = random.Random(17)
    model = load_model("gpt2")
    checked = 0
    pairs = list(itertools.combinations(MARKET.offers, 2))
    for _ in range(8):
        a, b = rng.choice(pairs)
        na, nb = rng.randint(1, a.max_nodes), rng.randint(1, b.max_nodes)
        cluster = Cluster(a.cluster(na).nodes + b.cluster(nb).nodes)
        batch = rng.choice([8, 16, 32])
        res = search_heterogeneous(model, cluster, batch, "fp16", top_k=5)
        floors = [_floor(model, a, batch), _floor(model, b, batch)]
        ga, gb = np.array(na * a.gpus_per_node), np.array(nb * b.gpus_per_node)
        lb = max(float(batch_floor_s(model, batch, floors, ga + gb)),
                 float(iteration_floor_s(model, batch, floors, [ga, gb])))  # fmt: skip
        for _, est in res.ranked:
            assert lb <= est.iteration_time_s * (1 + 1e-12), (a.name, na, b.name, nb, batch)
            checked += 1
    assert checked >= 8


def _brute_1f1b_gpus(layers, tps, times, back, fixed, t, m):
    """The fewest GPUs of any real 1F1B pipeline of ``m`` micro-batches finishing within
    ``t`` (the event replay): every sequence of stages (TP degree, layers >= 1) holding all
    layers, a stage's backward its layers' plus half the fixed cost, its forward the rest."""
    best = np.inf
    options = [(k, n) for k in range(len(tps)) for n in range(1, layers + 1)]
    for p in range(1, layers + 1):
        for stages in itertools.product(options, repeat=p):
            if sum(n for _, n in stages) != layers:
                continue
            gpus = sum(tps[k] for k, _ in stages)
            if gpus >= best:
                continue
            b = [n * back[k] + fixed / 2 for k, n in stages]
            f = [n * times[k] + fixed - x for (k, n), x in zip(stages, b, strict=True)]
            if _replay_1f1b(f, b, m) <= t:
                best = gpus
    return best


def test_schedule_floor_never_exceeds_any_real_1f1b_pipeline():
    """Random small cases against every 1F1B pipeline there is (event replay): the floor's
    GPUs are at most the fewest of any real pipeline, and reach them in some cases."""
    from hetplan.search.provision_batch import drain_gpus

    rng = random.Random(8)
    tight = 0
    for _ in range(80):
        layers = rng.randint(2, 5)
        tps = [1, 2]
        base = rng.uniform(0.5, 2.0)
        times = [base, base * rng.uniform(0.5, 0.9)]
        back = [x * rng.uniform(0.55, 0.7) for x in times]
        fixed = rng.uniform(0.0, 0.3)
        m = rng.randint(1, 6)
        lo = layers * min(times) + fixed
        t = lo * rng.uniform(1.0, 1.0 + m)
        real = _brute_1f1b_gpus(layers, tps, times, back, fixed, t, m)
        grid, ms = np.array([t]), np.array([float(m)])
        got = drain_gpus(layers, 0, np.array(tps, float), np.array(times), fixed, 0.0, lo, grid,
                         ms, np.array(back))[0, 0]  # fmt: skip
        got = float(got)
        assert got <= real * (1 + 1e-9), (layers, times, back, fixed, m, t)
        tight += bool(np.isfinite(real) and np.ceil(got - 1e-9) == real)
    assert tight >= 10


def test_interleaved_floor_by_hand():
    """Six layers at TP 1 (1 s each) or TP 2 (0.6 s), no fixed cost, in T = 8 s. Four
    micro-batches on p <= 4 < 2p stages (p = 3 runs them in one group of 4, p = 4 in groups
    of 4) take at least 3 GPUs; as m >= 2p the path is within 4 s: all six at TP 2 (3.6 s)
    in stages of at most 2 s (3 layers: 2 stages, 4 GPUs), or x layers at TP 1 (cap 2
    layers, 1/2 GPU each) with the rest at TP 2 (2/3 GPU each) and x + 0.6 (6 - x) <= 4:
    x = 1, 0.5 + 5 x 2/3 = 3.83 GPUs; the least: 3. Every pipeline also meets the base
    bound (stages of at most T / m, path within T): at m = 4, six layers at TP 1 in stages
    of 2 s (2 layers, 1/2 GPU each): 3 GPUs, so 3."""
    from hetplan.search.provision_batch import interleaved_gpus

    got = interleaved_gpus(6, np.array([1.0, 2.0]), np.array([1.0, 0.6]), 0.0, 0.0,
                           np.array([8.0]), np.array([4.0, 8.0]))  # fmt: skip
    assert float(got[0, 0]) == pytest.approx(min(3.0, 0.5 + 5 * 2 / 3), rel=1e-9)
    # eight micro-batches: p <= 8 < 2p stages means p >= 5 GPUs; with m >= 2p, stages of
    # 1 s hold 1 layer at TP 1 or TP 2 (0.6 s), path 4 s: x + 0.6 (6 - x) <= 4 gives x = 1
    # at TP 1 (1 GPU) and 5 at TP 2 (10 GPUs): 11; the least of the two: 5. The base bound
    # is larger: stages of 1 s hold one layer whatever the degree, so 6 stages, 6 GPUs.
    assert float(got[0, 1]) == pytest.approx(6.0, rel=1e-9)


def test_interleaved_floor_pays_two_chunks_fixed_costs():
    """The same six layers with 0.2 s fixed per micro-batch and chunk, four micro-batches
    in T = 8 s. An interleaved stage runs two chunks at least: 0.4 s fixed, so in its 2 s per
    micro-batch it holds 1 layer at TP 1 (1.4 s; 2 would take 2.4 s) or 2 at TP 2 (1.6 s;
    3 would take 2.2 s): one GPU per layer either way, 6 GPUs (the path, all at TP 2,
    is 6 x 0.6 + 3 x 0.4 = 4.8 s <= 8). With one chunk's 0.2 s, 3 layers at TP 2 (2.0 s)
    would fit a stage: 4 GPUs, which the two chunks' fixed cost rules out."""
    from hetplan.search.provision_batch import interleaved_gpus

    got = interleaved_gpus(6, np.array([1.0, 2.0]), np.array([1.0, 0.6]), 0.2, 0.0,
                           np.array([8.0]), np.array([4.0]))  # fmt: skip
    assert float(got[0, 0]) == pytest.approx(6.0, rel=1e-9)

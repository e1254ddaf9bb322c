"""The type-aware batch floor of two-type mixes (``provision_mixbatch``) and the floors
coupled size by size (``provision_stages.mix_iteration_floor_s``): hand cases, brute force
over real mixed pipelines, a case where it binds, and no plan either search ranks below
them."""

import itertools
import random

import numpy as np
import pytest

from hetplan.cluster import Cluster
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_batch import batch_floor_s
from hetplan.search.provision_bounds import TypeFloor, iteration_floor_s, type_floor
from hetplan.search.provision_mixbatch import (
    STEP,
    WEIGHTS,
    _candidates,
    _cost,
    _per_unit,
    mix_batch_floor_s,
)
from hetplan.search.provision_stages import mix_iteration_floor_s

from .conftest import MIX_LARGEST as LARGEST
from .conftest import MIX_MARKET as MARKET
from .conftest import one_offer as _offer


def _floor(model, offer, batch):
    node = offer.cluster(1).nodes[0]
    return type_floor(model, offer.gpu, offer.gpus_per_node, batch, default_params(), "fp16",
                      True, node, False, LARGEST)  # fmt: skip


def _synthetic(tps, times, fixed, back=None):
    """A type's floors at one micro-batch size (1) from given layer times per degree; the
    embedding and head free."""
    zeros = tuple(0.0 for _ in tps)
    return TypeFloor((1,), (1.0,), (min(times),), (0.0,), (0.0,), fixed, tuple(tps),
                     (tuple(times),), (zeros,), (zeros,),
                     (tuple(back),) if back is not None else ())  # fmt: skip


def test_mixed_cost_by_hand():
    """Ten units; A holds 2 units per GPU (rho 0.5) at a path of 1 s a unit, B 1 unit per GPU
    at 2 s. A path of 13 s lets B hold at most 3 units. At weights (1, 1/4): B's 3 units cost
    3.5 + 0.75 = 4.25, below 0 units (5 + 0.25) or 1 (4.5 + 0.25); at (1, 1) the kink u = 1
    (one B GPU holding one unit) costs 4.5 + 1 = 5.5, below 6 at both ends. A path under
    10 s fits no split."""

    def cost(path, wa, wb):
        one = np.array([1.0])
        c = _candidates(10.0, 0.5 * one, 1.0 * one, 1.0 * one, 2.0 * one, path * one)
        return float(_cost(c, wa, wb)[0])

    assert cost(13.0, 1.0, 0.25) == pytest.approx(4.25, rel=1e-9)
    assert cost(13.0, 1.0, 1.0) == pytest.approx(5.5, rel=1e-9)
    assert cost(13.0, 0.0, 1.0) == pytest.approx(1.0, rel=1e-9)  # B free of A: one B GPU
    assert cost(9.9, 1.0, 1.0) == np.inf


def test_whole_floor_by_hand():
    """A model of 12 layers; type A runs a layer in 1 s, type B in 100 s (TP 1, no fixed
    cost, free embedding and head); 4 micro-batches on 3 A and 1 B. Any B stage holding a
    layer puts 100 s on the path, so below 16 s the A GPUs carry every micro-batch: one each
    takes 3 + 1 > 3 GPUs, and a pipeline of m of them within T < 16 needs stages of at most
    floor(T / m) layers, never fewer than m GPUs for m <= 4 and 4 GPUs (ceil(12 / 3)) for 5
    to 7. At 16 s a 3-stage pipeline of 4 layers a stage runs all 4 in 4 x 4 = 16 s: the
    floor is the last grid time below 16. The type-blind floor counts the B GPU as an A one
    and stays at the path floor of 12 s."""
    model = load_model("gpt2")
    assert model.layers == 12
    fa = _synthetic([1], [1.0], 0.0)
    fb = _synthetic([1], [100.0], 0.0)
    got = float(mix_batch_floor_s(model, 4, (fa, fb), np.array(3), np.array(1)))
    assert 16.0 / STEP <= got < 16.0
    blind = float(batch_floor_s(model, 4, [fa, fb], np.array(4)))
    assert blind == pytest.approx(12.0, rel=1e-9)


def _brute_mixed(layers, types, weights, stage_s, path_s):
    """The least weighted GPUs of any real pipeline with stages of both types: every
    sequence of stages (type, degree, layers >= 1) holding all layers, each within
    ``stage_s`` (its layers and its type's fixed cost), their sum within ``path_s``."""
    best = np.inf
    options = [(k, d, n) for k, (tps, _, _) in enumerate(types) for d in range(len(tps))
               for n in range(1, layers + 1)]  # fmt: skip
    for p in range(2, layers + 1):
        for stages in itertools.combinations_with_replacement(options, p):
            if sum(n for _, _, n in stages) != layers or len({k for k, _, _ in stages}) < 2:
                continue
            times = [n * types[k][1][d] + types[k][2] for k, d, n in stages]
            if max(times) <= stage_s and sum(times) <= path_s:
                cost = sum(weights[k] * types[k][0][d] for k, d, _ in stages)
                best = min(best, cost)
    return best


def test_mixed_bound_never_exceeds_any_real_mixed_pipeline():
    """Random small cases against every mixed pipeline there is: at every weight the bound
    is at most the least weighted GPUs of a real one, and reaches it in some cases."""
    rng = random.Random(5)
    tight = 0
    for _ in range(40):
        layers = rng.randint(2, 5)
        types = []
        for _k in range(2):
            base = rng.uniform(0.5, 3.0)
            times = [base, base * rng.uniform(0.5, 0.9)]
            types.append(([1, 2], times, rng.uniform(0.0, 0.3)))
        stage_s = rng.uniform(1.0, 8.0)
        path_s = rng.uniform(layers * 0.5, layers * 4.0)
        floors = [_synthetic(tps, times, fixed) for tps, times, fixed in types]
        sa = np.array([stage_s])
        ra, pa = _per_unit(float(layers), floors[0], 0, sa, 0.0, None)
        rb, pb = _per_unit(float(layers), floors[1], 0, sa, 0.0, None)
        cands = _candidates(float(layers), ra, pa, rb, pb, np.array([path_s]))
        for wa, wb in WEIGHTS:
            got = max(float(_cost(cands, wa, wb)[0]), wa + wb)
            real = _brute_mixed(layers, types, (wa, wb), stage_s, path_s)
            assert got <= real * (1 + 1e-9), (layers, types, stage_s, path_s, wa, wb)
            tight += bool(np.isfinite(real) and got >= real * (1 - 1e-9))
    assert tight >= 10


def test_type_aware_floor_binds_on_a100_with_one_t4():
    """Seven single-A100 nodes and one T4, gpt2, a global batch of 8: the type-blind floors
    let the T4 run a micro-batch at A100 speed; counted at its own times it cannot, and the
    floor rises by more than 10% over the other floors coupled size by size. No plan of the
    heterogeneous search is below it."""
    model = load_model("gpt2")
    a, b = _offer("A100-80GB", 1, 7), _offer("T4", 1, 1)
    floors = (_floor(model, a, 8), _floor(model, b, 8))
    ga, gb = np.array(7), np.array(1)
    aware = float(mix_iteration_floor_s(model, 8, floors, ga, gb))
    blind = float(mix_iteration_floor_s(model, 8, floors, ga, gb, aware=False))
    assert aware > 1.10 * blind
    cluster = Cluster(a.cluster(7).nodes + b.cluster(1).nodes)
    res = search_heterogeneous(model, cluster, 8, "fp16", top_k=10)
    assert res.ranked
    for plan, est in res.ranked:
        assert aware <= est.iteration_time_s * (1 + 1e-12), plan


def _fewest_stages(plan):
    return min(len(p.stages) for p in plan.pipelines)


@pytest.mark.slow
def test_floors_below_the_heterogeneous_plans_on_sampled_mixes():
    """Two-type mixes of the small market and of single-GPU nodes: every ranked
    heterogeneous plan is at least the coupled floor with the type-aware one, with as many
    stages per pipeline as the plan's fewest."""
    rng = random.Random(23)
    model = load_model("gpt2")
    singles = [_offer("A100-80GB", 1, 8), _offer("T4", 1, 4), _offer("V100-32GB", 1, 4)]
    pairs = list(itertools.combinations(MARKET.offers, 2))
    pairs += list(itertools.combinations(singles, 2))
    checked = 0
    for _ in range(8):
        a, b = rng.choice(pairs)
        na, nb = rng.randint(1, a.max_nodes), rng.randint(1, b.max_nodes)
        cluster = Cluster(a.cluster(na).nodes + b.cluster(nb).nodes)
        batch = rng.choice([8, 16, 32])
        res = search_heterogeneous(model, cluster, batch, "fp16", top_k=5)
        floors = (_floor(model, a, batch), _floor(model, b, batch))
        ga, gb = np.array(na * a.gpus_per_node), np.array(nb * b.gpus_per_node)
        for plan, est in res.ranked:
            for stages in sorted({1, _fewest_stages(plan)}):
                lb = float(mix_iteration_floor_s(model, batch, floors, ga, gb, stages))
                assert lb <= est.iteration_time_s * (1 + 1e-12), (a.name, na, b.name, nb, batch)
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("name,batch", [("gpt2", 8), ("gpt2", 32)])
def test_single_type_floors_coupled_by_size_below_every_ranked_plan(name, batch):
    """One type (as provisioning's node counts): the larger of the throughput and batch
    floors at each micro-batch size, least over the sizes, is at most every ranked plan of
    the homogeneous search."""
    model = load_model(name)
    for offer in MARKET.offers:
        floor = _floor(model, offer, batch)
        counts = np.arange(1, offer.max_nodes + 1) * offer.gpus_per_node
        lbs = np.maximum(
            iteration_floor_s(model, batch, [floor], [counts], per_size=True),
            batch_floor_s(model, batch, [floor], counts, per_size=True),
        ).min(axis=0)
        for nodes in range(1, offer.max_nodes + 1):
            found = search_homogeneous(model, offer.cluster(nodes), batch, "fp16", top_k=40)
            for plan, est in found.ranked:
                assert lbs[nodes - 1] <= est.iteration_time_s * (1 + 1e-12), (offer.name, plan)

"""The homogeneous search's memory check against estimate()'s own per-stage memory, on every
candidate of clusters whose even splits put more layers on middle stages than on the first
and the last (``even_layer_split``): a check of the first and the last stage alone passed
candidates whose heavier middle stage overflows, each then estimated only to be refused."""

from dataclasses import replace
from itertools import pairwise

import pytest

from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.cost.sharding import deferred_sync
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.homogeneous import score_candidates
from hetplan.search.homogeneous_candidates import SearchSpace, enumerate_candidates
from hetplan.search.homogeneous_memory import SearchMemo, probe_stages
from hetplan.search.homogeneous_scoring import Scorer
from hetplan.search.layout import even_layer_split

CASES = [
    ("V100-32GB", 8, 5, "gpt3-2.7b", 128, "fp16"),
    ("RTX 4090", 1, 54, "gpt3-13b", 64, "fp16"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[2]}" for c in CASES])
def test_peak_is_estimates_largest_stage_peak_on_every_candidate(case):
    gpu, gpn, nodes, name, batch, precision = case
    offer = {"gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1}
    cluster = market_from_dict({"offers": [offer]}).offers[0].cluster(nodes, "on-demand")
    model, params = load_model(name), default_params()
    space = SearchSpace(max_virtual_stages=4)
    scorer = Scorer(model, cluster, precision, batch, params, True, SearchMemo(), space)
    middle_heavier = 0
    for c in enumerate_candidates(model, cluster.num_gpus, gpn, batch, space):
        est = estimate(scorer.knob_plan(c), model, cluster, params, validate=False)
        assert scorer.peak_bytes(c) == pytest.approx(est.max_memory_bytes, rel=1e-9), c
        split = even_layer_split(model.layers, c.pp)
        middle_heavier += max(split) > max(split[0], split[-1])
    assert middle_heavier > 20  # the cases hold such splits


def test_probe_stages_by_hand():
    # 10 layers on 4 stages: 2, 3, 3, 2; on 6 stages 1, 2, 2, 2, 2, 1; on 5 stages even
    assert even_layer_split(10, 4) == [2, 3, 3, 2]
    assert probe_stages(10, 4) == (0, 1, 3)
    assert even_layer_split(10, 6) == [1, 2, 2, 2, 2, 1]
    assert probe_stages(10, 6) == (0, 1, 5)
    assert probe_stages(10, 5) == (0, 1, 4)
    # 11 on 5 stages: 2, 2, 3, 2, 2: the earliest middle stage of each count
    assert even_layer_split(11, 5) == [2, 2, 3, 2, 2]
    assert probe_stages(11, 5) == (0, 1, 2, 4)
    assert probe_stages(7, 1) == (0,)
    assert probe_stages(7, 2) == (0, 1)


def _offer_cluster(gpu, gpn, nodes):
    offer = {"gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1}
    return market_from_dict({"offers": [offer]}).offers[0].cluster(nodes, "on-demand")


def test_peak_never_grows_with_dp_nor_with_sequence_parallelism_off():
    # the two orders MemoryScorer.fits settles candidates by, checked by brute force over
    # every candidate of 1-12 nodes: with all else equal, more replicas shard ZeRO's state
    # further and leave the busiest fewer micro-batches; sequence parallelism only shards
    model, params = load_model("gpt3-6.7b"), default_params()
    space = SearchSpace(max_virtual_stages=4)
    by_rest: dict[tuple, dict[int, float]] = {}
    twins = 0
    for nodes in range(1, 13):
        cluster = _offer_cluster("V100-32GB", 8, nodes)
        scorer = Scorer(model, cluster, "fp16", 192, params, True, SearchMemo(), space)
        peaks = {c: scorer.peak_bytes(c) for c in enumerate_candidates(
            model, cluster.num_gpus, 8, 192, space)}  # fmt: skip
        for c, peak in peaks.items():
            # interleaved in groups other than p, fewer micro-batches may hold more: the
            # order holds among equal counts (``Scorer.flexible_counts``, in the fit key)
            rest = (c.tp, c.pp, c.micro_batch, c.recompute, c.zero_stage, c.schedule,
                    c.virtual_stages, c.sequence_parallel, c.lightened,
                    scorer.flexible_counts(c))  # fmt: skip
            by_rest.setdefault(rest, {})[c.dp] = peak
            if c.sequence_parallel:
                off = replace(c, sequence_parallel=False)
                assert peak < peaks[off], c
                twins += 1
    pairs = 0
    for rest, peaks_by_dp in by_rest.items():
        dps = sorted(peaks_by_dp)
        for a, b in pairwise(dps):
            assert peaks_by_dp[b] <= peaks_by_dp[a], (rest, a, b)
            pairs += 1
    assert pairs > 500 and twins > 500


@pytest.mark.parametrize("zeros", [(0, 1, 2, 3), (0, 2, 3)], ids=["zero-0123", "zero-023"])
def test_settled_fits_equal_the_peaks_across_node_counts_sharing_a_memo(zeros):
    # provisioning's visit: counts of one offer in turn, one memo; fits() settles by the
    # orders, peak_bytes() computes, and both must agree on every candidate; the scored
    # candidates are those of the exact path. Without ZeRO-1, deferred ZeRO-3 (DP degrees
    # the batch does not divide) holds more than at a smaller DP degree that divides it
    model, params = load_model("gpt3-6.7b"), default_params()
    space = SearchSpace(max_virtual_stages=4, zero_stages=zeros)
    memo = SearchMemo()
    settled = total = 0
    for nodes in (6, 2, 9, 3, 12, 1, 4, 8):
        cluster = _offer_cluster("V100-32GB", 8, nodes)
        mem = cluster.nodes[0].gpu.memory_bytes
        scorer = Scorer(model, cluster, "fp16", 192, params, True, memo, space)
        fresh = Scorer(model, cluster, "fp16", 192, params, True, SearchMemo(), space)
        fits_seen = []
        for c in enumerate_candidates(model, cluster.num_gpus, 8, 192, space):
            fits, peak = scorer.fits(c)
            assert fits == (fresh.peak_bytes(c) <= mem), c
            settled += peak is None
            total += 1
            fits_seen.append(fits)
        assert any(fits_seen) and not all(fits_seen)
        exact = score_candidates(model, cluster, 192, "fp16", params, space,
                                 scorer=Scorer(model, cluster, "fp16", 192, params, True,
                                               SearchMemo(), space))  # fmt: skip
        quick = score_candidates(model, cluster, 192, "fp16", params, space, exact_counts=False,
                                 scorer=Scorer(model, cluster, "fp16", 192, params, True,
                                               memo, space))  # fmt: skip
        assert [c for _, c in quick.ranked] == [c for _, c in exact.ranked]
    assert settled > total // 4


@pytest.mark.parametrize(
    "case",
    [("V100-32GB", 2, "gpt3-2.7b", 24), ("A100-40GB", 3, "gpt3-6.7b", 36)],
    ids=["V100x2-b24", "A100-40x3-b36"],
)
def test_deferred_zero_stages_hold_what_estimate_holds(case):
    # without ZeRO-1 in the space (--zero-stage 0,2,3) the search keeps pipelined ZeRO-2/3
    # and ZeRO-3 on DP degrees the batch does not divide: estimate runs both deferred, with
    # ZeRO-1's table and an fp32 gradient shard besides (cost.memory.state_bytes); the
    # memory check once counted them sharded per micro-batch, 11.3 GB against 16.9 GB
    gpu, nodes, name, batch = case
    cluster = _offer_cluster(gpu, 8, nodes)
    model, params = load_model(name), default_params()
    space = SearchSpace(max_virtual_stages=2, zero_stages=(0, 2, 3))
    scorer = Scorer(model, cluster, "fp16", batch, params, True, SearchMemo(), space)
    kinds = set()
    for c in enumerate_candidates(model, cluster.num_gpus, 8, batch, space):
        plan = scorer.knob_plan(c)
        est = estimate(plan, model, cluster, params, validate=False)
        assert scorer.peak_bytes(c) == pytest.approx(est.max_memory_bytes, rel=1e-9), c
        if deferred_sync(plan):
            kinds.add("pipelined" if c.pp > 1 else "uneven ZeRO-3")
    assert kinds == {"pipelined", "uneven ZeRO-3"}

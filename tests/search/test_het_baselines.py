"""The single-type baseline of a mixed cluster (``het_baselines.best_single_type``) searches
its classes fastest first and cuts the others at the best time so far, skipping a class
whose provisioning floor is above it. It must return what searching every class alone,
with no cutoff, returns: the fastest of their best plans. The uniform baseline
(``best_uniform``) bounds its candidates lazily; it must return the best estimate of all
of them, enumerated here."""

import itertools
import math

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search import het_baselines
from hetplan.search.het_cache import SearchCache
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.layout import uniform_plan

CASES = [
    ("gpt2", "A100-80GB:1x4,V100-32GB:1x4,T4:2x2", 32, "fp16"),
    ("gpt2", "T4:2x4,V100-16GB:1x2", 16, "fp16"),
    ("gpt3-350m", "A100-40GB:1x2,L4:2x4,RTX 3090:1x4", 64, "fp16"),
    ("gpt3-350m", "H100-80GB:1x2,A100-80GB:2x4", 32, "bf16"),
]


def _each_class_alone(model, cluster, batch, precision):
    """The best plan of each GPU type alone, every class searched whole (no cutoff)."""
    out = {}
    for gpu in {n.gpu.name for n in cluster.nodes}:
        sub = cluster.without_nodes({n.name for n in cluster.nodes if n.gpu.name != gpu})
        res = search_homogeneous(model, sub, batch, precision, 1, default_params(),
                                 exact_counts=False)  # fmt: skip
        out[gpu] = res.ranked[0][1].iteration_time_s if res.ranked else math.inf
    return out


@pytest.mark.parametrize(("name", "spec", "batch", "precision"), CASES)
def test_the_baseline_is_the_fastest_class_alone(name, spec, batch, precision, monkeypatch):
    model, cluster = load_model(name), parse_inline_cluster(spec)
    alone = _each_class_alone(model, cluster, batch, precision)
    cut = {"searched": 0, "cut": 0}
    search = het_baselines.search_homogeneous

    def counted_search(*args, **kwargs):
        cut["searched"] += 1
        cut["cut"] += kwargs["cutoff"] < math.inf
        return search(*args, **kwargs)

    monkeypatch.setattr(het_baselines, "search_homogeneous", counted_search)
    for cache in (None, SearchCache(model, default_params())):
        best, _ = het_baselines.best_single_type(model, cluster, batch, precision,
                                                 default_params(), True, cache=cache)  # fmt: skip
        assert best is not None
        assert best[1].iteration_time_s == pytest.approx(min(alone.values()), rel=1e-12)
        assert best[1].fits
    # and again from the cache: the same answer, no search
    before = cut["searched"]
    again, _ = het_baselines.best_single_type(model, cluster, batch, precision,
                                              default_params(), True, cache=cache)  # fmt: skip
    assert again is not None and again[1].iteration_time_s == best[1].iteration_time_s
    assert cut["searched"] == before
    # one class a call searched whole (the first); the others under the best so far, or
    # skipped by their floors
    assert cut["searched"] - cut["cut"] == 2


def test_a_slow_class_is_skipped_by_its_floor(monkeypatch):
    """GPT-3 6.7B on 16 A100 + 16 V100 + 32 T4 (bench_search's mixed-64): the A100 class alone
    runs in about 28 s, and the V100 and T4 classes cannot (their throughput floors alone
    are about 60 s: 6 x 6.7e9 x 2.1e6 tokens over 16 x 125 or 32 x 65 TFLOP/s): they are
    not searched, and the baseline is the A100 class's own best."""
    model = load_model("gpt3-6.7b")
    cluster = parse_inline_cluster("A100-80GB:2x8,V100-32GB:2x8,T4:4x8")
    searched = []
    search = het_baselines.search_homogeneous

    def counted(model, sub, *args, **kwargs):
        searched.append(sub.nodes[0].gpu.name)
        return search(model, sub, *args, **kwargs)

    monkeypatch.setattr(het_baselines, "search_homogeneous", counted)
    best, _ = het_baselines.best_single_type(model, cluster, 1024, "fp16", default_params(), True)
    assert searched == ["A100-80GB"]
    a100 = cluster.without_nodes({n.name for n in cluster.nodes if n.gpu.name != "A100-80GB"})
    alone = search_homogeneous(model, a100, 1024, "fp16", 1, exact_counts=False)
    assert best is not None
    assert best[1].iteration_time_s == alone.ranked[0][1].iteration_time_s


def _every_uniform_estimate(model, cluster, batch, precision, ceiling=math.inf):
    """Every Megatron-style plan of the baseline's space, estimated: TP within the smallest
    node and dividing heads and the FFN, PP up to the layers, equal batch shares,
    micro-batches up to 8, no or full recomputation, ZeRO 0 or 1 (0 alone for one
    replica); the best time among those that fit."""
    gpus = cluster.num_gpus
    per_node = min(n.gpus for n in cluster.nodes)
    best = math.inf
    for tp, pp in itertools.product(range(1, per_node + 1), range(1, model.layers + 1)):
        if per_node % tp or model.heads % tp or model.ffn % tp or gpus % (tp * pp):
            continue
        dp = gpus // (tp * pp)
        if batch % dp:
            continue
        for mb, rc, zero in itertools.product(range(1, 9), ("none", "full"), (0, 1)):
            if (batch // dp) % mb or (zero and dp == 1):
                continue
            plan = uniform_plan(cluster, model.layers, tp, pp, dp, mb, batch,
                                precision=precision, recompute=rc, zero_stage=zero,
                                sequence_parallel=tp > 1)  # fmt: skip
            est = estimate(plan, model, cluster, default_params(), validate=False)
            if est.fits and est.iteration_time_s < ceiling:
                best = min(best, est.iteration_time_s)
    return best


@pytest.mark.parametrize(
    ("name", "spec", "batch", "precision"),
    [*CASES[:3], ("gpt3-1.3b", "V100-16GB:1x8,T4:2x4", 64, "fp16")],
)
def test_the_uniform_baseline_is_the_best_uniform_plan(name, spec, batch, precision):
    model, cluster = load_model(name), parse_inline_cluster(spec)
    want = _every_uniform_estimate(model, cluster, batch, precision)
    got = het_baselines.best_uniform(model, cluster, batch, precision, default_params(), True)
    assert got is not None and got[1].fits
    assert got[1].iteration_time_s == pytest.approx(want, rel=1e-12)
    # a ceiling leaves out only plans whose bound reaches it: above the best, the same
    # plan; just below it, that plan or none (its bound may be below the ceiling); below
    # any time a stage could take, none
    for ceiling, maybe_none in ((want * 1.01, False), (want * 0.999, True), (1e-6, True)):
        under = het_baselines.best_uniform(model, cluster, batch, precision, default_params(),
                                           True, ceiling_s=ceiling)  # fmt: skip
        if under is None:
            assert maybe_none
        else:
            assert ceiling > 1e-6 and under[1].iteration_time_s == got[1].iteration_time_s

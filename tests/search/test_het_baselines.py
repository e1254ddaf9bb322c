"""The single-type baseline of a mixed cluster (``het_baselines.best_single_type``) searches
its classes fastest first and cuts the others at the best time so far, skipping a class
whose provisioning floor is above it. It must return what searching every class alone,
with no cutoff, returns: the fastest of their best plans."""

import math

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search import het_baselines
from hetplan.search.het_cache import SearchCache
from hetplan.search.homogeneous import search_homogeneous

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

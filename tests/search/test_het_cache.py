"""Work shared across heterogeneous searches (``het_cache``): every search given the shared
cache returns what a search of its cluster alone returns, whatever ran before it."""

from __future__ import annotations

from hetplan.cluster import cluster_from_dict
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search.grouping import device_classes
from hetplan.search.het_baselines import best_single_type
from hetplan.search.het_cache import SearchCache
from hetplan.search.het_tables import Knobs, class_table
from hetplan.search.heterogeneous import search_heterogeneous


def _cluster(a100: int, v100: int, a100_link: str = "300 GB/s"):
    nodes = [{"gpu": "A100-80GB", "gpus": 4, "count": a100, "intra_node_bandwidth": a100_link}]
    if v100:
        nodes.append({"gpu": "V100-32GB", "gpus": 4, "count": v100})
    return cluster_from_dict({"nodes": nodes})


def _answer(res):
    return (
        [(plan, est.iteration_time_s, est.cost_usd_per_hour) for plan, est in res.ranked],
        {k: None if b is None else (b[0], b[1].iteration_time_s) for k, b in res.baselines.items()},
    )


def test_shared_cache_changes_no_answer():
    # counts of one kind of node vary (what the cache shares), then the A100 nodes get a
    # slower NVLink (what its key must tell apart: their stage times differ)
    model, params = load_model("gpt3-350m"), default_params()
    cache = SearchCache(model, params)
    for a100, v100, link in ((2, 1, "300 GB/s"), (1, 1, "300 GB/s"), (2, 2, "300 GB/s"),
                             (2, 1, "2 GB/s")):  # fmt: skip
        cluster = _cluster(a100, v100, link)
        shared = search_heterogeneous(model, cluster, 64, "fp16", 3, params, cache=cache)
        alone = search_heterogeneous(model, cluster, 64, "fp16", 3, params)
        assert shared.ranked
        assert _answer(shared) == _answer(alone)
    # the second and later searches found their class tables and baselines already built
    assert cache.tables and cache.homogeneous
    slow = [k for k in cache.tables if k[2] == 2e9]
    assert slow and len(slow) < len(cache.tables)


def test_cache_of_another_model_is_not_used():
    params = default_params()
    cache = SearchCache(load_model("gpt3-1.3b"), params)
    model = load_model("gpt3-350m")
    res = search_heterogeneous(model, _cluster(1, 1), 64, "fp16", 1, params, cache=cache)
    assert res.ranked
    assert not cache.tables and not cache.homogeneous and not cache.acts


def test_tables_of_other_node_hardware_are_kept_apart():
    # A100 nodes with a fast and a slow NVLink: at TP 4 the slow one's stages take longer;
    # each table built on the shared cache matches one built alone
    model, params = load_model("gpt3-350m"), default_params()
    knobs = Knobs(1, "none", 0, 1, "fp16", True)
    cache = SearchCache(model, params)
    times = []
    for link in ("300 GB/s", "2 GB/s"):
        cls = device_classes(_cluster(1, 0, link))[0]
        caches = cache.table_caches(cls.nodes[0], 4, knobs)
        shared = class_table(model, cls, 4, knobs, params, cache.acts, caches)
        alone = class_table(model, cls, 4, knobs, params)
        assert shared.stage_s(3, True, False) == alone.stage_s(3, True, False)
        assert shared.caps_row(2) == alone.caps_row(2)
        times.append(shared.stage_s(3, True, False))
    assert times[1] > times[0]


def test_homogeneous_memo_is_kept_per_node_hardware():
    # the single-type baselines of clusters of one kind of node at several counts share
    # one memo, and answer as searches without it do; another kind gets its own (the V100
    # class of these mixed clusters is not searched: its floor is above the A100 class's
    # best, ``best_single_type``; alone it is)
    model, params = load_model("gpt3-350m"), default_params()
    cache = SearchCache(model, params)
    for a100, v100 in ((1, 1), (2, 1), (3, 2), (0, 2)):
        v100_only = {"nodes": [{"gpu": "V100-32GB", "gpus": 4, "count": v100}]}
        cluster = _cluster(a100, v100) if a100 else cluster_from_dict(v100_only)
        shared, _ = best_single_type(model, cluster, 64, "fp16", params, True, cache=cache)
        alone, _ = best_single_type(model, cluster, 64, "fp16", params, True)
        assert shared is not None and alone is not None
        assert shared[0] == alone[0]
        assert shared[1].iteration_time_s == alone[1].iteration_time_s
        kinds = {key[0].name for key in cache.memos}
        assert kinds == ({"A100-80GB"} if a100 else {"A100-80GB", "V100-32GB"})
    assert all(memo.first and memo.acts for memo in cache.memos.values())

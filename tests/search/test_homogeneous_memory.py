"""The homogeneous search's memory check against estimate()'s own per-stage memory, on every
candidate of clusters whose even splits put more layers on middle stages than on the first
and the last (``even_layer_split``): a check of the first and the last stage alone passed
candidates whose heavier middle stage overflows, each then estimated only to be refused."""

import pytest

from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import load_model
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

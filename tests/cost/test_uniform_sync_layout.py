"""``uniform_sync_layout`` (from node indices) against ``sync_layout`` of the plan
``uniform_plan`` builds (from device names), field by field, on every degree triple of
clusters with nodes of 1, 2, 4 and 8 GPUs, all GPUs used or one replica short: data-parallel
groups inside a node and across them, stages straddling node boundaries."""

import pytest

from hetplan.cost.dp_sync import sync_layout, uniform_sync_layout
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.homogeneous_candidates import divisors
from hetplan.search.layout import even_layer_split, uniform_plan


def _names(per_group):
    return [[[n.name for n in m] for m in per] for per in per_group]


@pytest.mark.parametrize("gpn", [1, 2, 4, 8])
def test_uniform_layout_is_the_plans_layout(gpn):
    model = load_model("gpt3-2.7b")
    offer = {"gpu": "A100-80GB", "gpus_per_node": gpn, "max_nodes": 12,
             "on_demand_usd_per_gpu_hour": 1}  # fmt: skip
    market = market_from_dict({"offers": [offer]})
    checked = crossing = 0
    for count in (1, 3, 5, 12):
        cluster = market.offers[0].cluster(count, "on-demand")
        n = count * gpn
        for tp in divisors(gpn):
            for pp in divisors(n // tp):
                if pp > model.layers:
                    continue
                for dp in {n // (tp * pp), max(1, n // (tp * pp) - 1)}:
                    plan = uniform_plan(cluster, model.layers, tp, pp, dp, 1, 96)
                    want = sync_layout(plan, model, cluster.device_node)
                    split = even_layer_split(model.layers, pp)
                    got = uniform_sync_layout(cluster.nodes, tp, pp, dp, split, model)
                    where = (count, tp, pp, dp)
                    assert got.groups == want.groups, where
                    assert _names(got.members) == _names(want.members), where
                    assert got.concurrency == want.concurrency, where
                    assert {h: [x.name for x in g] for h, g in got.dp_members.items()} == {
                        h: [x.name for x in g] for h, g in want.dp_members.items()
                    }, where
                    assert got.edge_params == want.edge_params, where
                    kinds = [[x.gpu.name for x in lay.spread[0]] for lay in (got, want)]
                    assert kinds[0] == kinds[1]
                    assert got.spread[1:] == want.spread[1:], where
                    checked += 1
                    crossing += bool(want.concurrency)
    assert checked > 15 and (gpn == 1 or crossing > 0)

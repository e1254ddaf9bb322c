"""ZeRO-2/3 with pipelining: priced as PyTorch's pipelining runs them (gradient sync and
resharding deferred to the last micro-batch), they move ZeRO-1's bytes once a step and hold
no less memory, so the searches leave them out (``cost.sharding``,
docs/search.md). The case below shows the dominance with estimate itself."""

from __future__ import annotations

import math

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage

MODEL = ModelSpec("gpt-8L-2048", "gpt", 8, 2048, 16, 16, 8192, 50257, 2048)


def _pp2_dp2(zero: int, pp: int = 2) -> Plan:
    """Two replicas of a two-stage pipeline on one node of four GPUs (stage-major ranks)."""
    devs = [f"a100-80gb-0:{i}" for i in range(4)]
    if pp == 2:
        pipes = tuple(
            Pipeline(8, (Stage(4, (devs[r],)), Stage(4, (devs[2 + r],)))) for r in range(2)
        )
    else:  # one stage, two replicas of TP 2
        pipes = tuple(Pipeline(8, (Stage(8, (devs[2 * r], devs[2 * r + 1])),)) for r in range(2))
    return Plan(global_batch_size=16, micro_batch_size=1, pipelines=pipes, precision="bf16",
                zero_stage=zero)  # fmt: skip


@pytest.mark.parametrize("zero", [2, 3])
def test_pipelined_zero_2_3_never_beat_zero_1(zero):
    cluster = parse_inline_cluster("A100-80GB:1x4")
    params = default_params()
    one = estimate(_pp2_dp2(1), MODEL, cluster, params)
    sharded = estimate(_pp2_dp2(zero), MODEL, cluster, params)
    # not faster: the same gradient reduction once a step, no per-micro-batch collective
    assert sharded.iteration_time_s >= one.iteration_time_s * (1 - 1e-12)
    assert sharded.breakdown["sharded_dp_comm_s"] == 0.0
    assert math.isclose(sharded.breakdown["data_parallel_sync_total_s"],
                        one.breakdown["data_parallel_sync_total_s"], rel_tol=1e-12)  # fmt: skip
    assert one.breakdown["data_parallel_sync_total_s"] > 0
    # no less memory, per device: by hand, bf16 ZeRO-1 keeps 2 (weights) + 4 (fp32
    # gradients) + 12 / dp bytes a parameter; held whole through the step, ZeRO-2/3 keep the
    # same plus the fp32 gradient shard after the reduce-scatter, 4 / dp
    for a, b in zip(one.distinct_stages, sharded.distinct_stages, strict=True):
        assert b.memory.total >= a.memory.total
        first, last = a.stage == 0, a.stage == 1
        n = 4 * MODEL.layer_params()
        n += MODEL.embedding_params() if first else 0
        n += MODEL.head_params() if last else 0
        assert math.isclose(a.memory.weights + a.memory.grads + a.memory.optimizer,
                            (2 + 4 + 12 / 2) * n, rel_tol=1e-12)  # fmt: skip
        assert math.isclose(b.memory.total - a.memory.total, 4 / 2 * n, rel_tol=1e-12)


def test_unpipelined_zero_3_still_shards_per_micro_batch():
    # without pipelining, ZeRO-3 keeps its FSDP pricing: every state sharded (16 / dp bytes
    # a parameter instead of ZeRO-1's 6 + 12 / dp) and per-micro-batch collectives
    cluster = parse_inline_cluster("A100-80GB:1x4")
    one = estimate(_pp2_dp2(1, pp=1), MODEL, cluster)
    three = estimate(_pp2_dp2(3, pp=1), MODEL, cluster)
    assert three.breakdown["sharded_dp_comm_s"] > 0
    m1, m3 = one.distinct_stages[0].memory, three.distinct_stages[0].memory
    assert m3.grads < m1.grads and m3.optimizer < m1.optimizer
    assert m3.weights + m3.grads + m3.optimizer < m1.weights + m1.grads + m1.optimizer


def test_the_heterogeneous_search_leaves_them_out_too():
    """On the README's mixed 64-GPU cluster the best plans are pipelined; before the
    heterogeneous search left them out, its second and third plans were the first with
    ZeRO-2 and ZeRO-3 (the same 21.477 s, 1.2 GB more memory)."""
    from hetplan.cluster import load_cluster
    from hetplan.cost.sharding import deferred_sync
    from hetplan.model import load_model
    from hetplan.search.heterogeneous import search_heterogeneous

    model = load_model("gpt3-6.7b")
    cluster = load_cluster("examples/clusters/mixed64.yaml")
    res = search_heterogeneous(model, cluster, 1024, "fp16", top_k=5)
    assert len(res.ranked) == 5
    assert any(len(p.stages) > 1 for plan, _ in res.ranked for p in plan.pipelines)
    assert not any(deferred_sync(plan) for plan, _ in res.ranked)
    assert res.ranked[0][0].zero_stage == 1

"""A tied vocabulary table on a single-stage plan is one tensor: its gradient is synced once.

OPT-350m as the catalog states it (GPT family: learned positions, LayerNorm with biases;
24 layers, hidden 1024, FFN 4096, vocab 50272, sequence 2048, tied embeddings), counted by
hand:

- token table 50272 x 1024 = 51,478,528; position table 2048 x 1024 = 2,097,152;
  final LayerNorm 2 x 1024 = 2,048; the output head is the token table (tied).
- one layer: QKV and output projections 4 x 1024^2 = 4,194,304, MLP 2 x 1024 x 4096 =
  8,388,608, biases 3072 + 1024 + 4096 + 1024 = 9,216, two LayerNorms 4 x 1024 = 4,096:
  12,596,224; 24 layers: 302,309,376.
"""

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.dp_sync import sync_layout
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.model import load_model
from hetplan.search.layout import uniform_plan

TOKEN_TABLE = 50272 * 1024
EDGES_TIED = 51_478_528 + 2_097_152 + 2_048  # token + positions + final norm
LAYERS = 24 * 12_596_224


def _ideal_params() -> CostParams:
    """No latency, links at their datasheet bandwidth: collectives are volume / bandwidth."""
    eff = GPUEfficiency(link_efficiency=1.0, network_efficiency=1.0, grad_overlap=1.0)
    return CostParams(intra_latency_s=0.0, inter_latency_s=0.0).with_gpu("A100-80GB", eff)


def _plan(pp: int, zero_stage: int):  # type: ignore[no-untyped-def]
    cluster = parse_inline_cluster("A100-80GB:1x8")
    dp = 8 // pp
    plan = uniform_plan(cluster, 24, 1, pp, dp, 1, 8 * dp, precision="bf16",
                        zero_stage=zero_stage, overlap_grad_reduce=False)  # fmt: skip
    return cluster, plan


def test_hand_count_matches_the_catalog_model() -> None:
    model = load_model("opt-350m")
    assert model.tie_embeddings
    assert model.total_params() == LAYERS + EDGES_TIED


def test_single_stage_syncs_the_tied_table_once() -> None:
    model = load_model("opt-350m")
    cluster, plan = _plan(1, 3)
    node_of = {n.name: n for n in cluster.nodes}
    layout = sync_layout(plan, model, lambda d: node_of[d.rpartition(":")[0]])
    assert layout.edge_params == [EDGES_TIED]  # was 105,056,256: the table twice
    assert [n for n, _ in layout.groups] == [LAYERS + EDGES_TIED]


def test_pipeline_stages_hold_and_sync_their_own_copy() -> None:
    # two stages: the first holds the token and position tables, the last the final norm
    # and its copy of the table (synced with the first stage's, Megatron's embedding group)
    model = load_model("opt-350m")
    cluster, plan = _plan(2, 3)
    node_of = {n.name: n for n in cluster.nodes}
    layout = sync_layout(plan, model, lambda d: node_of[d.rpartition(":")[0]])
    assert layout.edge_params == [51_478_528 + 2_097_152, 2_048 + TOKEN_TABLE]
    half = 12 * 12_596_224
    assert [n for n, _ in layout.groups] == [half + 53_575_680, half + 51_480_576]


@pytest.mark.parametrize("zero_stage, synced", [(3, EDGES_TIED), (1, LAYERS + EDGES_TIED)])
def test_step_sync_time_moves_the_hand_counted_parameters(zero_stage: int, synced: int) -> None:
    # 8 A100s on one node, ring volumes: fp32 gradients reduce-scattered and bf16
    # parameters all-gathered, 7/8 of each per GPU. ZeRO-3 syncs only the embedding and head
    # once a step (its layers per micro-batch); ZeRO-1 the whole model
    model = load_model("opt-350m")
    cluster, plan = _plan(1, zero_stage)
    bw = cluster.nodes[0].intra_node_bytes_per_s
    est = estimate(plan, model, cluster, _ideal_params())
    st = est.stages[0]
    assert st.grad_sync_s == pytest.approx(7 / 8 * synced * (4 + 2) / bw, rel=1e-9)

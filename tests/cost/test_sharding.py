"""Data-parallel traffic as the frameworks issue it: hand-computed cases and textbook volumes
(ring all-gather/reduce-scatter (n-1)/n, ZeRO-3's 3x parameter traffic per micro-batch)."""

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate, sharded_microbatch_s
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.sharding import bucket_count, exposed_sync_s, zero3_exposed_s
from hetplan.model import ModelSpec
from hetplan.search.layout import uniform_plan


def test_last_bucket_is_always_exposed():
    # 4 buckets of 0.25 s, ready at 0.5, 1.0, 1.5, 2.0 s of a 2 s backward: each reduces
    # before the next is ready, the last one ends 0.25 s after the backward
    assert exposed_sync_s(1.0, 2.0, 1.0, True, 4) == pytest.approx(0.25)


def test_buckets_queue_when_the_network_is_slower_than_the_backward():
    # ready at 0.1, 0.2, 0.3, 0.4 s of a 0.4 s backward, 0.25 s each, one after another:
    # the last ends at 0.1 + 4 * 0.25 = 1.1 s, 0.7 s after the backward
    assert exposed_sync_s(1.0, 0.4, 1.0, True, 4) == pytest.approx(0.7)


def test_no_overlap_exposes_everything_and_one_bucket_cannot_hide():
    assert exposed_sync_s(1.0, 5.0, 1.0, False, 4) == 1.0
    assert exposed_sync_s(1.0, 5.0, 1.0, True, 1) == 1.0


def test_bucket_size_follows_megatron_core():
    assert bucket_count(40e6, 8) == 1
    assert bucket_count(40e6 + 1, 8) == 2
    assert bucket_count(400e6, 100) == 4  # buckets of max(40M, 1M x 100) = 100M


def test_zero3_without_compute_exposes_three_collectives_per_layer():
    # 10 layers, all-gather 1 s and reduce-scatter 2 s in total: with nothing to hide under,
    # 2 gathers and 1 reduce-scatter per layer: 1 + 1 + 2
    assert zero3_exposed_s(1.0, 2.0, 10, 0.0, 0.0) == pytest.approx(4.0)


def test_zero3_hides_behind_enough_compute_except_the_ends():
    # per layer: gather 0.1, reduce-scatter 0.1, forward 1, backward 2 (>= 0.2): only the
    # first gather of each pass and the last reduce-scatter are exposed
    assert zero3_exposed_s(1.0, 1.0, 10, 10.0, 20.0) == pytest.approx(0.1 + 0.1 + 0.1)
    # only half of the overlapped traffic is free: the rest slows the layers it runs under
    # forward: 9 * 0.5 * 0.1; backward: 9 * 0.5 * 0.2
    assert zero3_exposed_s(1.0, 1.0, 10, 10.0, 20.0, share=0.5) == pytest.approx(
        0.3 + 9 * 0.05 + 9 * 0.1
    )


def _one_node_params() -> CostParams:
    eff = GPUEfficiency(link_efficiency=1.0, network_efficiency=1.0, grad_overlap=1.0)
    return CostParams(intra_latency_s=0.0, inter_latency_s=0.0).with_gpu("A100-80GB", eff)


def test_zero3_traffic_is_three_times_the_parameters_per_micro_batch():
    # one node of 8 A100s, ring volumes: each all-gather moves 7/8 of a layer's bf16
    # parameters per GPU, the reduce-scatter 7/8 of its fp32 gradients; no compute to hide
    cluster = parse_inline_cluster("A100-80GB:1x8")
    node = cluster.nodes[0]
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    plan = uniform_plan(cluster, 4, 1, 1, 8, 1, 8, precision="bf16", zero_stage=3)
    params = _one_node_params()
    exposed, after = sharded_microbatch_s(plan, model, 4, 1, True, True, True,
                                          [node] * 8, params, {}, 0.0, 0.0)  # fmt: skip
    layer = model.layer_params()
    rest = model.embedding_params() + model.head_params()
    bw = node.intra_node_bytes_per_s
    want = 7 / 8 * ((layer * 4 + rest) * (2 * 2 + 4)) / bw
    assert exposed == pytest.approx(want, rel=1e-9)
    assert after == 0.0


def test_zero2_reduce_scatters_every_micro_batch_and_gathers_after_the_step():
    cluster = parse_inline_cluster("A100-80GB:1x8")
    node = cluster.nodes[0]
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    plan = uniform_plan(cluster, 4, 1, 1, 8, 1, 64, precision="bf16", zero_stage=2,
                        overlap_grad_reduce=False)  # fmt: skip
    params = _one_node_params()
    total = 4 * model.layer_params() + model.embedding_params() + model.head_params()
    bw = node.intra_node_bytes_per_s
    exposed, after = sharded_microbatch_s(plan, model, 4, 1, True, True, True,
                                          [node] * 8, params, {}, 0.0, 1.0)  # fmt: skip
    assert exposed == pytest.approx(7 / 8 * total * 4 / bw)  # fp32 gradients, every micro-batch
    assert after == pytest.approx(7 / 8 * total * 2 / bw)  # bf16 parameters, once
    est = estimate(plan, model, cluster, params)
    m = 8  # 64 sequences over 8 replicas, micro-batch 1
    st = est.stages[0]
    assert st.zero_comm_s == pytest.approx(exposed)
    assert est.breakdown["sharded_dp_comm_s"] == pytest.approx(m * exposed + after)


def test_pipeline_sends_share_the_node_link_among_all_senders():
    # tp1 pp2 dp8 on two A100 nodes: stage 0 is node 0, stage 1 node 1; all 8 GPUs of a node
    # send their micro-batch's activations across at once over its 200 GB/s network
    cluster = parse_inline_cluster("A100-80GB:2x8")
    node = cluster.nodes[0]
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    plan = uniform_plan(cluster, 4, 1, 2, 8, 1, 16, precision="bf16")
    params = _one_node_params()
    est = estimate(plan, model, cluster, params)
    act = 512 * 1024 * 2
    assert est.stages[0].send_s == pytest.approx(act / (node.network_bytes_per_s / 8))


def test_interleaved_chunks_carry_the_embedding_and_head_where_they_live():
    # 2 stages x 2 chunks: the first stage's chunk 0 runs the embedding, the last stage's
    # chunk 1 the head; the other chunks hold layers only
    from hetplan.cost.params import default_params

    cluster = parse_inline_cluster("A100-80GB:1x2")
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 50000, 512)
    plan = uniform_plan(cluster, 4, 1, 2, 1, 1, 4, precision="bf16",
                        schedule="Interleaved1F1B", virtual_stages=2)  # fmt: skip
    params = default_params()
    est = estimate(plan, model, cluster, params, record=True)
    gpu = cluster.nodes[0].gpu
    emb = params.compute.embedding(model, gpu, params, 1, 1, "bf16").times.forward_s
    head = params.compute.head(model, gpu, params, 1, 1, "bf16").times.forward_s
    dur = {(s, k, c): end - start for s, k, mb, c, start, end in est.replays[0].events if mb == 0}
    assert dur[(0, "F", 0)] - dur[(0, "F", 1)] == pytest.approx(emb)
    assert dur[(1, "F", 1)] - dur[(1, "F", 0)] == pytest.approx(head)

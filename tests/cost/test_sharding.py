"""Data-parallel traffic as the frameworks issue it: hand-computed cases and textbook volumes
(ring all-gather/reduce-scatter (n-1)/n, ZeRO-3's 3x parameter traffic per micro-batch)."""

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.dp_sync import sharded_microbatch_s
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.sharding import (
    bucket_count,
    exposed_sync_s,
    first_bucket_ready_s,
    serial_end_s,
    unhidden_sync_s,
    zero3_exposed_s,
)
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


def test_a_bucket_waits_for_the_slowest_member_that_holds_it():
    # 4 buckets; member A's last backward runs 0-2 s, member B's 1-1.4 s: A's first bucket is
    # ready at 0.5 s, B's at 1.1 s, so the first is ready everywhere at 1.1 s (B holds it
    # back although B ends first); with B at 0-0.4 s A holds it back, at 0.5 s
    assert first_bucket_ready_s([0.0, 1.0], [2.0, 1.4], 4) == pytest.approx(1.1)
    assert first_bucket_ready_s([0.0, 0.0], [2.0, 0.4], 4) == pytest.approx(0.5)
    # one bucket: ready when the last member ends
    assert first_bucket_ready_s([0.0, 0.0], [2.0, 0.4], 1) == pytest.approx(2.0)


def test_one_member_reads_as_the_backward_window():
    # the end plus the exposure equals the release-ordered finish of one reduction: 4 buckets
    # of a 1 s reduction over a 0.4 s backward ending at 3 s (the queueing case above): the
    # first bucket at 2.7 s, 2.7 + 1.0 = 3.7 s = 3 + 0.7
    first = first_bucket_ready_s([2.6], [3.0], 4)
    assert max(first + 1.0, 3.0 + unhidden_sync_s(1.0, 1.0, True, 4)) == pytest.approx(
        3.0 + exposed_sync_s(1.0, 0.4, 1.0, True, 4)
    )
    # what no window hides: the last bucket (0.25 s), or the share compute takes (0.6 s)
    assert unhidden_sync_s(1.0, 1.0, True, 4) == pytest.approx(0.25)
    assert unhidden_sync_s(1.0, 0.4, True, 4) == pytest.approx(0.6)
    assert unhidden_sync_s(1.0, 1.0, False, 4) == 1.0


def test_reductions_on_one_link_run_one_after_another_in_release_order():
    # released at 1, 0 and 5 s with 2, 3 and 1 s of work: 0-3, 3-5, 5-6
    assert serial_end_s([(1.0, 2.0), (0.0, 3.0), (5.0, 1.0)]) == pytest.approx(6.0)
    # a late release waits for nothing: 0-3, then 10-11
    assert serial_end_s([(0.0, 3.0), (10.0, 1.0)]) == pytest.approx(11.0)


def test_replicas_of_different_speeds_reduce_from_the_first_bucket_ready_everywhere():
    """Two single-stage replicas of GPT-3 1.3B at micro-batch 1, one on an A100, one on a T4:
    the T4 computes longer, so the A100 waits and every bucket is ready only when the T4
    makes it. The gradient sync then ends at the T4's first bucket plus the whole reduction,
    or the T4's end plus what no window hides, whichever is later: the A100's short last
    backward does not shrink the T4's window (it once did: the least window of the group)."""
    from hetplan.cost.dp_sync import grad_sync_times, sync_layout
    from hetplan.cost.params import default_params
    from hetplan.model import load_model
    from hetplan.plan import Pipeline, Plan, Stage

    model = load_model("gpt3-1.3b")
    cluster = parse_inline_cluster("A100-80GB:1x1,T4:1x1")
    a, t = (n.name for n in cluster.nodes)
    pipes = tuple(Pipeline(2, (Stage(model.layers, (f"{x}:0",)),)) for x in (a, t))
    plan = Plan(4, 1, pipes, precision="fp16")
    params = default_params()
    est = estimate(plan, model, cluster, params, record=True)
    fast, slow = sorted(est.stages, key=lambda s: s.last_backward_end_s)
    node_of = {f"{n.name}:0": n for n in cluster.nodes}.__getitem__
    (sync,) = grad_sync_times(sync_layout(plan, model, node_of), plan, params, model)
    n = bucket_count(model.total_params(), 2)
    assert n >= 2
    # the T4's last backward, one micro-batch's: its buckets come 1/n of it apart
    window = slow.backward_s
    first = slow.last_backward_end_s - window + window / n
    share = min(params.gpu(g).grad_overlap for g in ("A100-80GB", "T4"))
    tail = max(sync / n, (1 - share) * sync)
    expected = max(first + sync, slow.last_backward_end_s + tail)
    assert fast.last_backward_end_s < first  # the A100 holds no bucket back
    for st in (fast, slow):
        assert st.sync_end_s == pytest.approx(expected, rel=1e-9)
    # the group's least window (the A100's) would have exposed more
    old = slow.last_backward_end_s + exposed_sync_s(sync, fast.backward_s, share, True, n)
    assert old > expected * 1.01


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
    # parameters per GPU, the reduce-scatter 7/8 of its fp32 gradients; no compute to hide.
    # The layers only: embedding and head stay whole (next test)
    cluster = parse_inline_cluster("A100-80GB:1x8")
    node = cluster.nodes[0]
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    plan = uniform_plan(cluster, 4, 1, 1, 8, 1, 8, precision="bf16", zero_stage=3)
    params = _one_node_params()
    exposed, after = sharded_microbatch_s(plan, model, 4, 1, True, True, True,
                                          [node] * 8, params, {}, 0.0, 0.0)  # fmt: skip
    layer = model.layer_params()
    bw = node.intra_node_bytes_per_s
    want = 7 / 8 * (layer * 4 * (2 * 2 + 4)) / bw
    assert exposed == pytest.approx(want, rel=1e-9)
    assert after == 0.0


def test_zero3_syncs_embedding_and_head_once_a_step_as_zero1():
    # as the runtime (and its fsdp.py) runs them: kept whole, their fp32 gradients
    # reduce-scattered and their bf16 parameters all-gathered once a step, whatever the
    # micro-batches. 8 A100s on one node, micro-batch 1, 64 sequences: 8 micro-batches
    cluster = parse_inline_cluster("A100-80GB:1x8")
    node = cluster.nodes[0]
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    plan = uniform_plan(cluster, 4, 1, 1, 8, 1, 64, precision="bf16", zero_stage=3,
                        overlap_grad_reduce=False)  # fmt: skip
    est = estimate(plan, model, cluster, _one_node_params())
    bw = node.intra_node_bytes_per_s
    # GPT: 8192 x 1024 token and 512 x 1024 position tables; an untied 8192 x 1024 head
    # after the final LayerNorm (1024 weights, 1024 biases)
    rest = 8192 * 1024 + 512 * 1024 + 8192 * 1024 + 2 * 1024
    assert model.embedding_params() + model.head_params() == rest
    st = est.stages[0]
    assert st.grad_sync_s == pytest.approx(7 / 8 * rest * (4 + 2) / bw, rel=1e-9)
    # per micro-batch, the layers' gathers and reduce-scatters (partly under compute)
    assert 0 < st.zero_comm_s < 7 / 8 * 4 * model.layer_params() * (2 * 2 + 4) / bw
    assert est.breakdown["sharded_dp_comm_s"] == pytest.approx(8 * st.zero_comm_s)
    assert est.breakdown["data_parallel_sync_total_s"] == pytest.approx(st.grad_sync_s)


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
    # and per micro-batch the fp32 buffer cleared (4 B a parameter) and 1/8 of it summed
    # into the step's shard (two reads, one write: 12 B over 8), at HBM x mem_efficiency
    mem = node.gpu.hbm_bytes_per_s * params.gpu(node.gpu.name).mem_efficiency
    buffer = total * (4 + 12 / 8) / mem
    assert st.zero_comm_s == pytest.approx(exposed + buffer)
    assert est.breakdown["sharded_dp_comm_s"] == pytest.approx(m * (exposed + buffer) + after)


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


def test_zero3_replicas_with_unequal_micro_batches_sync_once_a_step():
    # two replicas without pipelining, 2 and 6 micro-batches of 1: per micro-batch, FSDP's
    # gathers of the longer replica would have no partner, so ZeRO-3 runs deferred (as the
    # runtime does): every parameter's fp32 gradient reduce-scattered and its bf16 value
    # all-gathered once a step (ring over 2 GPUs: half of each volume), nothing per
    # micro-batch; ZeRO-2 (zeros for the missing micro-batches) and equal replicas do not
    from dataclasses import replace

    from hetplan.cost.memory import state_bytes
    from hetplan.cost.sharding import deferred_sync

    cluster = parse_inline_cluster("A100-80GB:1x2")
    model = ModelSpec("m", "gpt", 4, 1024, 8, 8, 4096, 8192, 512)
    even = uniform_plan(cluster, 4, 1, 1, 2, 1, 8, precision="bf16", zero_stage=3,
                        overlap_grad_reduce=False)  # fmt: skip
    a, b = even.pipelines
    plan = replace(even, pipelines=(replace(a, batch_size=2), replace(b, batch_size=6)))
    assert deferred_sync(plan)
    assert not deferred_sync(even)
    assert not deferred_sync(replace(plan, zero_stage=2))
    est = estimate(plan, model, cluster, _one_node_params())
    bw = cluster.nodes[0].intra_node_bytes_per_s
    p = 4 * model.layer_params() + model.embedding_params() + model.head_params()
    for st in est.stages:
        assert st.zero_comm_s == 0.0
        assert st.grad_sync_s == pytest.approx(1 / 2 * p * (4 + 2) / bw, rel=1e-9)
        # ZeRO-1's bytes (bf16 weights, fp32 gradients, Adam over 2) and the gradient shard
        want = (2 + 4 + 12 / 2 + 4 / 2) * p
        assert st.memory.weights + st.memory.grads + st.memory.optimizer == pytest.approx(want)
        assert sum(state_bytes(p, "bf16", 3, 2, deferred=True)) == pytest.approx(want)


def test_zero2_buffer_work_by_hand():
    from hetplan.cost.dp_sync import zero2_buffer_s
    from hetplan.hardware import GPUType

    gpu = GPUType("X", 80e9, 1e15, 1e15, 1e14, 2e12, 1e11, 1e10)
    eff = GPUEfficiency(mem_efficiency=0.5)
    # 1e9 fp32 gradients among 4 members: the buffer cleared (4 GB written) and a 1 GB
    # shard summed into the step's (two 1 GB reads, one write): 7 GB at 1 TB/s
    assert zero2_buffer_s(1e9, 4, gpu, eff) == pytest.approx(7e-3)
    assert zero2_buffer_s(1e9, 1, gpu, eff) == 0.0  # one member reduces nothing

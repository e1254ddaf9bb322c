"""The least time of a gradient reduction (``comm.allreduce_floor_s_per_byte``,
``dp_sync.reduction_floor_s``), which the heterogeneous search's band bound charges every
pipeline beyond one: against the collectives ``estimate`` prices, on random groups and
concurrencies, against the textbook ring volume, and in the bound it raises."""

from __future__ import annotations

import itertools
import random

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost import comm
from hetplan.cost.dp_sync import GRAD_BYTES, reduction_floor_s
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.search import heterogeneous as het
from hetplan.search.grouping import device_classes
from hetplan.search.het_tables import Knobs

SPECS = [
    "A100-40GB:3x8,T4:2x4",
    "A100-80GB:2x8,V100-32GB:2x8",
    "H100-80GB:4x8",
    "L4:3x4,A10:2x2",
]


@pytest.mark.parametrize("seed", range(40))
def test_floor_never_exceeds_the_collectives_estimate_prices(seed):
    """Random groups over two node kinds, each member's node, random concurrency (every
    node's count at least the group's members on it, as ``estimate``'s sync layout counts
    them): the all-reduce, and an all-gather plus a reduce-scatter, take at least the
    buffer times the floor of every member's node."""
    rng = random.Random(seed)
    cluster = parse_inline_cluster(SPECS[seed % len(SPECS)])
    params = default_params()
    devices = list(cluster.devices())
    largest = max(n.gpus for n in cluster.nodes)
    for _ in range(20):
        n = rng.randint(2, min(len(devices), 24))
        members = [cluster.device_node(d) for d in rng.sample(devices, n)]
        local: dict[str, int] = {}
        for m in members:
            local[m.name] = local.get(m.name, 0) + 1
        conc = {k: v + rng.randint(0, 8) for k, v in local.items()}
        size = rng.choice([1e6, 5e7, 4e8, 3e9])
        ar = comm.group_allreduce_s(size, members, params, conc)
        halves = comm.group_allgather_s(size, members, params, conc)
        halves += comm.group_reduce_scatter_s(size, members, params, conc)
        for m in members:
            floor = size * comm.allreduce_floor_s_per_byte(m, n, largest, params)
            assert 0 < floor <= ar * (1 + 1e-12)
            assert floor <= halves * (1 + 1e-12)


def test_floor_is_the_ring_volume_over_the_binding_link():
    """By hand: 256 members on nodes of 8 span at least 32 nodes, so each member's node
    link carries 2 x 31/32 of the buffer (the hierarchical all-reduce's inter-node phase),
    at the fitted network efficiency; 4 members of one 8-GPU node: the lesser of the ring's
    2 x 3/4 over the intra-node link and, on two nodes, one buffer over the network link."""
    params = default_params()
    node = parse_inline_cluster("A100-40GB:1x8").nodes[0]
    net = node.network_bytes_per_s * params.network_efficiency_of(node.gpu.name)
    link = node.intra_node_bytes_per_s * params.link_efficiency_of(node.gpu.name)
    got = comm.allreduce_floor_s_per_byte(node, 256, 8, params)
    assert got == pytest.approx(2 * 31 / 32 / net, rel=1e-12)
    got4 = comm.allreduce_floor_s_per_byte(node, 4, 8, params)
    assert got4 == pytest.approx(min(2 * 3 / 4 / link, 1 / net), rel=1e-12)
    assert comm.allreduce_floor_s_per_byte(node, 1, 8, params) == 0.0
    # without latency the floor is the all-reduce itself where its members are packed: 32
    # members on 4 full nodes (the intra-node phase runs beside the slower network one)
    four = parse_inline_cluster("A100-40GB:4x8")
    members = [four.device_node(d) for d in four.devices()]
    ar = comm.group_allreduce_s(1e9, members, params)
    latency = 2 * 3 * params.inter_latency_of(node.gpu.name)
    floor32 = 1e9 * comm.allreduce_floor_s_per_byte(members[0], 32, 8, params)
    assert floor32 == pytest.approx(ar - latency, rel=1e-9)
    assert floor32 == pytest.approx(1e9 * 2 * 3 / 4 / net, rel=1e-12)


def test_layer_floor_is_below_the_exposed_reduction_estimate_prices():
    """GPT-3 1.3B, 16 single-GPU pipelines on two nodes and 32 on four (ZeRO 0 and 1,
    with and without overlap): each stage waits after its last backward at least its 24
    layers' floors (``reduction_floor_s`` x 24). A100-40GB's fitted overlap share is about
    0 (nearly all of the reduction waits), H100's 0.71 (with overlap, at least 0.29 of it:
    the floor must not take the whole)."""
    model = ModelSpec("gpt3-1.3b", "gpt", 24, 2048, 16, 16, 8192, 50257, 2048)
    params = default_params()
    for gpu, nodes in itertools.product(("A100-40GB", "H100-80GB"), (2, 4)):
        cluster = parse_inline_cluster(f"{gpu}:{nodes}x8")
        devices = list(cluster.devices())
        pipes = tuple(Pipeline(2, (Stage(24, (d,)),)) for d in devices)
        for zero in (0, 1):
            for overlap in (True, False):
                plan = Plan(global_batch_size=2 * len(devices), micro_batch_size=1,
                            pipelines=pipes, precision="bf16", zero_stage=zero,
                            overlap_grad_reduce=overlap)  # fmt: skip
                est = estimate(plan, model, cluster, params)
                per_param = GRAD_BYTES if zero == 0 else (GRAD_BYTES + 2) / 2
                for st in est.stages:
                    node = cluster.device_node(plan.pipelines[st.pipeline].stages[0].devices[0])
                    floor = 24 * reduction_floor_s(model, "bf16", 1, node, plan.dp, 8, params,
                                                   per_param, overlap)  # fmt: skip
                    assert floor > 0
                    assert floor <= (st.sync_end_s - st.last_backward_end_s) * (1 + 1e-9)


def test_band_bound_charges_the_reduction_and_stays_below_estimate():
    """256 single-GPU pipelines of GPT-3 1.3B on 32 A100-40GB nodes (its fitted overlap
    share is about 0: the whole reduction follows the backward): the band bound of exactly
    256 pipelines is above the one of a single pipeline's throughput alone, yet below the
    plan's estimate."""
    model = ModelSpec("gpt3-1.3b", "gpt", 24, 2048, 16, 16, 8192, 50257, 2048)
    cluster = parse_inline_cluster("A100-40GB:32x8")
    params = default_params()
    devices = list(cluster.devices())
    plan = Plan(global_batch_size=512, micro_batch_size=2,
                pipelines=tuple(Pipeline(2, (Stage(24, (d,)),)) for d in devices),
                precision="fp16", zero_stage=1)  # fmt: skip
    t = estimate(plan, model, cluster, params).iteration_time_s
    state = het._State(model, cluster, device_classes(cluster), 512, "fp16", params, True)
    knobs = Knobs(2, "none", 0, 1, "fp16", True, "1F1B", 1)
    tps = (1,)
    with_reduction = state.band_bound_s(tps, knobs, 256, 256)
    assert with_reduction <= t
    ratio = state._reduction_ratio(tps, knobs, 256)
    assert ratio > 0
    state.ratio_memo[(tps, knobs, 256)] = 0.0  # the bound without it
    without = state.band_bound_s(tps, knobs, 256, 256)
    assert with_reduction > without * 1.05


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_plan_bound_ends_stages_with_their_reduction(zero):
    """The heterogeneous search's bound of concrete plans (``PlanBounds``): 64 single-GPU
    pipelines and 16 two-stage pipelines of GPT-3 1.3B on 8 A100-40GB nodes, every ZeRO
    stage (pipelined ZeRO-2/3 deferred to ZeRO-1's once-a-step reduction; unpipelined
    ZeRO-2/3 reduce every micro-batch: no tail): below ``estimate``, and above the bound
    without the tail by the least stage's tail wherever one is due."""
    from hetplan.search.het_bounds import PlanBounds, reduction_kind

    model = ModelSpec("gpt3-1.3b", "gpt", 24, 2048, 16, 16, 8192, 50257, 2048)
    cluster = parse_inline_cluster("A100-40GB:8x8")
    params = default_params()
    devices = list(cluster.devices())
    single = tuple(Pipeline(2, (Stage(24, (d,)),)) for d in devices)
    double = tuple(Pipeline(8, (Stage(12, (a,)), Stage(12, (b,))))
                   for a, b in zip(devices[:32], devices[32:], strict=True))  # fmt: skip
    for pipes in (single, double):
        plan = Plan(global_batch_size=sum(p.batch_size for p in pipes), micro_batch_size=2,
                    pipelines=pipes, precision="bf16", zero_stage=zero)  # fmt: skip
        t = estimate(plan, model, cluster, params).iteration_time_s
        bounds = PlanBounds(model, cluster, params)
        bound = bounds.bound_s(plan)
        assert bound <= t
        due = reduction_kind(plan) is not None
        assert due == (zero < 2 or len(pipes[0].stages) > 1)
        bare = PlanBounds(model, cluster, params)
        bare._tails = _Zero()  # every tail 0: the bound before the reduction was charged
        if due:
            # every stage's end moves by its tail: the bound by at least the least of them,
            # 12 or 24 layers' floors among the plan's replicas
            per_param, overlap = reduction_kind(plan)
            layer = reduction_floor_s(model, "bf16", 1, cluster.nodes[0], plan.dp, 8, params,
                                      per_param, overlap)  # fmt: skip
            least = min(st.layers for st in pipes[0].stages) * layer
            assert least > 0.01 * t
            assert bound >= (bare.bound_s(plan) + least) * (1 - 1e-6)
        else:
            assert bound == bare.bound_s(plan)


class _Zero(dict):
    """A memo of ``PlanBounds._tail`` that answers no reduction for every key (none after
    the last backward, none in all)."""

    def get(self, key, default=None):
        return (0.0, 0.0)

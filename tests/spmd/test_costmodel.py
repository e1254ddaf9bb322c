"""The SPMD cost model prices work as the cost model does (one physics), hand-checked.

Every expected value is written out from the textbook formula with the test's own
numbers: a GPU "G" of 100 TFLOP/s fp16, 1 TB/s HBM, 100 GB/s NVLink, 100 Gbit/s network,
with fitted terms gemm_max 0.8, half dimension 64, memory efficiency 0.9, 5 us per kernel,
link efficiency 0.9, network efficiency 0.75, 6 us / 30 us per intra / inter step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetplan.cluster import cluster_from_dict
from hetplan.cost.compute import gemm_efficiency, gemm_time_s
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.spmd.capture import capture
from hetplan.spmd.costmodel import devices_from_cluster, param_state_factor
from hetplan.spmd.program import Instr
from hetplan.spmd.ratios import solve_ratios
from hetplan.spmd.space import Space

G = {
    "fp16_tflops": 100,
    "fp32_tflops": 50,
    "memory_gb": 80,
    "hbm_gbyte_per_s": 1000,
    "intra_node_gbyte_per_s": 100,
    "network_gbit_per_s": 100,
}
H = {**G, "fp16_tflops": 50}
G_EFF = GPUEfficiency(
    gemm_max=0.8,
    gemm_half_dim=64,
    mem_efficiency=0.9,
    kernel_overhead_s=5e-6,
    link_efficiency=0.9,
    network_efficiency=0.75,
    intra_latency_s=6e-6,
    inter_latency_s=30e-6,
)
H_EFF = GPUEfficiency(**{**G_EFF.__dict__, "gemm_max": 0.6, "gemm_half_dim": 128})
PARAMS = CostParams(gpus={"G": G_EFF, "H": H_EFF}, memory_reserve_bytes=0.0)
PEAK = 100e12
LAUNCH = 5e-6


def _devices(nodes: list[dict]) -> object:
    cluster = cluster_from_dict({"gpu_types": {"G": G, "H": H}, "nodes": nodes})
    return devices_from_cluster(cluster, "fp16", PARAMS)


class Linear(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.w = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x).sum()


def _linear_space(m: int, k: int, n: int, devs, ratios):
    cap = capture(Linear(k, n), (torch.zeros(m, k),), meta=True)
    node = next(x for x in cap.nodes if x.spec is not None and x.spec.family == "linear")
    space = Space(cap, devs, ratios)
    rules = space.rules[space.nodes.index(node)]
    return space, node, rules


def test_one_large_matmul_costs_gemm_time_at_its_efficiency() -> None:
    devs = _devices([{"gpu": "G", "gpus": 1}])
    space, node, rules = _linear_space(2048, 1024, 512, devs, [1.0])
    (rule,) = rules
    cost = space.compute_cost(node, rule).at([1.0])
    # smallest dimension 512: 0.8 * 512 / (512 + 64)
    eff = 0.8 * 512 / 576
    assert gemm_efficiency(G_EFF, 2048, 1024, 512) == pytest.approx(eff, rel=1e-12)
    one = 2 * 2048 * 1024 * 512 / (PEAK * eff)
    assert one == pytest.approx(30.199e-6, rel=1e-4)
    # forward and the weight gradient (x needs none), one kernel each
    assert cost == pytest.approx(2 * one + 2 * LAUNCH, rel=1e-12)
    assert cost == pytest.approx(
        2 * gemm_time_s(G_EFF, PEAK, 2048, 1024, 512) + 2 * LAUNCH, rel=1e-12
    )


def test_a_narrow_shard_runs_at_its_own_lower_efficiency() -> None:
    devs = _devices([{"gpu": "G", "gpus": 2}])
    ratios = [0.25, 0.75]
    space, node, rules = _linear_space(2048, 1024, 128, devs, ratios)
    # output features split: device 0 gets 32 of 128, device 1 gets 96
    rule = next(r for r in rules if (r.output.kind, r.output.dim) == ("S", 1))
    cost = space.compute_cost(node, rule)
    t0 = 2 * 2048 * 1024 * 32 / (PEAK * 0.8 * 32 / 96)
    t1 = 2 * 2048 * 1024 * 96 / (PEAK * 0.8 * 96 / 160)
    assert cost.at(ratios) == pytest.approx(2 * max(t0, t1) + 2 * LAUNCH, rel=1e-12)
    # the whole matmul at 128 columns would run at 0.8 * 128 / 192: the shards are slower
    whole = 2 * 2048 * 1024 * 128 / (PEAK * 0.8 * 128 / 192)
    assert t1 > 0.75 * whole


def test_elementwise_kernel_moves_its_bytes_at_the_fitted_bandwidth() -> None:
    class Relu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x).sum()

    devs = _devices([{"gpu": "G", "gpus": 1}])
    x = torch.zeros(4096, 1024, requires_grad=True)
    cap = capture(Relu(), (x,), meta=True)
    node = next(n for n in cap.nodes if n.spec is not None and n.label() == "relu")
    space = Space(cap, devs, [1.0])
    cost = space.compute_cost(node, space.rules[space.nodes.index(node)][0]).at([1.0])
    tensor = 4096 * 1024 * 4
    # forward reads and writes the tensor; backward twice that; 1 + 2 kernels
    assert cost == pytest.approx(3 * 2 * tensor / (1000e9 * 0.9) + 3 * LAUNCH, rel=1e-12)


def test_attention_is_two_batched_matmuls_of_the_fused_kernel() -> None:
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v).sum()

    devs = _devices([{"gpu": "G", "gpus": 1}])
    q = torch.zeros(2, 4, 128, 64)
    cap = capture(Attn(), (q, q.clone(), q.clone()), meta=True)
    node = next(n for n in cap.nodes if n.spec is not None and n.spec.family == "attention")
    space = Space(cap, devs, [1.0])
    cost = space.compute_cost(node, space.rules[space.nodes.index(node)][0]).at([1.0])
    # (128 x 64)(64 x 128) and (128 x 128)(128 x 64), 8 heads each, smallest dimension 64
    each = 2 * 128 * 64 * 128 * 8 / (PEAK * 0.8 * 64 / 128)
    assert cost == pytest.approx(1.25 * 2 * each + LAUNCH, rel=1e-12)


def test_allreduce_across_two_nodes_of_eight_is_the_hierarchical_ring() -> None:
    devs = _devices([{"gpu": "G", "count": 2, "gpus": 8}])
    size = 64 * 2**20
    # inside a node: ring all-reduce among 8, 2(n-1)/n of the tensor over NVLink
    intra = 2 * 7 / 8 * size / (100e9 * 0.9) + 2 * 7 * 6e-6
    # across: each GPU's 1/8 shard, ring among 2 nodes, the node's link shared by 8
    inter = 2 * 1 / 2 * (size / 8) / (100e9 / 8 * 0.75 / 8)
    expected = max(intra, inter) + 2 * 1 * 30e-6
    assert expected == pytest.approx(7.218e-3, rel=1e-3)
    assert devs.allreduce(size).at([1 / 16] * 16) == pytest.approx(expected, rel=1e-12)


def test_padded_allgather_sends_the_largest_shard_from_everyone() -> None:
    devs = _devices([{"gpu": "G", "gpus": 1}, {"gpu": "G", "gpus": 1}])
    size = 8 * 2**20
    ratios = [0.7, 0.3]
    # ring all-gather of 2 shards padded to 0.7: (n-1)/n of 2 * 0.7 * size, one step
    expected = 1 / 2 * (2 * 0.7 * size) / (100e9 / 8 * 0.75) + 30e-6
    assert devs.allgather(size, "padded").at(ratios) == pytest.approx(expected, rel=1e-9)
    # grouped: each rank broadcasts its exact shard (x per link, one step each)
    grouped = size / (100e9 / 8 * 0.75) + 2 * 30e-6
    assert devs.allgather(size, "grouped").at(ratios) == pytest.approx(grouped, rel=1e-9)


def test_lp_splits_a_matmul_by_the_devices_speed_ratio() -> None:
    devs = _devices([{"gpu": "G", "gpus": 1}, {"gpu": "H", "gpus": 1}])
    space, node, rules = _linear_space(8192, 1024, 1024, devs, [0.5, 0.5])
    rule = next(r for r in rules if (r.output.kind, r.output.dim) == ("S", 0))  # tokens
    op = Instr("op", node.name, rule.output, rule.inputs, True, cost=space.compute_cost(node, rule))
    lp = solve_ratios([op], devs)
    assert lp is not None
    # smallest dimension 1024 either way: G at 100 TF x 0.8 x 1024/1088, H at
    # 50 TF x 0.6 x 1024/1152; shares in proportion to those speeds
    speed_g = 100e12 * 0.8 * 1024 / 1088
    speed_h = 50e12 * 0.6 * 1024 / 1152
    assert lp[0][0] / lp[0][1] == pytest.approx(speed_g / speed_h, rel=1e-6)
    assert lp[0][0] == pytest.approx(0.7385, abs=1e-4)
    flops = 2 * 8192 * 1024 * 1024
    assert lp[1] == pytest.approx(2 * flops / (speed_g + speed_h) + 2 * LAUNCH, rel=1e-6)


def test_parameter_state_bytes_follow_the_memory_table() -> None:
    # fp32 Adam: 4 weight + 4 gradient + 8 moments per 4-byte parameter
    assert param_state_factor(4) == pytest.approx(16 / 4)
    # 16-bit weights: 2 + 4 (fp32 gradient) + 12 (master and moments) per 2 bytes
    assert param_state_factor(2) == pytest.approx(18 / 2)

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost import comm
from hetplan.cost.params import CostParams, GPUEfficiency

PARAMS = CostParams(link_efficiency=0.5, intra_latency_s=0.0, inter_latency_s=0.0)


def test_ring_allreduce_bytes():
    assert comm.ring_allreduce_bytes(8e6, 1) == 0.0
    assert comm.ring_allreduce_bytes(8e6, 2) == pytest.approx(8e6)
    assert comm.ring_allreduce_bytes(8e6, 8) == pytest.approx(2 * 7 / 8 * 8e6)


def test_intra_node_allreduce_is_ring_bytes_over_link():
    node = parse_inline_cluster("A100-80GB:1x8").nodes[0]
    size = 1e9
    expected = 2 * 7 / 8 * size / (node.intra_node_bytes_per_s * 0.5)
    assert comm.intra_node_allreduce_s(size, 8, node, PARAMS) == pytest.approx(expected)
    with_latency = CostParams(link_efficiency=0.5, intra_latency_s=1e-5)
    assert comm.intra_node_allreduce_s(size, 8, node, with_latency) == pytest.approx(
        expected + 14 * 1e-5
    )


def test_hierarchical_allreduce_on_two_nodes():
    """Two nodes x 4 GPUs: ring inside each node on the full size, and across the two nodes
    on a quarter each, the four GPUs of a node sharing its network link; the phases are
    pipelined, so the slower one sets the time."""
    nodes = parse_inline_cluster("T4:2x4").nodes
    members = [nodes[0]] * 4 + [nodes[1]] * 4
    size = 400e6
    node = nodes[0]
    intra = 2 * 3 / 4 * size / (node.intra_node_bytes_per_s * 0.5)
    inter = 2 * 1 / 2 * (size / 4) / (node.network_bytes_per_s / 4 * 0.5)
    got = comm.group_allreduce_s(size, members, PARAMS)
    assert got == pytest.approx(max(intra, inter))
    # one GPU per node: a plain two-member ring over the network
    alone = comm.group_allreduce_s(size, [nodes[0], nodes[1]], PARAMS)
    assert alone == pytest.approx(size / (node.network_bytes_per_s * 0.5))
    assert comm.group_allreduce_s(size, members, PARAMS, volume=0.5) == pytest.approx(got / 2)


def test_per_gpu_link_efficiency_overrides_the_global_one():
    node = parse_inline_cluster("T4:1x4").nodes[0]
    own = PARAMS.with_gpu("T4", GPUEfficiency(link_efficiency=0.25))
    base = comm.intra_node_allreduce_s(1e8, 4, node, PARAMS)
    assert comm.intra_node_allreduce_s(1e8, 4, node, own) == pytest.approx(2 * base)


def test_p2p_inside_and_across_nodes():
    a, b = parse_inline_cluster("A100-80GB:2x8").nodes
    size = 64e6
    assert comm.p2p_s(size, a, a, PARAMS) == pytest.approx(size / (a.intra_node_bytes_per_s * 0.5))
    assert comm.p2p_s(size, a, b, PARAMS, concurrency=8) == pytest.approx(
        8 * size / (a.network_bytes_per_s * 0.5)
    )


def test_ring_allgather_and_reduce_scatter_volumes():
    """Textbook ring: n-1 steps, each member sends one n-th of the buffer per step."""
    assert comm.ring_allgather_bytes(8e6, 1) == 0.0
    assert comm.ring_allgather_bytes(8e6, 2) == pytest.approx(4e6)
    assert comm.ring_allgather_bytes(8e6, 4) == pytest.approx(6e6)
    node = parse_inline_cluster("A100-80GB:1x4").nodes[0]
    params = CostParams(link_efficiency=0.5, intra_latency_s=1e-5)
    bw = node.intra_node_bytes_per_s * 0.5
    size = 1e9
    # 4 members: 3 steps of 1e9/4 bytes each, a step latency each
    expected = 3 * (size / 4) / bw + 3 * 1e-5
    for fn in (comm.group_allgather_s, comm.group_reduce_scatter_s):
        assert fn(size, [node] * 4, params) == pytest.approx(expected)
        assert fn(size, [node], params) == 0.0
    # across nodes: half the hierarchical all-reduce's traffic
    nodes = parse_inline_cluster("T4:2x4").nodes
    members = [nodes[0]] * 4 + [nodes[1]] * 4
    full = comm.group_allreduce_s(4e8, members, PARAMS)
    assert comm.group_allgather_s(4e8, members, PARAMS) == pytest.approx(full / 2)


def test_measured_allgather_and_reduce_scatter_figures(tmp_path):
    """A profile's stored figures (latency per ring step, bus bytes/s) of each kind price
    that collective; the other kind, not stored, stays half the all-reduce."""
    from hetplan.measured.profile_db import ProfileDB

    node = parse_inline_cluster("T4:1x4").nodes[0]
    db = ProfileDB(tmp_path / "p.sqlite")
    db.put_link("T4", "allgather", 0.002, 5e7)
    params = PARAMS.with_profile(db)
    size = 1e7
    # 2 members: one step of half the buffer
    assert comm.group_allgather_s(size, [node] * 2, params) == pytest.approx(0.002 + 5e6 / 5e7)
    # 4 members: 3 steps of a quarter each
    assert comm.group_allgather_s(size, [node] * 4, params) == pytest.approx(
        3 * 0.002 + 7.5e6 / 5e7
    )
    unmeasured = comm.intra_node_allreduce_s(size, 2, node, params) / 2
    assert comm.group_reduce_scatter_s(size, [node] * 2, params) == pytest.approx(unmeasured)
    db.put_link("T4", "reduce_scatter", 0.001, 2e7)
    params = PARAMS.with_profile(ProfileDB(tmp_path / "p.sqlite"))
    assert comm.group_reduce_scatter_s(size, [node] * 2, params) == pytest.approx(0.001 + 5e6 / 2e7)
    with pytest.raises(ValueError):
        comm.intra_node_half_s(size, 2, node, params, "broadcast")


def test_scalar_allreduce_is_tree_latency():
    """One number over 8 GPUs on each of 5 nodes: a binary tree of depth 3 inside the node
    (reduce up, broadcast down: 6 steps) and of depth ceil(log2 5) = 3 across nodes (6
    steps), latency only: 6 x 10 us + 6 x 30 us = 240 us. One node of 2: two steps."""
    params = CostParams(intra_latency_s=10e-6, inter_latency_s=30e-6)
    nodes = parse_inline_cluster("A100-80GB:5x8").nodes
    assert [comm.tree_steps(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 2, 4, 4, 6, 6, 8]
    assert comm.scalar_allreduce_s(nodes[:1], 5, 8, params) == pytest.approx(240e-6)
    assert comm.scalar_allreduce_s(nodes[:1], 1, 2, params) == pytest.approx(20e-6)
    assert comm.scalar_allreduce_s(nodes[:1], 1, 1, params) == 0.0
    assert comm.scalar_allreduce_s(nodes[:1], 2, 1, params) == pytest.approx(60e-6)


def test_a_member_list_priced_again_after_it_grew_is_priced_anew():
    # collectives keep what they read of a member list (its nodes, their talkers) by the
    # list's identity: a list that grew in between must be read again. Two A100 nodes of 8,
    # one member on each: the shards cross the network whole; a second member on the first
    # node leaves one on the second, so k stays 1 but the first node's link has two talkers
    a, b = parse_inline_cluster("A100-80GB:2x8").nodes
    members = [a, b]
    size = 1e9
    one_each = comm.group_allreduce_s(size, members, PARAMS)
    members.append(a)
    grown = comm.group_allreduce_s(size, members, PARAMS)
    assert grown == comm.group_allreduce_s(size, list(members), PARAMS)
    # ring of 2 nodes, 1 GB each way over the slowest share: its link halved by two talkers
    link = a.network_bytes_per_s * PARAMS.network_efficiency_of(a.gpu.name)
    assert one_each == pytest.approx(2 * 1 / 2 * size / link)
    assert grown == pytest.approx(2 * 1 / 2 * size / (link / 2))

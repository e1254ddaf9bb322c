"""The per-byte floors of a data-parallel reduction that the searches prune by: one for a
placed group (``comm.group_floor_s_per_byte``), one for a group of given sizes per kind of
node placed any way (``comm.spread_floor_s_per_byte``). Expected values from ring volumes
by hand; both held against ``group_allreduce_s`` on every placement of small cases."""

import itertools
import random

import pytest

from hetplan.cluster import Cluster, parse_inline_cluster
from hetplan.cost import comm
from hetplan.cost.params import CostParams

PARAMS = CostParams(link_efficiency=0.5, intra_latency_s=0.0, inter_latency_s=0.0)


def test_placed_floor_by_hand():
    """Eight members on three nodes of four, 4 + 3 + 1: the hierarchical all-reduce's shard
    is the whole buffer (one member alone on a node), sent around a ring of three nodes,
    2 x 2/3 of it, by each of the four members of the fullest node over a quarter of its
    link: 16/3 bytes per byte over the link. 4 + 4 on two nodes: a quarter of the buffer,
    once, over a quarter of the link: 1 byte per byte. One node: the ring inside it."""
    nodes = parse_inline_cluster("A100-80GB:3x4").nodes
    net = nodes[0].network_bytes_per_s * 0.5
    spread = [nodes[0]] * 4 + [nodes[1]] * 3 + [nodes[2]]
    assert comm.group_floor_s_per_byte(spread, PARAMS) == pytest.approx(16 / 3 / net)
    packed = [nodes[0]] * 4 + [nodes[1]] * 4
    assert comm.group_floor_s_per_byte(packed, PARAMS) == pytest.approx(1 / net)
    link = nodes[0].intra_node_bytes_per_s * 0.5
    assert comm.group_floor_s_per_byte([nodes[0]] * 4, PARAMS) == pytest.approx(1.5 / link)
    assert comm.group_floor_s_per_byte([nodes[0]], PARAMS) == 0.0
    # the same sizes placed any way: 4 + 4 is the best of them
    parts = [(nodes[0], 8, 3, 4)]
    assert comm.spread_floor_s_per_byte(parts, PARAMS) == pytest.approx(1 / net)


def _groups(rng: random.Random, cluster: Cluster):
    nodes = cluster.nodes
    for _ in range(60):
        members = []
        for n in rng.sample(nodes, rng.randint(1, len(nodes))):
            members += [n] * rng.randint(1, n.gpus)
        yield members


@pytest.mark.parametrize("spec", ["A100-80GB:3x4,T4:2x2", "V100-16GB:2x4,L4:3x1", "T4:4x2"])
def test_placed_floor_never_exceeds_the_collectives(spec):
    """Random groups, with other devices of their nodes talking at once (any concurrency at
    least the group's own members on a node): the floor times the buffer is never above
    the all-reduce, nor the reduce-scatter and all-gather together."""
    rng = random.Random(spec)
    cluster = parse_inline_cluster(spec)
    params = CostParams(link_efficiency=0.7, intra_latency_s=1e-5, inter_latency_s=2e-5)
    size = 3e8
    for members in _groups(rng, cluster):
        floor = comm.group_floor_s_per_byte(members, params) * size
        local = {m.name: members.count(m) for m in members}
        for extra in (0, 1, 3):
            conc = {name: c + rng.randint(0, extra) for name, c in local.items()}
            t = comm.group_allreduce_s(size, members, params, conc)
            assert floor <= t * (1 + 1e-12)
            half = comm.group_reduce_scatter_s(size, members, params, conc)
            half += comm.group_allgather_s(size, members, params, conc)
            assert floor <= half * (1 + 1e-12)
        if len(members) > 1 and len(local) > 1:
            assert floor == pytest.approx(comm.group_allreduce_s(size, members, PARAMS), rel=0.5)


@pytest.mark.parametrize("spec", ["A100-80GB:3x4,T4:2x2", "V100-16GB:2x4,L4:3x1,T4:1x2"])
def test_spread_floor_is_the_least_over_every_placement(spec):
    """For every count of members per kind of node, the spread floor equals the least
    placed floor over every way to put that many members on the kind's nodes (at most a
    node's GPUs each): enumerated here node by node."""
    cluster = parse_inline_cluster(spec)
    kinds: dict[str, list] = {}
    for n in cluster.nodes:
        kinds.setdefault(n.gpu.name, []).append(n)
    groups = list(kinds.values())

    def fills(nodes, count):  # every way to put ``count`` members on ``nodes``
        for sizes in itertools.product(*(range(n.gpus + 1) for n in nodes)):
            if sum(sizes) == count:
                yield [n for n, s in zip(nodes, sizes, strict=True) for _ in range(s)]

    for counts in itertools.product(*(range(sum(n.gpus for n in g) + 1) for g in groups)):
        if sum(counts) < 2:
            continue
        parts = [(g[0], c, len(g), g[0].gpus) for g, c in zip(groups, counts, strict=True)]
        spread = comm.spread_floor_s_per_byte(parts, PARAMS)
        least = min(
            comm.group_floor_s_per_byte([m for part in choice for m in part], PARAMS)
            for choice in itertools.product(
                *(fills(g, c) for g, c in zip(groups, counts, strict=True))
            )
        )
        assert spread <= least * (1 + 1e-12)
        # the node counts' floor is reached when the members fill their nodes evenly
        if len([c for c in counts if c]) == 1:
            assert spread == pytest.approx(least)


def test_floors_are_zero_with_a_measured_profile():
    from hetplan.cost.sources import ComputeSource

    nodes = parse_inline_cluster("T4:2x2").nodes
    params = CostParams(compute=ComputeSource(profile=object()))  # type: ignore[arg-type]
    assert comm.group_floor_s_per_byte([nodes[0], nodes[1]], params) == 0.0
    assert comm.spread_floor_s_per_byte([(nodes[0], 2, 2, 2)], params) == 0.0

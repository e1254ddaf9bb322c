"""Alpha-beta collectives on the links a group actually crosses, or the profile's measured
figures for them (``params.compute``: the runtime's link figures, imported bandwidths).

A collective over devices on several nodes runs hierarchically (as NCCL does): inside
each node over the intra-node link, across nodes over the node's network link, which
is shared by every device of the node that communicates across nodes at the same time.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.cluster import Node
from hetplan.cost.params import CostParams


def ring_allreduce_bytes(size_bytes: float, n: int) -> float:
    """Returns the bytes each member sends in a ring all-reduce of ``size_bytes``."""
    return 2.0 * (n - 1) / n * size_bytes if n > 1 else 0.0


def intra_node_allreduce_s(size_bytes: float, n: int, node: Node, params: CostParams) -> float:
    """Returns a ring all-reduce time among ``n`` GPUs of one node."""
    if n <= 1:
        return 0.0
    ring = params.compute.ask("link_figures", node.gpu, "allreduce")
    if ring is not None:  # the runtime's measured ring: latency per step, bus bytes/s
        return ring_allreduce_bytes(size_bytes, n) / ring[1] + 2 * (n - 1) * ring[0]
    measured = params.compute.network_bw(node.gpu.name, "intra", n, size_bytes)
    if measured is not None:  # achieved: message bytes per second, latency included
        return size_bytes / measured
    bw = node.intra_node_bytes_per_s * params.link_efficiency_of(node.gpu.name)
    return ring_allreduce_bytes(size_bytes, n) / bw + 2 * (n - 1) * params.intra_latency_of(
        node.gpu.name
    )


def ring_allgather_bytes(size_bytes: float, n: int) -> float:
    """Returns the bytes each member sends in a ring all-gather (or reduce-scatter) of a
    ``size_bytes`` buffer: (n-1)/n of it, half an all-reduce's."""
    return (n - 1) / n * size_bytes if n > 1 else 0.0


HALF_COLLECTIVES = ("allgather", "reduce_scatter")
"""Collectives that move half an all-reduce's ring volume, each with its own measured link
figures where the profile has them (``hetplan profile --links``)."""


def intra_node_half_s(
    size_bytes: float, n: int, node: Node, params: CostParams, kind: str
) -> float:
    """Returns a ring all-gather or reduce-scatter (``kind``) time of a ``size_bytes``
    buffer (the gathered whole, or the whole before scattering) among ``n`` GPUs of one
    node: the profile's measured figures of that kind (latency per ring step, bus bytes/s)
    where it has them, else half an all-reduce of the buffer."""
    if kind not in HALF_COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    if n <= 1:
        return 0.0
    ring = params.compute.ask("link_figures", node.gpu, kind)
    if ring is not None:  # n-1 ring steps
        return ring_allgather_bytes(size_bytes, n) / ring[1] + (n - 1) * ring[0]
    return intra_node_allreduce_s(size_bytes, n, node, params) / 2.0


def group_allreduce_s(
    size_bytes: float,
    members: Sequence[Node],
    params: CostParams,
    node_concurrency: dict[str, int] | None = None,
    volume: float = 1.0,
) -> float:
    """Returns the time of a hierarchical all-reduce of ``size_bytes`` among ``members``.

    ``members`` lists each participant's node (one entry per device). ``node_concurrency``
    gives, per node name, how many of its devices talk across nodes at the same time (they
    share its network link); default: this group's own members on the node. ``volume``
    scales the traffic (an all-gather or a reduce-scatter alone: ``group_allgather_s``,
    ``group_reduce_scatter_s``).
    Across nodes it is a reduce-scatter inside each node, an all-reduce of the shards across
    nodes (the node's link shared by its concurrent talkers), then an all-gather inside.
    """
    n = len(members)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    shape = _group_shape(members, node_concurrency)
    if shape.num_nodes == 1:
        return volume * intra_node_allreduce_s(size_bytes, n, members[0], params)
    intra = 0.0
    if shape.k > 1:  # each distinct (node kind, local count) once
        intra = max(intra_node_allreduce_s(size_bytes, c, node, params)
                    for node, c in shape.intra)  # fmt: skip
    shard = size_bytes / shape.k
    shares = []  # per node kind and talkers: its share
    for node, talkers in shape.talkers:
        measured = params.compute.network_bw(node.gpu.name, "inter", talkers, shard)
        if measured is not None:  # the node's achieved aggregate with ``talkers`` GPUs
            shares.append(measured / talkers)
        else:
            eff = params.network_efficiency_of(node.gpu.name)
            shares.append(node.network_bytes_per_s * eff / talkers)
    inter = ring_allreduce_bytes(shard, shape.num_nodes) / min(shares)
    gpus = {node.gpu.name for node, _ in shape.talkers}
    latency = 2 * (shape.num_nodes - 1) * max(params.inter_latency_of(g) for g in gpus)
    # NCCL pipelines chunks through the intra- and inter-node hops at once: the slower
    # phase sets the time, not their sum
    return volume * (max(intra, inter) + latency)


def allreduce_floor_s_per_byte(node: Node, members: int, largest: int, params: CostParams) -> float:
    """Returns a lower bound, per byte of the buffer, of ``group_allreduce_s`` (and twice
    ``group_allgather_s``/``group_reduce_scatter_s``) for any group of ``members`` devices
    one of which is on ``node``, whatever nodes the others are on (``largest``: the most
    GPUs a node of the cluster holds) and whoever shares the links. On one node it is a
    ring: 2 (n - 1) / n bytes per byte over the node's link. Across k nodes the inter-node
    phase alone takes 2 (k - 1) / k of the shard over the slowest share of a node's link;
    the shard is the buffer over the fewest members on a node, ``node``'s share its link
    over at least the members it holds, so at least 2 (k - 1) / k bytes per byte over
    ``node``'s network link. The members span ``node`` and, past its GPUs, at least one more
    node per ``largest`` of them. Latency is left out. 0 with a measured profile (its link
    figures stand in for the datasheet's) or one member."""
    if members <= 1 or params.compute.profile is not None:
        return 0.0
    name = node.gpu.name
    net = node.network_bytes_per_s * params.network_efficiency_of(name)

    def across(nodes: int) -> float:
        return ring_allreduce_bytes(1.0, nodes) / net if net > 0 else math.inf

    if members <= node.gpus:
        link = node.intra_node_bytes_per_s * params.link_efficiency_of(name)
        inside = ring_allreduce_bytes(1.0, members) / link if link > 0 else math.inf
        return min(inside, across(2))
    return across(1 + -(-(members - node.gpus) // max(largest, 1)))


def group_floor_s_per_byte(members: Sequence[Node], params: CostParams) -> float:
    """Returns a lower bound, per byte of the buffer, of ``group_allreduce_s`` (and twice
    ``group_allgather_s``/``group_reduce_scatter_s``) among exactly these ``members`` (one
    entry per device: its node), whoever else shares their links. On one node the ring:
    2 (n - 1) / n bytes per byte over the node's link. Across k nodes the inter-node phase:
    2 (k - 1) / k of the shard (the buffer over the fewest members on a node) over the
    slowest share of a node's network link, a node's link shared by at least the members it
    holds (every one of them talks across nodes). Latency and the intra-node phase are left
    out. 0 with a measured profile (its link figures stand in for the datasheet's) or one
    member."""
    if len(members) <= 1 or params.compute.profile is not None:
        return 0.0
    local: dict[str, int] = {}  # members per node: each node's talkers, at the fewest
    for node in members:
        local[node.name] = local.get(node.name, 0) + 1
    if len(local) == 1:
        node = members[0]
        link = node.intra_node_bytes_per_s * params.link_efficiency_of(node.gpu.name)
        return ring_allreduce_bytes(1.0, len(members)) / link if link > 0 else math.inf
    slowest = 0.0  # seconds per byte of the slowest share
    seen: set[str] = set()
    for node in members:
        if node.name not in seen:
            seen.add(node.name)
            net = node.network_bytes_per_s * params.network_efficiency_of(node.gpu.name)
            slowest = max(slowest, local[node.name] / net if net > 0 else math.inf)
    return ring_allreduce_bytes(1.0 / min(local.values()), len(local)) * slowest


SPREAD_CHOICES = 4096
"""The most node-count choices ``spread_floor_s_per_byte`` weighs (past them: no floor)."""


def spread_floor_s_per_byte(
    parts: Sequence[tuple[Node, int, int, int]], params: CostParams
) -> float:
    """Returns a lower bound, per byte of the buffer, of ``group_allreduce_s`` (and twice
    the half collectives) among members of several kinds of node, wherever each is placed
    on its kind's nodes: ``parts``: per kind (GPU type and links), one node of it, the
    members on such nodes, how many such nodes there are and the most members one holds.
    For every choice of how many nodes u of each kind the members use, they span k = sum u
    nodes, the fewest members on a node is at most the least ``members // u`` and the
    fullest node of a kind holds at least ``ceil(members / u)``, which share its link:
    ``group_floor_s_per_byte``'s terms at their least for that choice; the least over the
    choices. 0 with a measured profile, one member, or more than ``SPREAD_CHOICES``
    choices."""
    parts = [x for x in parts if x[1] > 0]
    if sum(x[1] for x in parts) <= 1 or params.compute.profile is not None:
        return 0.0
    ranges = []
    for _, members, nodes, most in parts:
        lo = -(-members // max(most, 1))
        if lo > nodes:
            return 0.0  # they do not fit: no placement to bound
        ranges.append(range(lo, min(nodes, members) + 1))
    if math.prod(len(r) for r in ranges) > SPREAD_CHOICES:
        return 0.0
    nets = [n.network_bytes_per_s * params.network_efficiency_of(n.gpu.name) for n, *_ in parts]
    best = math.inf
    for us in itertools.product(*ranges):
        k = sum(us)
        if k == 1:
            node, members = parts[0][0], parts[0][1]
            link = node.intra_node_bytes_per_s * params.link_efficiency_of(node.gpu.name)
            best = min(best, ring_allreduce_bytes(1.0, members) / link if link > 0 else math.inf)
            continue
        fewest = min(x[1] // u for x, u in zip(parts, us, strict=True))
        slowest = max(
            (-(-x[1] // u)) / net if net > 0 else math.inf
            for x, u, net in zip(parts, us, nets, strict=True)
        )
        best = min(best, ring_allreduce_bytes(1.0 / max(fewest, 1), k) * slowest)
    return best


@dataclass(frozen=True)
class _GroupShape:
    """What a collective reads of its members: how many nodes they are on, the fewest
    members on one node, each distinct (node kind, local count), and each distinct (GPU
    type, network link, devices talking across nodes) with one node of it."""

    num_nodes: int
    k: int
    intra: tuple[tuple[Node, int], ...]
    talkers: tuple[tuple[Node, int], ...]


_SHAPES: dict[tuple[int, int], tuple[object, object, int, _GroupShape]] = {}
"""``_group_shape``'s memo by the identity of the member list and concurrency map (both kept,
so their ids stay theirs; checked by length too). Searches price the same data-parallel
groups many times (per ZeRO stage, per micro-batch size); cleared when full."""


def _group_shape(members: Sequence[Node], conc: dict[str, int] | None) -> _GroupShape:
    key = (id(members), id(conc))
    hit = _SHAPES.get(key)
    if hit is not None and hit[0] is members and hit[1] is conc and hit[2] == len(members):
        return hit[3]
    per_node = Counter(m.name for m in members)
    nodes = {m.name: m for m in members}
    k = min(per_node.values())
    kinds = {(nodes[name].gpu.name, nodes[name].intra_node_bytes_per_s, c): (nodes[name], c)
             for name, c in per_node.items()}  # fmt: skip
    talk: dict[tuple[str, float, int], tuple[Node, int]] = {}
    for name, local in per_node.items():
        talkers = max((conc or {}).get(name, local), 1)
        node = nodes[name]
        talk.setdefault((node.gpu.name, node.network_bytes_per_s, talkers), (node, talkers))
    shape = _GroupShape(len(per_node), k, tuple(kinds.values()), tuple(talk.values()))
    if len(_SHAPES) >= 4096:
        _SHAPES.clear()
    _SHAPES[key] = (members, conc, len(members), shape)
    return shape


def group_allgather_s(
    size_bytes: float,
    members: Sequence[Node],
    params: CostParams,
    node_concurrency: dict[str, int] | None = None,
) -> float:
    """Returns the time of an all-gather of a ``size_bytes`` buffer among ``members`` (see
    ``group_allreduce_s``): inside one node the measured all-gather where the profile has
    it, else (and across nodes) half the hierarchical all-reduce's volume."""
    return _group_half_s(size_bytes, members, params, node_concurrency, "allgather")


def group_reduce_scatter_s(
    size_bytes: float,
    members: Sequence[Node],
    params: CostParams,
    node_concurrency: dict[str, int] | None = None,
) -> float:
    """Returns the time of a reduce-scatter of a ``size_bytes`` buffer among ``members``,
    as ``group_allgather_s`` with the profile's reduce-scatter figures."""
    return _group_half_s(size_bytes, members, params, node_concurrency, "reduce_scatter")


def _group_half_s(
    size_bytes: float,
    members: Sequence[Node],
    params: CostParams,
    node_concurrency: dict[str, int] | None,
    kind: str,
) -> float:
    n = len(members)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    if _group_shape(members, node_concurrency).num_nodes == 1:
        return intra_node_half_s(size_bytes, n, members[0], params, kind)
    return group_allreduce_s(size_bytes, members, params, node_concurrency, 0.5)


def tree_steps(n: int) -> int:
    """Returns the latency steps of an all-reduce of a few bytes among ``n`` members over a
    binary tree (reduce up, broadcast down; NCCL's choice for small messages): 2 ceil(log2 n).
    A ring of two takes the same two steps."""
    return 2 * math.ceil(math.log2(n)) if n > 1 else 0


def scalar_allreduce_s(
    kinds: Sequence[Node], nodes: int, per_node: int, params: CostParams
) -> float:
    """Returns the time of an all-reduce of one number (a loss, a gradient norm) among
    ``per_node`` devices on each of ``nodes`` nodes, ``kinds`` one node of each GPU type
    among them: latency only, ``tree_steps`` inside a node at the profile's measured step
    (``scalar`` link) or the intra-node latency, then between the nodes at the network
    latency (the slowest type's)."""
    if not kinds:
        return 0.0
    inside = 0.0
    if per_node > 1:
        steps = tree_steps(per_node)
        for node in kinds:
            own = params.compute.ask("link_figures", node.gpu, "scalar")
            step = own[0] if own is not None else params.intra_latency_of(node.gpu.name)
            inside = max(inside, steps * step)
    between = 0.0
    if nodes > 1:
        between = tree_steps(nodes) * max(params.inter_latency_of(n.gpu.name) for n in kinds)
    return inside + between


STEP_SCALARS = 2
"""All-reduces of one number each step ends with over all of a plan's devices, each rank
waiting for them: the gradient norm for clipping (before the optimizer) and the loss."""


def step_collectives_s(
    kinds: Sequence[Node], nodes: int, per_node: int, params: CostParams
) -> float:
    """Returns what the step's scalar all-reduces (``STEP_SCALARS`` of
    ``scalar_allreduce_s``) add to every stage's end, a plan's devices on ``nodes`` nodes,
    at most ``per_node`` on one, ``kinds`` one node of each GPU type among them."""
    return STEP_SCALARS * scalar_allreduce_s(kinds, nodes, per_node, params)


def p2p_s(
    size_bytes: float, src: Node, dst: Node, params: CostParams, concurrency: int = 1
) -> float:
    """Returns the time to send ``size_bytes`` from a device on ``src`` to one on ``dst``.

    ``concurrency`` devices of the node send at once over its network link.
    """
    if size_bytes <= 0:
        return 0.0
    if src.name == dst.name:
        link = params.compute.ask("link_figures", src.gpu, "p2p")
        if link is not None:  # the runtime's measured send: latency, bytes/s
            return link[0] + size_bytes / link[1]
        measured = params.compute.network_bw(src.gpu.name, "intra", 2, size_bytes)
        if measured is not None:
            return size_bytes / measured
        eff = params.link_efficiency_of(src.gpu.name)
        return size_bytes / (src.intra_node_bytes_per_s * eff) + params.intra_latency_of(
            src.gpu.name
        )
    rates = []
    for node in (src, dst):
        measured = params.compute.network_bw(node.gpu.name, "inter", concurrency, size_bytes)
        if measured is not None:  # the node's achieved aggregate with ``concurrency`` senders
            rates.append(measured / concurrency)
        else:
            rates.append(node.network_bytes_per_s * params.network_efficiency_of(node.gpu.name)
                         / concurrency)  # fmt: skip
    return size_bytes / min(rates) + max(
        params.inter_latency_of(src.gpu.name), params.inter_latency_of(dst.gpu.name)
    )

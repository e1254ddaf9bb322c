"""The pool a trace draws from, and the nodes a count of GPUs makes.

Each GPU type of the trace has a template node (GPUs per node, links, prices) from the
cluster file or the market's offer, and a ceiling: the cluster file's GPUs of that type, or
the offer's ``max_nodes`` x GPUs per node. A policy using n GPUs of a type holds the
canonical layout of n: full template-size nodes, then one smaller node for the remainder
(the same instance family with fewer GPUs), named ``<type>-<k>`` and ``<type>-<k>x<g>``.
A node whose size changes is a different machine: one that shrinks is preempted (its disk
goes with it) and one that grows is replaced. The same counts give the same nodes, so plans
are cached per count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from hetplan.cluster import Cluster, Node
from hetplan.errors import InputError
from hetplan.hardware import GPUType
from hetplan.market import Market


@dataclass(frozen=True)
class PoolType:
    """One GPU type of the pool."""

    template: Node
    max_gpus: int
    spot_usd_per_gpu_hour: float
    on_demand_usd_per_gpu_hour: float


@dataclass(frozen=True)
class Pool:
    """GPU type name -> its template, ceiling and prices; user-defined GPU types."""

    types: dict[str, PoolType]
    gpu_types: dict[str, GPUType]

    def check(self, gpus: list[str]) -> None:
        """Raises an InputError naming ``--trace`` when it counts a type the pool lacks."""
        for gpu in gpus:
            if gpu not in self.types:
                have = ", ".join(self.types)
                raise InputError("--trace", f"it counts {gpu} GPUs, which the pool lacks ({have})")

    def cluster(self, nodes: tuple[Node, ...]) -> Cluster:
        """Returns the cluster of ``nodes`` (with the pool's user-defined GPU types)."""
        return Cluster(nodes, self.gpu_types)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def pool_from_cluster(cluster: Cluster) -> Pool:
    """Returns the pool of a cluster file: per type its first node and its GPU total."""
    types: dict[str, PoolType] = {}
    for node in cluster.nodes:
        name = node.gpu.name
        if name in types:
            types[name] = replace(types[name], max_gpus=types[name].max_gpus + node.gpus)
            continue
        on_demand = node.usd_per_gpu_hour
        if on_demand is None:
            on_demand = node.gpu.on_demand_usd_per_hour
        if on_demand is None:
            raise InputError(
                "--cluster", f"no price per GPU-hour for {name}: set price_per_gpu_hour"
            )
        spot = node.gpu.spot_usd_per_hour
        types[name] = PoolType(node, node.gpus, on_demand if spot is None else spot, on_demand)
    return Pool(types, dict(cluster.gpu_types))


def pool_from_market(market: Market, gpus: list[str]) -> Pool:
    """Returns the pool of the market's offers for the trace's GPU types (the cheapest
    spot offer of each type)."""
    types: dict[str, PoolType] = {}
    for gpu in gpus:
        offers = [o for o in market.offers if o.gpu.name == gpu]
        if not offers:
            sold = sorted({o.gpu.name for o in market.offers})
            raise InputError("--trace", f"the market sells no {gpu} (it sells {', '.join(sold)})")
        o = min(offers, key=lambda x: x.price(x.spot_usd_per_gpu_hour is not None))
        spot = o.spot_usd_per_gpu_hour
        node = o.cluster(1, spot is not None).nodes[0]
        types[gpu] = PoolType(
            node,
            o.max_nodes * o.gpus_per_node,
            o.on_demand_usd_per_gpu_hour if spot is None else spot,
            o.on_demand_usd_per_gpu_hour,
        )
    return Pool(types, {})


def layout(pool: Pool, counts: dict[str, int]) -> tuple[Node, ...]:
    """Returns the nodes of ``counts`` GPUs per type (capped at each ceiling): full
    template-size nodes, then one smaller node for the remainder."""
    out: list[Node] = []
    for gpu, entry in pool.types.items():
        free = min(counts.get(gpu, 0), entry.max_gpus)
        size = entry.template.gpus
        for k in range(-(-free // size)):
            g = min(size, free - k * size)
            name = f"{_slug(gpu)}-{k}" if g == size else f"{_slug(gpu)}-{k}x{g}"
            out.append(replace(entry.template, name=name, gpus=g))
    return tuple(out)


def counts_of(nodes: tuple[Node, ...]) -> dict[str, int]:
    """Returns GPUs per type of ``nodes``."""
    out: dict[str, int] = {}
    for n in nodes:
        out[n.gpu.name] = out.get(n.gpu.name, 0) + n.gpus
    return out


def key_of(nodes: tuple[Node, ...]) -> tuple[tuple[str, str, int], ...]:
    """Returns a hashable key of a set of nodes (names, types, sizes)."""
    return tuple(sorted((n.name, n.gpu.name, n.gpus) for n in nodes))

"""Clusters: nodes of GPUs with their links and prices, from YAML or an inline string."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from hetplan.cost.money import OWNERSHIP_KEYS, Ownership, ownership
from hetplan.errors import InputError, invalid_yaml, shown
from hetplan.hardware import GPUType, get_gpu, gpu_from_mapping
from hetplan.units import parse_bandwidth_bytes_per_s


@dataclass(frozen=True)
class Node:
    """One machine: ``gpus`` GPUs of one type, an intra-node link and a network link."""

    name: str
    gpu: GPUType
    gpus: int
    intra_node_bytes_per_s: float
    """Per GPU, per direction, to GPUs of the same node."""
    network_bytes_per_s: float
    """Per node, per direction, to other nodes."""
    usd_per_gpu_hour: float | None
    """Price per GPU-hour; None where unknown. An owned node's is its amortisation and
    energy (``owned``), never a rental."""
    owned: Ownership | None = None
    """The node's GPUs are owned: what one costs (``hetplan.cost.money``)."""
    rental_kind: str = "on-demand"
    """How a rented node's ``usd_per_gpu_hour`` is charged: on-demand, reserved or spot."""

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise InputError(f"nodes.{self.name}.gpus", "must be a positive integer")

    def devices(self) -> list[str]:
        """Returns the device names of this node ('name:0', 'name:1', ...)."""
        return list(self._devices)

    @cached_property
    def _devices(self) -> tuple[str, ...]:
        return tuple(f"{self.name}:{i}" for i in range(self.gpus))

    def __hash__(self) -> int:
        # the dataclass's own hash of the compared fields, computed once: the searches'
        # caches key on tuples of nodes and hash them many times a search
        kept = self.__dict__.get("_hash")
        if kept is None:
            kept = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
            object.__setattr__(self, "_hash", kept)
        return int(kept)

    def __getstate__(self) -> dict[str, Any]:
        # string hashes differ between processes: a pickled or copied node hashes afresh
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state


@dataclass(frozen=True)
class Cluster:
    """A set of nodes; devices are named 'node:index'."""

    nodes: tuple[Node, ...]
    gpu_types: dict[str, GPUType] = field(default_factory=dict)
    """User-defined GPU types, by name."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise InputError("nodes", "the cluster has no nodes")
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise InputError("nodes", f"node name {node.name} appears twice")
            seen.add(node.name)

    def node(self, name: str) -> Node:
        """Returns the node called ``name``."""
        node = self.node_or_none(name)
        if node is None:
            raise InputError("node", f"no node named {shown(name)} in the cluster")
        return node

    def device_node(self, device: str) -> Node:
        """Returns the node holding ``device`` ('node:index'), checking the index."""
        hit = self._by_device.get(device)
        if hit is not None:
            return hit
        name, _, index = device.rpartition(":")
        if not name or not index.isdigit():
            raise InputError("devices", f"{shown(device)} is not of the form 'node:index'")
        node = self.node_or_none(name)
        if node is None:
            raise InputError(
                "devices", f"{shown(device)} names node {shown(name)}, not in the cluster"
            )
        if int(index) >= node.gpus:
            raise InputError("devices", f"{shown(device)}: node {name} has only {node.gpus} GPUs")
        return node

    def node_or_none(self, name: str) -> Node | None:
        """Returns the node called ``name``, or None."""
        return self._by_name.get(name)

    @cached_property
    def _by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def _by_device(self) -> dict[str, Node]:
        return {d: n for n in self.nodes for d in n.devices()}

    def devices(self) -> Iterator[str]:
        """Yields every device name, node by node."""
        return iter(self._devices)

    @cached_property
    def _devices(self) -> tuple[str, ...]:
        return tuple(d for node in self.nodes for d in node._devices)

    @property
    def num_gpus(self) -> int:
        """Returns the number of GPUs in the cluster."""
        return sum(n.gpus for n in self.nodes)

    def gpu_types_used(self) -> list[GPUType]:
        """Returns the distinct GPU types of the nodes, in order of appearance."""
        out: dict[str, GPUType] = {}
        for node in self.nodes:
            out.setdefault(node.gpu.name, node.gpu)
        return list(out.values())

    def is_homogeneous(self) -> bool:
        """Returns whether every node has the same GPU type, GPU count and links."""
        first = self.nodes[0]
        return all(
            (n.gpu.name, n.gpus, n.intra_node_bytes_per_s, n.network_bytes_per_s)
            == (first.gpu.name, first.gpus, first.intra_node_bytes_per_s, first.network_bytes_per_s)
            for n in self.nodes
        )

    def usd_per_hour(self) -> float | None:
        """Returns the cluster's price per hour, or None if any node's price is unknown."""
        total = 0.0
        for node in self.nodes:
            if node.usd_per_gpu_hour is None:
                return None
            total += node.usd_per_gpu_hour * node.gpus
        return total

    def without_nodes(self, names: set[str]) -> Cluster:
        """Returns the cluster less the named nodes."""
        return Cluster(tuple(n for n in self.nodes if n.name not in names), self.gpu_types)


_NODE_KEYS = {
    "name",
    "gpu",
    "gpus",
    "count",
    "intra_node_bandwidth",
    "network_bandwidth",
    "price_per_gpu_hour",
    "owned",
    *OWNERSHIP_KEYS,
}


def _node_entries(entry: dict[str, Any], index: int, types: dict[str, GPUType]) -> list[Node]:
    where = f"nodes[{index}]"
    if not isinstance(entry, dict):
        raise InputError(where, "each node must be a mapping with at least 'gpu' and 'gpus'")
    unknown = set(entry) - _NODE_KEYS
    if unknown:
        allowed = ", ".join(sorted(_NODE_KEYS))
        raise InputError(f"{where}.{sorted(unknown)[0]}", f"unknown key (allowed: {allowed})")
    if "gpu" not in entry:
        raise InputError(f"{where}.gpu", "required")
    gpu = get_gpu(str(entry["gpu"]), types, field=f"{where}.gpu")
    gpus = entry.get("gpus", 8)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 0:
        raise InputError(f"{where}.gpus", f"expected a positive integer, got {shown(gpus)}")
    count = entry.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        raise InputError(f"{where}.count", f"expected a positive integer, got {shown(count)}")
    intra = (
        parse_bandwidth_bytes_per_s(entry["intra_node_bandwidth"], f"{where}.intra_node_bandwidth")
        if "intra_node_bandwidth" in entry
        else gpu.intra_node_bytes_per_s
    )
    net = (
        parse_bandwidth_bytes_per_s(entry["network_bandwidth"], f"{where}.network_bandwidth")
        if "network_bandwidth" in entry
        else gpu.network_bytes_per_s
    )
    own = _ownership(entry, gpu, where)
    price = entry.get("price_per_gpu_hour", gpu.on_demand_usd_per_hour)
    if own is not None:
        price = own.parts().total
    elif price is not None and (
        isinstance(price, bool)
        or not isinstance(price, int | float)
        or not math.isfinite(price)
        or price < 0
    ):
        raise InputError(
            f"{where}.price_per_gpu_hour", f"expected a price >= 0, got {shown(price)}"
        )
    base = check_node_name(str(entry.get("name") or _slug(gpu.name)), f"{where}.name")
    names = [base] if count == 1 and "name" in entry else [f"{base}-{i}" for i in range(count)]
    price = None if price is None else float(price)
    return [Node(n, gpu, gpus, intra, net, price, own) for n in names]


def check_node_name(name: str, field: str) -> str:
    """Returns ``name`` if it can name nodes (letters, digits, '-', '_', '.': plans name a
    device ``node:index``), else raises naming ``field``."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise InputError(field, f"{shown(name)}: use letters, digits, '-', '_' and '.'")
    return name


def _ownership(entry: dict[str, Any], gpu: GPUType, where: str) -> Ownership | None:
    """Returns what an owned node's GPUs cost, or None for a rented node."""
    owned = entry.get("owned", False)
    if not isinstance(owned, bool):
        raise InputError(f"{where}.owned", f"expected true or false, got {shown(owned)}")
    figures = {k: entry[k] for k in OWNERSHIP_KEYS if k in entry}
    if not owned:
        if figures:
            key = sorted(figures)[0]
            raise InputError(f"{where}.{key}", "only owned nodes (owned: true) take it")
        return None
    if "price_per_gpu_hour" in entry:
        raise InputError(
            f"{where}.price_per_gpu_hour",
            "an owned node pays no rental (its cost is amortisation and energy)",
        )
    return ownership(gpu, figures, where)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cluster_from_dict(data: Any) -> Cluster:
    """Returns the Cluster described by a parsed cluster file."""
    if not isinstance(data, dict):
        raise InputError("cluster", "the file must hold a mapping with a 'nodes' list")
    unknown = set(data) - {"nodes", "gpu_types", "storage_bandwidth"}
    if unknown:
        raise InputError(sorted(unknown)[0], "unknown top-level key (nodes, gpu_types)")
    types: dict[str, GPUType] = {}
    raw_types = data.get("gpu_types") or {}
    if not isinstance(raw_types, dict):
        raise InputError("gpu_types", "must be a mapping of name to figures")
    for name, spec in raw_types.items():
        if not isinstance(spec, dict):
            raise InputError(f"gpu_types.{name}", "must be a mapping of figures")
        types[str(name)] = gpu_from_mapping(str(name), spec, f"gpu_types.{name}")
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise InputError("nodes", "required: a non-empty list of nodes")
    nodes: list[Node] = []
    counters: dict[str, int] = {}
    for i, entry in enumerate(entries):
        for node in _node_entries(entry, i, types):
            if isinstance(entry, dict) and "name" not in entry:
                # unnamed entries of one type share a numbering: a100-80gb-0, a100-80gb-1, ...
                base = _slug(node.gpu.name)
                k = counters.get(base, 0)
                counters[base] = k + 1
                node = Node(
                    f"{base}-{k}",
                    node.gpu,
                    node.gpus,
                    node.intra_node_bytes_per_s,
                    node.network_bytes_per_s,
                    node.usd_per_gpu_hour,
                    node.owned,
                )
            nodes.append(node)
    return Cluster(tuple(nodes), types)


def parse_inline_cluster(text: str) -> Cluster:
    """Returns the Cluster of 'A100-80GB:4x8,V100-32GB:2x8' (type:nodes x GPUs per node)."""
    entries = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(.+?)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if match is None:
            raise InputError(
                "--cluster", f"{shown(part.strip())} is not TYPE:NODESxGPUS (e.g. A100-80GB:4x8)"
            )
        entries.append(
            {"gpu": match.group(1), "count": int(match.group(2)), "gpus": int(match.group(3))}
        )
    return cluster_from_dict({"nodes": entries})


def load_cluster(spec: str, option: str = "--cluster") -> Cluster:
    """Returns the Cluster from a YAML file path or an inline 'TYPE:NxG,...' string;
    ``option`` names it in messages (a field inside it is named after the option where that
    is not --cluster: a second cluster, such as replan's --joined)."""
    path = Path(spec)
    try:
        if path.suffix.lower() in {".yaml", ".yml", ".json"} or path.exists():
            try:
                data = yaml.safe_load(path.read_text())
            except OSError as exc:
                raise InputError(option, f"cannot read {spec}: {exc.strerror}") from None
            except yaml.YAMLError as exc:
                raise InputError(option, invalid_yaml(spec, exc)) from None
            return cluster_from_dict(data)
        return parse_inline_cluster(spec)
    except InputError as exc:
        if option == "--cluster" or exc.field.startswith("--"):
            raise
        raise InputError(f"{option} {exc.field}", exc.reason) from None

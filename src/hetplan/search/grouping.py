"""Device classes, tensor-parallel groups, and the choice of pipelines as a MILP.

A *class* is a set of interchangeable nodes (same GPU type, GPUs per node and links).
A *variant* is one pipeline shape: how many groups of each class it uses, with its
modelled ``fill`` and ``bottleneck`` per micro-batch. Choosing how many pipelines of each
variant to build, and how many micro-batches each runs, so that the slowest pipeline is
as fast as possible, is solved exactly: bisection on the iteration time Z, where each
step is an integer program (HiGHS) maximising the micro-batches processable within Z.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import Bounds, LinearConstraint, milp

from hetplan.cluster import Cluster, Node
from hetplan.hardware import GPUType
from hetplan.search.partition import split_batch, split_time_s


@dataclass(frozen=True)
class DeviceClass:
    """Nodes with the same GPU type, GPU count and links."""

    key: str
    gpu: GPUType
    nodes: tuple[Node, ...]

    @property
    def gpus_per_node(self) -> int:
        """Returns the GPUs of each node of the class."""
        return self.nodes[0].gpus

    @property
    def num_gpus(self) -> int:
        """Returns the GPUs of the class."""
        return self.gpus_per_node * len(self.nodes)

    def groups(self, tp: int) -> list[tuple[str, ...]]:
        """Returns the tensor-parallel groups of ``tp`` GPUs inside each node, in node order."""
        out: list[tuple[str, ...]] = []
        for node in self.nodes:
            devs = node.devices()
            out.extend(tuple(devs[i : i + tp]) for i in range(0, node.gpus - tp + 1, tp))
        return out


def device_classes(cluster: Cluster) -> list[DeviceClass]:
    """Returns the cluster's device classes, in order of first appearance."""
    by_key: dict[tuple[str, int, float, float], list[Node]] = {}
    for node in cluster.nodes:
        sig = (node.gpu.name, node.gpus, node.intra_node_bytes_per_s, node.network_bytes_per_s)
        by_key.setdefault(sig, []).append(node)
    out = []
    names: dict[str, int] = {}
    for (gpu_name, _, _, _), nodes in by_key.items():
        k = names.get(gpu_name, 0)
        names[gpu_name] = k + 1
        key = gpu_name if k == 0 else f"{gpu_name}#{k}"
        out.append(DeviceClass(key, nodes[0].gpu, tuple(nodes)))
    return out


@dataclass(frozen=True)
class Selection:
    """Chosen pipelines: a variant index and micro-batch count per pipeline."""

    variants: tuple[int, ...]
    micro_batches: tuple[int, ...]
    time_s: float


def _max_units(
    counts: NDArray[np.int64],
    cap: NDArray[np.int64],
    avail: NDArray[np.int64],
    num_pipelines: tuple[int, int],
    need: int,
) -> tuple[float, NDArray[np.int64]] | None:
    """Returns pipelines per variant that run ``need`` micro-batches (each pipeline at most
    ``cap``) within the groups and pipeline bounds, with their capacity; None if none do."""
    use = np.flatnonzero(cap > 0)
    if use.size == 0 or int(cap[use].max()) * num_pipelines[1] < need:
        return None
    a = counts[use].T.astype(float)
    upper = np.min(np.where(a > 0, avail[:, None] // np.maximum(a, 1), np.inf), axis=0)
    upper = np.minimum(upper, num_pipelines[1])
    cons = [
        LinearConstraint(a, -np.inf, avail.astype(float)),
        LinearConstraint(np.ones((1, use.size)), num_pipelines[0], num_pipelines[1]),
        LinearConstraint(cap[use][None, :].astype(float), need, np.inf),
    ]
    # a feasibility problem; fewest pipelines as the objective keeps the search short
    res = milp(
        np.ones(use.size),
        constraints=cons,
        integrality=np.ones(use.size),
        bounds=Bounds(0, upper),
        options={"mip_rel_gap": 1.0},
    )
    if res.x is None:
        return None
    x = np.zeros(len(cap), dtype=np.int64)
    x[use] = np.round(res.x).astype(np.int64)
    return float(cap @ x), x


def _caps(fill: NDArray[np.float64], bott: NDArray[np.float64], z: float, total: int):
    room = np.floor((z - fill) / bott * (1 + 1e-12) + 1e-9) + 1
    return np.clip(room, 0, total).astype(np.int64)


def _realise(
    x: NDArray[np.int64], fill: NDArray[np.float64], bott: NDArray[np.float64], total: int
) -> Selection | None:
    variants = [int(v) for v in np.repeat(np.arange(len(x)), x)]
    f = [float(fill[v]) for v in variants]
    b = [float(bott[v]) for v in variants]
    counts = split_batch(f, b, total)
    if counts is None:
        return None
    return Selection(tuple(variants), tuple(counts), split_time_s(f, b, counts))


def select_pipelines(
    counts: NDArray[np.int64],
    fill_s: NDArray[np.float64],
    bottleneck_s: NDArray[np.float64],
    avail: NDArray[np.int64],
    total_micro: int,
    num_pipelines: tuple[int, int],
    rel_tol: float = 1e-4,
) -> Selection | None:
    """Returns the pipelines minimising the slowest ``fill + (m-1) * bottleneck``.

    ``counts[v, k]``: groups of class k variant v uses; ``avail[k]``: groups of class k;
    ``num_pipelines``: (fewest, most) pipelines. Exact up to ``rel_tol`` in time.
    """
    fill = np.asarray(fill_s, dtype=float)
    bott = np.asarray(bottleneck_s, dtype=float)
    lo_n, hi_n = num_pipelines[0], min(num_pipelines[1], total_micro)
    if len(fill) == 0 or lo_n > hi_n:
        return None
    bounds = (lo_n, hi_n)
    hi = float(np.max(fill + (total_micro - lo_n) * bott))
    found = _max_units(counts, _caps(fill, bott, hi, total_micro), avail, bounds, total_micro)
    if found is None or found[0] < total_micro:
        return None
    best = _realise(found[1], fill, bott, total_micro)
    if best is None:
        return None
    hi = best.time_s
    lo = float(np.min(fill + (math.ceil(total_micro / hi_n) - 1) * bott)) * (1 - 1e-9)
    while hi - lo > rel_tol * hi:
        z = 0.5 * (lo + hi)
        found = _max_units(counts, _caps(fill, bott, z, total_micro), avail, bounds, total_micro)
        if found is None or found[0] < total_micro:
            lo = z
            continue
        sel = _realise(found[1], fill, bott, total_micro)
        if sel is None or sel.time_s >= best.time_s:
            hi = z
            continue
        best = sel
        hi = min(z, sel.time_s)
    return best

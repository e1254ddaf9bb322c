"""Device classes, tensor-parallel groups, and the choice of pipelines as a MILP.

A *class* is a set of interchangeable nodes (same GPU type, GPUs per node and links).
A *variant* is one pipeline shape: how many groups of each class it uses, with its
modelled ``fill`` and ``bottleneck`` per micro-batch. Choosing how many pipelines of each
variant to build, and how many micro-batches each runs, so that the slowest pipeline is
as fast as possible, is solved exactly: bisection on the iteration time Z, where each
step is an integer program asking whether the micro-batches fit within Z (answered by
``packing_bound`` where it can, else by HiGHS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from hetplan.cluster import Cluster, Node
from hetplan.hardware import GPUType
from hetplan.search.packing_bound import settle
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

    def group_count(self, tp: int) -> int:
        """Returns how many tensor-parallel groups of ``tp`` GPUs the class holds (the length
        of ``groups(tp)``: every node holds the same GPUs)."""
        return len(self.nodes) * (self.gpus_per_node // tp)

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


@dataclass
class MilpMemo:
    """Answers of pipeline-selection MILPs keyed by their reduced instance, and counters."""

    answers: dict[bytes, NDArray[np.int64] | None] = field(default_factory=dict)
    solves: int = 0
    """MILPs solved by HiGHS."""
    proofs: int = 0
    """Instances proven infeasible without HiGHS (``packing_bound``)."""
    rounded: int = 0
    """Instances answered with a point by ``packing_bound`` (identical pipelines, a rounded
    LP point or its table), HiGHS not asked."""
    hits: int = 0
    duals: list[NDArray[np.float64]] = field(default_factory=list)
    """Duals of the latest infeasibility proofs, tried first on the next instances."""
    gids: dict[bytes, NDArray[np.int64]] = field(default_factory=dict)
    """Per row set (counts), the number of each row's count vector."""


def _columns(
    counts: NDArray[np.int64],
    gid: NDArray[np.int64],
    cap: NDArray[np.int64],
    score: NDArray[np.float64],
) -> NDArray[np.int64]:
    """Returns the variants that need a column at one Z: per count vector (``gid`` numbers
    them) the largest capacity, then the least ``score``, less those another column
    matches with fewer groups of every class.

    Exact: a pipeline of a dropped variant can be swapped for one of a kept variant that
    uses no more groups of any class and runs at least as many micro-batches within Z.
    """
    use = np.flatnonzero(cap > 0)
    if use.size <= 1:
        return use
    order = use[np.lexsort((score[use], -cap[use], gid[use]))]
    g = gid[order]
    cols = order[np.concatenate([[True], g[1:] != g[:-1]])]
    if cols.size > 1:
        c, q = counts[cols], cap[cols]
        fewer = np.all(c[:, None, :] <= c[None, :, :], axis=2)
        np.fill_diagonal(fewer, False)  # count vectors are distinct: off-diagonal is strict
        cols = cols[~np.any(fewer & (q[:, None] >= q[None, :]), axis=0)]
    return cols


def _max_units(
    a: NDArray[np.float64],
    cap: NDArray[np.int64],
    avail: NDArray[np.int64],
    num_pipelines: tuple[int, int],
    need: int,
) -> NDArray[np.int64] | None:
    """Returns pipelines per column (``a[k, v]`` groups of class k) that run ``need``
    micro-batches (each pipeline at most ``cap``) within the groups and pipeline bounds."""
    n = cap.size
    if n == 0 or int(cap.max()) * num_pipelines[1] < need:
        return None
    # scipy.optimize takes 0.3 s to import: only searches that need HiGHS pay for it
    from scipy.optimize import Bounds, LinearConstraint, milp

    upper = np.min(np.where(a > 0, avail[:, None] // np.maximum(a, 1), np.inf), axis=0)
    upper = np.minimum(upper, num_pipelines[1])
    cons = [
        LinearConstraint(a, -np.inf, avail.astype(float)),
        LinearConstraint(np.ones((1, n)), num_pipelines[0], num_pipelines[1]),
        LinearConstraint(cap[None, :].astype(float), need, np.inf),
    ]
    # a feasibility problem; fewest pipelines as the objective keeps the search short
    res = milp(
        np.ones(n),
        constraints=cons,
        integrality=np.ones(n),
        bounds=Bounds(0, upper),
        options={"mip_rel_gap": 1.0},
    )
    if res.x is None:
        return None
    x: NDArray[np.int64] = np.round(res.x).astype(np.int64)
    return x


def _caps(
    fill: NDArray[np.float64],
    bott: NDArray[np.float64],
    z: float,
    total: int,
    steps: NDArray[np.int64] | None = None,
) -> NDArray[np.int64]:
    room = np.floor((z - fill) / bott * (1 + 1e-12) + 1e-9) + 1
    cap = np.clip(room, 0, total).astype(np.int64)
    if steps is not None:
        cap = cap // steps * steps
    return cap


def _realise(
    x: NDArray[np.int64],
    fill: NDArray[np.float64],
    bott: NDArray[np.float64],
    total: int,
    steps: NDArray[np.int64] | None = None,
) -> Selection | None:
    variants = [int(v) for v in np.repeat(np.arange(len(x)), x)]
    f = [float(fill[v]) for v in variants]
    b = [float(bott[v]) for v in variants]
    step = None if steps is None else [int(steps[v]) for v in variants]
    counts = split_batch(f, b, total, step)
    if counts is None:
        return None
    return Selection(tuple(variants), tuple(counts), split_time_s(f, b, counts))


Rows = tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]


def identical_pipelines(
    counts: NDArray[np.int64],
    fill_s: NDArray[np.float64],
    bottleneck_s: NDArray[np.float64],
    avail: NDArray[np.int64],
    total_micro: int,
    num_pipelines: tuple[int, int],
    steps: NDArray[np.int64] | None = None,
) -> Selection | None:
    """Returns the fastest selection of copies of one variant (as many as fit, within
    ``num_pipelines``), or None when no variant fits that often.

    ``select_pipelines`` minimises the slowest pipeline alone; replicas of different
    shapes then synchronise their gradients segment by segment across unlike stage
    boundaries, which ``estimate`` prices and the selection cannot see. Identical replicas
    synchronise stage by stage, so this is offered next to the selection's answer.

    k copies share the micro-batches as evenly as their steps allow: the slowest runs
    ceil(units / k) steps of micro-batches, which picks the variant; ``split_batch`` then
    makes the split."""
    cnt = np.asarray(counts, dtype=np.int64)
    fill = np.asarray(fill_s, dtype=float)
    bott = np.asarray(bottleneck_s, dtype=float)
    avl = np.asarray(avail, dtype=np.int64)
    lo_n, hi_n = max(num_pipelines[0], 1), min(num_pipelines[1], total_micro)
    if len(cnt) == 0 or lo_n > hi_n:
        return None
    step = np.ones(len(cnt), dtype=np.int64) if steps is None else np.asarray(steps, np.int64)
    used = cnt > 0
    room = np.where(used, avl[None, :] // np.maximum(cnt, 1), np.iinfo(np.int64).max)
    units = total_micro // step
    k = np.minimum(np.minimum(room.min(axis=1), hi_n), units)
    ok = np.any(used, axis=1) & (k >= lo_n) & (total_micro % step == 0)
    if not np.any(ok):
        return None
    most = -(-units // np.maximum(k, 1)) * step  # ceil(units / k) steps
    t = np.where(ok, fill + (most - 1) * bott, np.inf)
    v = int(np.argmin(t))
    x = np.zeros(len(cnt), dtype=np.int64)
    x[v] = k[v]
    return _realise(x, fill, bott, total_micro, None if steps is None else step)


def select_pipelines(
    counts: NDArray[np.int64],
    fill_s: NDArray[np.float64],
    bottleneck_s: NDArray[np.float64],
    avail: NDArray[np.int64],
    total_micro: int,
    num_pipelines: tuple[int, int],
    rel_tol: float = 1e-4,
    cutoff_s: float = math.inf,
    memo: MilpMemo | None = None,
    bound: Rows | None = None,
    slack_s: float = math.inf,
    steps: NDArray[np.int64] | None = None,
    bound_steps: NDArray[np.int64] | None = None,
) -> Selection | None:
    """Returns the pipelines minimising the slowest ``fill + (m-1) * bottleneck``.

    ``counts[v, k]``: groups of class k variant v uses; ``avail[k]``: groups of class k;
    ``num_pipelines``: (fewest, most) pipelines. Exact up to ``rel_tol`` in time. None
    when nothing fits, or when no selection of ``bound`` rows (counts, fill, bottleneck
    whose ``fill + (m-1) * bottleneck`` bound a pipeline's true time from below; default
    the variants) is faster than ``cutoff_s``: then nothing built here can be. If some
    is, the best time is at most ``cutoff_s + slack_s``, where the bisection starts.
    ``steps`` (``bound_steps``): per row, the multiple its micro-batches must be
    (interleaved pipelines run a multiple of their stages); default 1.

    Each bisection step asks whether some selection runs every micro-batch within Z:
    ``packing_bound`` answers where it can (identical pipelines, a rounded LP point, or
    its exact table; "no" by the dual bound), HiGHS the rest; the memo keeps every answer.
    """
    fill = np.asarray(fill_s, dtype=float)
    bott = np.asarray(bottleneck_s, dtype=float)
    cnt = np.asarray(counts, dtype=np.int64)
    avl = np.asarray(avail, dtype=np.int64)
    lo_n, hi_n = num_pipelines[0], min(num_pipelines[1], total_micro)
    if len(fill) == 0 or lo_n > hi_n:
        return None
    bc, bf, bb = bound if bound is not None else (cnt, fill, bott)
    bc = np.asarray(bc, dtype=np.int64)
    if hi_n == 1:  # one pipeline: the best variant that fits, running every micro-batch
        fits = np.all(bc <= avl[None, :], axis=1)
        if bound_steps is not None:
            fits &= total_micro % np.asarray(bound_steps) == 0
        if not np.any(fits) or float(np.min((bf + (total_micro - 1) * bb)[fits])) >= cutoff_s:
            return None
        whole = np.all(cnt <= avl[None, :], axis=1)
        if steps is not None:
            whole &= total_micro % np.asarray(steps) == 0
        ok = np.flatnonzero(whole)
        if ok.size == 0:
            return None
        t = fill[ok] + (total_micro - 1) * bott[ok]
        v = int(ok[np.argmin(t)])
        return Selection((v,), (total_micro,), float(t.min()))
    memo = memo if memo is not None else MilpMemo()
    tail = np.array([lo_n, hi_n, total_micro, *avl], dtype=np.int64).tobytes()

    def feasible(
        rows: Rows,
        gid: NDArray[np.int64],
        z: float,
        step: NDArray[np.int64] | None,
    ) -> NDArray[np.int64] | None:
        """Returns pipelines per row running every micro-batch within ``z``, or None when
        none do: a point ``packing_bound`` finds (checked in integers), else the MILP's
        answer; "none" proven by ``packing_bound`` or HiGHS."""
        c, f, b = rows
        cap = _caps(f, b, z, total_micro, step)
        cols = _columns(c, gid, cap, f + (cap - 1) * b)
        key = b"".join((c[cols].tobytes(), cap[cols].tobytes(), tail))
        if key in memo.answers:
            memo.hits += 1
            x = memo.answers[key]
        else:
            a = c[cols].T.astype(float)
            quick = settle(a, cap[cols], avl, (lo_n, hi_n), total_micro, True, memo.duals)
            if quick is False:  # proven infeasible: the MILP's answer too
                memo.proofs += 1
                x = memo.answers[key] = None
            elif isinstance(quick, np.ndarray):  # a feasible point: as good an answer
                memo.rounded += 1
                x = memo.answers[key] = quick
            else:
                memo.solves += 1
                x = memo.answers[key] = _max_units(a, cap[cols], avl, (lo_n, hi_n), total_micro)
        if x is None:
            return None
        full = np.zeros(len(f), dtype=np.int64)
        full[cols] = x
        return full

    def groups(c: NDArray[np.int64]) -> NDArray[np.int64]:
        key = c.tobytes() + np.array(c.shape, dtype=np.int64).tobytes()
        out = memo.gids.get(key)  # the bands of one setting share their rows
        if out is None:
            out = memo.gids[key] = np.unique(c, axis=0, return_inverse=True)[1].reshape(-1)
        return out

    if math.isfinite(cutoff_s):  # one MILP: can any selection's bound beat the cutoff?
        floor = np.min(bf + (math.ceil(total_micro / hi_n) - 1) * bb) * (1 - 1e-9)
        if floor >= cutoff_s:
            return None
        z = cutoff_s * (1 - 1e-12)
        if feasible((bc, bf, bb), groups(bc), z, bound_steps) is None:
            return None
    rows, gid = (cnt, fill, bott), groups(cnt)

    def probe(z: float) -> Selection | None:
        x = feasible(rows, gid, z, steps)
        return None if x is None else _realise(x, fill, bott, total_micro, steps)

    # every selection fits under ``top``; none under ``lo`` (a pipeline runs >= total/hi_n)
    top = float(np.max(fill + (total_micro - lo_n) * bott))
    lo = float(np.min(fill + (math.ceil(total_micro / hi_n) - 1) * bott)) * (1 - 1e-9)
    best = probe(cutoff_s + slack_s) if cutoff_s + slack_s < top else None
    best = best or probe(top)
    if best is None:
        return None
    hi = best.time_s
    while hi - lo > rel_tol * hi:
        z = 0.5 * (lo + hi)
        sel = probe(z)
        if sel is None:
            lo = z
            continue
        if sel.time_s < best.time_s:
            best = sel
        hi = min(z, sel.time_s)
    return best

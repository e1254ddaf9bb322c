"""Cost tables of one device class under one set of knobs, and pipeline templates.

The tables use the same compute, communication and memory functions as ``estimate``;
the search reads only these numbers, so tests can replace them with random ones.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from hetplan.cost import comm
from hetplan.cost.memory import stage_activation_bytes, stage_params, state_bytes
from hetplan.cost.params import CostParams
from hetplan.model import ModelSpec
from hetplan.plan import element_bytes
from hetplan.search.grouping import DeviceClass
from hetplan.search.partition import Partition, uniform_frontier


@dataclass(frozen=True)
class Knobs:
    """Per-plan choices shared by every stage."""

    micro_batch: int
    recompute: str
    zero_stage: int
    dp_assumed: int
    """Data-parallel degree the ZeRO memory saving assumes (a lower bound of the plan's)."""
    precision: str
    flash_attention: bool


@dataclass
class ClassTable:
    """Per-micro-batch times and memory of one class at one tensor-parallel degree."""

    cls: DeviceClass
    tp: int
    layer_s: float
    """One transformer layer, forward + backward + recomputation + TP all-reduces."""
    embedding_s: float
    head_s: float
    overhead_s: float
    """The fixed cost per micro-batch of any stage of this class (CostParams)."""
    p2p_exposed: float
    """Share of each pipeline transfer a stage of this class waits for (CostParams)."""
    send_intra_s: float
    send_inter_s: float
    groups: int
    model: ModelSpec
    knobs: Knobs
    reserve_bytes: float
    _caps: dict[tuple[int, int], int] = field(default_factory=dict)

    def stage_bytes(self, layers: int, j: int, p: int) -> float:
        """Returns the peak bytes of a stage at position ``j`` of ``p`` holding ``layers``."""
        k, m = self.knobs, self.model
        first, last = j == 0, j == p - 1
        params = stage_params(m, layers, self.tp, first, last, p == 1)
        w, g, o = state_bytes(params, k.precision, k.zero_stage, k.dp_assumed)
        acts = stage_activation_bytes(
            m, layers, self.tp, k.micro_batch, self.tp > 1, k.recompute,
            k.flash_attention, first, last, p - j, 1, k.precision,
        )  # fmt: skip
        return w + g + o + acts + self.reserve_bytes

    def max_layers(self, j: int, p: int) -> int:
        """Returns the most layers a stage at position ``j`` of ``p`` holds in memory."""
        key = (j, p)
        if key not in self._caps:
            cap = self.cls.gpu.memory_bytes
            one = self.stage_bytes(1, j, p)
            if one > cap:
                self._caps[key] = 0
            else:
                slope = self.stage_bytes(2, j, p) - one
                self._caps[key] = self.model.layers if slope <= 0 else 1 + int((cap - one) // slope)
        return min(self._caps[key], self.model.layers)


def class_table(
    model: ModelSpec, cls: DeviceClass, tp: int, knobs: Knobs, params: CostParams
) -> ClassTable:
    """Returns the cost table of ``cls`` at tensor-parallel degree ``tp``."""
    node = cls.nodes[0]
    eff = params.gpu(cls.gpu.name)
    mb, prec = knobs.micro_batch, knobs.precision
    src = params.compute
    lt = src.layer(model, cls.gpu, params, tp, mb, prec, knobs.flash_attention).times
    rc = {"none": 0.0, "selective": lt.selective_recompute_s, "full": lt.forward_s}
    act = mb * model.seq * model.hidden * element_bytes(prec)
    ar = comm.intra_node_allreduce_s(act, tp, node, params)
    if src.tp_comm_included(cls.gpu, model, tp, mb, prec):
        ar = 0.0
    n_ar = 4 + (2 if knobs.recompute == "full" else 0)
    peer = replace(node, name=node.name + "~peer")  # another node with the same links
    et = src.embedding(model, cls.gpu, params, tp, mb, prec, knobs.flash_attention).times
    ht = src.head(model, cls.gpu, params, tp, mb, prec, knobs.flash_attention).times
    return ClassTable(
        cls=cls,
        tp=tp,
        layer_s=lt.forward_s + lt.backward_s + rc[knobs.recompute] + n_ar * ar,
        embedding_s=et.forward_s + et.backward_s + ar,
        head_s=ht.forward_s + ht.backward_s + ar,
        overhead_s=eff.microbatch_overhead_s + 2 * src.action_overhead_s(cls.gpu),
        p2p_exposed=eff.p2p_exposed,
        send_intra_s=comm.p2p_s(act / tp, node, node, params),
        send_inter_s=comm.p2p_s(act / tp, node, peer, params, concurrency=tp),
        groups=len(cls.groups(tp)),
        model=model,
        knobs=knobs,
        reserve_bytes=params.memory_reserve_bytes,
    )


@dataclass(frozen=True)
class Template:
    """One pipeline shape: class index per stage (in order) and its best layer splits."""

    classes: tuple[int, ...]
    counts: tuple[int, ...]
    frontier: tuple[Partition, ...]
    extra_s: float
    """Send latency added to the fill (forward and backward crossings)."""


class StageArrays:
    """Per-class arrays of a list of tables, to build stage arrays without Python loops."""

    def __init__(self, tables: list[ClassTable]) -> None:
        self.tables = tables
        self.layer_s = np.array([t.layer_s for t in tables])
        self.embedding_s = np.array([t.embedding_s for t in tables])
        self.head_s = np.array([t.head_s for t in tables])
        self.overhead_s = np.array([t.overhead_s for t in tables])
        self.p2p_exposed = np.array([t.p2p_exposed for t in tables])
        self.intra_s = np.array([t.send_intra_s for t in tables])
        self.inter_s = np.array([t.send_inter_s for t in tables])
        self.pair_in_node = np.array([t.cls.gpus_per_node >= 2 * t.tp for t in tables])
        self._caps: dict[int, np.ndarray] = {}

    def caps(self, p: int) -> np.ndarray:
        """Returns the most layers each class holds at each position of ``p`` stages."""
        if p not in self._caps:
            rows = [[t.max_layers(j, p) for j in range(p)] for t in self.tables]
            self._caps[p] = np.array(rows, dtype=np.int64).reshape(len(self.tables), p)
        return self._caps[p]

    def of(self, seq: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Returns per-stage (time per layer, fixed time, max layers) and the send total."""
        p = len(seq)
        k = np.asarray(seq, dtype=np.int64)
        tau = self.layer_s[k]
        fixed = self.overhead_s[k].astype(float)
        fixed[0] += self.embedding_s[k[0]]
        fixed[-1] += self.head_s[k[-1]]
        caps = self.caps(p)[k, np.arange(p)]
        a, b = k[:-1], k[1:]
        same = (a == b) & self.pair_in_node[a]
        hop = np.where(same, self.intra_s[a], np.maximum(self.inter_s[a], self.inter_s[b]))
        # blocked in its own transfers (estimate.p2p_wait_s with v = 1): both directions of
        # the hop to the previous and to the next stage
        wait = np.zeros(p)
        wait[1:] += hop
        wait[:-1] += hop
        fixed += 2.0 * self.p2p_exposed[k] * wait
        return tau, fixed, caps, 2.0 * float(hop.sum())


def stage_arrays(
    tables: list[ClassTable], seq: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Returns per-stage (time per layer, fixed time, max layers) and the send total."""
    return StageArrays(tables).of(seq)


FrontierCache = dict[bytes, tuple[Partition, ...]]


def make_template(
    tables: list[ClassTable] | StageArrays,
    seq: tuple[int, ...],
    layers: int,
    cache: FrontierCache | None = None,
) -> Template | None:
    """Returns the template of a stage sequence, or None if the layers cannot fit; equal
    stage arrays share one frontier through ``cache``."""
    arrays = tables if isinstance(tables, StageArrays) else StageArrays(tables)
    tau, fixed, caps, sends = arrays.of(seq)
    key = b"".join((tau.tobytes(), fixed.tobytes(), caps.tobytes(), layers.to_bytes(4, "little")))
    frontier = cache.get(key) if cache is not None else None
    if frontier is None:
        frontier = tuple(uniform_frontier(tau, fixed, caps, layers))
        if cache is not None:
            cache[key] = frontier
    if not frontier:
        return None
    counts = tuple(seq.count(k) for k in range(len(arrays.tables)))
    return Template(seq, counts, frontier, sends)


def class_orders(tables: list[ClassTable]) -> list[tuple[int, ...]]:
    """Returns the class orders tried along a pipeline: large memory first, fast first."""
    ks = range(len(tables))
    by_mem = tuple(sorted(ks, key=lambda k: (-tables[k].cls.gpu.memory_bytes, tables[k].layer_s)))
    by_speed = tuple(sorted(ks, key=lambda k: (tables[k].layer_s, -tables[k].cls.gpu.memory_bytes)))
    out = [by_mem, by_speed]
    if len(tables) <= 3:
        out += list(itertools.permutations(ks))
    return list(dict.fromkeys(out))


def compositions(
    avail: list[int], max_stages: int, budget: int, max_share: int | None = None
) -> list[tuple[int, ...]]:
    """Returns group counts per class for one pipeline: all of them when few, else the
    near-even shares ``floor/ceil(n_k / d)`` over subsets of classes, for d up to
    ``max_share`` (the most pipelines that share one subset)."""
    k = len(avail)
    total = math.prod(min(a, max_stages) + 1 for a in avail)
    if total <= budget:
        ranges = [range(min(a, max_stages) + 1) for a in avail]
        return [c for c in itertools.product(*ranges) if 1 <= sum(c) <= max_stages]
    out: set[tuple[int, ...]] = set()
    for mask in range(1, 2**k):
        members = [i for i in range(k) if mask >> i & 1]
        most = sum(avail[i] for i in members)
        for d in range(1, min(most, max_share or most) + 1):
            options = [
                sorted({avail[i] // d, -(-avail[i] // d)}) if i in members else [0]
                for i in range(k)
            ]
            for c in itertools.product(*options):
                if 1 <= sum(c) <= max_stages:
                    out.add(c)
    return sorted(out)

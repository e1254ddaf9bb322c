"""Cost tables of one device class under one set of knobs, pipeline templates, and the
lower bounds the heterogeneous search prunes by.

Nothing here models time on its own: a stage's per-micro-batch forward and backward come
from ``estimate``'s ``stage_times`` for its actual layer count and position, each transfer
from ``comm.p2p_s`` between the nodes involved, each stage's wait in its own transfers from
``p2p_wait_s``, the optimizer step from ``params.compute.optimizer_s`` and memory from the
memory functions ``estimate`` sums, with the plan's own sequence-parallel, ZeRO and
schedule knobs. The linear per-layer figures (``layer_s`` ...) are differences of
``stage_times`` used to generate layer splits; bounds read the stage times themselves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from hetplan.cluster import Cluster, Node
from hetplan.cost import comm
from hetplan.cost.estimate import (
    StageKey,
    p2p_wait_s,
    part_split,
    pipeline_talkers,
    stage_times,
)
from hetplan.cost.memory import (
    held_chunks,
    stage_activation_bytes,
    stage_params,
    state_bytes,
    zero3_working_bytes,
)
from hetplan.cost.params import CostParams
from hetplan.cost.schedule import EXACT_ACTION_LIMIT, held_layers, peak_in_flight, replay
from hetplan.cost.sharding import deferred_sync
from hetplan.model import ModelSpec
from hetplan.plan import Plan, element_bytes
from hetplan.search.grouping import DeviceClass
from hetplan.search.het_cache import TableCaches
from hetplan.search.partition import Partition, uniform_frontiers

MANY = 1 << 30
"""A micro-batch count beyond any warm-up: the steady-state number of chunks in flight."""


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
    schedule: str = "1F1B"
    virtual_stages: int = 1
    sequence_parallel: bool | None = None
    """None: either; times and memory are those of on (faster and smaller where TP > 1)."""
    zero_choices: tuple[int, ...] = ()
    """ZeRO stages whose least memory sets the caps (empty: ``zero_stage`` alone)."""
    overlap_tp_comm: bool = False
    """The plan option (``PlanConstraints.overlap_tp_comm``), read by ``stage_times``."""

    def time_plan(self) -> Plan:
        """Returns a plan carrying the knobs ``stage_times`` reads (no pipelines)."""
        return Plan(
            global_batch_size=0,
            micro_batch_size=self.micro_batch,
            pipelines=(),
            precision=self.precision,
            recompute=self.recompute,
            zero_stage=self.zero_stage,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            # None (either): on, the faster (sequence parallelism only removes forward work)
            sequence_parallel=self.sequence_parallel is not False,
            flash_attention=self.flash_attention,
            overlap_tp_comm=self.overlap_tp_comm,
        )


def stage_state_bytes(
    model: ModelSpec,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    single: bool,
    precision: str,
    zero: int,
    dp: int,
    deferred: bool = False,
) -> float:
    """Returns weights, gradients and optimizer state of one stage device, as ``estimate``
    counts them (ZeRO-3's gathered working layers included when it shards per layer;
    ``deferred``: pipelined ZeRO-2/3, ``sharding.deferred_sync``)."""
    p_local = stage_params(model, layers, tp, first, last, single)
    w, g, o = state_bytes(p_local, precision, zero, dp, deferred)
    if zero == 3 and dp > 1 and not deferred:
        w += zero3_working_bytes(model, tp, precision)
    return w + g + o


@dataclass
class ClassTable:
    """Per-micro-batch times and memory of one class at one tensor-parallel degree."""

    cls: DeviceClass
    tp: int
    layer_s: float
    """One more transformer layer on a stage: forward, backward, recomputation and TP
    collectives (a difference of ``stage_times``)."""
    embedding_s: float
    head_s: float
    overhead_s: float
    """The fixed cost per micro-batch of any stage of this class (``stage_times`` at no
    layers: the framework's overhead and the runtime's per-action cost, per chunk)."""
    p2p_exposed: float
    """Share of each pipeline transfer a stage of this class waits for (CostParams)."""
    send_intra_s: float
    send_inter_s: float
    groups: int
    model: ModelSpec
    knobs: Knobs
    reserve_bytes: float
    params: CostParams | None = None
    node: Node | None = None
    peer: Node | None = None
    """Another node of the class (or a copy of ``node`` under another name)."""
    _caps: dict[tuple[int, bool, bool, bool], int] = field(default_factory=dict)
    _rows: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _times: dict[tuple[int, bool, bool], tuple[float, ...]] = field(default_factory=dict)
    _acts: dict[tuple[object, ...], float] = field(default_factory=dict)
    """Peak activations by TP degree, activation knobs, layers, position, micro-batches in
    flight and sequence parallelism: they depend on nothing else of one model, so tables
    of other classes and ZeRO settings may share it (``class_table``'s ``acts``)."""
    _state: dict[tuple[int, bool, bool, bool, int], float] = field(default_factory=dict)

    @property
    def pair_in_node(self) -> bool:
        """Returns whether two of the class's TP groups fit on one node."""
        return self.cls.gpus_per_node >= 2 * self.tp

    def stage_fb(self, layers: int, first: bool, last: bool) -> tuple[float, float]:
        """Returns (forward, backward side) of a stage of ``layers`` layers per micro-batch
        from ``stage_times``: the backward side holds recomputation and TP collectives."""
        key = (layers, first, last)
        hit = self._times.get(key)
        if hit is None:
            assert self.params is not None and self.node is not None
            node = self.node
            skey = StageKey(node.gpu, node.intra_node_bytes_per_s, self.tp, layers, first, last,
                            first and last)  # fmt: skip
            fwd, bwd, rc, tpc, _, _ = stage_times(
                self.knobs.time_plan(), self.model, skey, node, self.params
            )
            hit = self._times[key] = (fwd, bwd + rc + tpc)
        return hit  # type: ignore[return-value]

    def parts(self, first: bool, last: bool) -> tuple[float, float, float, float]:
        """Returns the embedding's and the head's forward and backward per micro-batch on a
        stage that holds them (zero for a part it does not hold), from ``params.compute``:
        an interleaved stage runs them on its first and its last chunk."""
        key = (-1, first, last)
        hit = self._times.get(key)
        if hit is None:
            assert self.params is not None
            hit = self._times[key] = part_split(
                self.knobs.time_plan(), self.model, self.cls.gpu, self.tp, first, last,
                self.params,
            )  # fmt: skip
        return hit  # type: ignore[return-value]

    def stage_s(self, layers: int, first: bool, last: bool) -> float:
        """Returns a stage's forward plus backward side per micro-batch (no transfers)."""
        f, b = self.stage_fb(layers, first, last)
        return f + b

    def send_s(self, other: ClassTable, same_node: bool) -> float:
        """Returns one transfer from a stage of this class to one of ``other``'s, inside one
        node or between two (``comm.p2p_s``, as ``estimate`` sends them)."""
        assert self.params is not None and self.node is not None
        act = self.knobs.micro_batch * self.model.seq * self.model.hidden
        size = act * element_bytes(self.knobs.precision) / self.tp
        if same_node:
            return comm.p2p_s(size, self.node, self.node, self.params, self.tp)
        dst = other.peer if other.cls.key == self.cls.key else other.node
        assert dst is not None
        return comm.p2p_s(size, self.node, dst, self.params, self.tp)

    def min_send_s(self, other: ClassTable) -> float:
        """Returns the least a transfer to a stage of ``other`` can take on this cluster."""
        same = other.cls.key == self.cls.key
        out = math.inf
        if same and self.pair_in_node:
            out = self.send_s(other, True)
        if not same or len(self.cls.nodes) > 1:
            out = min(out, self.send_s(other, False))
        return out if math.isfinite(out) else self.send_s(other, False)

    def optimizer_s(self, layers: int, first: bool, last: bool, single: bool, shards: int) -> float:
        """Returns a stage's optimizer step (``params.compute.optimizer_s``)."""
        assert self.params is not None
        gpu = self.cls.gpu
        p_local = stage_params(self.model, layers, self.tp, first, last, single)
        pieces = [("layer", layers), ("embed", int(first)), ("head", int(last))]
        return float(
            self.params.compute.optimizer_s(
                self.model, gpu, self.params.gpu(gpu.name), self.tp, self.knobs.precision,
                pieces, p_local, shards,
            )[0]
        )  # fmt: skip

    def activation_bytes(
        self, layers: int, first: bool, last: bool, in_flight: int, sp: bool
    ) -> float:
        """Returns a stage's peak activations (``stage_activation_bytes``)."""
        k = self.knobs
        return stage_activation_bytes(
            self.model, layers, self.tp, k.micro_batch, sp, k.recompute, k.flash_attention,
            first, last, in_flight, k.virtual_stages, k.precision,
        )  # fmt: skip

    def _choices(self) -> list[tuple[bool, int]]:
        k = self.knobs
        sps = (False, True) if k.sequence_parallel is None else (k.sequence_parallel,)
        if self.tp == 1:
            sps = sps[:1]
        return [(sp, z) for sp in sps for z in (k.zero_choices or (k.zero_stage,))]

    def _stage_bytes(self, layers: int, j: int, p: int, m: int, sp: bool, z: int) -> float:
        k = self.knobs
        first, last = j == 0, j == p - 1
        units = peak_in_flight(k.schedule, p, m, k.virtual_stages, j)
        # activations do not depend on the ZeRO stage or the GPU, nor the state on the
        # micro-batches in flight: each is computed once and shared
        akey = (self.tp, k.micro_batch, k.recompute, k.flash_attention, k.virtual_stages,
                k.precision, layers, first, last, units, sp)  # fmt: skip
        acts = self._acts.get(akey)
        if acts is None:
            acts = self._acts[akey] = self.activation_bytes(layers, first, last, units, sp)
        skey = (layers, first, last, p == 1, z)
        state = self._state.get(skey)
        if state is None:
            state = self._state[skey] = stage_state_bytes(
                self.model, layers, self.tp, first, last, p == 1, k.precision, z, k.dp_assumed
            )
        return state + acts + self.reserve_bytes

    def stage_bytes(self, layers: int, j: int, p: int, m: int = MANY) -> float:
        """Returns the peak bytes of a stage at position ``j`` of ``p`` holding ``layers``
        with ``m`` micro-batches (default: as many as the schedule keeps in flight), the
        least over the knobs' sequence-parallel and ZeRO choices."""
        return min(self._stage_bytes(layers, j, p, m, sp, z) for sp, z in self._choices())

    def caps_row(self, p: int) -> tuple[int, ...]:
        """Returns ``max_layers`` at every position of ``p`` stages."""
        hit = self._rows.get(p)
        if hit is None:
            k, caps = self.knobs, self._caps
            hit = self._rows[p] = tuple(
                caps[key] if key in caps else self.max_layers(j, p)
                for j, key in enumerate(cap_keys(k.schedule, k.virtual_stages, p))
            )
        return hit

    def max_layers(self, j: int, p: int) -> int:
        """Returns the most layers a stage at position ``j`` of ``p`` holds in memory (under
        the choice that holds the most; memory is affine in the layers from one on)."""
        k = self.knobs
        key = cap_key(k.schedule, k.virtual_stages, j, p)
        hit = self._caps.get(key)
        if hit is None:
            cap = self.cls.gpu.memory_bytes
            top = self.model.layers
            most = 0
            for sp, z in self._choices():
                one = self._stage_bytes(1, j, p, MANY, sp, z)
                if one > cap:
                    continue
                slope = self._stage_bytes(2, j, p, MANY, sp, z) - one
                n = top if slope <= 0 else min(top, 1 + int((cap - one) // slope))
                while n > 1 and self._stage_bytes(n, j, p, MANY, sp, z) > cap:
                    n -= 1  # rounding
                most = max(most, n)
            hit = self._caps[key] = most
        return int(hit)


def cap_key(schedule: str, v: int, j: int, p: int) -> tuple[int, bool, bool, bool]:
    """Returns what ``ClassTable.max_layers`` at position ``j`` of ``p`` stages depends on
    besides the table: the micro-batches in flight there and the stage's position."""
    return (peak_in_flight(schedule, p, MANY, v, j), j == 0, j == p - 1, p == 1)


@lru_cache(maxsize=1024)
def cap_keys(schedule: str, v: int, p: int) -> tuple[tuple[int, bool, bool, bool], ...]:
    """Returns ``cap_key`` at every position of ``p`` stages."""
    return tuple(cap_key(schedule, v, j, p) for j in range(p))


@lru_cache(maxsize=256)
def cap_positions(schedule: str, v: int, most: int) -> tuple[tuple[int, int], ...]:
    """Returns one (position, stages) per distinct ``cap_key`` over pipelines of up to
    ``most`` stages: two tables of this schedule have the same ``caps_row`` for every
    stage count up to ``most`` exactly when their ``max_layers`` agree at these."""
    out: dict[tuple[int, bool, bool, bool], tuple[int, int]] = {}
    for p in range(1, most + 1):
        for j in range(p):
            out.setdefault(cap_key(schedule, v, j, p), (j, p))
    return tuple(out.values())


def class_table(
    model: ModelSpec,
    cls: DeviceClass,
    tp: int,
    knobs: Knobs,
    params: CostParams,
    acts: dict[tuple[object, ...], float] | None = None,
    caches: TableCaches | None = None,
) -> ClassTable:
    """Returns the cost table of ``cls`` at tensor-parallel degree ``tp``; ``acts``: a
    cache of peak activations shared with the other tables of ``model``; ``caches``: the
    memory caps, stage times and state bytes of tables of the same node hardware, TP degree
    and knobs (``het_cache.SearchCache``), shared with them."""
    node = cls.nodes[0]
    peer = cls.nodes[1] if len(cls.nodes) > 1 else replace(node, name=node.name + "~peer")
    table = ClassTable(
        cls=cls,
        tp=tp,
        layer_s=0.0,
        embedding_s=0.0,
        head_s=0.0,
        overhead_s=0.0,
        p2p_exposed=params.gpu(cls.gpu.name).p2p_exposed,
        send_intra_s=0.0,
        send_inter_s=0.0,
        groups=len(cls.groups(tp)),
        model=model,
        knobs=knobs,
        reserve_bytes=params.memory_reserve_bytes,
        params=params,
        node=node,
        peer=peer,
    )
    if acts is not None:
        table._acts = acts
    if caches is not None:
        table._caps, table._rows, table._times, table._state = caches
    base = table.stage_s(0, False, False)
    table.overhead_s = base
    table.layer_s = table.stage_s(1, False, False) - base
    table.embedding_s = table.stage_s(0, True, False) - base
    table.head_s = table.stage_s(0, False, True) - base
    table.send_intra_s = table.send_s(table, True)
    table.send_inter_s = table.send_s(table, False)
    return table


def per_layer_floor_s(table: ClassTable) -> float:
    """Returns the least time per layer and micro-batch any stage of the class spends
    (forward, backward side; no transfers), a throughput bound's unit of work: the least
    slope of ``stage_times`` over the stage positions (its times are affine in the layers,
    with a non-negative fixed part)."""
    top = table.model.layers
    return min(
        (table.stage_s(top, first, last) - table.stage_s(0, first, last)) / top
        for first, last in ((False, False), (True, False), (False, True), (True, True))
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
    """Per-class arrays of a list of tables, to build stage arrays without Python loops.

    Splits are generated in units of the knobs' virtual stages (an interleaved stage
    holds a multiple of them): ``tau`` is per unit, ``caps`` in units."""

    def __init__(self, tables: list[ClassTable]) -> None:
        self.tables = tables
        self.unit = tables[0].knobs.virtual_stages if tables else 1
        u = self.unit
        self.layer_s = np.array([t.layer_s * u for t in tables])
        self.embedding_s = np.array([t.embedding_s for t in tables])
        self.head_s = np.array([t.head_s for t in tables])
        self.overhead_s = np.array([t.overhead_s for t in tables])
        self.p2p_exposed = np.array([t.p2p_exposed for t in tables])
        self.pair_in_node = np.array([t.pair_in_node for t in tables])
        n = len(tables)
        # transfers between stages of two classes: the least the cluster allows (inside a
        # node or between two), so that every split's times bound any placement's
        self.hop = np.array([[a.min_send_s(b) for b in tables] for a in tables]).reshape(n, n)
        self._caps: dict[int, np.ndarray] = {}
        self._wait_counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def caps(self, p: int) -> np.ndarray:
        """Returns the most units each class holds at each position of ``p`` stages."""
        if p not in self._caps:
            rows = [t.caps_row(p) for t in self.tables]
            self._caps[p] = np.array(rows, dtype=np.int64).reshape(len(self.tables), p) // self.unit
        return self._caps[p]

    def of(self, seq: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Returns per-stage (time per unit, fixed time, max units) and the send total."""
        tau, fixed, caps, sends = self.of_many([seq])
        return tau[0], fixed[0], caps[0], float(sends[0])

    def of_many(
        self, seqs: list[tuple[int, ...]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Returns ``of`` for sequences of one length, a row each (sends: one per row)."""
        k = np.array(seqs, dtype=np.int64)
        p = k.shape[1]
        tau = self.layer_s[k]
        fixed = self.overhead_s[k].astype(float)
        fixed[:, 0] += self.embedding_s[k[:, 0]]
        fixed[:, -1] += self.head_s[k[:, -1]]
        caps = self.caps(p)[k, np.arange(p)[None, :]]
        # stage j to j+1, the last to the first
        hop = self.hop[k, np.concatenate([k[:, 1:], k[:, :1]], axis=1)]
        if p > 1:
            # estimate.p2p_wait_s, vectorised: each chunk receives from the previous stage
            # (not the very first chunk) and sends to the next (not the very last)
            before, after = self._counts(p)
            prev = np.concatenate([hop[:, -1:], hop[:, :-1]], axis=1)
            fixed += 2.0 * self.p2p_exposed[k] * (before * prev + after * hop)
        return tau, fixed, caps, 2.0 * hop[:, : p - 1].sum(axis=1)

    def _counts(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._wait_counts.get(p)
        if hit is None:
            before = np.full(p, float(self.unit))
            before[0] -= 1
            after = np.full(p, float(self.unit))
            after[-1] -= 1
            hit = self._wait_counts[p] = (before, after)
        return hit


def stage_arrays(
    tables: list[ClassTable], seq: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Returns per-stage (time per layer unit, fixed time, max units) and the send total."""
    return StageArrays(tables).of(seq)


FrontierCache = dict[bytes, tuple[Partition, ...]]


def make_template(
    tables: list[ClassTable] | StageArrays,
    seq: tuple[int, ...],
    layers: int,
    cache: FrontierCache | None = None,
) -> Template | None:
    """Returns the template of a stage sequence, or None if the layers cannot fit; equal
    stage arrays share one frontier through ``cache``. Splits are in layers."""
    return make_templates(tables, [seq], layers, cache)[0]


def make_templates(
    tables: list[ClassTable] | StageArrays,
    seqs: list[tuple[int, ...]],
    layers: int,
    cache: FrontierCache | None = None,
) -> list[Template | None]:
    """Returns ``make_template`` of every sequence, the frontiers of sequences of one
    length computed together (``uniform_frontiers``)."""
    arrays = tables if isinstance(tables, StageArrays) else StageArrays(tables)
    u = arrays.unit
    out: list[Template | None] = [None] * len(seqs)
    if layers % u:
        return out
    units = layers // u
    cache = cache if cache is not None else {}
    tail = units.to_bytes(4, "little")
    by_len: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        by_len.setdefault(len(seq), []).append(i)
    for idx in by_len.values():
        tau, fixed, caps, sends = arrays.of_many([seqs[i] for i in idx])
        keys = [
            b"".join((tau[r].tobytes(), fixed[r].tobytes(), caps[r].tobytes(), tail))
            for r in range(len(idx))
        ]
        todo: dict[bytes, int] = {}
        for r, key in enumerate(keys):
            if key not in cache and key not in todo:
                todo[key] = r
        if todo:
            rows = np.array(list(todo.values()), dtype=np.int64)
            fronts = uniform_frontiers(tau[rows], fixed[rows], caps[rows], units)
            for key, front in zip(todo, fronts, strict=True):
                if u > 1:
                    front = [Partition(tuple(x * u for x in q.layers), q.stage_s) for q in front]
                cache[key] = tuple(front)
        for r, i in enumerate(idx):
            frontier = cache[keys[r]]
            if frontier:
                seq = seqs[i]
                counts = tuple(seq.count(k) for k in range(len(arrays.tables)))
                out[i] = Template(seq, counts, frontier, float(sends[r]))
    return out


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


# ------------------------------------------------------------------------- lower bounds


def chunk_times(
    fwd_s: float,
    bwd_s: float,
    wait_s: float,
    v: int,
    parts: tuple[float, float, float, float],
) -> tuple[list[float], list[float]]:
    """Returns one stage's forward and backward-side time per chunk as ``estimate`` replays
    them: the layers (and half the transfer wait each way) split evenly over ``v``
    chunks, the embedding on chunk 0 and the head on chunk v-1 (``parts``, when v > 1)."""
    ef, eb, hf, hb = parts if v > 1 else (0.0, 0.0, 0.0, 0.0)
    f = (fwd_s - ef - hf + wait_s / 2) / v
    b = (bwd_s - eb - hb + wait_s / 2) / v
    fc = [f + (ef if c == 0 else 0.0) + (hf if c == v - 1 else 0.0) for c in range(v)]
    bc = [b + (eb if c == 0 else 0.0) + (hb if c == v - 1 else 0.0) for c in range(v)]
    return fc, bc


def replay_is_exact(p: int, m: int, v: int) -> bool:
    """Returns whether ``estimate`` replays a pipeline of this size action by action (its
    longer runs are extrapolated, where only the closed-form bound is proven)."""
    return (p == 1 and v == 1) or 2 * p * m * v <= EXACT_ACTION_LIMIT or m <= 3 * p


def pipeline_bound_s(
    schedule: str,
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
    opt_s: list[float],
) -> float:
    """Returns a lower bound of the latest ``last backward end + optimizer`` over one
    pipeline's stages in ``estimate``, for any plan whose stages' chunks take at least
    ``fwd_c[j][c]`` / ``bwd_c[j][c]`` per micro-batch (waits included), whose transfers
    take at least ``send_s`` (stage j to j+1, wrapping) and whose optimizer steps take at
    least ``opt_s``.

    The replay is monotone in every duration, so replaying these times bounds
    ``estimate``'s where it replays exactly. Otherwise (see ``closed_bound_s``) per stage
    j: its first forward waits for chunk 0 of every earlier stage and the transfers
    between them, it then computes all its m micro-batches, and after its last backward
    (chunk 0 of the last micro-batch) every earlier stage still runs that chunk's
    backward, transfers included, before stage 0 ends."""
    p, v = len(fwd_c), len(fwd_c[0])
    if not replay_is_exact(p, m, v):
        return closed_bound_s(m, fwd_c, bwd_c, send_s, opt_s)
    if p == 1 and v == 1:
        ends = [m * (fwd_c[0][0] + bwd_c[0][0])]
    else:
        ends = replay(schedule, m, v, fwd_c, bwd_c, list(send_s)).last_backward_end_s
    return max(e + o for e, o in zip(ends, opt_s, strict=True)) * (1.0 - 1e-9)


def closed_bound_s(
    m: int,
    fwd_c: list[list[float]],
    bwd_c: list[list[float]],
    send_s: list[float],
    opt_s: list[float],
) -> float:
    """Returns the closed-form bound of ``pipeline_bound_s`` (non-decreasing in ``m``)."""
    f_acc = b_acc = 0.0
    out = last = 0.0
    for j in range(len(fwd_c)):
        own = f_acc + m * (sum(fwd_c[j]) + sum(bwd_c[j]))
        out = max(out, own + opt_s[j])
        last = max(last, own + b_acc)
        f_acc += fwd_c[j][0] + send_s[j]
        b_acc += bwd_c[j][0] + send_s[j]
    return max(out, last + opt_s[0]) * (1.0 - 1e-9)


class PlanBounds:
    """Memory and a proven lower bound of ``estimate``'s iteration time for concrete plans
    (devices placed), from ``estimate``'s own pieces; caches stage times, optimizer steps
    and pipeline bounds across plans that share them (twins differing in ZeRO or sequence
    parallelism share everything but memory and the optimizer's shards). ``pipes``: pipeline
    bounds by their stage times (keyed by every number they read), shared across clusters."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: Cluster,
        params: CostParams,
        pipes: dict[tuple[object, ...], float] | None = None,
    ) -> None:
        self.model = model
        self.cluster = cluster
        self.params = params
        self._nodes: dict[str, Node] = {}
        self._stage: dict[tuple[object, ...], tuple[float, ...]] = {}
        self._opt: dict[tuple[object, ...], float] = {}
        self._pipe: dict[tuple[object, ...], float] = {} if pipes is None else pipes
        self._plans: dict[tuple[object, ...], float] = {}

    def node(self, device: str) -> Node:
        """Returns the node of a device (memoized)."""
        hit = self._nodes.get(device)
        if hit is None:
            hit = self._nodes[device] = self.cluster.device_node(device)
        return hit

    def fits(self, plan: Plan) -> tuple[bool, float]:
        """Returns whether every stage fits, and the largest peak of a stage that does not
        (0 when all fit): the sums ``estimate`` makes, from the same memory functions."""
        model, dp = self.model, plan.dp
        deferred = deferred_sync(plan)  # pipelined ZeRO-2/3, as estimate prices them
        worst = 0.0
        ok = True
        for pipe in plan.pipelines:
            p = len(pipe.stages)
            m = plan.num_micro_batches(pipe)
            for j, stage in enumerate(pipe.stages):
                node = self.node(stage.devices[0])
                first, last = j == 0, j == p - 1
                state = stage_state_bytes(
                    model, stage.layers, stage.tp, first, last, p == 1, plan.precision,
                    plan.zero_stage, dp, deferred,
                )  # fmt: skip
                units = peak_in_flight(plan.schedule, p, m, plan.virtual_stages, j)
                even = held_chunks(stage.layers, plan.virtual_stages, first)
                acts = stage_activation_bytes(
                    model, stage.layers, stage.tp, plan.micro_batch_size,
                    plan.sequence_parallel, plan.recompute, plan.flash_attention, first, last,
                    units, plan.virtual_stages, plan.precision,
                    held_layers(plan.schedule, p, m, j, even) if even else None,
                )  # fmt: skip
                total = state + acts + self.params.memory_reserve_bytes
                if total > node.gpu.memory_bytes:
                    ok = False
                    worst = max(worst, total)
        return ok, worst

    def bound_s(self, plan: Plan, exact: bool = True) -> float:
        """Returns a lower bound of ``estimate(plan).iteration_time_s``: per pipeline, the
        replay (or its closed-form bound) of ``stage_times`` with the plan's transfers
        (the node links shared as ``pipeline_talkers`` counts) and waits, each stage
        ending with its optimizer step; gradient reduction and ZeRO-2/3's collectives
        only add (left out). ``exact=False``: the closed-form bound alone (cheaper)."""
        v = plan.virtual_stages
        tk = (plan.micro_batch_size, plan.precision, plan.recompute, v, plan.flash_attention,
              plan.overlap_tp_comm, plan.sequence_parallel)  # fmt: skip
        shards = plan.dp if plan.zero_stage >= 1 else 1
        # twins differing in the ZeRO stage alone share it (the optimizer's shards aside)
        key = (plan.pipelines, plan.schedule, *tk, shards, exact)
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = self._bound_s(plan, tk, shards, exact)
        return hit

    def _bound_s(self, plan: Plan, tk: tuple[object, ...], shards: int, exact: bool) -> float:
        model, params = self.model, self.params
        v = plan.virtual_stages
        act = plan.micro_batch_size * model.seq * model.hidden * element_bytes(plan.precision)
        talkers = pipeline_talkers(plan, self.node)
        out = 0.0
        for pipe in plan.pipelines:
            p = len(pipe.stages)
            m = plan.num_micro_batches(pipe)
            nodes = [self.node(s.devices[0]) for s in pipe.stages]
            fwd, bwd, opt, sends, parts = [], [], [], [], []
            for j, stage in enumerate(pipe.stages):
                node = nodes[j]
                first, last = j == 0, j == p - 1
                skey = (id(node), stage.tp, stage.layers, first, last, *tk)
                fb = self._stage.get(skey)
                if fb is None:
                    key = StageKey(node.gpu, node.intra_node_bytes_per_s, stage.tp,
                                   stage.layers, first, last, p == 1)  # fmt: skip
                    f, b, rc, tpc, _, _ = stage_times(plan, model, key, node, params)
                    split = part_split(plan, model, node.gpu, stage.tp, first, last, params)
                    fb = self._stage[skey] = (f, b + rc + tpc, *split)
                fwd.append(fb[0])
                bwd.append(fb[1])
                parts.append(fb[2:])
                okey = (id(node.gpu), stage.tp, stage.layers, first, last, p == 1,
                        plan.precision, shards)  # fmt: skip
                o = self._opt.get(okey)
                if o is None:
                    p_local = stage_params(model, stage.layers, stage.tp, first, last, p == 1)
                    pieces = [("layer", stage.layers), ("embed", int(first)), ("head", int(last))]
                    o = self._opt[okey] = params.compute.optimizer_s(
                        model, node.gpu, params.gpu(node.gpu.name), stage.tp, plan.precision,
                        pieces, p_local, shards,
                    )[0]  # fmt: skip
                opt.append(o)
                nxt = nodes[(j + 1) % p]
                if p > 1:
                    conc = max(talkers.get(node.name, 0), talkers.get(nxt.name, 0), stage.tp)
                    sends.append(comm.p2p_s(act / stage.tp, node, nxt, params, conc))
                else:
                    sends.append(0.0)
            fwd_c, bwd_c = [], []
            for j in range(p):
                w = p2p_wait_s(sends, j, v, params.gpu(nodes[j].gpu.name).p2p_exposed)
                fc, bc = chunk_times(fwd[j], bwd[j], w, v, parts[j])  # type: ignore[arg-type]
                fwd_c.append(fc)
                bwd_c.append(bc)
            if not exact:
                out = max(out, closed_bound_s(m, fwd_c, bwd_c, sends, opt))
                continue
            pkey = (plan.schedule, m, tuple(map(tuple, fwd_c)), tuple(map(tuple, bwd_c)),
                    tuple(sends), tuple(opt))  # fmt: skip
            hit = self._pipe.get(pkey)
            if hit is None:
                hit = self._pipe[pkey] = pipeline_bound_s(
                    plan.schedule, m, fwd_c, bwd_c, sends, opt
                )
            out = max(out, hit)
        return out

"""Cost tables of one device class under one set of knobs: per-micro-batch stage times,
transfers, optimizer steps and memory caps, the figures the heterogeneous search builds its
pipeline templates (``het_templates``) and bounds (``het_bounds``) from.

Nothing here models time on its own: a stage's per-micro-batch forward and backward come
from ``estimate``'s ``stage_times`` for its actual layer count and position, each transfer
from ``comm.p2p_s`` between the nodes involved, the optimizer step from
``params.compute.optimizer_s`` and memory from the memory functions ``estimate`` sums, with
the plan's own sequence-parallel, ZeRO and schedule knobs. The linear per-layer figures
(``layer_s`` ...) are differences of ``stage_times`` used to generate layer splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from hetplan.cluster import Node
from hetplan.cost import comm
from hetplan.cost.estimate import StageKey, part_split, stage_times
from hetplan.cost.memory import (
    activation_pieces,
    stage_activation_bytes,
    stage_params,
    stage_state,
)
from hetplan.cost.params import CostParams
from hetplan.cost.schedule import peak_in_flight
from hetplan.model import ModelSpec
from hetplan.plan import Plan, element_bytes
from hetplan.search.grouping import DeviceClass
from hetplan.search.het_cache import TableCaches

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

    def same_activations(self, other: ClassTable) -> bool:
        """Returns whether a stage of this table holds the same activations as one of
        ``other`` wherever it sits and whatever it holds, under every sequence-parallel
        choice (``activation_pieces``: those are all a stage's activations depend on, so
        two tables that also agree on everything else have the same ``max_layers``)."""
        mine = {sp for sp, _ in self._choices()}
        if mine != {sp for sp, _ in other._choices()}:
            return False
        a, b = self.knobs, other.knobs
        return all(
            activation_pieces(self.model, self.tp, a.micro_batch, sp, a.recompute,
                              a.flash_attention, a.precision)
            == activation_pieces(other.model, other.tp, b.micro_batch, sp, b.recompute,
                                 b.flash_attention, b.precision)
            for sp in mine
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
            state = self._state[skey] = sum(
                stage_state(
                    self.model, layers, self.tp, first, last, p == 1, k.precision, z, k.dp_assumed
                )
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
        groups=cls.group_count(tp),
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

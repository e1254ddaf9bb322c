"""The homogeneous search's memory check: each candidate's per-GPU peak (its stages'
weights, gradients and optimizer state, and their activations at the schedule's peak: the
first, the last and the heaviest middle stages, ``probe_stages``), from ``memory``'s own
building blocks, with the caches (``SearchMemo``) that searches on clusters of one node
type share; ``homogeneous_scoring`` adds the time bounds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cache

from hetplan.chunk_layout import lightened_chunks
from hetplan.cluster import Cluster
from hetplan.cost.memory import (
    combine_activation_bytes,
    held_chunks,
    stage_params,
    stage_state,
)
from hetplan.cost.params import CostParams
from hetplan.cost.schedule import held_layers, memory_micro_batches, peak_in_flight
from hetplan.cost.sharding import deferred
from hetplan.model import ModelSpec
from hetplan.plan import element_bytes
from hetplan.search.homogeneous_candidates import Candidate, SearchSpace, most_micro_batches
from hetplan.search.layout import even_layer_split, share_counts


@cache
def probe_stages(layers: int, pp: int) -> tuple[int, ...]:
    """Returns the stages whose memory peaks bound every stage's of the even split
    (``even_layer_split``): the first and the last (the embedding, the head), and of the
    middle stages the earliest of each layer count (the same state; a stage holds no fewer
    micro-batches in flight than a later one, and checking more stages only adds)."""
    split = even_layer_split(layers, pp)
    out = {0, pp - 1}
    seen: set[int] = set()
    for j in range(1, pp - 1):
        if split[j] not in seen:
            seen.add(split[j])
            out.add(j)
    return tuple(sorted(out))


@dataclass(frozen=True)
class Shape:
    """Activation sizes of a candidate's stages (memory), independent of its DP degree."""

    split: tuple[int, ...]
    p_first: float
    p_last: float
    layer_act_bytes: float
    """Activations one layer keeps per micro-batch."""
    embed_act_bytes: float
    head_act_bytes: float
    working_act_bytes: float
    """Full recomputation: one layer's activations rebuilt during its backward."""


class SearchMemo:
    """Caches of shapes, layouts and stage times, valid for one model, one node type (GPU,
    GPUs per node, links) and one set of parameters; reusable across node counts."""

    def __init__(self) -> None:
        self.shapes: dict[tuple[object, ...], Shape] = {}
        self.stages: dict[tuple[object, ...], tuple[float, float, float, float, float]] = {}
        self.optimizer: dict[tuple[object, ...], float] = {}
        self.sends: dict[tuple[object, ...], tuple[float, float]] = {}
        self.first: dict[tuple[object, ...], tuple[list[float], list[float], dict[int, float]]] = {}
        self.acts: dict[tuple[object, ...], float] = {}
        self.fit_dp: dict[tuple[object, ...], list[int]] = {}
        """Per candidate less its DP degree: the largest DP degree known not to fit and the
        smallest known to fit (``MemoryScorer.fits``)."""


@dataclass
class MemoryScorer:
    """The per-GPU memory peak of candidates on one cluster of one node type."""

    model: ModelSpec
    cluster: Cluster
    precision: str
    global_batch: int
    params: CostParams
    flash: bool
    memo: SearchMemo
    space: SearchSpace
    states: dict[tuple[object, ...], float] = field(default_factory=dict)
    """Per degrees, ZeRO stage and stage: the weights, gradients and optimizer state held."""

    def shape(self, c: Candidate) -> Shape:
        """Returns the candidate's activation sizes (they do not depend on its DP degree)."""
        model, precision, flash, memo = self.model, self.precision, self.flash, self.memo
        key = (c.tp, c.pp, c.micro_batch, c.recompute, c.sequence_parallel, precision, flash)
        hit = memo.shapes.get(key)
        if hit is not None:
            return hit
        mb = c.micro_batch
        split = tuple(even_layer_split(model.layers, c.pp))
        single = c.pp == 1
        e = element_bytes(precision)
        shape = Shape(
            split=split,
            p_first=stage_params(model, split[0], c.tp, True, single, single),
            p_last=stage_params(model, split[-1], c.tp, single, True, single),
            layer_act_bytes=mb
            * model.layer_activation_bytes(c.tp, c.sequence_parallel, c.recompute, flash, e),
            embed_act_bytes=mb * model.embedding_activation_bytes(c.tp, c.sequence_parallel, e),
            head_act_bytes=mb * model.head_activation_bytes(c.tp, e),
            working_act_bytes=(
                mb * model.layer_activation_bytes(c.tp, c.sequence_parallel, "none", flash, e)
                if c.recompute == "full"
                else 0.0
            ),
        )
        memo.shapes[key] = shape
        return shape

    def peak_bytes(self, c: Candidate) -> float:
        """Returns the largest peak of a candidate's stages (``probe_stages``: the first, the
        last, and the earliest of the middle ones per layer count) (its state and its
        activations kept apart: candidates of one search share the state of their degrees
        and ZeRO stage, and node counts share the activations of their knobs and
        micro-batches per replica)."""
        precision, memo = self.precision, self.memo
        most = most_micro_batches(self.global_batch, c.dp, c.micro_batch)  # the busiest's
        # interleaved in groups other than p (``interleave_group``), a replica of fewer
        # micro-batches may hold more: every count is asked
        flex = self.flexible_counts(c)
        worst = 0.0
        shape = None
        for j, count in itertools.product(probe_stages(self.model.layers, c.pp), flex or (most,)):
            first, last = j == 0, j == c.pp - 1
            state = self.state_bytes(c.tp, c.pp, c.dp, c.zero_stage, j)
            # past its warm-up (and a cycle, interleaved) a stage holds no more: node counts
            # whose replicas run more micro-batches share the entry
            m = memory_micro_batches(c.schedule, c.pp, count, c.virtual_stages, j)
            akey = (c.tp, c.pp, c.micro_batch, c.recompute, c.sequence_parallel, c.schedule,
                    c.virtual_stages, c.lightened, m, j, precision, self.flash)  # fmt: skip
            acts = memo.acts.get(akey)
            if acts is None:
                shape = shape or self.shape(c)
                units = peak_in_flight(c.schedule, c.pp, m, c.virtual_stages, j)
                split, v = shape.split, c.virtual_stages
                light = lightened_chunks(split, v)[j] if c.lightened else None
                chunks = held_chunks(split[j], v, first, light)
                held = held_layers(c.schedule, c.pp, m, j, chunks) if chunks else None
                acts = memo.acts[akey] = combine_activation_bytes(
                    split[j], shape.layer_act_bytes, shape.embed_act_bytes,
                    shape.head_act_bytes, shape.working_act_bytes, first, last, units, v, held,
                )  # fmt: skip
            worst = max(worst, state + acts + self.params.memory_reserve_bytes)
        return worst

    def fits(self, c: Candidate) -> tuple[bool, float | None]:
        """Returns whether the candidate fits the GPU's memory, and its peak where it was
        computed (``peak_bytes``); None where a bound settled it.

        Two orders settle most candidates without their peak. With all else equal, the peak
        never grows with the DP degree (the state ZeRO shards over it only shrinks, and the
        busiest replica's micro-batches, hence those in flight, only fall), so a candidate
        fits where one of a smaller DP degree does and not where one of a larger does not;
        the degrees seen are kept per candidate less its DP degree, across node counts. And
        sequence parallelism only shards activations: a candidate without it does not fit
        where its twin with it does not (asked first where the space holds that twin, which
        is then already settled when its turn comes)."""
        limit = self.cluster.nodes[0].gpu.memory_bytes
        known = self._known_fit(c, limit)
        if known is not None:
            return known, None
        if not c.sequence_parallel and c.tp > 1 and True in self.space.sequence_parallel:
            twin = Candidate(c.tp, c.pp, c.dp, c.micro_batch, c.recompute, c.zero_stage,
                             c.schedule, c.virtual_stages, True, c.lightened)  # fmt: skip
            twin_fits = self._known_fit(twin, limit)
            if twin_fits is None:
                twin_fits = self._record(twin, limit, self.peak_bytes(twin) <= limit)
            if not twin_fits:
                return self._record(c, limit, False), None
        peak = self.peak_bytes(c)
        return self._record(c, limit, peak <= limit), peak

    def flexible_counts(self, c: Candidate) -> tuple[int, ...] | None:
        """Returns the replicas' micro-batch counts where the candidate interleaves some of
        them in groups other than its stages (``interleave_group``: a count p does not
        divide), else None."""
        if c.schedule != "Interleaved1F1B" or c.virtual_stages < 2:
            return None
        q, r = share_counts(self.global_batch, c.dp, c.micro_batch)
        counts = (q, q + 1) if r else (q,)
        return counts if any(m % c.pp for m in counts) else None

    def _fit_key(self, c: Candidate, limit: float) -> tuple[object, ...]:
        # deferred ZeRO-2/3 holds more than the same stage run per micro-batch, and ZeRO-3
        # defers only at DP degrees the batch does not divide: each kind orders on its own.
        # Interleaved in groups other than p, fewer micro-batches may hold more (a longer
        # group): the DP order holds only among equal counts
        return (c.tp, c.pp, c.micro_batch, c.recompute, c.zero_stage, c.schedule,
                c.virtual_stages, c.sequence_parallel, c.lightened, self.global_batch,
                self.precision, self.flash, limit,
                self.deferred(c.pp, c.dp, c.zero_stage), self.flexible_counts(c))  # fmt: skip

    def _known_fit(self, c: Candidate, limit: float) -> bool | None:
        seen = self.memo.fit_dp.get(self._fit_key(c, limit))
        if seen is None:
            return None
        if c.dp <= seen[0]:
            return False
        if c.dp >= seen[1]:
            return True
        return None

    def _record(self, c: Candidate, limit: float, fits: bool) -> bool:
        seen = self.memo.fit_dp.setdefault(self._fit_key(c, limit), [0, 1 << 62])
        if fits:
            seen[1] = min(seen[1], c.dp)
        else:
            seen[0] = max(seen[0], c.dp)
        return fits

    def state_bytes(self, tp: int, pp: int, dp: int, zero: int, j: int) -> float:
        """Returns the weights, gradients and optimizer state one GPU of stage ``j`` holds
        (``memory.stage_state`` of the even split; ZeRO-2/3 deferred where ``estimate``
        defers them: pipelined, or ZeRO-3 whose replicas run unequal micro-batch counts,
        which the batch makes so exactly where the DP degree does not divide it), memoised
        per degrees and ZeRO stage."""
        skey = (tp, pp, dp, zero, j, self.precision)
        state = self.states.get(skey)
        if state is None:
            split = even_layer_split(self.model.layers, pp)
            later = self.deferred(pp, dp, zero)
            w, g, o = stage_state(self.model, split[j], tp, j == 0, j == pp - 1, pp == 1,
                                  self.precision, zero, dp, later)  # fmt: skip
            state = self.states[skey] = w + g + o
        return state

    def deferred(self, pp: int, dp: int, zero: int) -> bool:
        """Returns whether candidates of these degrees and ZeRO stage run it deferred
        (``sharding.deferred``, as ``estimate`` reads it from their plans)."""
        return deferred(zero, dp, pp > 1, zero == 3 and self.global_batch % dp != 0)

    def state_overflows(self, tp: int, pp: int, dp: int, zero: int) -> bool:
        """Returns whether the first or the last stage's state and the reserve alone exceed
        the GPU's memory: then so does every candidate of these degrees and ZeRO stage,
        whatever its activations (``peak_bytes`` adds them)."""
        mem = self.cluster.nodes[0].gpu.memory_bytes - self.params.memory_reserve_bytes
        return max(self.state_bytes(tp, pp, dp, zero, j) for j in {0, pp - 1}) > mem

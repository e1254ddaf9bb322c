"""Where each rank sits in a plan: its replica, stage, tensor-parallel index, model chunks,
and the process groups the runtime needs. Pure Python: no torch here."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetplan.cluster import Cluster
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan, validate_plan

EMBED = "embed"
HEAD = "head"
EMBED_TOK = "embed_tok"
"""Sync unit of the token embedding alone (a tied head holds it without the rest of EMBED)."""


@dataclass(frozen=True)
class Chunk:
    """One model chunk a rank runs: a virtual pipeline stage and its layers [start, end)."""

    stage_index: int
    """Index among the replica's virtual stages (stage j, chunk c -> c * stages + j)."""
    start: int
    end: int
    embed: bool
    head: bool
    tied: bool = False
    """The head's weight is the token embedding (held here too if this chunk has the head)."""

    def units(self) -> list[str]:
        """Returns the checkpoint/sync units this chunk holds, in model order."""
        out = [EMBED] if self.embed or (self.head and self.tied) else []
        out += [layer_unit(i) for i in range(self.start, self.end)]
        return out + ([HEAD] if self.head else [])

    def sync_units(self) -> list[str]:
        """Returns the gradient-sync units of this chunk (EMBED split off its token table)."""
        out = [EMBED, EMBED_TOK] if self.embed else []
        out += [EMBED_TOK] if self.head and self.tied and not self.embed else []
        return out + [u for u in self.units() if u != EMBED]

    def native_units(self) -> list[str]:
        """Returns the units whose every parameter this chunk holds (what it can save)."""
        return [u for u in self.units() if u != EMBED or self.embed]


@dataclass(frozen=True)
class RankPlace:
    """One rank's place in the plan."""

    rank: int
    device: str
    replica: int
    stage: int
    tp_index: int
    tp_ranks: tuple[int, ...]
    """The ranks of this stage's tensor-parallel group."""
    pp_ranks: tuple[int, ...]
    """The ranks of this rank's pipeline lane: the stages' devices at this TP index."""
    chunks: tuple[Chunk, ...]
    num_virtual_stages: int
    batch_offset: int
    """First row of this replica's share of the global batch."""
    batch_size: int
    micro_batches: int

    @property
    def tp(self) -> int:
        """Returns the tensor-parallel degree of this rank's stage."""
        return len(self.tp_ranks)


@dataclass(frozen=True)
class SyncGroup:
    """Ranks that sum the gradients of some units: the holders of those units."""

    ranks: tuple[int, ...]
    units: tuple[str, ...]
    sharded: bool
    """True: members hold equal shards (same TP degree and index), reduce them as they are.
    False: TP degrees differ; members reduce full-size buffers."""


@dataclass
class RuntimeLayout:
    """Every rank's place and every process group, computed the same way on every rank."""

    places: list[RankPlace]
    rank_of: dict[str, int]
    sync_groups: list[SyncGroup] = field(default_factory=list)

    def all_groups(self) -> list[tuple[int, ...]]:
        """Returns every process group's ranks, deduplicated, in creation order."""
        seen: dict[tuple[int, ...], None] = {}
        for p in self.places:
            seen.setdefault(p.tp_ranks, None)
            seen.setdefault(p.pp_ranks, None)
        for g in self.sync_groups:
            seen.setdefault(g.ranks, None)
        return list(seen)

    def owner(self, unit: str) -> RankPlace:
        """Returns the TP-rank-0 place of the first stage holding ``unit`` (it saves it)."""
        for p in self.places:
            if any(unit in c.native_units() for c in p.chunks):
                return self.places[p.tp_ranks[0]]
        raise KeyError(unit)


def layer_unit(i: int) -> str:
    """Returns the unit name of transformer layer ``i``."""
    return f"layer_{i:04d}"


def device_order(plan: Plan, cluster: Cluster) -> list[str]:
    """Returns the plan's devices in cluster order: device i runs as rank i."""
    used = set(plan.devices())
    return [d for d in cluster.devices() if d in used]


def check_runtime_plan(plan: Plan, model: ModelSpec, cluster: Cluster) -> None:
    """Raises InputError unless the runtime can execute ``plan`` for ``model`` on ``cluster``."""
    validate_plan(plan, model, cluster)
    for i, pipe in enumerate(plan.pipelines):
        tps = {s.tp for s in pipe.stages}
        if len(tps) > 1:
            raise InputError(
                f"pipelines[{i}].stages",
                "the runtime needs one tensor-parallel degree per pipeline, got "
                + ", ".join(map(str, sorted(tps))),
            )
        tp = pipe.stages[0].tp
        if model.kv_heads % tp:
            raise InputError(
                f"pipelines[{i}].stages",
                f"tensor-parallel degree {tp} does not divide the {model.kv_heads} kv heads",
            )
        if any(s.layers == 0 for s in pipe.stages) and len(pipe.stages) > 1:
            raise InputError(f"pipelines[{i}].stages", "the runtime needs >= 1 layer per stage")
        v = plan.virtual_stages if plan.schedule == "Interleaved1F1B" else 1
        for j, s in enumerate(pipe.stages):
            if v > 1 and 0 in s.chunk_layers(v):
                raise InputError(
                    f"pipelines[{i}].stages[{j}].chunks",
                    "the runtime needs >= 1 layer per chunk, got "
                    + ", ".join(map(str, s.chunk_layers(v))),
                )
        if plan.schedule == "Interleaved1F1B":
            m = plan.num_micro_batches(pipe)
            if m < len(pipe.stages):
                raise InputError(
                    f"pipelines[{i}].batch_size",
                    f"Interleaved1F1B needs at least {len(pipe.stages)} micro-batches, got {m}",
                )


def build_layout(
    plan: Plan, model: ModelSpec, cluster: Cluster, order: list[str] | None = None
) -> RuntimeLayout:
    """Returns the layout of ``plan``; device ``order[i]`` runs as rank i (cluster order)."""
    check_runtime_plan(plan, model, cluster)
    order = order or device_order(plan, cluster)
    rank_of = {d: i for i, d in enumerate(order)}
    v = plan.virtual_stages if plan.schedule == "Interleaved1F1B" else 1
    places: dict[int, RankPlace] = {}
    offset = 0
    for r, pipe in enumerate(plan.pipelines):
        p = len(pipe.stages)
        # virtual stage (chunk c of stage j) = c * p + j; layers follow virtual-stage order,
        # each chunk with its own layer count (even unless the stage lists its chunks)
        chunks: dict[int, list[Chunk]] = {j: [] for j in range(p)}
        start = 0
        sizes = [stage.chunk_layers(v) for stage in pipe.stages]
        for c in range(v):
            for j in range(p):
                n = sizes[j][c]
                s = c * p + j
                last = s == p * v - 1
                chunks[j].append(Chunk(s, start, start + n, s == 0, last, model.tie_embeddings))
                start += n
        for j, stage in enumerate(pipe.stages):
            tp_ranks = tuple(rank_of[d] for d in stage.devices)
            for t, dev in enumerate(stage.devices):
                pp_ranks = tuple(rank_of[st.devices[t]] for st in pipe.stages)
                places[rank_of[dev]] = RankPlace(
                    rank=rank_of[dev],
                    device=dev,
                    replica=r,
                    stage=j,
                    tp_index=t,
                    tp_ranks=tp_ranks,
                    pp_ranks=pp_ranks,
                    chunks=tuple(chunks[j]),
                    num_virtual_stages=p * v,
                    batch_offset=offset,
                    batch_size=pipe.batch_size,
                    micro_batches=plan.num_micro_batches(pipe),
                )
        offset += pipe.batch_size
    ordered = [places[i] for i in range(len(order))]
    layout = RuntimeLayout(ordered, rank_of)
    layout.sync_groups = _sync_groups(ordered, model)
    return layout


def _sync_groups(places: list[RankPlace], model: ModelSpec) -> list[SyncGroup]:
    units = [EMBED, EMBED_TOK] + [layer_unit(i) for i in range(model.layers)] + [HEAD]
    holders: dict[str, list[RankPlace]] = {u: [] for u in units}
    for p in places:
        for u in dict.fromkeys(u for c in p.chunks for u in c.sync_units()):
            holders[u].append(p)
    by_key: dict[tuple[tuple[int, ...], bool], list[str]] = {}
    for u in units:
        hs = holders[u]
        tps = {h.tp for h in hs}
        if len(tps) == 1:
            # one group per TP index: the shards at that index across replicas
            for t in range(tps.pop()):
                ranks = tuple(sorted(h.rank for h in hs if h.tp_index == t))
                by_key.setdefault((ranks, True), []).append(u)
        else:
            ranks = tuple(sorted(h.rank for h in hs))
            by_key.setdefault((ranks, False), []).append(u)
    return [
        SyncGroup(ranks, tuple(us), sharded)
        for (ranks, sharded), us in by_key.items()
        if len(ranks) > 1
    ]

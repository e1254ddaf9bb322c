"""What a user may impose on the search: degrees, micro-batch, chunks, ZeRO, recomputation,
schedule, sequence parallelism, flash attention, GPU types and memory headroom.

A single value pins a knob, a list (``1,2,4``) or a range (``2..16``) limits it. The
searches take the limits as their knob domains and also check every plan they record
against ``PlanConstraints.violation``, so the best plan under constraints is the best of
the plans that satisfy them (tested against the unconstrained ranking, filtered)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from hetplan.cluster import Cluster
from hetplan.errors import InputError, shown
from hetplan.model import ModelSpec
from hetplan.plan import RECOMPUTE, SCHEDULES, Plan
from hetplan.search.homogeneous_candidates import SearchSpace, tp_splits_model

MAX_RANGE = 1 << 20
"""The widest range a knob may be given (``1..1048576``): more is a typo."""


def parse_ints(option: str, text: str | None, lowest: int = 1) -> tuple[int, ...] | None:
    """Returns the values of ``8``, ``1,2,4`` or ``2..16`` (sorted, no repeats); None for no
    text. Bad text raises an InputError naming ``option``."""
    if text is None:
        return None
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo_text, dots, hi_text = part.partition("..")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dots else lo
        except ValueError:
            raise InputError(
                option, f"{shown(text)} is not a number, a list like 1,2,4 or a range like 2..16"
            ) from None
        if lo < lowest or hi < lo:
            raise InputError(option, f"{shown(part)}: values must be >= {lowest}, ranges low..high")
        if hi - lo > MAX_RANGE:
            raise InputError(option, f"{shown(part)}: a range of at most {MAX_RANGE} values")
        values.update(range(lo, hi + 1))
    return tuple(sorted(values))


def parse_names(option: str, text: str | None, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    """Returns the names of a comma list, each matched case-insensitively to ``allowed``."""
    if text is None:
        return None
    by_lower = {a.lower(): a for a in allowed}
    out = []
    for part in text.split(","):
        name = by_lower.get(part.strip().lower())
        if name is None:
            raise InputError(option, f"{shown(part.strip())} is not one of {', '.join(allowed)}")
        if name not in out:
            out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class PlanConstraints:
    """Limits on the plans a search may return (None: free)."""

    tp: tuple[int, ...] | None = None
    """Every stage's tensor-parallel degree is one of these."""
    pp: tuple[int, ...] | None = None
    """Every pipeline's number of stages is one of these."""
    dp: tuple[int, ...] | None = None
    """The number of pipelines (data-parallel replicas) is one of these."""
    micro_batch: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] | None = None
    """Model chunks per stage (1 for 1F1B and GPipe)."""
    zero_stage: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    schedule: tuple[str, ...] | None = None
    sequence_parallel: bool | None = None
    flash_attention: bool | None = None
    gpu_types: tuple[str, ...] | None = None
    """Only nodes of these GPU types are used (the cluster is cut to them)."""
    memory_headroom: float = 0.0
    """Share of each GPU's memory a plan must leave free."""
    max_gpus: int | None = None
    """At most this many GPUs: ``plan`` uses the cluster's first nodes holding at most this
    many; ``provision`` rents no more."""
    overlap_tp_comm: bool = False
    """Every plan overlaps its TP collectives with the TP matmuls (``Plan.overlap_tp_comm``:
    hidden only with sequence parallelism, by the fitted ``tp_overlap`` share); not a
    limit but a plan option every search gives its plans."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.memory_headroom < 1.0:
            raise InputError("--memory-headroom", "must be a fraction in [0, 1), e.g. 0.1")
        if self.max_gpus is not None and self.max_gpus < 1:
            raise InputError("--max-gpus", "must be a positive integer")
        if self.zero_stage and max(self.zero_stage) > 3:
            raise InputError("--zero-stage", "ZeRO stages are 0, 1, 2 and 3")

    @property
    def active(self) -> bool:
        """Whether anything is constrained."""
        return self != PlanConstraints()

    def described(self) -> list[str]:
        """Returns each constraint as the option a user gave, e.g. ``--tp 8``."""
        return [text for text, _, _ in self.relaxations()]

    def relaxations(self) -> list[tuple[str, str, PlanConstraints]]:
        """Returns, per constraint given, its text (``--tp 8``), its option (``--tp``) and
        these constraints without it."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            option = "--" + ("micro-batch-size" if f.name == "micro_batch" else
                             f.name.replace("_", "-"))  # fmt: skip
            if isinstance(value, bool):
                text = option if value else option.replace("--", "--no-", 1)
            elif isinstance(value, float | int):
                text = f"{option} {value:g}"
            else:
                text = f"{option} {_compact(value)}"
            changes: dict[str, Any] = {f.name: f.default}
            out.append((text, option, replace(self, **changes)))
        return out

    def obstacle(
        self, option: str, model: ModelSpec, node_gpus: int, total_gpus: int, batch: int = 0
    ) -> str | None:
        """Returns why no value the limit ``option`` allows can be, whatever the other
        knobs, where the model and the hardware's size alone say so (nodes of at most
        ``node_gpus`` GPUs, ``total_gpus`` in all), or None: a tensor-parallel group inside
        one node, splitting the heads, the key-value heads and the MLP evenly; a stage per
        layer and GPU at most; a GPU per replica; micro-batches that fill the ``batch`` (its
        sequences; 0: not known) in whole ones."""
        if option == "--tp" and self.tp:
            reasons = []
            for t in self.tp:
                if t > node_gpus:
                    reasons.append(f"TP {t} needs {t} GPUs in one node, and the largest has "
                                   f"{node_gpus}")  # fmt: skip
                    continue
                if tp_splits_model(model, t):  # the searches' own rule
                    return None
                kv = model.kv_heads if t % model.kv_heads else t  # t: replicated in groups
                parts = [(model.heads, "attention heads"), (kv, "key-value heads"),
                         (model.ffn, "MLP width")]  # fmt: skip
                uneven = [f"{n:,} {what}" for n, what in parts if n % t]
                reasons.append(f"TP {t} does not divide {model.name}'s {' or '.join(uneven)}")
            return "; ".join(reasons)
        if option == "--pp" and self.pp and min(self.pp) > min(model.layers, total_gpus):
            return (f"every stage the searches make holds a layer and a GPU, and "
                    f"{model.name} has {model.layers} layers on {total_gpus} GPUs")  # fmt: skip
        if option == "--dp" and self.dp and min(self.dp) > total_gpus:
            return f"every replica needs a GPU, and there are {total_gpus} GPUs"
        sizes = self.micro_batch or ()
        if option == "--micro-batch-size" and batch and sizes and all(batch % mb for mb in sizes):
            return (
                "every replica runs whole micro-batches and the replicas' shares add up to "
                f"the batch of {batch} sequences, which {' or '.join(map(str, sizes))} does "
                "not divide"
            )
        return None

    def violation(self, plan: Plan) -> str | None:
        """Returns the first constraint ``plan`` breaks, as its option name, or None."""
        tps = self.tp
        checks: list[tuple[str, bool]] = [
            ("--tp", tps is None or all(s.tp in tps for p in plan.pipelines for s in p.stages)),
            ("--pp", self.pp is None or all(len(p.stages) in self.pp for p in plan.pipelines)),
            ("--dp", self.dp is None or plan.dp in self.dp),
            ("--micro-batch-size",
             self.micro_batch is None or plan.micro_batch_size in self.micro_batch),
            ("--virtual-stages",
             self.virtual_stages is None or plan.virtual_stages in self.virtual_stages),
            ("--zero-stage", self.zero_stage is None or plan.zero_stage in self.zero_stage),
            ("--recompute", self.recompute is None or plan.recompute in self.recompute),
            ("--schedule", self.schedule is None or plan.schedule in self.schedule),
            ("--sequence-parallel",
             self.sequence_parallel is None or plan.sequence_parallel == self.sequence_parallel),
            ("--flash-attention",
             self.flash_attention is None or plan.flash_attention == self.flash_attention),
            ("--overlap-tp-comm", plan.overlap_tp_comm == self.overlap_tp_comm),
        ]  # fmt: skip
        return next((name for name, ok in checks if not ok), None)

    def allows(self, plan: Plan) -> bool:
        """Returns whether ``plan`` meets every constraint."""
        return self.violation(plan) is None

    def apply_to_cluster(self, cluster: Cluster) -> Cluster:
        """Returns the cluster the search may use: nodes of the allowed GPU types, each GPU's
        memory reduced by the headroom (so every fit check, bound and estimate agrees)."""
        nodes = cluster.nodes
        if self.gpu_types is not None:
            known = {n.gpu.name.lower(): n.gpu.name for n in nodes}
            wanted = set()
            for name in self.gpu_types:
                if name.lower() not in known:
                    raise InputError(
                        "--gpu-types",
                        f"the cluster has no {name} (it has {', '.join(sorted(known.values()))})",
                    )
                wanted.add(known[name.lower()])
            nodes = tuple(n for n in nodes if n.gpu.name in wanted)
        if self.max_gpus is not None:
            kept, total = [], 0
            for n in nodes:
                if total + n.gpus > self.max_gpus:
                    break
                kept.append(n)
                total += n.gpus
            if not kept:
                raise InputError("--max-gpus", f"the first node alone has more than "
                                 f"{self.max_gpus} GPUs")  # fmt: skip
            nodes = tuple(kept)
        if self.memory_headroom > 0.0:
            keep = 1.0 - self.memory_headroom
            nodes = tuple(
                replace(n, gpu=replace(n.gpu, memory_bytes=n.gpu.memory_bytes * keep))
                for n in nodes
            )
        if nodes == cluster.nodes:
            return cluster
        return replace(cluster, nodes=nodes)


def _compact(values: object) -> str:
    """Returns ``1,2,4`` or ``2..16`` for a sorted tuple of ints (names joined by commas)."""
    assert isinstance(values, tuple)
    if values and all(isinstance(v, int) for v in values):
        ints = [int(v) for v in values]
        if len(ints) > 2 and ints == list(range(ints[0], ints[-1] + 1)):
            return f"{ints[0]}..{ints[-1]}"
    return ",".join(str(v) for v in values)


def constraints_from_options(
    tp: str | None = None,
    pp: str | None = None,
    dp: str | None = None,
    micro_batch_size: str | None = None,
    virtual_stages: str | None = None,
    zero_stage: str | None = None,
    recompute: str | None = None,
    schedule: str | None = None,
    sequence_parallel: bool | None = None,
    flash_attention: bool | None = None,
    gpu_types: str | None = None,
    memory_headroom: float | None = None,
    max_gpus: int | None = None,
    overlap_tp_comm: bool = False,
) -> PlanConstraints:
    """Returns the constraints of the CLI's options (text as the user typed it)."""
    types = None
    if gpu_types is not None:
        types = tuple(t.strip() for t in gpu_types.split(",") if t.strip())
        if not types:
            raise InputError("--gpu-types", "give one or more GPU type names, e.g. A100-80GB,T4")
    return PlanConstraints(
        tp=parse_ints("--tp", tp),
        pp=parse_ints("--pp", pp),
        dp=parse_ints("--dp", dp),
        micro_batch=parse_ints("--micro-batch-size", micro_batch_size),
        virtual_stages=parse_ints("--virtual-stages", virtual_stages),
        zero_stage=parse_ints("--zero-stage", zero_stage, lowest=0),
        recompute=parse_names("--recompute", recompute, RECOMPUTE),
        schedule=parse_names("--schedule", schedule, SCHEDULES),
        sequence_parallel=sequence_parallel,
        flash_attention=flash_attention,
        gpu_types=types,
        memory_headroom=0.0 if memory_headroom is None else memory_headroom,
        max_gpus=max_gpus,
        overlap_tp_comm=overlap_tp_comm,
    )


T = TypeVar("T")


def narrow(allowed: tuple[T, ...] | None, current: tuple[T, ...]) -> tuple[T, ...]:
    """Returns the values of ``current`` a constraint allows (all of them for None)."""
    return current if allowed is None else tuple(x for x in current if x in allowed)


def _meet(
    allowed: tuple[int, ...] | None, current: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    if allowed is None:
        return current
    if current is None:
        return allowed
    return tuple(x for x in current if x in allowed)


def require_mixed_schedule(c: PlanConstraints, what: str) -> None:
    """Raises naming --schedule when the constraints allow only GPipe, which the search of
    ``what`` (mixed clusters, mixes) does not cover: it runs 1F1B and Interleaved1F1B."""
    if c.schedule is not None and not {"1F1B", "Interleaved1F1B"} & set(c.schedule):
        raise InputError("--schedule", f"the search of {what} runs 1F1B and Interleaved1F1B; "
                         "GPipe is searched on one GPU type")  # fmt: skip


def homogeneous_space(c: PlanConstraints, base: SearchSpace | None = None) -> SearchSpace:
    """Returns the homogeneous search's space narrowed to the constraints."""
    base = base or SearchSpace()
    sp = base.sequence_parallel
    if c.sequence_parallel is not None:
        sp = tuple(x for x in sp if x == c.sequence_parallel)
    return replace(
        base,
        tp=_meet(c.tp, base.tp),
        pp=_meet(c.pp, base.pp),
        dp=_meet(c.dp, base.dp),
        micro_batch=_meet(c.micro_batch, base.micro_batch),
        virtual_stages=_meet(c.virtual_stages, base.virtual_stages),
        recompute=narrow(c.recompute, base.recompute),
        zero_stages=narrow(c.zero_stage, base.zero_stages),
        # GPipe holds every micro-batch's activations for 1F1B's time: searched when asked
        schedules=narrow(c.schedule, base.schedules)
        + (("GPipe",) if c.schedule and "GPipe" in c.schedule else ()),
        sequence_parallel=sp,
        overlap_tp_comm=c.overlap_tp_comm,
    )

"""The knob space of the heterogeneous search: the micro-batches, tensor-parallel degrees,
bands of data-parallel degrees, schedules and ZeRO stages it tries, and the identity and
preference order of its plans (pipelines in one order; simpler plans first on ties)."""

from __future__ import annotations

import itertools
import math
from dataclasses import fields
from operator import attrgetter

from hetplan.model import ModelSpec
from hetplan.plan import RECOMPUTE, Pipeline, Plan
from hetplan.search.grouping import DeviceClass
from hetplan.search.hashed import Hashed
from hetplan.search.homogeneous_candidates import divisors

MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL_STAGES = 8


def tp_options(model: ModelSpec, cls: DeviceClass) -> list[int]:
    """Returns the tensor-parallel degrees a class may use (divide its nodes and the heads)."""
    return [
        t
        for t in divisors(cls.gpus_per_node)
        if not (model.heads % t or model.ffn % t or (model.kv_heads % t and t % model.kv_heads))
    ]


def tp_configs(
    model: ModelSpec, classes: list[DeviceClass], around: int | None = None
) -> list[tuple[int, ...]]:
    """Returns per-class TP degrees: the symmetric ones (``around`` None), or those with one
    class off the symmetric degree ``around`` (all combinations when there are few)."""
    opts = [tp_options(model, c) for c in classes]
    common = sorted(set.intersection(*(set(o) for o in opts)))
    if around is None:
        return [tuple([t] * len(classes)) for t in common]
    if math.prod(len(o) for o in opts) <= 16:
        return [c for c in itertools.product(*opts) if len(set(c)) > 1]
    out = []
    for k, o in enumerate(opts):
        for alt in o:
            if alt != around:
                cfg = [around] * len(classes)
                cfg[k] = alt
                out.append(tuple(cfg))
    return out


def dp_bands(max_pipelines: int) -> list[tuple[int, int]]:
    """Returns data-parallel bands [1,1], [2,3], [4,7], ... up to ``max_pipelines``."""
    out, lo = [], 1
    while lo <= max_pipelines:
        out.append((lo, min(2 * lo - 1, max_pipelines)))
        lo *= 2
    return out


def schedule_options(layers: int) -> list[tuple[str, int]]:
    """Returns (schedule, chunks per stage): 1F1B, and Interleaved1F1B with every chunk
    count that splits the layers (each stage's layers must split into them)."""
    out = [("1F1B", 1)]
    out += [("Interleaved1F1B", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if layers % v == 0]
    return out


def zero_choices(dp: int) -> tuple[int, ...]:
    """Returns the ZeRO stages a plan of ``dp`` pipelines may use (one pipeline: none, as
    any stage would shard nothing)."""
    return (0,) if dp == 1 else (0, 1, 2, 3)


def pipeline_key(p: Pipeline) -> tuple[object, ...]:
    return (p.batch_size, tuple((s.layers, s.devices) for s in p.stages))


_KNOBS = attrgetter(*(f.name for f in fields(Plan) if f.compare and f.name != "pipelines"))
"""A plan's compared fields but its pipelines, as one tuple."""


def seen_key(
    plan: Plan, order: dict[int, Hashed] | None = None, ordered: bool = False
) -> tuple[Hashed, object]:
    """Returns the key of the search's set of plans seen: the plan's pipelines in one order
    (``estimate`` does not depend on their order), hashed once, and its other fields.
    ``order``: a memo of the ordered pipelines by the id of the plan's (twins share them),
    which keeps each tuple, so its id stays its own; ``ordered``: the plan's pipelines are
    in that order already."""
    if ordered:
        return Hashed(plan.pipelines), _KNOBS(plan)
    hit = None if order is None else order.get(id(plan.pipelines))
    if hit is None or hit.source is not plan.pipelines:
        hit = Hashed(tuple(sorted(plan.pipelines, key=pipeline_key)), plan.pipelines)
        if order is not None:
            if len(order) >= 4096:
                order.clear()
            order[id(plan.pipelines)] = hit
    return hit, _KNOBS(plan)


def tiebreak(plan: Plan) -> tuple[object, ...]:
    # on equal estimates prefer simpler plans: less recomputation, lower ZeRO, fewer
    # chunks, no sequence parallelism, fewer pipelines
    rc = RECOMPUTE.index(plan.recompute)
    return (rc, plan.zero_stage, plan.virtual_stages, plan.sequence_parallel, plan.dp)

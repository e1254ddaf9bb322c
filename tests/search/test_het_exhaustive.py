"""The heterogeneous search's first plan against an exhaustive enumeration by ``estimate``.

The enumerator builds ``Plan`` objects itself from the definition of the search's space
(``hetplan.search.heterogeneous`` docstring), with nothing from the search: per GPU type a
tensor-parallel degree, micro-batch 1/2/4/8, every recomputation, 1F1B or Interleaved1F1B
with every chunk count, ZeRO 0-3 (ZeRO only with two pipelines or more), sequence
parallelism on and off where a stage has TP > 1; any multiset of pipelines, each a
sequence of stages whose GPU types form contiguous blocks, any contiguous layer split, any
batch share, and any injective placement of stages on TP groups. Every plan that
``validate_plan`` accepts is estimated; the best that fits is the reference. The search's
pool also holds the single-type and uniform baselines, so it may only be at least as good.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from hetplan.cluster import Cluster, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage, validate_plan

TOL = 1e-9


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(total: int, parts: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0, *cuts, total)
        out.append(tuple(b[i + 1] - b[i] for i in range(parts)))
    return out


def _contiguous(seq: tuple[str, ...]) -> bool:
    seen: list[str] = []
    for g in seq:
        if seen and seen[-1] == g:
            continue
        if g in seen:
            return False
        seen.append(g)
    return True


@dataclass
class Best:
    time_s: float = math.inf
    plan: Plan | None = None
    scored: int = 0


def _groups(cluster: Cluster, gpu: str, tp: int) -> list[tuple[str, ...]]:
    out = []
    for node in cluster.nodes:
        if node.gpu.name != gpu:
            continue
        devs = [f"{node.name}:{i}" for i in range(node.gpus)]
        out += [tuple(devs[i : i + tp]) for i in range(0, node.gpus - tp + 1, tp)]
    return out


def exhaustive(
    model: ModelSpec,
    cluster: Cluster,
    batch: int,
    precision: str,
    params: CostParams,
    keep: Callable[[Plan], bool] | None = None,
) -> Best:
    """Returns the best plan of the space by estimate() (of those ``keep`` accepts)."""
    best = Best()
    for plan in plans(model, cluster, batch, precision):
        if keep is not None and not keep(plan):
            continue
        try:
            validate_plan(plan, model, cluster)
        except InputError:
            continue
        est = estimate(plan, model, cluster, params, validate=False)
        best.scored += 1
        if est.fits and est.iteration_time_s < best.time_s:
            best.time_s, best.plan = est.iteration_time_s, plan
    return best


def plans(model: ModelSpec, cluster: Cluster, batch: int, precision: str):
    """Yields every plan of the space (validation left to the caller)."""
    types = sorted({n.gpu.name for n in cluster.nodes if n.gpu.supports(precision)})
    gpn = {t: next(n.gpus for n in cluster.nodes if n.gpu.name == t) for t in types}
    for tps in itertools.product(*(_divisors(gpn[t]) for t in types)):
        tp_of = dict(zip(types, tps, strict=True))
        groups = {t: _groups(cluster, t, tp_of[t]) for t in types}
        # every pipeline shape: a sequence of GPU types in contiguous blocks, and a split
        shapes = []
        for p in range(1, model.layers + 1):
            for seq in itertools.product(types, repeat=p):
                if not _contiguous(seq) or any(seq.count(t) > len(groups[t]) for t in types):
                    continue
                for split in _splits(model.layers, p):
                    shapes.append((seq, split))
        for mb in (1, 2, 4, 8):
            if batch % mb:
                continue
            total = batch // mb
            for d in range(1, total + 1):
                for combo in itertools.combinations_with_replacement(range(len(shapes)), d):
                    need = {t: sum(shapes[i][0].count(t) for i in combo) for t in types}
                    if any(need[t] > len(groups[t]) for t in types):
                        continue
                    yield from _selection(batch, precision, mb, total,
                                          [shapes[i] for i in combo], groups)  # fmt: skip


def _shares(total: int, n: int):
    for cuts in itertools.combinations(range(1, total), n - 1):
        b = (0, *cuts, total)
        yield tuple(b[i + 1] - b[i] for i in range(n))


def _placements(pipes, groups):
    """Yields every injective map of stages to TP groups of their type (distinct plans
    only up to the order of the groups inside one node)."""
    slots = [(r, j, t) for r, (seq, _) in enumerate(pipes) for j, t in enumerate(seq)]
    seen = set()
    per_type = {}
    for t in groups:
        mine = [(r, j) for r, j, tt in slots if tt == t]
        per_type[t] = [dict(zip(mine, pick, strict=True))
                       for pick in itertools.permutations(groups[t], len(mine))]  # fmt: skip
    for choice in itertools.product(*per_type.values()):
        out = {}
        for part in choice:
            out.update(part)
        # a stage's node is all that matters about its group: skip relabelled duplicates
        key = tuple(sorted((k, v[0].rpartition(":")[0]) for k, v in out.items()))
        if key in seen:
            continue
        seen.add(key)
        yield out


def _selection(batch, precision, mb, total, pipes, groups):
    d = len(pipes)
    for ms in _shares(total, d):
        for place in _placements(pipes, groups):
            pipelines = tuple(
                Pipeline(m * mb, tuple(Stage(x, place[(r, j)]) for j, x in enumerate(split)))
                for r, ((_, split), m) in enumerate(zip(pipes, ms, strict=True))
            )
            any_tp = any(s.tp > 1 for p in pipelines for s in p.stages)
            scheds = [("1F1B", 1)] + [("Interleaved1F1B", v) for v in range(2, 9)]
            for rc in ("none", "selective", "full"):
                for zero in (0,) if d == 1 else (0, 1, 2, 3):
                    for sched, v in scheds:
                        for sp in (False, True) if any_tp else (False,):
                            yield Plan(batch, mb, pipelines, precision=precision, recompute=rc,
                                       zero_stage=zero, schedule=sched, virtual_stages=v,
                                       sequence_parallel=sp)  # fmt: skip


def test_the_enumeration_covers_the_space():
    """Spot checks of the enumerator itself, so that matching it means something."""
    model = ModelSpec("tiny", "gpt", 4, 1024, 16, 16, 4096, 32000, 512)
    cluster = parse_inline_cluster("A100-40GB:1x2,T4:2x1")
    seen = set()
    kinds = set()
    for plan in plans(model, cluster, 4, "fp16"):
        try:
            validate_plan(plan, model, cluster)
        except InputError:
            continue
        kinds.add((plan.zero_stage, plan.schedule, plan.virtual_stages, plan.sequence_parallel,
                   plan.recompute))  # fmt: skip
        seen.add(tuple(sorted(
            (p.batch_size, tuple((s.layers, s.devices) for s in p.stages)) for p in plan.pipelines
        )))  # fmt: skip
    assert {k[0] for k in kinds} == {0, 1, 2, 3}
    assert {(k[1], k[2]) for k in kinds} == {("1F1B", 1), ("Interleaved1F1B", 2),
                                              ("Interleaved1F1B", 4)}  # fmt: skip
    assert {k[3] for k in kinds} == {False, True}
    assert {k[4] for k in kinds} == {"none", "selective", "full"}
    a, t0, t1 = "a100-40gb-0", "t4-0", "t4-1"
    # T4 stages on either node, in either order around the A100 block, and two pipelines
    assert ((4, ((2, (f"{a}:0",)), (1, (f"{t0}:0",)), (1, (f"{t1}:0",)))),) in seen
    assert ((4, ((1, (f"{t1}:0",)), (3, (f"{a}:0", f"{a}:1")))),) in seen
    two = ((2, ((4, (f"{a}:0",)),)), (2, ((2, (f"{t0}:0",)), (2, (f"{t1}:0",)))))
    assert tuple(sorted(two)) in seen


CASES = [
    # (layers, hidden, sequence, cluster, batch): each best plan mixes GPU types or spreads
    # one type's stages over nodes (placement matters)
    (4, 4096, 1024, "L4:2x1,V100-32GB:1x1", 4),
    (4, 4096, 1024, "L4:1x1,T4:2x1", 4),
    (3, 2048, 2048, "V100-32GB:1x2,A10:1x2", 4),
    (3, 4096, 1024, "A10:1x1,L4:1x2", 4),
    (4, 4096, 2048, "V100-32GB:2x1,L4:1x1", 4),
    (3, 2048, 2048, "V100-32GB:2x1,T4:1x1", 8),
    (4, 1024, 512, "A100-40GB:1x2,V100-16GB:1x2", 4),
]


@pytest.mark.parametrize(("layers", "hidden", "seq", "spec", "batch"), CASES)
def test_first_plan_is_the_exhaustive_best(layers, hidden, seq, spec, batch):
    from hetplan.search.heterogeneous import search_heterogeneous

    model = ModelSpec("tiny", "gpt", layers, hidden, 16, 16, 4 * hidden, 32000, seq)
    cluster = parse_inline_cluster(spec)
    params = default_params()
    want = exhaustive(model, cluster, batch, "fp16", params)
    assert want.plan is not None
    res = search_heterogeneous(model, cluster, batch, "fp16", 1, params)
    assert res.proven, res.notes
    got = res.ranked[0][0]
    validate_plan(got, model, cluster)
    again = estimate(got, model, cluster, params)
    assert again.fits
    assert again.iteration_time_s <= want.time_s * (1 + TOL), (got, want.plan)
    # a ceiling a hair above the best keeps it (the bounds it prunes by are true); a hair
    # below, the search proves that nothing beats it, estimating no more plans on the way,
    # and returns no plan
    t0 = res.ranked[0][1].iteration_time_s
    above = search_heterogeneous(
        model, cluster, batch, "fp16", 1, params, ceiling_s=t0 * (1 + 1e-6)
    )
    assert above.proven and above.ranked[0][1].iteration_time_s == pytest.approx(t0, rel=1e-12)
    below = search_heterogeneous(
        model, cluster, batch, "fp16", 1, params, ceiling_s=t0 * (1 - 1e-6)
    )
    assert not below.ranked  # nothing slower than the ceiling, the baselines neither
    assert below.evaluated <= res.evaluated

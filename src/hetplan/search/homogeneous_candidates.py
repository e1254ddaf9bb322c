"""The homogeneous search's space: which knobs it may turn (``SearchSpace``), every point
that passes the divisibility rules (``enumerate_candidates``; memory is the scorer's,
``homogeneous_scoring``), the uniform plan of a point and the order that prefers simpler
plans on ties."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from hetplan.chunk_layout import lightened_chunks
from hetplan.cluster import Cluster
from hetplan.cost.schedule import interleave_fits
from hetplan.cost.sharding import dominated_by_zero1
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.search.layout import even_layer_split, share_counts, uniform_plan


def divisors(n: int) -> list[int]:
    """Returns the positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Candidate:
    """One point of the homogeneous search space."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: str
    zero_stage: int
    schedule: str
    virtual_stages: int
    sequence_parallel: bool
    lightened: bool = False
    """Interleaved with the first and last stages one layer lighter than the others (in
    the chunk beside the embedding and the head; Llama 3 405B's layout), where the
    layers do not split evenly into equal chunks (``lightened_chunks``)."""


def lightens(layers: int, pp: int, v: int) -> bool:
    """Returns whether ``layers`` fill ``pp`` stages of ``v`` equal chunks but for one layer
    less on the first and the last stage (``layers + 2 = pp * v * n``, n >= 1). With n = 1
    the first chunk holds only the embedding and the last only the head, as Meta states
    of Llama 3 405B (126 layers, PP 16, V 8)."""
    return pp > 1 and v > 1 and (layers + 2) % (pp * v) == 0


@dataclass(frozen=True)
class SearchSpace:
    """Which knobs the search may turn."""

    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_virtual_stages: int = 8
    sequence_parallel: tuple[bool, ...] = (False, True)
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B")
    virtual_stages: tuple[int, ...] | None = None
    """Model chunks per stage allowed (1: not interleaved); None: 1..max_virtual_stages."""
    overlap_grad_reduce: bool = True
    """Plan option of every candidate: gradient reduction overlapped with the backward."""
    overlap_tp_comm: bool = False
    """Plan option of every candidate: TP collectives overlapped with the TP matmuls."""
    zero0_has_twin: bool = False
    """Leave ZeRO-0 out where its ZeRO-1 twin is in the space: plans of several replicas
    (the twin moves no more, holds less and steps a sharded optimizer). One replica keeps
    ZeRO-0, its only choice (provisioning's space)."""


def tp_splits_model(model: ModelSpec, tp: int) -> bool:
    """Returns whether ``tp`` ranks split the attention heads and the MLP evenly (KV heads
    split too, or are replicated across groups of ranks)."""
    return not (model.heads % tp or model.ffn % tp or (model.kv_heads % tp and tp % model.kv_heads))


def no_layout_reason(model: ModelSpec, num_gpus: int, gpus_per_node: int, batch: int) -> str:
    """Returns why ``enumerate_candidates`` yields nothing for ``num_gpus`` GPUs whatever the
    knobs: more GPUs than any layout uses, or a count that does not factor by its rules."""
    tps = [tp for tp in divisors(gpus_per_node) if tp_splits_model(model, tp)]
    most = max(tps) * model.layers * batch
    if num_gpus > most:
        return (
            f"{model.name} with a batch of {batch} sequences uses at most {most:,} GPUs "
            f"(TP {max(tps)} x PP {model.layers} layers x DP {batch}), the cluster has "
            f"{num_gpus:,}: --max-gpus plans on fewer"
        )
    per_node = f"{gpus_per_node} GPUs per node" if gpus_per_node > 1 else "one GPU per node"
    return (
        f"{num_gpus:,} GPUs do not factor as TP x PP x DP with TP one of "
        f"{', '.join(map(str, tps))} (dividing {per_node} and the model's heads), PP at most "
        f"the {model.layers} layers and DP at most the batch of {batch}: --max-gpus plans on "
        f"fewer"
    )


def enumerate_candidates(
    model: ModelSpec,
    num_gpus: int,
    gpus_per_node: int,
    global_batch: int,
    space: SearchSpace,
    overflows: Callable[[int, int, int, int], bool] | None = None,
) -> Iterator[Candidate]:
    """Yields every candidate that passes divisibility rules (not memory). ``overflows``:
    also leaves out the (TP, PP, DP, ZeRO stage) it says no candidate of can fit."""
    zero1 = 1 in space.zero_stages  # else ZeRO-0 has no ZeRO-1 twin
    for tp in divisors(gpus_per_node):
        if space.tp and tp not in space.tp:
            continue
        if not tp_splits_model(model, tp):
            continue
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp]
        for pp in divisors(num_gpus // tp):
            if pp > model.layers or (space.pp and pp not in space.pp):
                continue
            dp = num_gpus // (tp * pp)
            if dp > global_batch or (space.dp and dp not in space.dp):
                continue
            # the ZeRO stages whose state alone overflows at these degrees (asked once)
            full = {z for z in space.zero_stages if overflows and overflows(tp, pp, dp, z)}
            # where dp does not divide the batch, its micro-batches spread as evenly as
            # they go (``layout.replica_shares``): every GPU still runs a replica
            if global_batch % dp == 0:
                mbs = divisors(global_batch // dp)
            else:
                mbs = [x for x in divisors(global_batch) if global_batch // x >= dp]
            for mb in mbs:
                if space.micro_batch and mb not in space.micro_batch:
                    continue
                # the replicas' micro-batch counts (``layout.replica_shares``)
                q, r = share_counts(global_batch, dp, mb)
                counts = {q, q + 1} if r else {q}
                schedules: list[tuple[str, int]] = [("1F1B", 1)]
                if (pp > 1 and "Interleaved1F1B" in space.schedules
                        and all(interleave_fits(pp, m) for m in counts)):  # fmt: skip
                    min_layers = model.layers // pp
                    top_v = max(space.virtual_stages or (space.max_virtual_stages,))
                    splits = set(even_layer_split(model.layers, pp))
                    for v in range(2, top_v + 1):
                        if v <= min_layers and all(x % v == 0 for x in splits):
                            schedules.append(("Interleaved1F1B", v))
                        elif lightens(model.layers, pp, v):
                            schedules.append(("Interleaved1F1B", -v))
                if "GPipe" in space.schedules:
                    schedules.append(("GPipe", 1))
                if "1F1B" not in space.schedules:
                    schedules = [s for s in schedules if s[0] != "1F1B"]
                if space.virtual_stages is not None:
                    schedules = [s for s in schedules if abs(s[1]) in space.virtual_stages]
                zeros = []
                for zero in space.zero_stages:
                    if zero and dp == 1:
                        continue
                    if zero == 0 and dp > 1 and space.zero0_has_twin and zero1:
                        continue
                    if dominated_by_zero1(zero, dp, pp > 1, len(counts) > 1, space.zero_stages):
                        # pipelined, frameworks run ZeRO-2/3 with ZeRO-1's traffic and no
                        # less memory (DeepSpeed's pipeline engine refuses them; PyTorch's
                        # pipelining stages defer FSDP's gradient sync and resharding to
                        # the last micro-batch), and estimate prices them so
                        # (cost.sharding.deferred_sync; docs/search.md)
                        continue
                    if zero not in full:
                        zeros.append(zero)
                for rc in space.recompute:
                    for zero in zeros:
                        for sched, v in schedules:
                            for sp in sps:
                                yield Candidate(tp, pp, dp, mb, rc, zero, sched, abs(v), sp,
                                                v < 0)  # fmt: skip


def most_micro_batches(global_batch: int, dp: int, micro_batch: int) -> int:
    """Returns the micro-batches of the busiest replica (``layout.replica_shares``)."""
    q, r = share_counts(global_batch, dp, micro_batch)
    return q + (r > 0)


def lighten(plan: Plan, v: int) -> Plan:
    """Returns ``plan`` (an even split over its stages) with each stage's layers in ``v``
    chunks, the first stage's lighter chunk first and the last stage's last."""
    split = [s.layers for s in plan.pipelines[0].stages]
    chunks = lightened_chunks(split, v)
    pipes = tuple(
        Pipeline(
            pipe.batch_size,
            tuple(
                Stage(s.layers, s.devices, ch) for s, ch in zip(pipe.stages, chunks, strict=True)
            ),
        )
        for pipe in plan.pipelines
    )
    return replace(plan, pipelines=pipes)


def candidate_plan(
    model: ModelSpec,
    cluster: Cluster,
    c: Candidate,
    global_batch: int,
    precision: str,
    flash_attention: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_tp_comm: bool = False,
) -> Plan:
    """Returns the uniform plan of a candidate."""
    plan = uniform_plan(
        cluster,
        model.layers,
        c.tp,
        c.pp,
        c.dp,
        c.micro_batch,
        global_batch,
        precision=precision,
        recompute=c.recompute,
        zero_stage=c.zero_stage,
        schedule=c.schedule,
        virtual_stages=c.virtual_stages,
        sequence_parallel=c.sequence_parallel,
        flash_attention=flash_attention,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_tp_comm=overlap_tp_comm,
    )
    return lighten(plan, c.virtual_stages) if c.lightened else plan


def tiebreak(c: Candidate) -> tuple[object, ...]:
    """Returns the sort key that breaks ties between equal times."""
    # prefer simpler plans on ties: less recomputation, lower ZeRO, fewer chunks
    rc = ("none", "selective", "full").index(c.recompute)
    return (rc, c.zero_stage, c.virtual_stages, c.lightened, c.pp, c.tp, -c.micro_batch,
            c.sequence_parallel)  # fmt: skip

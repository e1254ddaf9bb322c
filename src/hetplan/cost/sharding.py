"""Data-parallel traffic as the frameworks issue it: gradient buckets overlapped with the
backward (the last bucket exposed), and ZeRO-2/3 (FSDP) collectives per micro-batch.

ZeRO-2 keeps only a shard of the gradients, so every micro-batch's gradients are
reduce-scattered during its backward (DeepSpeed ZeRO-2, FSDP SHARD_GRAD_OP) and the
updated parameter shards are all-gathered after the optimizer step. ZeRO-3 (FSDP
FULL_SHARD) also shards the parameters: each layer is all-gathered before its forward and
again before its backward, and its gradients are reduce-scattered right after, one
collective per layer per micro-batch (latency paid each time), prefetched one layer ahead.
Ring volumes per member (Rajbhandari et al. 2020): all-gather and reduce-scatter each
(n-1)/n of the data, so ZeRO-3 moves 3x the parameters per micro-batch where plain data
parallelism moves 2x once per step.

With pipelining, no framework runs ZeRO-2/3 that way. DeepSpeed's pipeline engine refuses
them (``deepspeed/runtime/pipe/engine.py``, ``PipelineEngine.__init__``: "ZeRO-2 and ZeRO-3
are incompatible with pipeline parallelism"). PyTorch's pipelining stages, which torchtitan
runs with FSDP2, turn off FSDP's gradient sync and resharding for every micro-batch but the
last (``torch/distributed/pipelining/stage.py``, ``backward_maybe_with_nosync``:
``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``), and
torchtitan also keeps the parameters gathered after the forward when pipelining. Such a
stage gathers its parameters once, holds them and its gradients whole through the step and
reduce-scatters once after the last backward: ZeRO-1's traffic (``deferred_sync``).

ZeRO-3 replicas without pipelining whose batch shares give different micro-batch counts
run the same way (FSDP's ``no_sync`` accumulation, parameters held from the first
forward): per micro-batch, a replica with 3 micro-batches would issue a third gather and
reduce-scatter of every layer that its 2-micro-batch peer never joins. Deferred, each layer
syncs once a step whatever the counts. The runtime runs exactly these plans so
(``runtime/fsdp.py``).
"""

from __future__ import annotations

import math

from hetplan.plan import Plan

BUCKET_PARAMS = 40e6
"""Gradient bucket of Megatron-Core's DDP: max(40M, 1M x DP) parameters."""


def deferred_sync(plan: Plan) -> bool:
    """Returns whether the plan's ZeRO-2/3 run as PyTorch's pipelining runs them: some
    pipeline has several stages, or (ZeRO-3) replicas run different micro-batch counts, so
    gradients and parameters stay whole until the last micro-batch and the step moves
    ZeRO-1's bytes once (module docstring)."""
    counts = {plan.num_micro_batches(p) for p in plan.pipelines}
    pipelined = any(len(p.stages) > 1 for p in plan.pipelines)
    return deferred(plan.zero_stage, plan.dp, pipelined, len(counts) > 1)


def deferred(zero_stage: int, dp: int, pipelined: bool, uneven_counts: bool) -> bool:
    """``deferred_sync`` from a plan's parts: ZeRO stage, pipelines, whether some pipeline
    has several stages, and whether replicas run different micro-batch counts. Such a plan
    costs ZeRO-1's time with no less memory than ZeRO-1: the searches leave it out."""
    if zero_stage < 2 or dp <= 1:
        return False
    return pipelined or (zero_stage == 3 and uneven_counts)


def dominated_by_zero1(
    zero_stage: int, dp: int, pipelined: bool, uneven_counts: bool, allowed: tuple[int, ...]
) -> bool:
    """Returns whether a plan's ZeRO stage is one the searches leave out: ZeRO-2/3 deferred
    to ZeRO-1's traffic (``deferred``) with no less memory, where its ZeRO-1 twin of the same
    degrees is ``allowed`` (a constraint without ZeRO-1 leaves it no twin)."""
    return 1 in allowed and deferred(zero_stage, dp, pipelined, uneven_counts)


def bucket_count(params_local: float, dp: int) -> int:
    """Returns the number of gradient buckets of ``params_local`` parameters."""
    return max(1, math.ceil(params_local / max(BUCKET_PARAMS, 1e6 * dp)))


def exposed_sync_s(t: float, window: float, share: float, overlap: bool, buckets: int) -> float:
    """Returns the part of a gradient reduction of ``t`` seconds left after the last
    backward.

    With overlap, ``buckets`` equal buckets become ready one by one during that backward
    (``window`` seconds) and reduce one after another; a ``share`` of the reduction can run
    concurrently with compute. The last bucket is ready only when the backward ends, so at
    least its reduction is exposed. Without overlap, all of it."""
    if not overlap or t <= 0:
        return t
    n = max(buckets, 1)
    return max(t / n, t - min(share * t, window * (n - 1) / n))


def first_bucket_ready_s(starts: list[float], ends: list[float], buckets: int) -> float:
    """Returns when the first of ``buckets`` equal gradient buckets is ready on every member
    of a reduction whose members' last backward runs from ``starts`` to ``ends``: a bucket is
    reduced once every member has it, so at the latest of the members' first buckets (with
    one bucket, the latest end)."""
    n = max(buckets, 1)
    return max(s + (e - s) / n for s, e in zip(starts, ends, strict=True))


def unhidden_sync_s(t: float, share: float, overlap: bool, buckets: int) -> float:
    """Returns the part of a gradient reduction of ``t`` seconds that runs after the last
    gradient whatever the window: the last bucket's reduction, and the ``1 - share`` that
    cannot run beside compute (all of it without overlap). ``exposed_sync_s`` is the most
    of this and what the window leaves."""
    if not overlap or t <= 0:
        return max(t, 0.0)
    return max(t / max(buckets, 1), (1.0 - share) * t)


def serial_end_s(jobs: list[tuple[float, float]]) -> float:
    """Returns when one link done with ``jobs`` (release time, seconds of work), served in
    release order, finishes: the most over k of the k-th release plus the work released
    then or later. Never earlier for a later release or more work."""
    end = -math.inf
    for release, work in sorted(jobs):
        end = max(end, release) + work
    return end


def zero3_exposed_s(
    gather_s: float,
    scatter_s: float,
    units: int,
    forward_s: float,
    backward_s: float,
    share: float = 1.0,
) -> float:
    """Returns ZeRO-3's per-micro-batch collective time not hidden behind compute.

    ``gather_s``/``scatter_s``: one all-gather of all ``units`` layers' parameters and one
    reduce-scatter of their gradients (summed over the per-layer collectives). Forward:
    layer i+1 is gathered while layer i computes, the first gather is exposed. Backward:
    each layer is gathered again and its gradients reduce-scattered while the next layer's
    backward runs; the first gather and the last reduce-scatter are exposed. Collectives
    running under compute take GPU resources from it: only a ``share`` of them is free, the
    rest lengthens the layer it runs under. With no compute to hide under, every collective
    is exposed: ``units`` x (2 gathers + 1 reduce-scatter)."""
    if units <= 0 or gather_s + scatter_s <= 0:
        return 0.0
    g, r = gather_s / units, scatter_s / units
    f, b = forward_s / units, backward_s / units
    u = units
    fwd = g + (u - 1) * max(f + (1.0 - share) * g, g) + f - u * f
    bwd = g + (u - 1) * max(b + (1.0 - share) * (g + r), g + r) + b + r - u * b
    return fwd + bwd

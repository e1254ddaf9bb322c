"""Proven lower bounds on a rented configuration's iteration time, from the cost model's blocks.

Every plan the searches can return for a configuration (one offer, or two offers mixed) is
priced by ``estimate``. Two facts of ``estimate`` hold for any plan on those GPUs:

* **throughput**: every device runs its share of the layers and the head, each at no more
  than the best fraction of peak any layer or head shape of the plan's micro-batch size
  reaches on its GPU type (over every tensor-parallel degree that divides its node, with
  and without sequence parallelism); the iteration lasts at least as long as the busiest
  device, hence at least ``flops / sum(GPUs x peak x best efficiency)``;
* **critical path**: the replay of the schedule runs each micro-batch's forward through
  every stage in order and its backward back, each stage taking its layers' times (plus
  the embedding on the first stage and the head on the last), so the iteration lasts at
  least one micro-batch's forward and backward through all layers, the embedding and the
  head, each at the fastest time any of the configuration's GPU types reaches for it.

A plan has one micro-batch size, a divisor of the global batch: the bound is, over those
sizes, the least of the larger of the two at that size (a large micro-batch computes
efficiently but lengthens the critical path). Both read ``params.compute``, so a measured profile
moves the bound as it moves the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.cost.params import CostParams
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.search.homogeneous import divisors


@dataclass(frozen=True)
class TypeFloor:
    """What no plan beats on one GPU type, per micro-batch size a plan may use (one per
    plan): ``micro_batches[i]`` is a size, the other fields its floors."""

    micro_batches: tuple[int, ...]
    rate_flops: tuple[float, ...]
    """Model FLOP/s of one GPU at the best efficiency any layer or head shape reaches."""
    layer_s: tuple[float, ...]
    """Fastest forward + backward of one transformer layer for one micro-batch."""
    embed_s: tuple[float, ...]
    """Fastest forward + backward of the embedding for one micro-batch."""
    head_s: tuple[float, ...]
    """Fastest forward + backward of the head (final norm, output layer, loss)."""
    fixed_s: float = 0.0
    """What every stage adds to each micro-batch's forward + backward whatever it computes:
    the fixed cost per micro-batch and the pipelining runtime's cost per action, at one
    model chunk (``estimate.stage_times``; more chunks add more)."""


def micro_batches(global_batch: int) -> list[int]:
    """Returns every micro-batch size a plan may use: the global batch is a whole number of
    micro-batches in both searches, so a divisor of it."""
    return divisors(global_batch)


def type_floor(
    model: ModelSpec,
    gpu: GPUType,
    gpus_per_node: int,
    global_batch: int,
    params: CostParams,
    precision: str,
    flash: bool,
) -> TypeFloor:
    """Returns the floors of ``gpu`` in nodes of ``gpus_per_node`` (memoized), over every
    tensor-parallel degree dividing the node, with and without sequence parallelism."""
    src = params.compute

    def make() -> TypeFloor:
        layer_flops, head_flops = 3 * model.layer_flops(), 3 * model.head_flops()
        cols: list[tuple[float, float, float, float]] = []
        mbs = micro_batches(global_batch)
        for mb in mbs:
            rate = 0.0
            layer = embed = head = float("inf")
            for tp in divisors(gpus_per_node):
                for sp in {False, tp > 1}:
                    lt = src.layer(model, gpu, params, tp, mb, precision, flash, sp).times
                    fb = lt.forward_s + lt.backward_s
                    rate = max(rate, mb * layer_flops / tp / fb)
                    layer = min(layer, fb)
                ht = src.head(model, gpu, params, tp, mb, precision, flash).times
                hb = ht.forward_s + ht.backward_s
                rate = max(rate, mb * head_flops / tp / hb)
                head = min(head, hb)
                et = src.embedding(model, gpu, params, tp, mb, precision, flash).times
                embed = min(embed, et.forward_s + et.backward_s)
            cols.append((rate, layer, embed, head))
        rates, layers, embeds, heads = zip(*cols, strict=True)
        fixed = max(params.gpu(gpu.name).microbatch_overhead_s, 0.0) + 2 * max(
            src.action_overhead_s(gpu), 0.0
        )
        return TypeFloor(tuple(mbs), rates, layers, embeds, heads, fixed)

    key = ("type_floor", model, gpu, gpus_per_node, global_batch, params.gpu(gpu.name),
           precision, flash)  # fmt: skip
    out: TypeFloor = src.cached(key, make)
    return out


def path_floor_s(model: ModelSpec, floors: list[TypeFloor], i: int) -> float:
    """Returns the critical-path floor of an iteration at micro-batch ``floors[.].
    micro_batches[i]`` on GPUs of these types: one micro-batch through every layer, the
    embedding and the head, each on its fastest type, and through at least one stage's
    fixed costs."""
    return (
        model.layers * min(f.layer_s[i] for f in floors)
        + min(f.embed_s[i] for f in floors)
        + min(f.head_s[i] for f in floors)
        + min(f.fixed_s for f in floors)
    )


def iteration_floor_s(
    model: ModelSpec,
    global_batch: int,
    floors: list[TypeFloor],
    gpus: list[np.ndarray],
) -> np.ndarray:
    """Returns the lower bound of the iteration time for every count combination:
    ``gpus[i]`` holds the GPU counts of type ``floors[i]`` (numpy arrays that broadcast).

    A plan has one micro-batch size: the bound at each size is the larger of the
    throughput and critical-path floors at that size, and the plan's time is at least the
    least of these over the sizes.

    Throughput with fixed costs: a device of pipeline r is busy at least m_r (its
    micro-batches) x (its FLOPs per micro-batch / its best rate + its fixed cost), at most
    the iteration T; times its rate and summed over the devices, T x (sum of rates) >= all
    FLOPs + sum of m_r x rate x fixed, and the pipelines' m_r sum to global / micro-batch
    (each pipeline has a device), so the second term is at least that many times the least
    rate x fixed of the types."""
    flops = global_batch * model.model_flops_per_sequence()
    best: np.ndarray | None = None
    for i in range(len(floors[0].micro_batches)):
        rate = sum(f.rate_flops[i] * g for f, g in zip(floors, gpus, strict=True))
        m = global_batch // floors[0].micro_batches[i]
        fixed_work = m * min(f.rate_flops[i] * f.fixed_s for f in floors)
        with np.errstate(divide="ignore"):
            at = np.maximum((flops + fixed_work) / np.asarray(rate, dtype=float),
                            path_floor_s(model, floors, i))  # fmt: skip
        best = at if best is None else np.minimum(best, at)
    assert best is not None
    return best

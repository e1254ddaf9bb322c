"""Peak memory of one device: weights, gradients, optimizer states (ZeRO 0-3) and the
activations of the micro-batches a schedule keeps in flight (Korthikanti et al. 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.model import ModelSpec


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at its peak."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    reserve: float

    @property
    def total(self) -> float:
        """Returns the peak bytes."""
        return self.weights + self.grads + self.optimizer + self.activations + self.reserve


def stage_params(
    model: ModelSpec, layers: int, tp: int, first: bool, last: bool, single_stage: bool
) -> float:
    """Returns the parameters one TP rank of a stage holds."""
    params = layers * model.layer_params() / tp
    if first:
        params += model.embedding_params() / tp
    if last:
        head = model.head_params()
        if model.tie_embeddings and single_stage:
            head -= model.vocab * model.hidden
        params += head / tp
    return params


def state_bytes(
    params_local: float, precision: str, zero_stage: int, dp: int
) -> tuple[float, float, float]:
    """Returns (weights, grads, optimizer) bytes: fp32 main grads, fp32 Adam master/m/v."""
    if precision == "fp32":
        weights, grads, opt = 4 * params_local, 4 * params_local, 8 * params_local
    else:
        weights, grads, opt = 2 * params_local, 4 * params_local, 12 * params_local
    if zero_stage >= 1:
        opt /= dp
    if zero_stage >= 2:
        grads /= dp
    if zero_stage >= 3:
        weights /= dp
    return weights, grads, opt


def stage_activation_bytes(
    model: ModelSpec,
    layers: int,
    tp: int,
    micro_batch: int,
    sequence_parallel: bool,
    recompute: str,
    flash_attention: bool,
    first: bool,
    last: bool,
    in_flight: int,
    v: int,
) -> float:
    """Returns the activation bytes a stage holds at its peak with ``in_flight`` chunks."""
    per_layer = model.layer_activation_bytes(tp, sequence_parallel, recompute, flash_attention)
    chunk = layers / v * per_layer * micro_batch
    out = in_flight * chunk
    chunks_of_first = math.ceil(in_flight / v)
    if first:
        out += (
            chunks_of_first * micro_batch * model.embedding_activation_bytes(tp, sequence_parallel)
        )
    if last:
        # the loss's logits live only between the last chunk's forward and backward
        out += micro_batch * model.head_activation_bytes(tp)
    if recompute == "full" and layers:
        # the layer being recomputed holds its full activations during its backward
        out += micro_batch * model.layer_activation_bytes(
            tp, sequence_parallel, "none", flash_attention
        )
    return out


def zero3_working_bytes(model: ModelSpec, tp: int, precision: str) -> float:
    """Returns the gathered weights ZeRO-3 keeps while computing (two layers, prefetch)."""
    e = 4 if precision == "fp32" else 2
    return 2 * model.layer_params() / tp * e

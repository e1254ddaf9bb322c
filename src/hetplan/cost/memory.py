"""Peak memory of one device: weights, gradients, optimizer states (ZeRO 0-3) and the
activations of the micro-batches a schedule keeps in flight (Korthikanti et al. 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.model import ModelSpec
from hetplan.plan import element_bytes


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


SHARD_GRAD_BYTES = 4.0
"""FSDP's reduce-scattered gradient shard: fp32 (torchtitan reduces in fp32)."""


def edge_params(model: ModelSpec, tp: int, first: bool, last: bool, single_stage: bool) -> float:
    """Returns the embedding and head parameters one TP rank of a stage holds (those of
    ``stage_params`` outside the transformer layers)."""
    return stage_params(model, 0, tp, first, last, single_stage)


def state_bytes(
    params_local: float,
    precision: str,
    zero_stage: int,
    dp: int,
    deferred: bool = False,
    whole_local: float = 0.0,
) -> tuple[float, float, float]:
    """Returns (weights, grads, optimizer) bytes of mixed-precision Adam under ZeRO 0-3.

    ``deferred``: ZeRO-2/3 with pipelining as PyTorch runs them (``sharding.deferred_sync``):
    the parameters gathered and held through the step and the gradients accumulated whole in
    fp32 (FSDP2 upcasts its accumulation to the reduce dtype), so ZeRO-1's table, plus the
    fp32 gradient shard each rank keeps after the one reduce-scatter of the step for the
    optimizer: never less than ZeRO-1.

    ``whole_local``: of ``params_local``, those ZeRO-3 shards per layer does not (the
    embedding and head, ``edge_params``): kept whole with ZeRO-1's sharded optimizer state,
    as the runtime holds them (a tied table on the first and last stage cannot be gathered
    across stages that run at different times) and as ``estimate`` syncs them, once a step.
    """
    if zero_stage == 3 and not deferred and whole_local > 0:
        w3, g3, o3 = state_bytes(params_local - whole_local, precision, 3, dp)
        w1, g1, o1 = state_bytes(whole_local, precision, 1, dp)
        return w3 + w1, g3 + g1, o3 + o1
    if deferred:
        w, g, o = state_bytes(params_local, precision, 1, dp)
        return w, g + SHARD_GRAD_BYTES * params_local / dp, o
    # Megatron-Core distributed-optimizer docs (docs.nvidia.com/megatron-core/developer-guide/
    # latest/distrib_optimizer.html), bytes per parameter, non-distributed / distributed:
    # fp16 params + fp16 grads 20 / 4 + 16/d; bf16 params + fp32 grads 18 / 6 + 12/d;
    # fp32 16 / 8 + 8/d. 16-bit params use fp32 grads (18): the SC'21 fp16 runs fit in
    # 80 GB only so (GPT 1T needs 80.6 GB at 20); the 20-byte fp16-grads variant needs a
    # per-plan framework flag (plan/estimate), not added here.
    if element_bytes(precision) == 4 or zero_stage >= 3:
        # fp32 and tf32 store fp32 weights: no master copy. ZeRO-3 too in every precision:
        # FSDP's fp32 shard is the master, gathered in the low precision only while a layer
        # runs (zero3_working_bytes); 16/d in all, the ZeRO paper's (2 + 2 + 12)/N_d for
        # stage 3 (Rajbhandari et al. 2020, Fig. 1), which DeepSpeed splits as 2-byte weight
        # and gradient shards beside the 12 of the optimizer
        weights, model_grads, main_grads, opt = 4.0, 4.0, 0.0, 8.0
    else:
        weights, model_grads, main_grads, opt = 2.0, 4.0, 0.0, 12.0
    if zero_stage >= 1:
        opt /= dp
        main_grads /= dp
    if zero_stage >= 2:
        model_grads /= dp
    if zero_stage >= 3:
        weights /= dp
    grads = model_grads + main_grads
    return weights * params_local, grads * params_local, opt * params_local


def stage_state(
    model: ModelSpec,
    layers: int,
    tp: int,
    first: bool,
    last: bool,
    single_stage: bool,
    precision: str,
    zero_stage: int,
    dp: int,
    deferred: bool = False,
) -> tuple[float, float, float]:
    """Returns (weights, grads, optimizer) bytes of one device of a stage holding ``layers``
    (``state_bytes`` of its parameters, ZeRO-3's embedding and head whole, and ZeRO-3's
    gathered working layers where it shards per layer; ``deferred``: pipelined ZeRO-2/3,
    ``sharding.deferred_sync``): what ``estimate`` and every search count."""
    p_local = stage_params(model, layers, tp, first, last, single_stage)
    edge = edge_params(model, tp, first, last, single_stage)
    w, g, o = state_bytes(p_local, precision, zero_stage, dp, deferred, edge)
    if zero_stage == 3 and dp > 1 and not deferred:
        w += zero3_working_bytes(model, tp, precision)
    return w, g, o


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
    precision: str = "bf16",
    held: tuple[tuple[int, int], ...] | None = None,
) -> float:
    """Returns the activation bytes a stage holds at its peak with ``in_flight`` chunks
    (``held``: for chunks of different sizes, ``schedule.held_layers`` instead)."""
    layer, embed, head, working = activation_pieces(
        model, tp, micro_batch, sequence_parallel, recompute, flash_attention, precision
    )
    return combine_activation_bytes(layers, layer, embed, head, working, first, last,
                                    in_flight, v, held)  # fmt: skip


def activation_pieces(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    sequence_parallel: bool,
    recompute: str,
    flash_attention: bool,
    precision: str = "bf16",
) -> tuple[float, float, float, float]:
    """Returns one micro-batch's activation bytes per piece: a layer's, the embedding's,
    the head's, and the working layer's under full recomputation (0 otherwise), which
    ``combine_activation_bytes`` weighs by what a stage holds: two settings with the same
    pieces hold the same activations on every stage."""
    e = element_bytes(precision)
    layer = micro_batch * model.layer_activation_bytes(
        tp, sequence_parallel, recompute, flash_attention, e
    )
    embed = micro_batch * model.embedding_activation_bytes(tp, sequence_parallel, e)
    head = micro_batch * model.head_activation_bytes(tp, e)
    working = 0.0
    if recompute == "full":
        working = micro_batch * model.layer_activation_bytes(
            tp, sequence_parallel, "none", flash_attention, e
        )
    return layer, embed, head, working


def held_chunks(
    layers: int, v: int, first: bool, chunks: tuple[int, ...] | None = None
) -> tuple[int, ...] | None:
    """Returns the chunk sizes whose action-order count (``schedule.held_layers``) a stage's
    peak activations need, else None (``in_flight`` chunks of ``layers / v`` suffice): its
    own ``chunks`` where they differ in size; on an interleaved first stage its ``v`` equal
    chunks, since its embedding outputs live per chunk-0 micro-batch and the action order,
    not ``in_flight / v``, says how many are held (with p = 4, v = 2, m = 8, its 11 chunks in
    flight at the peak include chunk 0 of all 8)."""
    if chunks is not None:
        return chunks
    if not first or v <= 1 or layers % v:
        return None
    return (layers // v,) * v


def combine_activation_bytes(
    layers: int,
    layer_bytes: float,
    embed_bytes: float,
    head_bytes: float,
    working_bytes: float,
    first: bool,
    last: bool,
    in_flight: int,
    v: int,
    held: tuple[tuple[int, int], ...] | None = None,
) -> float:
    """Returns a stage's peak activation bytes from one micro-batch's per-piece bytes.

    ``working_bytes``: under full recomputation, the layer being recomputed holds its full
    activations during its backward (0 otherwise). ``held``: where chunks differ in size,
    and on an interleaved first stage (``held_chunks``), the (layers, chunk-0 micro-batches)
    held at the candidate peaks of the stage's action order (``schedule.held_layers``);
    None: ``in_flight`` chunks of ``layers / v`` layers.
    """
    if held is not None:
        out = max(a * layer_bytes + (b * embed_bytes if first else 0.0) for a, b in held)
    else:
        out = in_flight * layers / v * layer_bytes
    if first and held is None:
        out += math.ceil(in_flight / v) * embed_bytes
    if last:
        # the loss's logits live only between the last chunk's forward and backward
        out += head_bytes
    if layers:
        out += working_bytes
    return out


def zero3_working_bytes(model: ModelSpec, tp: int, precision: str) -> float:
    """Returns the gathered weights ZeRO-3 keeps while computing (two layers, prefetch)."""
    return 2 * model.layer_params() / tp * element_bytes(precision)

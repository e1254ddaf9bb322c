"""Pipeline stages and the plan's schedule on torch.distributed.pipelining."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn import functional as F

from hetplan.model import ModelSpec
from hetplan.runtime.layout import Chunk, RankPlace
from hetplan.runtime.precision import LossScaler
from hetplan.runtime.tp import sends_slices


def make_loss_fn(
    micro_batch: int, global_batch: int, scaler: LossScaler | None = None
) -> Callable[..., torch.Tensor]:
    """Returns the micro-batch loss from fp32 logits, pre-scaled by its share of the global
    batch and by the fp16 loss scale (read at each call: it changes between steps)."""
    weight = micro_batch / global_batch

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        scale = scaler.scale if scaler is not None else 1.0
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        return loss * (weight * scale)

    return loss_fn


def _examples(
    chunk: Chunk,
    spec: ModelSpec,
    micro_batch: int,
    precision: str,
    act_dtype: torch.dtype = torch.float32,
    tp: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns meta tensors shaped as a chunk's input and output for one micro-batch: token
    ids or activations in; activations or logits out (in the autocast dtype, as the head's
    linear layer gives them under bf16 or fp16). Activations are ``act_dtype``: fp32 where
    the parameters are (autocast keeps the residual stream in fp32: ZeRO-3 plans), the low
    precision where the modules run on low-precision parameters (``precision.LowParams``,
    ``zero.py``), as Megatron sends them; at TP ``tp`` > 1, this rank's sequence slice
    (``tp.sends_slices``)."""
    meta = torch.device("meta")
    b, s = micro_batch, spec.seq
    sent = s // tp if sends_slices(s, tp) else s
    if chunk.stage_index == 0:
        x = torch.empty(b, s, dtype=torch.int64, device=meta)
    else:
        x = torch.empty(b, sent, spec.hidden, dtype=act_dtype, device=meta, requires_grad=True)
    if chunk.head:
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}
        dtype = low.get(precision, torch.float32)
        y = torch.empty(b, s, spec.vocab, dtype=dtype, device=meta, requires_grad=True)
    else:
        y = torch.empty(b, sent, spec.hidden, dtype=act_dtype, device=meta, requires_grad=True)
    return x, y


class DeferredStage(PipelineStage):
    """A stage whose ZeRO-3 layers sync once a step: before each micro-batch's backward
    the schedule says whether it is this stage's last (``fsdp.set_deferred_sync``)."""

    def __init__(self, submod: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(submod, *args, **kwargs)
        from hetplan.runtime.fsdp import sharded_layers

        self.sharded = sharded_layers(submod)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        from hetplan.runtime.fsdp import set_deferred_sync

        set_deferred_sync(self.sharded, last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def build_schedule(
    schedule: str,
    place: RankPlace,
    modules: list[nn.Module],
    device: torch.device,
    pp_group: Any,
    loss_fn: Callable[..., torch.Tensor],
    spec: ModelSpec,
    precision: str,
    deferred_zero3: bool = False,
    act_dtype: torch.dtype = torch.float32,
) -> Any:
    """Returns the schedule object that runs this rank's chunks of its replica's pipeline.

    Each stage is given its input and output shapes (meta tensors): without them torch's
    pipelining infers them at the first step by running a real forward and backward whose
    graph, one micro-batch of activations, it then keeps for the whole run.
    ``deferred_zero3``: the stages' ZeRO-3 layers sync at the last backward only
    (``DeferredStage``). ``act_dtype``: the activations' dtype between stages
    (``_examples``)."""
    mb = place.batch_size // place.micro_batches
    stages: list[Any] = []
    stage_cls = DeferredStage if deferred_zero3 else PipelineStage
    for m, c in zip(modules, place.chunks, strict=True):
        x, y = _examples(c, spec, mb, precision, act_dtype, place.tp)
        stages.append(
            stage_cls(
                m,
                c.stage_index,
                place.num_virtual_stages,
                device,
                input_args=x,
                output_args=y,
                group=pp_group,
            )
        )
    n = place.micro_batches
    if schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if schedule == "GPipe" else Schedule1F1B
    return cls(stages[0], n, loss_fn=loss_fn, scale_grads=False)


def run_step(sched: Any, place: RankPlace, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Runs one forward/backward over this replica's batch; returns its summed scaled loss."""
    first = any(c.stage_index == 0 for c in place.chunks)
    last = any(c.stage_index == place.num_virtual_stages - 1 for c in place.chunks)
    losses: list[torch.Tensor] = []
    args = (inputs,) if first else ()
    sched.step(*args, target=targets if last else None, losses=losses if last else None)
    return float(sum(float(x.detach()) for x in losses)) if last else 0.0

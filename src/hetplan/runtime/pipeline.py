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

from hetplan.runtime.layout import RankPlace


def make_loss_fn(micro_batch: int, global_batch: int) -> Callable[..., torch.Tensor]:
    """Returns the micro-batch loss, pre-scaled by its share of the global batch."""
    weight = micro_batch / global_batch

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) * weight

    return loss_fn


def build_schedule(
    schedule: str,
    place: RankPlace,
    modules: list[nn.Module],
    device: torch.device,
    pp_group: Any,
    loss_fn: Callable[..., torch.Tensor],
) -> Any:
    """Returns the schedule object that runs this rank's chunks of its replica's pipeline."""
    stages: list[Any] = [
        PipelineStage(m, c.stage_index, place.num_virtual_stages, device, group=pp_group)
        for m, c in zip(modules, place.chunks, strict=True)
    ]
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

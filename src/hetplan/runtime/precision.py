"""Mixed precision as the plan states it.

- fp32: fp32 everywhere (on CUDA, TF32 tensor cores forbidden).
- tf32: fp32 storage, matmuls on TF32 tensor cores (CUDA); on CPU the same math as fp32.
- bf16: ``torch.autocast`` to bfloat16 around every chunk's forward (matmuls and attention
  in bf16); parameters, gradients and AdamW state stay fp32 (the master weights the cost
  model counts); the loss is computed from fp32 logits.
- fp16: as bf16 with float16, plus dynamic loss scaling (Micikevicius et al. 2018): the
  loss is multiplied by a scale S before the backward; the gradients are divided by S
  before clipping and the step; a step whose gradients hold an inf or NaN on any rank is
  skipped and S halved; S doubles after ``growth_interval`` good steps in a row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """Returns the autocast dtype of ``precision`` (None: no autocast)."""
    return AUTOCAST.get(precision)


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Runs the block under the plan's autocast (nothing for fp32 and tf32)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def set_matmul_precision(precision: str, device: torch.device) -> None:
    """Lets fp32 matmuls use TF32 tensor cores for tf32 plans and forbids it otherwise."""
    if device.type != "cuda":
        return  # on CPU tf32 is fp32 math
    allow = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


class LossScaler:
    """Dynamic loss scaling for fp16; a fixed scale of 1 (a no-op) for other precisions."""

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        backoff: float = 0.5,
        growth: float = 2.0,
    ) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.backoff, self.growth = growth_interval, backoff, growth
        self.good_steps = 0
        self.skipped = 0

    @torch.no_grad()
    def unscale_and_check(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Divides the gradients by the scale; returns True if every rank's are finite
        (a collective over the default group when enabled)."""
        if not self.enabled:
            return True
        bad = torch.zeros(1, device=device)
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            local = g.to_local() if hasattr(g, "to_local") else g
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad.fill_(1.0)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return float(bad.item()) == 0.0

    def update(self, finite: bool) -> None:
        """Adjusts the scale after a step (finite: the step was taken)."""
        if not self.enabled:
            return
        if not finite:
            self.scale *= self.backoff
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

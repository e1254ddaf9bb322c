"""Mixed precision as the plan states it.

- fp32: fp32 everywhere (on CUDA, TF32 tensor cores forbidden).
- tf32: fp32 storage, matmuls on TF32 tensor cores (CUDA); on CPU the same math as fp32.
- bf16: ``torch.autocast`` to bfloat16 around every chunk's forward (matmuls and attention
  in bf16); the modules' parameters are bf16 and the optimizer steps fp32 masters (whole:
  ``LowParams``; under ZeRO-1/2 the shard's: ``zero.py``), gradients summed in fp32, as
  Megatron and the cost model's table; the loss is computed from fp32 logits. ZeRO-3
  layers gather bf16 from fp32 shards (FSDP's mixed precision, ``fsdp.py``). No fp32
  parameter runs under autocast: there each micro-batch in flight would keep its own bf16
  copy of every weight it used, saved for its backward (GPipe's m micro-batches: m copies
  of the stage's weights).
- fp16: as bf16 with float16, plus dynamic loss scaling (Micikevicius et al. 2018): the
  loss is multiplied by a scale S before the backward; the gradients are divided by S
  before clipping and the step; a step whose gradients hold an inf or NaN on any rank is
  skipped and S halved; S doubles after ``growth_interval`` good steps in a row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

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


class LowParams:
    """Megatron's mixed precision for parameters outside ZeRO's buckets: the modules run on
    bf16/fp16 parameters while the optimizer, gradient sums, clipping and checkpoints keep
    working on the fp32 masters (the parameters they were given). Each micro-batch's
    low-precision gradient is added into its master's fp32 gradient and dropped
    (``register_post_accumulate_grad_hook``): the sums autocast makes over fp32 parameters.
    ``refresh`` copies the masters into the low-precision parameters after each optimizer
    step or load. 2 + 4 (gradient) + 12 bytes a parameter, the cost model's table, and the
    model runs with no cast."""

    def __init__(
        self, modules: list[torch.nn.Module], masters: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        low_of: dict[int, torch.nn.Parameter] = {}
        for p in masters:
            low = torch.nn.Parameter(p.detach().to(dtype))
            low.register_post_accumulate_grad_hook(self._hook(p))
            low_of[id(p)] = low
            self.pairs.append((p, low))
        for module in modules:
            for m in module.modules():
                for name, q in list(m._parameters.items()):
                    if q is not None and id(q) in low_of:
                        m._parameters[name] = low_of[id(q)]  # a tied table: one low copy

    @staticmethod
    def _hook(master: torch.Tensor) -> Any:
        def add(low: torch.Tensor) -> None:
            g = low.grad
            if g is None:
                return
            if master.grad is None:
                master.grad = g.to(master.dtype)
            else:
                master.grad.add_(g)
            low.grad = None

        return add

    @torch.no_grad()
    def refresh(self) -> None:
        """Rounds every master into its low-precision parameter."""
        for master, low in self.pairs:
            low.copy_(master)

    def tensors(self) -> list[torch.Tensor]:
        """Returns the low-precision parameters (memory the run holds)."""
        return [low for _, low in self.pairs]


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

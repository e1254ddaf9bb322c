"""Mixed precision as the plan states it.

- fp32: fp32 everywhere (on CUDA, TF32 tensor cores forbidden).
- tf32: fp32 storage, matmuls on TF32 tensor cores (CUDA); on CPU the same math as fp32.
- bf16: ``torch.autocast`` to bfloat16 around every chunk's forward (matmuls and attention
  in bf16); the modules' parameters are bf16 and the optimizer steps fp32 masters (whole:
  ``LowParams``; under ZeRO-1/2 the shard's: ``zero.py``), gradients summed in fp32, as
  Megatron and the cost model's table; the loss is computed from fp32 logits. ZeRO-3
  layers are FSDP's fp32 shards, run under autocast. Where fp32 parameters run under
  autocast (ZeRO-3 plans), the linear layers take their low-precision weights from one
  copy a step (``step_weights``, ``linear``; FSDP's layers cast in the forward and again
  in the backward): under plain autocast each micro-batch in flight keeps its own copy
  of every weight it used, saved for its backward (GPipe's m micro-batches: m copies of
  the stage's weights), cast anew each micro-batch.
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
import torch.nn.functional as F

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


_STEP_WEIGHTS: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
"""Inside ``step_weights``: id(parameter) -> (parameter, its low-precision copy)."""


@contextlib.contextmanager
def step_weights() -> Iterator[None]:
    """One training step's forwards and backwards: each weight is cast to the low precision
    at its first use and the copy shared by every micro-batch (the weights change only in
    the optimizer step after the block), then dropped. The low-precision weights a
    Megatron stage keeps (2 bytes a parameter beside the fp32 master), cast once a step."""
    global _STEP_WEIGHTS
    outer, _STEP_WEIGHTS = _STEP_WEIGHTS, {}
    try:
        yield
    finally:
        _STEP_WEIGHTS = outer


class _CastLinear(torch.autograd.Function):
    """y = x W^T + b in ``dtype`` from fp32 parameters, keeping no copy of W per
    micro-batch: it saves the step's shared copy ``low`` (``step_weights``), or else W
    itself (the parameter: no new memory), cast again in the backward. The same products as
    autocast's linear: x, W and b cast to ``dtype``, grad_x = g W, grad_W = g^T x and
    grad_b = sum g in ``dtype``, each gradient cast back to the dtype of its input."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        low: torch.Tensor | None,
    ) -> torch.Tensor:
        xl = x.to(dtype)
        ctx.save_for_backward(xl, weight if low is None else low)
        ctx.dtype, ctx.x_dtype, ctx.w_dtype = dtype, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):
            b = None if bias is None else bias.to(dtype)
            return F.linear(xl, weight.to(dtype) if low is None else low, b)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        xl, w = ctx.saved_tensors
        g = grads[0].to(ctx.dtype)
        gx = gw = gb = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                gx = (g @ w.to(ctx.dtype)).to(ctx.x_dtype)
            g2 = g.reshape(-1, g.shape[-1])
            if ctx.needs_input_grad[1]:
                gw = (g2.t() @ xl.reshape(-1, xl.shape[-1])).to(ctx.w_dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                gb = g2.sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, share: bool = True
) -> torch.Tensor:
    """``F.linear`` that, under autocast with gradients on, keeps no copy of the weight per
    micro-batch in flight (``_CastLinear``): inside ``step_weights`` one copy a step shared
    by all (``share``; FSDP-sharded layers say False, whose weights exist whole only while
    they run), else a cast in the forward and again in the backward. Plain ``F.linear``
    otherwise."""
    kind = x.device.type
    if not (torch.is_grad_enabled() and torch.is_autocast_enabled(kind)):
        return F.linear(x, weight, bias)
    dtype = torch.get_autocast_dtype(kind)
    if weight.dtype == dtype or not weight.requires_grad:
        return F.linear(x, weight, bias)
    low = None
    if share and _STEP_WEIGHTS is not None:
        hit = _STEP_WEIGHTS.get(id(weight))
        if hit is None or hit[0] is not weight:
            hit = _STEP_WEIGHTS[id(weight)] = (weight, weight.detach().to(dtype))
        low = hit[1]
    out: torch.Tensor = _CastLinear.apply(x, weight, bias, dtype, low)
    return out


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

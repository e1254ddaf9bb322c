"""AdamW settings, the learning-rate schedule and the clipping factor (no torch: the
launcher and the reference share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (the same for every plan and the one-device reference)."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping), as the DeepSpeed export says."""
    warmup_steps: int = 0
    decay_steps: int = 0
    """Cosine decay from the end of warm-up to this step (0: constant after warm-up)."""
    min_lr_ratio: float = 0.1


def adamw_kwargs(cfg: OptimConfig) -> dict[str, Any]:
    """Returns the AdamW arguments every run uses."""
    return {
        "lr": cfg.lr,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": cfg.weight_decay,
        "foreach": False,
    }


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Returns the learning rate of optimizer step ``step`` (1-based): linear warm-up to
    ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at
    ``decay_steps`` (and constant after it)."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.decay_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (cfg.lr - low) * (1.0 + math.cos(math.pi * progress))


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Returns the factor clip_grad_norm_ applies to every gradient."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))

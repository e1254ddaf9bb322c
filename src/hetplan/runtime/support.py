"""What the runtime can run: each plan field either honoured or refused here, before any
process starts, with one line naming the field (no torch needed for the plan checks)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import PRECISIONS, RECOMPUTE, Plan
from hetplan.runtime.layout import RuntimeLayout

if TYPE_CHECKING:
    from hetplan.runtime.config import RunConfig


def resolve_device(name: str) -> str:
    """Returns 'cpu' or 'cuda' for the --device option (auto: cuda where available)."""
    if name not in ("auto", "cpu", "cuda"):
        raise InputError("--device", f"{name}: use auto, cpu or cuda")
    if name == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if name == "cuda":
        raise InputError("--device", "cuda was asked for, but CUDA is not available here")
    return "cpu"


def check_plan_support(plan: Plan, model: ModelSpec, layout: RuntimeLayout, device: str) -> None:
    """Raises InputError for a plan field this runtime cannot honour on ``device``."""
    if plan.precision not in PRECISIONS:
        raise InputError("precision", f"{plan.precision}: use one of {', '.join(PRECISIONS)}")
    if plan.precision == "bf16" and device == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise InputError("precision", "bf16: this GPU has no bfloat16 support; use fp16")
    if plan.recompute not in RECOMPUTE:
        raise InputError("recompute", f"{plan.recompute}: use one of {', '.join(RECOMPUTE)}")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise InputError("zero_stage", f"{plan.zero_stage}: use 0, 1, 2 or 3")
    if plan.zero_stage > 0:
        for g in layout.sync_groups:
            if not g.sharded:
                tps = sorted({layout.places[r].tp for r in g.ranks})
                raise InputError(
                    "zero_stage",
                    f"{plan.zero_stage} shards state among replicas of one tensor-parallel "
                    f"degree; {g.units[0]} is held at degrees {tps}",
                )
    # ZeRO-3 runs on any replicas of one TP degree per unit: unequal stage splits and batch
    # shares sync each layer once a step (cost.sharding.deferred_sync, runtime/fsdp.py)
    if plan.sequence_parallel:
        for i, pipe in enumerate(plan.pipelines):
            tp = pipe.stages[0].tp
            if model.seq % tp:
                raise InputError(
                    "sequence_parallel",
                    f"pipelines[{i}] has tensor-parallel degree {tp}, which does not divide "
                    f"the sequence length {model.seq}",
                )


def check_run_options(cfg: RunConfig) -> None:
    """Raises InputError for a training option out of range."""
    dropout, grad_clip, weight_decay, keep = cfg.dropout, cfg.grad_clip, cfg.weight_decay, cfg.keep
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise InputError("--lr", f"{cfg.lr} is not a positive learning rate")
    if cfg.lr_warmup_steps < 0:
        raise InputError("--lr-warmup-steps", f"{cfg.lr_warmup_steps} is negative")
    if cfg.lr_decay_steps < 0:
        raise InputError("--lr-decay-steps", f"{cfg.lr_decay_steps} is negative")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise InputError("--min-lr-ratio", f"{cfg.min_lr_ratio} is not in [0, 1]")
    if cfg.threads < 0:
        raise InputError("--threads", f"{cfg.threads} is negative (0: torch's default)")
    if cfg.checkpoint_every < 0:
        raise InputError("--checkpoint-every", f"{cfg.checkpoint_every} is negative")
    if not 0.0 <= dropout < 1.0:
        raise InputError("--dropout", f"{dropout} is not in [0, 1)")
    if grad_clip < 0:
        raise InputError("--grad-clip", f"{grad_clip} is negative (0 turns clipping off)")
    if weight_decay < 0:
        raise InputError("--weight-decay", f"{weight_decay} is negative")
    if keep < 0:
        raise InputError("--keep", f"{keep} is negative (0 keeps every checkpoint)")

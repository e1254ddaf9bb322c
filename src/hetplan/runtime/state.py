"""Moving parameters and Adam state between a rank's shards and plan-independent unit files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetplan.runtime.checkpoint import write_atomic
from hetplan.runtime.grad_sync import LocalParam
from hetplan.runtime.model_torch import shard
from hetplan.runtime.optim import STATE_KEYS, PlanOptimizer
from hetplan.runtime.optim_config import OptimConfig, adamw_kwargs


def make_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """Returns the AdamW optimizer of the single-process reference (the plan's runs use
    the same arguments through ``PlanOptimizer``)."""
    return torch.optim.AdamW(params, **adamw_kwargs(cfg))


def _gather(t: torch.Tensor, dim: int | None, tp: int, group: Any) -> torch.Tensor:
    if dim is None or tp == 1:
        return t.detach().cpu().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim).cpu()


def gather_unit(
    params: list[LocalParam], opt: PlanOptimizer, tp: int, group: Any
) -> dict[str, Any]:
    """Returns the full parameters and Adam state of ``params`` (a collective on the TP group;
    ``opt.materialize()`` must have run on every rank first)."""
    out: dict[str, Any] = {"params": {}, "optim": {}}
    for lp in params:
        out["params"][lp.name] = _gather(opt.param_of(lp), lp.dim, tp, group)
        st = opt.state_of(lp)
        entry: dict[str, Any] = {"step": float(st["step"]) if "step" in st else 0.0}
        for key in STATE_KEYS:
            if key in st:
                entry[key] = _gather(st[key], lp.dim, tp, group)
        out["optim"][lp.name] = entry
    return out


def save_unit(path: Path, state: dict[str, Any]) -> None:
    """Writes one unit file atomically."""
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(path, buf.getvalue())


def load_unit(path: Path) -> dict[str, Any]:
    """Returns the contents of one unit file."""
    data: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return data


@torch.no_grad()
def restore_unit(
    state: dict[str, Any],
    params: list[LocalParam],
    opt: PlanOptimizer,
    tp: int,
    tp_index: int,
) -> None:
    """Loads this rank's shards of ``params`` and their Adam state from a unit's contents."""
    for lp in params:
        full = shard(state["params"][lp.name], lp.dim, tp, tp_index)
        entry = state["optim"].get(lp.name, {})
        st = None
        if all(k in entry for k in STATE_KEYS):
            st = {"step": entry["step"]}
            for key in STATE_KEYS:
                st[key] = shard(entry[key], lp.dim, tp, tp_index)
        opt.load(lp, full, st)

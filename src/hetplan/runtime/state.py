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

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """Returns the AdamW optimizer every run uses (the single-process reference too)."""
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False
    )


def _gather(t: torch.Tensor, dim: int | None, tp: int, group: Any) -> torch.Tensor:
    if dim is None or tp == 1:
        return t.detach().cpu().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim).cpu()


def gather_unit(
    params: list[LocalParam], opt: torch.optim.Optimizer, tp: int, group: Any
) -> dict[str, Any]:
    """Returns the full parameters and Adam state of ``params`` (a collective on the TP group)."""
    out: dict[str, Any] = {"params": {}, "optim": {}}
    for lp in params:
        out["params"][lp.name] = _gather(lp.param, lp.dim, tp, group)
        st = opt.state.get(lp.param, {})
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
    opt: torch.optim.Optimizer,
    tp: int,
    tp_index: int,
) -> None:
    """Loads this rank's shards of ``params`` and their Adam state from a unit's contents."""
    for lp in params:
        full = state["params"][lp.name]
        lp.param.copy_(shard(full, lp.dim, tp, tp_index).to(lp.param.device))
        entry = state["optim"].get(lp.name, {})
        if all(k in entry for k in STATE_KEYS):
            st: dict[str, Any] = {"step": torch.tensor(float(entry["step"]))}
            for key in STATE_KEYS:
                st[key] = shard(entry[key], lp.dim, tp, tp_index).to(lp.param.device).clone()
            opt.state[lp.param] = st

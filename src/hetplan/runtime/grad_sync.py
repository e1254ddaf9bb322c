"""Layer-wise gradient synchronisation among the ranks that hold each layer.

Each micro-batch loss is pre-scaled by its share of the global batch, so summing the
holders' gradients gives the full-batch gradient, whatever the replicas' shares.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetplan.runtime.layout import EMBED_TOK, SyncGroup
from hetplan.runtime.model_torch import TIED_EMBED, canonical_name, shard, shard_dim, unit_of


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """Returns the sum of squares of ``t`` in float64 with one read of ``t`` (the reduction
    upcasts as it reads; ``t.double().pow(2)`` would write and read two float64 copies):
    the gradient-norm pass every step pays, and ``profile`` times with the optimizer."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


class LocalParam:
    """A parameter this rank holds, with its full name and TP split."""

    def __init__(self, name: str, param: nn.Parameter, dim: int | None) -> None:
        self.name, self.param, self.dim = name, param, dim
        self.unit = unit_of(name)
        self.sync_unit = EMBED_TOK if name == TIED_EMBED else self.unit


def local_params(modules: list[nn.Module]) -> list[LocalParam]:
    """Returns the distinct parameters of this rank's chunks (tied weights once)."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(LocalParam(canonical_name(m, name), p, shard_dim(m, name)))
    return out


def sync_grads(
    params: list[LocalParam],
    groups: list[tuple[SyncGroup, Any]],
    tp: int,
    tp_index: int,
) -> None:
    """Sums gradients over each sync group this rank belongs to (one flat buffer per group)."""
    for sg, pg in groups:
        units = set(sg.units)
        mine = [lp for lp in params if lp.sync_unit in units]
        if not mine:
            continue
        pieces = []
        for lp in mine:
            g = _grad(lp.param)
            if sg.sharded:
                pieces.append(g.reshape(-1))
            else:
                pieces.append(_to_full(g, lp.dim, tp, tp_index).reshape(-1))
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=pg)
        pos = 0
        for lp in mine:
            g = _grad(lp.param)
            if sg.sharded:
                n = g.numel()
                g.copy_(flat[pos : pos + n].view_as(g))
            else:
                shape = list(g.shape)
                if lp.dim is not None:
                    shape[lp.dim] *= tp
                n = int(torch.Size(shape).numel())
                full = flat[pos : pos + n].view(shape)
                g.copy_(shard(full, lp.dim, tp, tp_index))
            pos += n


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _to_full(g: torch.Tensor, dim: int | None, tp: int, index: int) -> torch.Tensor:
    """Returns a full-size buffer whose sum over the TP group is the stage's gradient."""
    if dim is None:
        return g / tp  # replicated: every TP rank holds the same gradient
    shape = list(g.shape)
    shape[dim] *= tp
    full = torch.zeros(shape, dtype=g.dtype, device=g.device)
    full.narrow(dim, index * g.shape[dim], g.shape[dim]).copy_(g)
    return full

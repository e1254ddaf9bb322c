"""Differentiable collectives over uneven shards, called by the generated rank programs.

Each forward collective's backward is its dual (all-gather <-> reduce-scatter,
all-reduce <-> all-reduce, all-to-all <-> the inverse all-to-all), so autograd on a
rank's program yields gradients in the dual layouts (a replicated tensor's gradient
is a partial sum). ``padded`` forms pad every shard to the largest and run one
collective; ``grouped`` forms move exact sizes (one broadcast or reduce per rank, or
point-to-point rounds for all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim).contiguous()


def _with_size(x: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = size
    return shape


def _gather(x: torch.Tensor, dim: int, sizes: Sequence[int], form: str) -> torch.Tensor:
    rank = dist.get_rank()
    if form == "padded":
        top = max(sizes)
        bufs = [x.new_empty(_with_size(x, dim, top)) for _ in sizes]
        dist.all_gather(bufs, _pad(x, dim, top))
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(bufs, sizes, strict=True)], dim)
    parts = []
    for j, s in enumerate(sizes):
        buf = x.contiguous().clone() if j == rank else x.new_empty(_with_size(x, dim, s))
        dist.broadcast(buf, src=j)
        parts.append(buf)
    return torch.cat(parts, dim)


def _scatter_sum(x: torch.Tensor, dim: int, sizes: Sequence[int], form: str) -> torch.Tensor:
    rank = dist.get_rank()
    chunks = list(torch.split(x, list(sizes), dim))
    if form == "padded":
        top = max(sizes)
        out = x.new_empty(_with_size(x, dim, top))
        dist.reduce_scatter(out, [_pad(c, dim, top) for c in chunks])
        return out.narrow(dim, 0, sizes[rank]).contiguous()
    mine = None
    for j, c in enumerate(chunks):
        buf = c.contiguous().clone()
        dist.reduce(buf, dst=j)
        if j == rank:
            mine = buf
    assert mine is not None
    return mine


def _exchange(
    x: torch.Tensor,
    src_dim: int,
    src_sizes: Sequence[int],
    dst_dim: int,
    dst_sizes: Sequence[int],
    form: str,
) -> torch.Tensor:
    """Re-shards ``x`` (split along src_dim) to be split along dst_dim."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sends = [c.contiguous() for c in torch.split(x, list(dst_sizes), dst_dim)]
    shapes = []
    for j in range(n):
        shape = list(x.shape)
        shape[src_dim], shape[dst_dim] = src_sizes[j], dst_sizes[rank]
        shapes.append(shape)
    if form == "padded":
        ts, td = max(src_sizes), max(dst_sizes)
        padded = [_pad(_pad(c, src_dim, ts), dst_dim, td) for c in sends]
        recv = [x.new_empty(padded[0].shape) for _ in range(n)]
        dist.all_to_all(recv, padded)
        parts = [
            r.narrow(src_dim, 0, s[src_dim]).narrow(dst_dim, 0, s[dst_dim])
            for r, s in zip(recv, shapes, strict=True)
        ]
        return torch.cat(parts, src_dim)
    parts = [x.new_empty(s) for s in shapes]
    parts[rank] = sends[rank].clone()
    ops = []
    for j in range(n):
        if j != rank:
            ops.append(dist.P2POp(dist.isend, sends[j], j))
            ops.append(dist.P2POp(dist.irecv, parts[j], j))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return torch.cat(parts, src_dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], form: str
    ) -> torch.Tensor:
        ctx.args = (dim, sizes, form)
        return _gather(x, dim, sizes, form)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _scatter_sum(g.contiguous(), *ctx.args), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], form: str
    ) -> torch.Tensor:
        ctx.args = (dim, sizes, form)
        return _scatter_sum(x, dim, sizes, form)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _gather(g.contiguous(), *ctx.args), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        out = g.contiguous().clone()
        dist.all_reduce(out)
        return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        src_dim: int,
        src_sizes: tuple[int, ...],
        dst_dim: int,
        dst_sizes: tuple[int, ...],
        form: str,
    ) -> torch.Tensor:
        ctx.args = (dst_dim, dst_sizes, src_dim, src_sizes, form)
        return _exchange(x, src_dim, src_sizes, dst_dim, dst_sizes, form)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _exchange(g.contiguous(), *ctx.args), None, None, None, None, None


def all_gather(x: torch.Tensor, dim: int, sizes: tuple[int, ...], form: str) -> torch.Tensor:
    """Returns the whole tensor from per-rank shards along ``dim`` (S to R)."""
    return _AllGather.apply(x, dim, sizes, form)


def reduce_scatter(x: torch.Tensor, dim: int, sizes: tuple[int, ...], form: str) -> torch.Tensor:
    """Returns this rank's shard of the sum of per-rank partial tensors (P to S)."""
    return _ReduceScatter.apply(x, dim, sizes, form)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Returns the sum of per-rank partial tensors on every rank (P to R)."""
    return _AllReduce.apply(x)


def all_to_all(
    x: torch.Tensor,
    src_dim: int,
    src_sizes: tuple[int, ...],
    dst_dim: int,
    dst_sizes: tuple[int, ...],
    form: str,
) -> torch.Tensor:
    """Returns ``x`` re-sharded from ``src_dim`` to ``dst_dim`` (S to S)."""
    return _AllToAll.apply(x, src_dim, src_sizes, dst_dim, dst_sizes, form)


def shard_slice(x: torch.Tensor, dim: int, offset: int, size: int) -> torch.Tensor:
    """Returns this rank's shard of a replicated tensor (R to S, no communication)."""
    return x.narrow(dim, offset, size)


def mask(x: torch.Tensor, keep: bool) -> torch.Tensor:
    """Returns ``x`` on the rank that keeps it and zeros elsewhere (R to P)."""
    return x if keep else torch.zeros_like(x)


def mean_as_sum(x: torch.Tensor, dim: Any, keepdim: bool, count: int) -> torch.Tensor:
    """Returns this rank's part of a mean over sharded dims: local sum / global count."""
    out = x.sum() if dim is None else x.sum(dim, keepdim=keepdim)
    return out / count


def loss_as_sum(
    fn_name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    kwargs: dict[str, Any],
    count: int,
) -> torch.Tensor:
    """Returns this rank's part of a mean loss over sharded rows: local sum / global count.

    ``fn_name`` names the torch.nn.functional loss (cross_entropy, mse_loss, l1_loss).
    """
    fn: Callable[..., torch.Tensor] = getattr(F, fn_name)
    kw = dict(kwargs)
    mean = kw.pop("reduction", "mean") == "mean"
    out = fn(a, b, reduction="sum", **kw)
    return out / count if mean else out


def embedding_vocab(
    idx: torch.Tensor, weight: torch.Tensor, offset: int, kwargs: dict[str, Any]
) -> torch.Tensor:
    """Returns this rank's partial embedding: rows of its vocabulary shard, zeros elsewhere."""
    local = idx - offset
    hit = (local >= 0) & (local < weight.shape[0])
    pad = kwargs.get("padding_idx")
    if pad is not None:
        pad = pad - offset if 0 <= pad - offset < weight.shape[0] else None
    out = F.embedding(local.clamp(0, max(weight.shape[0] - 1, 0)), weight, pad)
    return out * hit.unsqueeze(-1).to(out.dtype)


class _SFBLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, dim: int, sizes: tuple[int, ...], form: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.args = (dim, sizes, form)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        dim, sizes, form = ctx.args
        gx = g @ w
        xs = _gather(x.contiguous(), dim, sizes, form)
        gs = _gather(g.contiguous(), dim, sizes, form)
        gw = gs.reshape(-1, gs.shape[-1]).t() @ xs.reshape(-1, xs.shape[-1])
        return gx, gw, None, None, None


def sfb_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    sizes: tuple[int, ...],
    form: str,
) -> torch.Tensor:
    """Returns F.linear whose weight gradient is rebuilt from gathered factors (x, dy)."""
    out = _SFBLinear.apply(x, w, dim, sizes, form)
    return out if bias is None else out + bias

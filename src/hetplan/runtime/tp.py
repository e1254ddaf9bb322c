"""Megatron-style tensor parallelism on a process group: column- and row-parallel linears,
and sequence parallelism (Korthikanti et al. 2022): between the parallel linears the
activations are split along the sequence over the group; an all-gather feeds the
column-parallel linears and a reduce-scatter replaces the row-parallel all-reduce."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (input of column-parallel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward; identity backward (output of row-parallel)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Returns ``x``; its gradient is summed over ``group`` (None: no-op)."""
    if group is None:
        return x
    out: torch.Tensor = _CopyToGroup.apply(x, group)
    return out


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Returns ``x`` summed over ``group`` (None: no-op)."""
    if group is None:
        return x
    out: torch.Tensor = _ReduceFromGroup.apply(x, group)
    return out


def _rank(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    _, n = _rank(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    i, n = _rank(group)
    return x.chunk(n, dim=1)[i].contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    i, n = _rank(group)
    if dist.get_backend(group) == "nccl":
        src = x.transpose(0, 1).contiguous()  # reduce_scatter_tensor splits dim 0
        out = torch.empty((src.shape[0] // n, *src.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, src, group=group)
        return out.transpose(0, 1).contiguous()
    # gloo has no reduce-scatter: all-reduce, keep this rank's part
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x.chunk(n, dim=1)[i].contiguous()


class _ScatterToSeq(torch.autograd.Function):
    """Replicated -> this rank's sequence slice; backward all-gathers the slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


class _GatherFromSeq(torch.autograd.Function):
    """Sequence slices -> replicated (computation after it is repeated on every rank);
    backward keeps this rank's slice of the (identical) gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_seq(grad, ctx.group), None


class _GatherForTP(torch.autograd.Function):
    """Sequence slices -> the whole sequence for column-parallel linears; backward
    reduce-scatters the partial input gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterFromTP(torch.autograd.Function):
    """Partial outputs of a row-parallel linear -> summed, this rank's sequence slice;
    backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(grad, ctx.group), None


def scatter_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Returns this rank's sequence slice of replicated ``x`` (None group: ``x``)."""
    if group is None:
        return x
    out: torch.Tensor = _ScatterToSeq.apply(x, group)
    return out


def gather_from_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Returns the whole sequence, for computation replicated on every rank after it."""
    if group is None:
        return x
    out: torch.Tensor = _GatherFromSeq.apply(x, group)
    return out


def sends_slices(seq: int, tp: int) -> bool:
    """Returns whether stages of TP degree ``tp`` pass activations to the next stage as
    sequence slices: tensor-parallel rank i sends only its 1/tp of the sequence to rank i
    of the next stage, which gathers the whole over its group where it needs it (Megatron's
    scatter/gather between stages; with sequence parallelism the slice is what the layers
    hold anyway). The cost model prices a send at 1/tp of the activation
    (``cost/estimate.py``). Where tp does not divide the sequence, every rank sends all."""
    return tp > 1 and seq % tp == 0


def gather_for_tp(x: torch.Tensor, group: Any, sequence_parallel: bool) -> torch.Tensor:
    """Returns the input of column-parallel linears: the gathered sequence (sequence
    parallel) or ``x`` whose gradient is summed over the group."""
    if group is None:
        return x
    if not sequence_parallel:
        return copy_to_group(x, group)
    out: torch.Tensor = _GatherForTP.apply(x, group)
    return out


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over the group; output stays split."""

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_f // tp, in_f))
        self.bias = nn.Parameter(torch.empty(out_f // tp)) if bias else None

    def forward(self, x: torch.Tensor, gathered: bool = False) -> torch.Tensor:
        """Returns this rank's slice of the output (``gathered``: x is already the output
        of ``gather_for_tp``)."""
        if not gathered:
            x = copy_to_group(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial outputs are summed over the group."""

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(
        self, in_f: int, out_f: int, bias: bool, tp: int, group: Any, seq_par: bool = False
    ) -> None:
        super().__init__()
        self.group, self.seq_par = group, seq_par
        self.weight = nn.Parameter(torch.empty(out_f, in_f // tp))
        self.bias = nn.Parameter(torch.empty(out_f)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the full output from this rank's slice of the input (sequence parallel:
        this rank's sequence slice of it)."""
        y = nn.functional.linear(x, self.weight)
        if self.group is not None and self.seq_par:
            out: torch.Tensor = _ReduceScatterFromTP.apply(y, self.group)
            y = out
        else:
            y = reduce_from_group(y, self.group)
        return y + self.bias if self.bias is not None else y

"""Megatron-style tensor parallelism on a process group: column- and row-parallel linears."""

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


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over the group; output stays split."""

    shard_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_f // tp, in_f))
        self.bias = nn.Parameter(torch.empty(out_f // tp)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns this rank's slice of the output."""
        return nn.functional.linear(copy_to_group(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial outputs are summed over the group."""

    shard_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(self, in_f: int, out_f: int, bias: bool, tp: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_f, in_f // tp))
        self.bias = nn.Parameter(torch.empty(out_f)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the full output from this rank's slice of the input."""
        y = reduce_from_group(nn.functional.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

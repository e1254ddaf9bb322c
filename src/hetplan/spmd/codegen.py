"""Code generation: one fx GraphModule per rank that runs its part of the program."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hetplan.spmd import runtime
from hetplan.spmd.capture import Captured, GNode
from hetplan.spmd.layout import Layout, shard_offsets, shard_sizes
from hetplan.spmd.ops import Call, Ref
from hetplan.spmd.program import Instr, Program


def local_sizes(node: GNode, lay: Layout, ratios: Sequence[float]) -> tuple[int, ...]:
    """Returns every rank's size along the sharded dimension of ``node`` in ``lay``."""
    return tuple(shard_sizes(node.shape[lay.dim], lay.granule, ratios))


def local_part(
    value: torch.Tensor, node: GNode, lay: Layout, ratios: Sequence[float], rank: int
) -> torch.Tensor:
    """Returns rank ``rank``'s part of the full tensor ``value`` held in layout ``lay``."""
    if lay.kind != "S":
        return value
    sizes = local_sizes(node, lay, ratios)
    return value.narrow(lay.dim, shard_offsets(sizes)[rank], sizes[rank])


def local_shape(node: GNode, lay: Layout, ratios: Sequence[float], rank: int) -> list[int]:
    """Returns the shape of rank ``rank``'s part of ``node`` in layout ``lay``."""
    shape = list(node.shape)
    if lay.kind == "S":
        shape[lay.dim] = local_sizes(node, lay, ratios)[rank]
    return shape


def _map_refs(value: Any, envs: list[fx.Node]) -> Any:
    """Replaces Refs, in occurrence order, by the given fx nodes."""
    it = iter(envs)

    def walk(v: Any) -> Any:
        if isinstance(v, Ref):
            return next(it)
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    return walk(value)


class RankModule(nn.Module):
    """One rank's program: local parameters and the generated graph."""

    def __init__(
        self,
        gm: fx.GraphModule,
        rank: int,
        input_layouts: dict[str, Layout],
        param_layouts: dict[str, Layout],
        grad_sync: list[str],
        param_paths: dict[str, str],
    ) -> None:
        super().__init__()
        self.gm = gm
        self.rank = rank
        self.input_layouts = input_layouts
        self.param_layouts = param_layouts
        self.grad_sync = grad_sync
        self.param_paths = param_paths

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Returns this rank's partial loss from its local inputs."""
        return self.gm(*inputs)

    def local_params(self) -> dict[str, nn.Parameter]:
        """Returns the rank's parameters by graph node name."""
        return {name: getattr(self.gm, name) for name in self.param_layouts}


class _Builder:
    def __init__(self, cap: Captured, program: Program, rank: int) -> None:
        self.cap, self.prog, self.rank = cap, program, rank
        self.b = program.ratios
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[tuple[str, Layout], fx.Node] = {}
        self.param_layouts: dict[str, Layout] = {}
        self.grad_sync: list[str] = []

    def sizes(self, name: str, lay: Layout) -> tuple[int, ...]:
        return local_sizes(self.cap.node(name), lay, self.b)

    def fn(self, target: Any, *args: Any) -> fx.Node:
        return self.graph.call_function(target, args)

    def build(self) -> RankModule:
        layouts = {i.node: i.output for i in self.prog.instrs if i.kind == "input"}
        for name in self.cap.inputs:
            lay = layouts.get(name)
            node = self.graph.placeholder(name)
            if lay is not None:
                self.env[(name, lay)] = node
        instrs = self.prog.instrs
        for k, ins in enumerate(instrs):
            self.emit(ins, instrs[k + 1 : k + 3])
        gm = fx.GraphModule(self.root, self.graph)
        return RankModule(
            gm,
            self.rank,
            {n: lay for n, lay in layouts.items() if lay},
            self.param_layouts,
            self.grad_sync,
            self.cap.param_paths,
        )

    def emit(self, ins: Instr, after: Sequence[Instr]) -> None:
        t = ins.node
        out = ins.output
        assert out is not None or ins.kind == "grad_all_reduce"
        if ins.kind in ("param", "const") and out is not None:
            node = self.cap.node(t)
            full = self.cap.params[t] if ins.kind == "param" else self.cap.consts[t]
            part = local_part(full.detach(), node, out, self.b, self.rank).clone()
            if ins.kind == "param":
                self.root.register_parameter(t, nn.Parameter(part))
                self.param_layouts[t] = out
            else:
                self.root.register_buffer(t, part)
            self.env[(t, out)] = self.graph.get_attr(t)
        elif ins.kind == "grad_all_reduce":
            self.grad_sync.append(t)
        elif ins.kind in ("input", "sfb_gather", "output"):
            if ins.kind == "output":
                self.graph.output(self.env[(t, out)])  # type: ignore[index]
        elif ins.kind == "item":
            node = self.cap.node(t)
            src = node.inputs[0]
            self.env[(t, out)] = self.fn(node.target, self.env[(src, out)], node.args[1])  # type: ignore[index]
        elif ins.kind == "op":
            self.env[(t, out)] = self.op(ins, after)  # type: ignore[index]
        else:
            self.env[(t, out)] = self.comm(ins)  # type: ignore[index]

    def comm(self, ins: Instr) -> fx.Node:
        t, src, dst = ins.node, ins.src, ins.output
        assert src is not None and dst is not None
        x = self.env[(t, src)]
        if ins.kind == "slice":
            sizes = self.sizes(t, dst)
            return self.fn(
                runtime.shard_slice, x, dst.dim, shard_offsets(sizes)[self.rank], sizes[self.rank]
            )
        if ins.kind == "mask":
            return self.fn(runtime.mask, x, self.rank == 0)
        if ins.kind == "all_reduce":
            return self.fn(runtime.all_reduce, x)
        if ins.kind == "all_gather":
            return self.fn(runtime.all_gather, x, src.dim, self.sizes(t, src), ins.form)
        if ins.kind == "reduce_scatter":
            return self.fn(runtime.reduce_scatter, x, dst.dim, self.sizes(t, dst), ins.form)
        if ins.kind == "all_to_all":
            return self.fn(
                runtime.all_to_all,
                x,
                src.dim,
                self.sizes(t, src),
                dst.dim,
                self.sizes(t, dst),
                ins.form,
            )
        raise AssertionError(f"unknown instruction {ins.kind}")

    def op(self, ins: Instr, after: Sequence[Instr]) -> fx.Node:
        node = self.cap.node(ins.node)
        spec = node.spec
        assert spec is not None and ins.output is not None
        envs = [self.env[(t, lay)] for t, lay in zip(node.inputs, ins.inputs, strict=True)]
        args = _map_refs(node.args, envs)
        kwargs = _map_refs(node.kwargs, envs[len(Call(node.args, {}, {}, ()).refs()) :])
        out = ins.output
        sharded_in = [lay for lay in ins.inputs if lay.kind == "S"]
        if spec.local in ("reshape", "expand"):
            shape = local_shape(node, out, self.b, self.rank)
            target = torch.reshape if spec.local == "reshape" else torch.Tensor.expand
            return self.fn(target, envs[0], shape)
        if spec.local == "mean" and out.kind == "P" and sharded_in:
            c = Call(node.args, node.kwargs, {}, ())
            dim, keep = c.get(1, "dim"), bool(c.get(2, "keepdim", False))
            in_shape = self.cap.node(node.inputs[0]).shape
            dims = range(len(in_shape)) if dim is None else [dim] if isinstance(dim, int) else dim
            count = math.prod(in_shape[d] for d in dims)
            return self.fn(runtime.mean_as_sum, envs[0], dim, keep, count)
        if spec.local == "loss_sum" and out.kind == "P" and sharded_in:
            a_shape = self.cap.node(node.inputs[0]).shape
            targets_1d = len(self.cap.node(node.inputs[1]).shape) == len(a_shape) - 1
            count = a_shape[0] if targets_1d else math.prod(a_shape)
            return self.fn(
                runtime.loss_as_sum, node.target.__name__, envs[0], envs[1], dict(kwargs), count
            )
        if spec.local == "embedding" and ins.note == "vocab":
            w_lay = ins.inputs[1]
            offset = shard_offsets(self.sizes(node.inputs[1], w_lay))[self.rank]
            c = Call(node.args, node.kwargs, {}, ())
            return self.fn(
                runtime.embedding_vocab,
                envs[0],
                envs[1],
                offset,
                {"padding_idx": c.get(2, "padding_idx")},
            )
        if ins.note == "sfb":
            x_lay = ins.inputs[0]
            form = next(i.form for i in after if i.kind == "sfb_gather")
            bias = envs[2] if len(envs) > 2 else None
            return self.fn(
                runtime.sfb_linear,
                envs[0],
                envs[1],
                bias,
                x_lay.dim,
                self.sizes(node.inputs[0], x_lay),
                form,
            )
        if node.call == "call_method":
            return self.graph.call_method(node.target, tuple(args), kwargs)
        return self.graph.call_function(node.target, tuple(args), kwargs)


def build_rank_module(cap: Captured, program: Program, rank: int) -> RankModule:
    """Returns rank ``rank``'s runnable program (an fx GraphModule with local parameters)."""
    return _Builder(cap, program, rank).build()


def shard_inputs(
    module: RankModule, cap: Captured, inputs: Sequence[torch.Tensor], ratios: Sequence[float]
) -> list[torch.Tensor]:
    """Returns this rank's parts of the full example inputs."""
    out = []
    for name, value in zip(cap.inputs, inputs, strict=True):
        lay = module.input_layouts.get(name)
        out.append(
            value
            if lay is None
            else local_part(value, cap.node(name), lay, ratios, module.rank).contiguous()
        )
    return out

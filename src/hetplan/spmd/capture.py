"""Capture: trace a module's training step (forward + loss) with torch.fx and normalise it.

Normalisation traces through every submodule (so nn.Linear becomes F.linear on its
weight), runs the example inputs once to fold shape arithmetic and input-independent
tensors into constants, and maps each remaining call to an index-map spec (ops.py).
"""

from __future__ import annotations

import copy
import math
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hetplan.errors import InputError
from hetplan.spmd.ops import REGISTRY, Call, OpSpec, Ref, Shape, Unsupported


@dataclass
class GNode:
    """One node of the normalised graph."""

    name: str
    op: str
    """'input', 'param', 'const', 'compute', 'item' (element of a tuple result) or 'output'."""
    target: Any = None
    call: str = ""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    shape: Shape = ()
    itemsize: int = 4
    requires_grad: bool = False
    is_tuple: bool = False
    spec: OpSpec | None = None
    location: str = ""

    @property
    def bytes(self) -> int:
        """Returns the size of the full (global) tensor."""
        return math.prod(self.shape) * self.itemsize

    def label(self) -> str:
        """Returns a short name of the call."""
        if self.op in ("compute", "item"):
            t = self.target
            return str(t) if isinstance(t, str) else getattr(t, "__name__", str(t))
        return self.op


@dataclass
class Captured:
    """A normalised single-device training step."""

    nodes: list[GNode]
    params: dict[str, nn.Parameter]
    """Node name -> the module's parameter."""
    param_paths: dict[str, str]
    consts: dict[str, torch.Tensor]
    inputs: list[str]
    loss: str

    def __post_init__(self) -> None:
        self.by_name = {n.name: n for n in self.nodes}

    def node(self, name: str) -> GNode:
        """Returns the node called ``name``."""
        return self.by_name[name]


class _Tracer(fx.Tracer):
    """Traces through every submodule and keeps each node's Python stack (``_location``
    names the user's line in messages). fx's own ``record_stack_traces`` symbolises a
    combined C++/Python traceback per node: 2-3 s for BERT's 116 nodes, most of a capture;
    the interpreter's own frames take microseconds."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False

    def create_node(
        self,
        kind: str,
        target: Any,
        args: Any,
        kwargs: Any,
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:
            node.stack_trace = "".join(traceback.format_list(traceback.extract_stack()[:-1]))
        return node


def _location(node: fx.Node) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', node.stack_trace or "")
    user = [f for f in frames if "/torch/" not in f[0]]
    if not user:
        return "<unknown>"
    path, line, fn = user[-1]
    return f"{path}:{line} in {fn}"


_DATA_TO_PYTHON = {("method", "item"), ("method", "tolist"), ("method", "__bool__")}


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, tuple | list):
        return any(_holds_tensor(v) for v in value)
    return False


def _target_key(node: fx.Node) -> Any:
    return ("method", node.target) if node.op == "call_method" else node.target


def _target_name(node: fx.Node) -> str:
    t = node.target
    return str(t) if isinstance(t, str) else getattr(t, "__name__", str(t))


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def trace(module: nn.Module) -> fx.GraphModule:
    """Returns the fx graph of ``module``'s forward, traced through every submodule."""
    try:
        graph = _Tracer().trace(module)
    except Exception as exc:  # fx raises many kinds for untraceable code
        raise InputError("--module", f"torch.fx cannot trace the model: {exc}") from None
    return fx.GraphModule(module, graph)


def capture(module: nn.Module, inputs: tuple[Any, ...], meta: bool = False) -> Captured:
    """Returns the normalised graph of ``module(*inputs)``, which must return a scalar loss.

    With ``meta`` the example step runs on the meta device (shapes only, fast; enough
    to plan, not to run: constants then hold no data).
    """
    if meta:
        module = copy.deepcopy(module).to("meta")
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    gm = trace(module)
    rec = _Recorder(gm)
    with torch.enable_grad():
        try:
            result = rec.run(*inputs)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:  # the model refused
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(
                "--module", f"the model's forward fails on its example inputs: {first}"
            ) from None
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        raise InputError("--module", "forward must return the scalar training loss")
    named = dict(module.named_parameters())
    dynamic: set[str] = set()
    nodes: list[GNode] = []
    params: dict[str, nn.Parameter] = {}
    paths: dict[str, str] = {}
    consts: dict[str, torch.Tensor] = {}
    folded: dict[str, Any] = {}
    problems: list[str] = []
    in_names: list[str] = []
    loss = ""

    def node_meta(name: str, value: torch.Tensor, **kw: Any) -> GNode:
        return GNode(
            name,
            shape=tuple(value.shape),
            itemsize=value.element_size(),
            requires_grad=value.requires_grad,
            **kw,
        )

    for n in gm.graph.nodes:
        value = rec.values.get(n.name)
        if n.op == "placeholder":
            if not isinstance(value, torch.Tensor):
                raise InputError("--module", f"input {n.name} must be a tensor")
            dynamic.add(n.name)
            in_names.append(n.name)
            nodes.append(node_meta(n.name, value, op="input", location=_location(n)))
            continue
        if n.op == "get_attr":
            if n.target in named and named[n.target].requires_grad and value is not None:
                dynamic.add(n.name)
                params[n.name] = named[n.target]
                paths[n.name] = str(n.target)
                nodes.append(node_meta(n.name, value, op="param", location=_location(n)))
            elif isinstance(value, torch.Tensor):
                consts[n.name] = value.detach()
                nodes.append(node_meta(n.name, value, op="const"))
            else:
                folded[n.name] = value
            continue
        if n.op == "output":
            out = n.args[0]
            if not isinstance(out, fx.Node):
                raise InputError("--module", "forward must return one scalar tensor")
            loss = out.name
            nodes.append(GNode("output", op="output", args=(Ref(out.name),), inputs=(out.name,)))
            continue
        deps = [a.name for a in n.all_input_nodes]
        if not any(d in dynamic for d in deps):
            if isinstance(value, torch.Tensor):
                consts[n.name] = value.detach()
                nodes.append(node_meta(n.name, value, op="const"))
            else:
                folded[n.name] = value
            continue
        if not _holds_tensor(value):
            if _target_key(n) in _DATA_TO_PYTHON:
                problems.append(
                    f"{n.name} ({_target_name(n)}) at {_location(n)}: "
                    "turns tensor data into a Python value"
                )
            folded[n.name] = value  # shape arithmetic: a constant for these inputs
            continue
        dynamic.add(n.name)

        def conv(a: fx.Node) -> Any:
            return folded[a.name] if a.name in folded else Ref(a.name)

        args = fx.node.map_arg(n.args, conv)
        kwargs = fx.node.map_arg(n.kwargs, conv)
        loc = _location(n)
        src = n.args[0] if n.args else None
        if isinstance(value, tuple | list):
            if not all(isinstance(v, torch.Tensor) for v in value):
                problems.append(f"{n.name} ({_target_name(n)}) at {loc}: non-tensor results")
                continue
            value0 = value[0]
        else:
            value0 = value
        if (
            isinstance(src, fx.Node)
            and isinstance(rec.values.get(src.name), tuple | list)
            and n.target is __import__("operator").getitem
        ):
            nodes.append(
                node_meta(
                    n.name,
                    value0,
                    op="item",
                    target=n.target,
                    call=n.op,
                    args=args,
                    kwargs=kwargs,
                    inputs=(src.name,),
                    location=loc,
                )
            )
            continue
        builder = REGISTRY.get(_target_key(n))
        if builder is None:
            problems.append(f"{n.name} ({_target_name(n)}) at {loc}: unsupported operator")
            continue
        refs: list[Ref] = []
        c = Call(args, kwargs, {}, tuple(value0.shape))
        for r in c.refs():
            refs.append(r)
            c.shapes[id(r)] = (
                tuple(rec.values[r.name].shape)
                if not isinstance(rec.values[r.name], tuple | list)
                else tuple(rec.values[r.name][0].shape)
            )
        try:
            spec = builder(c)
        except Unsupported as exc:
            problems.append(f"{n.name} ({_target_name(n)}) at {loc}: {exc}")
            continue
        nodes.append(
            node_meta(
                n.name,
                value0,
                op="compute",
                target=n.target,
                call=n.op,
                args=args,
                kwargs=kwargs,
                inputs=tuple(r.name for r in refs),
                spec=spec,
                is_tuple=isinstance(value, tuple | list),
                location=loc,
            )
        )
    if problems:
        raise InputError("--module", "unsupported operators:\n  " + "\n  ".join(problems))
    return Captured(nodes, params, paths, consts, in_names, loss)

"""Operator registry: each supported operator as an index map over its tensors' dimensions.

Every tensor dimension gets a letter. A letter shared by inputs and the output may be
sharded on all of them at once; a letter in ``contract`` (absent from the output) may
be sharded on the inputs, leaving the output as partial sums; letters in ``fixed`` are
never sharded; '_' marks a broadcast dimension. ``linear_slots`` lists the sets of
inputs in which the operator is linear (they may jointly hold partial sums).
"""

from __future__ import annotations

import math
import operator
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Ref:
    """A tensor argument: the name of the graph node that produces it."""

    name: str


@dataclass(frozen=True)
class OpSpec:
    """The sharding-relevant description of one operator call."""

    family: str
    in_letters: tuple[str, ...]
    out_letters: str
    fixed: frozenset[str] = frozenset()
    contract: frozenset[str] = frozenset()
    linear_slots: tuple[frozenset[int], ...] = ()
    bias: int | None = None
    flops: float = 0.0
    local: str = "same"
    """How a rank runs it: 'same', 'reshape', 'expand', 'mean', 'loss_sum', 'embedding'."""
    gemms: tuple[tuple[str, str, str, str], ...] = ()
    """Its matmuls as (batch, m, k, n) letter groups (the cost model's matmul shapes)."""
    attention: tuple[str, str, str, str, str] | None = None
    """A fused attention's (batch, query, key, head, value) letter groups."""


class Unsupported(Exception):
    """Raised by a spec builder for a call it cannot shard (reason in the message)."""


@dataclass
class Call:
    """The arguments of one call, with tensor arguments as Refs and their shapes."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shapes: dict[int, Shape]
    """Shape of each Ref occurrence, by id()."""
    out_shape: Shape

    def get(self, pos: int, name: str, default: Any = None) -> Any:
        """Returns argument ``name`` given at position ``pos`` or by keyword."""
        if len(self.args) > pos:
            return self.args[pos]
        return self.kwargs.get(name, default)

    def refs(self) -> list[Ref]:
        """Returns every tensor argument occurrence, args then kwargs, flattened."""
        out: list[Ref] = []

        def walk(v: Any) -> None:
            if isinstance(v, Ref):
                out.append(v)
            elif isinstance(v, list | tuple):
                for x in v:
                    walk(x)
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)

        walk(self.args)
        walk(self.kwargs)
        return out

    def shape(self, ref: Ref) -> Shape:
        """Returns the shape of tensor argument ``ref``."""
        return self.shapes[id(ref)]

    def spec(self, family: str, letters: dict[int, str], out: str, **kw: Any) -> OpSpec:
        """Returns an OpSpec with input letters given per Ref id, in occurrence order."""
        refs = self.refs()
        ins = tuple(letters.get(id(r), "_" * len(self.shape(r))) for r in refs)
        slots = kw.pop("linear_slots", ())
        slot_pos = tuple(frozenset(i for i, r in enumerate(refs) if id(r) in s) for s in slots if s)
        bias = kw.pop("bias", None)
        bias_pos = next((i for i, r in enumerate(refs) if r is bias), None)
        return OpSpec(family, ins, out, linear_slots=slot_pos, bias=bias_pos, **kw)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _letters(n: int) -> str:
    return string.ascii_lowercase[:n]


def _broadcast(c: Call, refs: list[Ref], out: str) -> dict[int, str]:
    letters: dict[int, str] = {}
    for r in refs:
        s = c.shape(r)
        off = len(out) - len(s)
        letters[id(r)] = "".join(
            out[off + j] if s[j] == c.out_shape[off + j] else "_" for j in range(len(s))
        )
    return letters


def _tensor_args(c: Call) -> list[Ref]:
    return [a for a in c.args if isinstance(a, Ref)]


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def elementwise(linear: str) -> Callable[[Call], OpSpec]:
    """Returns a builder for an elementwise op; ``linear`` in {'none','all','each','first'}."""

    def build(c: Call) -> OpSpec:
        refs = _tensor_args(c)
        out = _letters(len(c.out_shape))
        has_scalar = any(isinstance(a, int | float) and not isinstance(a, bool) for a in c.args)
        slots: list[set[int]] = []
        if linear == "all" and not has_scalar:
            slots = [{id(r) for r in refs}]
        elif linear == "each":
            slots = [{id(r)} for r in refs]
        elif (linear == "first" and refs and refs[0] is c.args[0]) or (
            linear == "unary" and len(refs) == 1
        ):
            slots = [{id(refs[0])}]
        flops = float(_numel(c.out_shape))
        return c.spec("elementwise", _broadcast(c, refs, out), out, linear_slots=slots, flops=flops)

    return build


def _softmax(c: Call) -> OpSpec:
    x = c.args[0]
    out = _letters(len(c.out_shape))
    d = _dim(c.get(1, "dim"), len(out))
    return c.spec(
        "softmax", {id(x): out}, out, fixed=frozenset(out[d]), flops=5.0 * _numel(c.out_shape)
    )


def _layer_norm(c: Call) -> OpSpec:
    x = c.args[0]
    k = len(c.get(1, "normalized_shape"))
    out = _letters(len(c.out_shape))
    letters = {id(x): out}
    for pos, name in ((2, "weight"), (3, "bias")):
        p = c.get(pos, name)
        if isinstance(p, Ref):
            letters[id(p)] = out[-k:]
    return c.spec(
        "layer_norm", letters, out, fixed=frozenset(out[-k:]), flops=8.0 * _numel(c.out_shape)
    )


def _linear(c: Call) -> OpSpec:
    x, w, b = c.get(0, "input"), c.get(1, "weight"), c.get(2, "bias")
    batch = _letters(len(c.out_shape) - 1)
    letters = {id(x): batch + "y", id(w): "zy"}
    slots: list[set[int]] = [{id(x)}, {id(w)}]
    if isinstance(b, Ref):
        letters[id(b)] = "z"
        slots = [{id(x), id(b)}, {id(w), id(b)}]
    flops = 2.0 * _numel(c.shape(x)) * c.shape(w)[0]
    return c.spec(
        "linear",
        letters,
        batch + "z",
        contract=frozenset("y"),
        linear_slots=slots,
        bias=b if isinstance(b, Ref) else None,
        flops=flops,
        gemms=(("", batch, "y", "z"),),
    )


def _matmul(c: Call) -> OpSpec:
    a, b = c.args[0], c.args[1]
    sa, sb = c.shape(a), c.shape(b)
    if len(sa) < 2 or len(sb) < 2:
        raise Unsupported("matmul with a 1-D operand")
    nb = len(c.out_shape) - 2
    batch = _letters(nb)
    out = batch + "xz"
    letters = {}
    for r, tail in ((a, "xy"), (b, "yz")):
        s = c.shape(r)
        off = nb - (len(s) - 2)
        lead = "".join(
            batch[off + j] if s[j] == c.out_shape[off + j] else "_" for j in range(len(s) - 2)
        )
        letters[id(r)] = lead + tail
    flops = 2.0 * _numel(c.out_shape) * sa[-1]
    return c.spec(
        "matmul",
        letters,
        out,
        contract=frozenset("y"),
        linear_slots=[{id(a)}, {id(b)}],
        flops=flops,
        gemms=((batch, "x", "y", "z"),),
    )


def _einsum(c: Call) -> OpSpec:
    eq = c.args[0].replace(" ", "")
    ops = list(c.args[1:])
    if len(ops) == 1 and isinstance(ops[0], list | tuple):
        ops = list(ops[0])
    if "..." in eq or "->" not in eq:
        raise Unsupported("einsum needs an explicit '->' output and no '...'")
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    sizes: dict[str, int] = {}
    for t, r in zip(terms, ops, strict=True):
        sizes.update(zip(t, c.shape(r), strict=True))
    contract = frozenset(set("".join(terms)) - set(out))
    flops = 2.0 * _numel(list(sizes.values()))
    gemms: tuple[tuple[str, str, str, str], ...] = ()
    if len(terms) == 2:  # batch: in both and kept; m, n: in one and kept; k: summed
        first, second = terms
        letters = "".join(dict.fromkeys(first + second))
        batch = "".join(x for x in letters if x in first and x in second and x in out)
        m = "".join(x for x in letters if x in first and x not in second and x in out)
        n = "".join(x for x in letters if x in second and x not in first and x in out)
        k = "".join(x for x in letters if x not in out)
        gemms = ((batch, m, k, n),)
    return c.spec(
        "einsum",
        {id(r): t for t, r in zip(terms, ops, strict=True)},
        out,
        contract=contract,
        linear_slots=[{id(r)} for r in ops],
        flops=flops,
        gemms=gemms,
    )


def _embedding(c: Call) -> OpSpec:
    idx, w = c.get(0, "input"), c.get(1, "weight")
    if c.get(3, "max_norm") is not None:
        raise Unsupported("embedding with max_norm")
    batch = _letters(len(c.shape(idx)))
    return c.spec(
        "embedding",
        {id(idx): batch, id(w): "vz"},
        batch + "z",
        contract=frozenset("v"),
        linear_slots=[{id(w)}],
        local="embedding",
        flops=float(_numel(c.out_shape)),
    )


def _reduce(kind: str) -> Callable[[Call], OpSpec]:
    def build(c: Call) -> OpSpec:
        x = c.args[0]
        n = len(c.shape(x))
        dims = c.get(1, "dim")
        keep = bool(c.get(2, "keepdim", False))
        if dims is None:
            dims = list(range(n))
        dims = {_dim(d, n) for d in ([dims] if isinstance(dims, int) else dims)}
        xin = _letters(n)
        out = "".join(
            xin[i] if i not in dims else string.ascii_uppercase[i]
            for i in range(n)
            if keep or i not in dims
        )
        reduced = frozenset(xin[i] for i in dims)
        if kind in ("sum", "mean"):
            return c.spec(
                kind,
                {id(x): xin},
                out,
                contract=reduced,
                fixed=frozenset(string.ascii_uppercase),
                linear_slots=[{id(x)}],
                local="mean" if kind == "mean" else "same",
                flops=float(_numel(c.shape(x))),
            )
        return c.spec(
            kind,
            {id(x): xin},
            out,
            fixed=reduced | frozenset(string.ascii_uppercase),
            flops=float(_numel(c.shape(x))),
        )

    return build


def _loss(c: Call) -> OpSpec:
    a, b = c.args[0], c.args[1]
    if c.get(99, "reduction", "mean") not in ("mean", "sum"):
        raise Unsupported("loss with reduction='none'")
    if isinstance(c.kwargs.get("weight"), Ref):
        raise Unsupported("class-weighted loss")
    sa = c.shape(a)
    if len(c.shape(b)) == len(sa) - 1:  # cross entropy with class indices
        if len(sa) != 2:
            raise Unsupported("cross entropy needs logits [N, C] and targets [N]")
        return c.spec(
            "loss",
            {id(a): "nC", id(b): "n"},
            "",
            contract=frozenset("n"),
            fixed=frozenset("C"),
            local="loss_sum",
            flops=6.0 * _numel(sa),
        )
    xs = _letters(len(sa))
    return c.spec(
        "loss",
        {id(a): xs, id(b): xs},
        "",
        contract=frozenset(xs),
        local="loss_sum",
        flops=3.0 * _numel(sa),
    )


def _attention(c: Call) -> OpSpec:
    q, k, v = c.get(0, "query"), c.get(1, "key"), c.get(2, "value")
    if c.get(4, "dropout_p", 0.0):
        raise Unsupported("attention dropout")
    nb = len(c.shape(q)) - 2
    batch = _letters(nb)
    fixed = set("SDE")
    if c.get(5, "is_causal", False):
        fixed.add("L")
    letters = {id(q): batch + "LD", id(k): batch + "SD", id(v): batch + "SE"}
    mask = c.get(3, "attn_mask")
    if isinstance(mask, Ref):
        s = c.shape(mask)
        full = batch + "LS"
        letters[id(mask)] = "".join(
            full[len(full) - len(s) + j] if s[j] > 1 else "_" for j in range(len(s))
        )
    L, S, D = c.shape(q)[-2], c.shape(k)[-2], c.shape(q)[-1]
    flops = 4.0 * _numel(c.shape(q)[:-2]) * L * S * D
    return c.spec(
        "attention",
        letters,
        batch + "LE",
        fixed=frozenset(fixed),
        flops=flops,
        attention=(batch, "L", "S", "D", "E"),
    )


def _topk(c: Call) -> OpSpec:
    x = c.args[0]
    n = len(c.shape(x))
    d = _dim(c.get(2, "dim", -1), n)
    xin = _letters(n)
    out = xin[:d] + "K" + xin[d + 1 :]
    return c.spec(
        "topk", {id(x): xin}, out, fixed=frozenset({xin[d], "K"}), flops=float(_numel(c.shape(x)))
    )


def _one_hot(c: Call) -> OpSpec:
    x = c.args[0]
    xin = _letters(len(c.shape(x)))
    return c.spec(
        "one_hot", {id(x): xin}, xin + "K", fixed=frozenset("K"), flops=float(_numel(c.out_shape))
    )


def _permute(c: Call, perm: Sequence[int]) -> OpSpec:
    x = c.args[0]
    xin = _letters(len(perm))
    return c.spec("permute", {id(x): xin}, "".join(xin[p] for p in perm), linear_slots=[{id(x)}])


def _transpose(c: Call) -> OpSpec:
    n = len(c.out_shape)
    d0, d1 = (0, 1) if len(c.args) == 1 else (_dim(c.args[1], n), _dim(c.args[2], n))
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(c, perm)


def _permute_call(c: Call) -> OpSpec:
    dims: Sequence[int] = c.args[1:]
    if len(dims) == 1 and isinstance(dims[0], list | tuple):
        dims = list(dims[0])
    n = len(c.out_shape)
    return _permute(c, [_dim(d, n) for d in dims])


def _reshape(c: Call) -> OpSpec:
    x = c.args[0]
    return c.spec(
        "reshape",
        {id(x): _letters(len(c.shape(x)))},
        _letters(len(c.out_shape)),
        linear_slots=[{id(x)}],
        local="reshape",
    )


def _expand(c: Call) -> OpSpec:
    x = c.args[0]
    out = _letters(len(c.out_shape))
    return c.spec("expand", _broadcast(c, [x], out), out, linear_slots=[{id(x)}], local="expand")


def _cat(c: Call) -> OpSpec:
    tensors = c.args[0]
    out = _letters(len(c.out_shape))
    d = _dim(c.get(1, "dim", 0), len(out))
    return c.spec(
        "cat",
        {id(t): out for t in tensors},
        out,
        fixed=frozenset(out[d]),
        linear_slots=[{id(t) for t in tensors}],
    )


def _getitem(c: Call) -> OpSpec:
    x, index = c.args
    if not isinstance(index, tuple):
        index = (index,)
    n = len(c.shape(x))
    if any(isinstance(i, Ref) or not isinstance(i, int | slice | None | type(...)) for i in index):
        raise Unsupported("indexing with tensors")
    if index.count(...) > 1:
        raise Unsupported("more than one ellipsis")
    if ... in index:
        k = index.index(...)
        used = sum(1 for i in index if i is not None and i is not ...)
        index = index[:k] + (slice(None),) * (n - used) + index[k + 1 :]
    xin, out, fixed = _letters(n), "", set()
    d = 0
    for i in index:
        if i is None:
            out += "N"
            continue
        if isinstance(i, int):
            fixed.add(xin[d])
        elif i == slice(None) or i.indices(c.shape(x)[d]) == (0, c.shape(x)[d], 1):
            out += xin[d]
        else:
            fixed.add(xin[d])
            out += xin[d].upper()
        d += 1
    out += xin[d:]
    return c.spec(
        "index",
        {id(x): xin},
        out,
        fixed=frozenset(fixed | set(string.ascii_uppercase)),
        linear_slots=[{id(x)}],
    )


def _conv2d(c: Call) -> OpSpec:
    x, w, b = c.get(0, "input"), c.get(1, "weight"), c.get(2, "bias")
    if c.get(6, "groups", 1) != 1:
        raise Unsupported("grouped convolution")
    letters = {id(x): "bchw", id(w): "ocKL"}
    slots: list[set[int]] = [{id(x)}, {id(w)}]
    if isinstance(b, Ref):
        letters[id(b)] = "o"
        slots = [{id(x), id(b)}, {id(w), id(b)}]
    sw = c.shape(w)
    flops = 2.0 * _numel(c.out_shape) * sw[1] * sw[2] * sw[3]
    return c.spec(
        "conv2d",
        letters,
        "boHW",
        fixed=frozenset("hwHWKL"),
        contract=frozenset("c"),
        linear_slots=slots,
        bias=b if isinstance(b, Ref) else None,
        flops=flops,
        gemms=(("", "bHW", "cKL", "o"),),
    )


def _dropout(c: Call) -> OpSpec:
    if c.get(1, "p", 0.5) and c.get(2, "training", True):
        raise Unsupported("dropout with p > 0 in training mode (random masks differ per rank)")
    return elementwise("unary")(c)


_UNARY = [
    F.relu,
    torch.relu,
    F.gelu,
    torch.tanh,
    torch.sigmoid,
    F.silu,
    torch.exp,
    torch.sqrt,
    torch.rsqrt,
    torch.abs,
    torch.log,
    F.tanh,
    F.sigmoid,
    torch.erf,
]
_UNARY_METHODS = [
    "relu",
    "tanh",
    "sigmoid",
    "exp",
    "sqrt",
    "rsqrt",
    "abs",
    "log",
    "float",
    "to",
    "pow",
    "square",
]
_LINEAR_UNARY_METHODS = ["contiguous", "clone", "neg", "detach"]

REGISTRY: dict[Any, Callable[[Call], OpSpec]] = {
    **{f: elementwise("none") for f in _UNARY},
    **{("method", m): elementwise("none") for m in _UNARY_METHODS},
    **{("method", m): elementwise("unary") for m in _LINEAR_UNARY_METHODS},
    operator.neg: elementwise("unary"),
    torch.neg: elementwise("unary"),
    operator.add: elementwise("all"),
    torch.add: elementwise("all"),
    ("method", "add"): elementwise("all"),
    operator.sub: elementwise("all"),
    torch.sub: elementwise("all"),
    operator.mul: elementwise("each"),
    torch.mul: elementwise("each"),
    ("method", "mul"): elementwise("each"),
    operator.truediv: elementwise("first"),
    torch.div: elementwise("first"),
    operator.pow: elementwise("none"),
    torch.pow: elementwise("none"),
    torch.where: elementwise("none"),
    ("method", "masked_fill"): elementwise("none"),
    torch.maximum: elementwise("none"),
    torch.minimum: elementwise("none"),
    F.dropout: _dropout,
    F.softmax: _softmax,
    torch.softmax: _softmax,
    ("method", "softmax"): _softmax,
    F.log_softmax: _softmax,
    torch.log_softmax: _softmax,
    ("method", "log_softmax"): _softmax,
    F.layer_norm: _layer_norm,
    F.linear: _linear,
    torch.matmul: _matmul,
    operator.matmul: _matmul,
    torch.bmm: _matmul,
    ("method", "matmul"): _matmul,
    ("method", "bmm"): _matmul,
    torch.einsum: _einsum,
    F.embedding: _embedding,
    torch.sum: _reduce("sum"),
    ("method", "sum"): _reduce("sum"),
    torch.mean: _reduce("mean"),
    ("method", "mean"): _reduce("mean"),
    torch.amax: _reduce("amax"),
    ("method", "amax"): _reduce("amax"),
    F.cross_entropy: _loss,
    F.mse_loss: _loss,
    F.l1_loss: _loss,
    F.scaled_dot_product_attention: _attention,
    torch.topk: _topk,
    ("method", "topk"): _topk,
    F.one_hot: _one_hot,
    torch.transpose: _transpose,
    ("method", "transpose"): _transpose,
    ("method", "t"): _transpose,
    torch.permute: _permute_call,
    ("method", "permute"): _permute_call,
    torch.reshape: _reshape,
    ("method", "reshape"): _reshape,
    ("method", "view"): _reshape,
    torch.flatten: _reshape,
    ("method", "flatten"): _reshape,
    torch.unsqueeze: _reshape,
    ("method", "unsqueeze"): _reshape,
    torch.squeeze: _reshape,
    ("method", "squeeze"): _reshape,
    ("method", "expand"): _expand,
    torch.cat: _cat,
    operator.getitem: _getitem,
    F.conv2d: _conv2d,
    torch.conv2d: _conv2d,
}
"""Builders by call target: the function, or ('method', name) for a tensor method."""

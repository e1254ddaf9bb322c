"""Per-operator sharding rules: the layouts an operator accepts and the layout it yields."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn.functional as F

from hetplan.spmd.capture import Captured, GNode
from hetplan.spmd.layout import PARTIAL, REPLICATED, SFB, Layout, shard

MATCH = 0
"""Granule placeholder in a rule: take the granule the input already has (else 1)."""


@dataclass(frozen=True)
class Rule:
    """One way to run an operator: input layouts (per input occurrence) and output layout."""

    inputs: tuple[Layout, ...]
    output: Layout
    sharded: bool
    """Whether the work is split by the ratios (else every rank does all of it)."""
    note: str = ""
    gran_mul: int = 1
    gran_div: int = 1
    """Output granule = input granule x gran_mul / gran_div (reshapes)."""


def _min_size_ok(size: int, n: int) -> bool:
    return size >= n


def consumers(cap: Captured) -> dict[str, list[tuple[GNode, int]]]:
    """Returns, per tensor, its consuming nodes with the input position of each use."""
    out: dict[str, list[tuple[GNode, int]]] = {n.name: [] for n in cap.nodes}
    for node in cap.nodes:
        for pos, name in enumerate(node.inputs):
            out[name].append((node, pos))
    return out


def sfb_eligible(node: GNode, uses: Sequence[tuple[GNode, int]]) -> bool:
    """Returns whether a parameter may take its gradient from sufficient factors.

    It must be a 2-D weight used only as the weight of F.linear calls.
    """
    return (
        node.op == "param"
        and len(node.shape) == 2
        and bool(uses)
        and all(u.target is F.linear and pos == 1 for u, pos in uses)
    )


def source_rules(
    node: GNode,
    uses: Sequence[tuple[GNode, int]],
    n: int,
    restrict: str | None = None,
    granules: Sequence[int] = (1,),
) -> list[Rule]:
    """Returns the layouts an input, constant or parameter may start in.

    ``granules`` are the granule sizes worth offering besides 1 (those reshapes need).
    """
    if restrict == "dp":
        if node.op == "param":
            return [Rule((), REPLICATED, False)]
        if node.op == "input" and node.shape and node.shape[0] >= n:
            return [Rule((), shard(0), False)]
    out = [Rule((), REPLICATED, False)]
    out += [
        Rule((), shard(d, g), False)
        for d, s in enumerate(node.shape)
        for g in sorted(set(granules) | {1})
        if s % g == 0 and _min_size_ok(s // g, n)
    ]
    if n > 1 and sfb_eligible(node, uses):
        out.append(Rule((), SFB, False, note="sfb"))
    return out


def reshape_granules(rules: Sequence[Rule]) -> set[int]:
    """Returns the granule factors that reshape rules multiply or divide by (besides 1)."""
    return {g for r in rules for g in (r.gran_mul, r.gran_div) if g > 1}


def _reshape_rules(node: GNode, in_shape: tuple[int, ...], n: int) -> list[Rule]:
    out_shape = node.shape
    rules = [Rule((REPLICATED,), REPLICATED, False), Rule((PARTIAL,), PARTIAL, False)]
    pin = [math.prod(in_shape[:k]) for k in range(len(in_shape) + 1)]
    pout = [math.prod(out_shape[:k]) for k in range(len(out_shape) + 1)]
    common = sorted(set(pin) & set(pout))
    for d, size in enumerate(in_shape):
        if size < n:
            continue
        lo = max(c for c in common if c <= pin[d])
        hi = min(c for c in common if c >= pin[d + 1])
        in_dims = [
            k for k in range(len(in_shape)) if pin[k] >= lo and pin[k + 1] <= hi and in_shape[k] > 1
        ]
        out_dims = [
            k
            for k in range(len(out_shape))
            if pout[k] >= lo and pout[k + 1] <= hi and out_shape[k] > 1
        ]
        if not in_dims or in_dims[0] != d or not out_dims:
            continue
        o = out_dims[0]
        rules.append(
            Rule(
                (shard(d, MATCH),),
                shard(o, MATCH),
                True,
                gran_mul=hi // pin[d + 1],
                gran_div=hi // pout[o + 1],
            )
        )
    return rules


def compute_rules(
    node: GNode, cap: Captured, n: int, sfb_params: set[str] | frozenset[str] = frozenset()
) -> list[Rule]:
    """Returns every rule of a compute node (spec from ops.py) for ``n`` ranks."""
    spec = node.spec
    assert spec is not None
    k = len(node.inputs)
    shapes = [cap.node(t).shape for t in node.inputs]
    if spec.family == "reshape":
        return _reshape_rules(node, shapes[0], n)
    rules = [Rule((REPLICATED,) * k, REPLICATED, False)]
    if n == 1:
        return rules
    out = spec.out_letters

    def dim_size(letter: str) -> int:
        for lt, s in zip(spec.in_letters, shapes, strict=True):
            if letter in lt:
                return s[lt.index(letter)]
        return node.shape[out.index(letter)]

    for pos, letter in enumerate(out):
        if letter == "_" or letter in spec.fixed or node.shape[pos] < n:
            continue
        ins = tuple(
            shard(lt.index(letter), MATCH) if letter in lt else REPLICATED for lt in spec.in_letters
        )
        rules.append(Rule(ins, shard(pos, MATCH), True))
        if spec.family == "linear" and node.inputs[1] in sfb_params and pos < len(out) - 1:
            sfb_ins = tuple(SFB if i == 1 else lay for i, lay in enumerate(ins))
            rules.append(Rule(sfb_ins, shard(pos, MATCH), True, note="sfb"))
    for letter in sorted(spec.contract - spec.fixed):
        if dim_size(letter) < n:
            continue
        ins = tuple(
            shard(lt.index(letter), MATCH)
            if letter in lt
            else PARTIAL
            if i == spec.bias
            else REPLICATED
            for i, lt in enumerate(spec.in_letters)
        )
        note = "vocab" if spec.local == "embedding" else ""
        rules.append(Rule(ins, PARTIAL, True, note=note))
    for slot in spec.linear_slots:
        ins = tuple(PARTIAL if i in slot else REPLICATED for i in range(k))
        rules.append(Rule(ins, PARTIAL, False))
    return rules

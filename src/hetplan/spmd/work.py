"""What each captured operator costs to run: its matmul shapes and elementwise bytes.

Turns a node's index map (``ops.OpSpec``) and its tensors' shapes into a
``costmodel.OpWork`` that ``Devices.op_cost`` prices with the cost model's blocks, and
names the letter a rule shards (so the shard's own matmul shape sets its efficiency).
"""

from __future__ import annotations

from hetplan.spmd.capture import Captured, GNode
from hetplan.spmd.costmodel import OpWork
from hetplan.spmd.rules import Rule

VIEWS = frozenset({"reshape", "expand", "permute", "index"})
"""Families torch runs as views of their input: no kernel, no traffic."""
MATMULS = frozenset({"linear", "matmul", "einsum", "conv2d", "attention"})
BACKWARD_ELEMENTWISE = 2.0
"""Backward bytes (and kernels) of an elementwise kernel per forward ones."""


def letter_sizes(node: GNode, cap: Captured) -> dict[str, int]:
    """Returns the size of every letter of ``node``'s index map."""
    spec = node.spec
    assert spec is not None
    sizes: dict[str, int] = {}
    for letters, t in zip(spec.in_letters, node.inputs, strict=True):
        for c, s in zip(letters, cap.node(t).shape, strict=True):
            if c != "_":
                sizes.setdefault(c, s)
    for c, s in zip(spec.out_letters, node.shape, strict=True):
        if c != "_":
            sizes[c] = s
    return sizes


def sharded_letter(node: GNode, rule: Rule) -> str | None:
    """Returns the letter ``rule`` splits by the ratios (None if it splits none)."""
    spec = node.spec
    if spec is None or not rule.sharded:
        return None
    for letters, lay in zip(spec.in_letters, rule.inputs, strict=True):
        if lay.kind == "S" and lay.dim < len(letters) and letters[lay.dim] != "_":
            return letters[lay.dim]
    if rule.output.kind == "S" and rule.output.dim < len(spec.out_letters):
        return spec.out_letters[rule.output.dim]
    return None


def op_work(node: GNode, cap: Captured, passes: int | None = None) -> OpWork:
    """Returns the forward + backward work of compute node ``node``.

    Matmuls (linear, matmul, einsum, conv2d) run one backward matmul per operand that
    needs a gradient (dX and dW each cost what the forward does: the same smallest
    dimension); a linear's or convolution's bias gradient reads the output's gradient
    once; a fused attention's backward is twice its forward (``cost.compute.layer_times``'
    convention). Other kernels read their inputs and write their output (an embedding
    reads only the rows it gathers); where an input needs a gradient their backward
    moves twice those bytes in two kernels (``layer_times``' "about twice the elementwise
    traffic" and twice the launches). Views cost nothing. ``passes`` (sufficient-factor rules)
    overrides the backward matmul count and drops the bias term.
    """
    spec = node.spec
    assert spec is not None
    sizes = letter_sizes(node, cap)
    ins = [cap.node(t) for t in node.inputs]
    grads = sum(t.requires_grad for t in ins)
    if spec.family in VIEWS:
        return OpWork(sizes)
    if spec.family == "attention":
        return OpWork(sizes, attention=spec.attention, backward=2.0 * bool(grads),
                      kernels=1 + bool(grads))  # fmt: skip
    if spec.family in MATMULS:
        bias = passes is None and spec.bias is not None and ins[spec.bias].requires_grad
        if passes is None:
            passes = sum(t.requires_grad for t in ins[:2])
        return OpWork(
            sizes,
            gemms=spec.gemms,
            square_flops=0.0 if spec.gemms else spec.flops,
            backward=float(passes),
            backward_bytes=float(node.bytes) if bias else 0.0,
            kernels=1 + passes + int(bias),
        )
    if spec.local == "embedding":
        moved = 2.0 * node.bytes + ins[0].bytes
    else:
        moved = float(node.bytes + sum(t.bytes for t in ins))
    back = BACKWARD_ELEMENTWISE if grads else 0.0
    return OpWork(sizes, forward_bytes=moved, backward_bytes=back * moved, kernels=1 + int(back))

"""Distributed programs: a list of instructions (compute under a rule, or communication)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hetplan.spmd.costmodel import ZERO, Cost
from hetplan.spmd.layout import Layout

COMM_KINDS = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "grad_all_reduce",
    "sfb_gather",
)
"""Instruction kinds that move data between ranks."""


@dataclass(frozen=True)
class Instr:
    """One instruction of a distributed program.

    ``kind`` is 'input', 'param', 'const' (a source tensor placed in ``output``),
    'op' (a compute node run under input layouts ``inputs``), 'item' (an element of a
    tuple result), 'output' (the loss), 'slice' (R to S, local), 'mask' (R to P, local:
    rank 0 keeps the value), or a collective of COMM_KINDS converting ``tensor`` from
    layout ``src`` to ``output``, in ``form`` 'padded' or 'grouped' for uneven shards.
    """

    kind: str
    node: str
    output: Layout | None = None
    inputs: tuple[Layout, ...] = ()
    src: Layout | None = None
    form: str = ""
    sharded: bool = False
    note: str = ""
    cost: Cost = ZERO
    label: str = ""

    def line(self, ratios: Sequence[float]) -> str:
        """Returns a one-line rendering with the time at ``ratios``."""
        t_ms = self.cost.at(ratios) * 1e3
        if self.kind == "op":
            ins = ",".join(str(x) for x in self.inputs)
            how = "sharded" if self.sharded else "replicated"
            extra = f" [{self.note}]" if self.note else ""
            return f"{self.node} = {self.label}({ins}) -> {self.output} {how}{extra}  {t_ms:.3f} ms"
        if self.kind in ("input", "param", "const"):
            extra = " [zero]" if self.note == "zero" else f" [{self.note}]" if self.note else ""
            return f"{self.kind} {self.node}: {self.output}{extra}  {t_ms:.3f} ms"
        if self.kind in ("item", "output"):
            return f"{self.kind} {self.node}: {self.output}"
        form = f" {self.form}" if self.form else ""
        return f"{self.kind}{form} {self.node}: {self.src} -> {self.output}  {t_ms:.3f} ms"

    def to_dict(self, ratios: Sequence[float]) -> dict[str, Any]:
        """Returns a JSON-ready mapping."""
        return {
            "kind": self.kind,
            "node": self.node,
            "op": self.label,
            "output": None if self.output is None else str(self.output),
            "inputs": [str(x) for x in self.inputs],
            "src": None if self.src is None else str(self.src),
            "form": self.form,
            "sharded": self.sharded,
            "note": self.note,
            "time_s": self.cost.at(ratios),
        }


@dataclass
class Program:
    """A synthesised distributed program for a fixed graph and device group."""

    instrs: list[Instr]
    ratios: list[float]
    devices: tuple[str, ...]
    stats: dict[str, Any] = field(default_factory=dict)

    def time_s(self, ratios: Sequence[float] | None = None) -> float:
        """Returns the predicted time of one training step at ``ratios`` (default: own)."""
        b = self.ratios if ratios is None else ratios
        return sum(i.cost.at(b) for i in self.instrs)

    def lines(self) -> list[str]:
        """Returns one line per instruction."""
        return [i.line(self.ratios) for i in self.instrs]

    def layouts(self) -> dict[str, Layout]:
        """Returns the layout each source and compute node is produced in."""
        return {
            i.node: i.output
            for i in self.instrs
            if i.kind in ("input", "param", "const", "op", "item") and i.output is not None
        }

    def comm_bytes_kinds(self) -> dict[str, int]:
        """Returns how many instructions of each communication kind the program has."""
        out: dict[str, int] = {}
        for i in self.instrs:
            if i.kind in COMM_KINDS:
                out[i.kind] = out.get(i.kind, 0) + 1
        return out

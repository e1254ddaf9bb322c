"""Layout conversions: the cheapest collective (and form) taking a tensor to a layout."""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.spmd.capture import GNode
from hetplan.spmd.costmodel import BACKWARD_FACTOR, Cost, Devices
from hetplan.spmd.layout import PARTIAL, REPLICATED, SFB, Layout
from hetplan.spmd.program import Instr

Conversion = tuple[list[Instr], frozenset[Layout]]


class Converter:
    """Chooses conversions for one device group at fixed ratios."""

    def __init__(self, devs: Devices, ratios: Sequence[float]) -> None:
        self.devs, self.n = devs, devs.n
        self.b = [float(x) for x in ratios]

    def gather(self, size_bytes: float) -> tuple[str, Cost]:
        """Returns the cheaper all-gather form ('padded' or 'grouped') and its cost."""
        forms = [(self.devs.allgather(size_bytes, f), f) for f in ("padded", "grouped")]
        cost, form = min(forms, key=lambda x: x[0].at(self.b))
        return form, cost

    def valid_shard(self, node: GNode, lay: Layout) -> bool:
        """Returns whether ``node``'s tensor can be split as ``lay``."""
        if lay.kind != "S":
            return True
        if lay.dim >= len(node.shape) or lay.granule <= 0:
            return False
        size = node.shape[lay.dim]
        return size % lay.granule == 0 and size // lay.granule >= self.n

    def _to_replicated(self, t: GNode, have: frozenset[Layout], k: float) -> list[Instr] | None:
        best: tuple[float, list[Instr]] | None = None
        for h in sorted(have):
            if h.kind == "S":
                form, c = self.gather(t.bytes)
                ins = Instr("all_gather", t.name, REPLICATED, src=h, form=form, cost=c.scaled(k))
            elif h.kind == "P":
                ins = Instr(
                    "all_reduce",
                    t.name,
                    REPLICATED,
                    src=h,
                    cost=self.devs.allreduce(t.bytes).scaled(k),
                )
            else:
                continue
            if best is None or ins.cost.at(self.b) < best[0]:
                best = (ins.cost.at(self.b), [ins])
        return None if best is None else best[1]

    def convert(self, t: GNode, have: frozenset[Layout], want: Layout) -> Conversion | None:
        """Returns the cheapest instructions making ``t`` available as ``want``, or None.

        A collective on a tensor that needs a gradient is charged twice (its backward
        dual moves the same bytes). R to S (slice) and R to P (mask) are local.
        """
        if want in have:
            return [], have
        if t.is_tuple or want == SFB or SFB in have or not self.valid_shard(t, want):
            return None
        k = BACKWARD_FACTOR if t.requires_grad else 1.0
        opts: list[tuple[float, list[Instr], set[Layout]]] = []

        def add(instrs: list[Instr], extra: Sequence[Layout]) -> None:
            opts.append((sum(x.cost.at(self.b) for x in instrs), instrs, set(extra)))

        if want.kind == "R":
            via = self._to_replicated(t, have, k)
            if via is not None:
                add(via, [REPLICATED])
        elif want.kind == "S":
            if REPLICATED in have:
                add([Instr("slice", t.name, want, src=REPLICATED)], [want])
            for h in sorted(have):
                kind = {"P": "reduce_scatter", "S": "all_to_all"}.get(h.kind)
                if kind is None:
                    continue
                for form in ("padded", "grouped"):
                    c = (
                        self.devs.allgather(t.bytes, form)
                        if kind == "reduce_scatter"
                        else self.devs.alltoall(t.bytes, form, self.b)
                    )
                    add([Instr(kind, t.name, want, src=h, form=form, cost=c.scaled(k))], [want])
        elif want.kind == "P":
            mask = Instr("mask", t.name, PARTIAL, src=REPLICATED)
            if REPLICATED in have:
                add([mask], [PARTIAL])
            else:
                via = self._to_replicated(t, have, k)
                if via is not None:
                    add([*via, mask], [REPLICATED, PARTIAL])
        if not opts:
            return None
        _, instrs, new = min(opts, key=lambda o: o[0])
        return instrs, frozenset(have | new)

"""The search space: nodes in order, their rules, and the transitions under fixed ratios.

A state is the next node's index and, for every live tensor, the set of layouts it is
already available in. A step runs the next node under one rule, first converting its
inputs (choosing the cheapest collective and form), and charges every instruction's
time at the current ratios. A source (input, constant, parameter) with a single use is
placed by its consumer's rule directly (it never enters the state); a parameter the
rule needs replicated is either stored replicated (gradient all-reduce) or ZeRO-sharded
(all-gather in forward, reduce-scatter of its gradient in backward).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetplan.spmd.capture import Captured, GNode
from hetplan.spmd.convert import Converter
from hetplan.spmd.costmodel import Cost, Devices, param_state_factor
from hetplan.spmd.layout import PARTIAL, REPLICATED, SFB, Layout, shard
from hetplan.spmd.program import Instr
from hetplan.spmd.rules import (
    MATCH,
    Rule,
    compute_rules,
    consumers,
    reshape_granules,
    sfb_eligible,
    source_rules,
)
from hetplan.spmd.work import op_work, sharded_letter

State = tuple[tuple[str, frozenset[Layout]], ...]
"""The live tensors with their layouts, in the order the search produced them (one state,
one tuple: a step updates the layouts of tensors already live, where they are, and adds
only its own node's tensor, which comes last)."""
SOURCES = ("input", "param", "const")
Variant = tuple[list[Instr], float, float]


@dataclass(frozen=True)
class Step:
    """The outcome of running one node under one rule from given input layouts."""

    instrs: tuple[Instr, ...]
    cost_s: float
    updates: tuple[tuple[str, frozenset[Layout]], ...]
    """The layouts tensors are available in after the step (as ``Space.steps`` returns it:
    only tensors used after the node)."""
    rep_bytes: float
    shard_bytes: float


def search_order(
    cap: Captured, uses: dict[str, list[tuple[GNode, int]]], inline: set[str]
) -> list[GNode]:
    """Returns the nodes to search, in graph order, each shared source moved to its first use.

    Inline (single-use) sources are left out: their consumer places them.
    """
    placed: set[str] = set()
    out: list[GNode] = []
    for node in cap.nodes:
        if node.op in SOURCES:
            if not uses[node.name] and node.name not in inline:
                out.append(node)
                placed.add(node.name)
            continue
        for t in node.inputs:
            if cap.node(t).op in SOURCES and t not in placed and t not in inline:
                out.append(cap.node(t))
                placed.add(t)
        out.append(node)
    return out


class Space(Converter):
    """Nodes, rules and transitions of one graph on one device group at fixed ratios."""

    def __init__(
        self,
        cap: Captured,
        devs: Devices,
        ratios: Sequence[float],
        restrict: str | None = None,
        memory_limit: bool = True,
        exact_memory: bool = False,
    ) -> None:
        super().__init__(devs, ratios)
        self._cost_memo: dict[tuple[str, Rule], Cost] = {}
        self.exact_memory = exact_memory
        """Merge duplicate states only when dominated in time and memory (slower)."""
        self.cap, self.restrict = cap, restrict
        uses = consumers(cap)
        self.inline = {
            n.name
            for n in cap.nodes
            if n.op in SOURCES and len(uses[n.name]) == 1 and uses[n.name][0][0].op == "compute"
        }
        self.nodes = search_order(cap, uses, self.inline)
        index = {node.name: i for i, node in enumerate(self.nodes)}
        self.last_use = {
            name: max([index[u.name] for u, _ in us], default=index.get(name, -1))
            for name, us in uses.items()
        }
        self.sfb: set[str] = set()
        if restrict != "dp" and self.n > 1:
            self.sfb = {p.name for p in cap.nodes if sfb_eligible(p, uses[p.name])}
        self.rules: list[list[Rule]] = [
            compute_rules(node, cap, self.n, self.sfb)
            if node.op == "compute"
            else [Rule((), REPLICATED, False)]
            for node in self.nodes
        ]
        self.granules = sorted(reshape_granules([r for rs in self.rules for r in rs]) | {1})
        for i, node in enumerate(self.nodes):
            if node.op in SOURCES:
                rs = source_rules(node, uses[node.name], self.n, restrict, self.granules)
                self.rules[i] = [r for r in rs if r.output != SFB or node.name in self.sfb]
        finite = bool(np.isfinite(np.asarray(devs.capacity_bytes)).any())
        self.capacity = np.asarray(devs.capacity_bytes) if memory_limit and finite else None
        self.h_node = [
            min((self.intrinsic(i, r) for r in rs), default=0.0) for i, rs in enumerate(self.rules)
        ]
        self.h_suffix = np.concatenate([np.cumsum(self.h_node[::-1])[::-1], [0.0]]).tolist()
        self._memo: dict[tuple[object, ...], list[Step]] = {}
        self._lb_memo: dict[tuple[str, frozenset[Layout], int], float] = {}
        self._accept_memo: dict[str, list[tuple[int, list[Layout]]]] = {}
        pairs = {(float(b), float(c)) for b, c in zip(self.b, devs.capacity_bytes, strict=True)}
        self._cap_pairs = sorted(pairs)

    def use_exact_memory(self) -> None:
        """Switches to merging duplicate states only when dominated in time and memory."""
        self.exact_memory = True
        self._memo.clear()

    # -- costs ----------------------------------------------------------------------------

    def compute_cost(self, node: GNode, rule: Rule) -> Cost:
        """Returns the forward+backward compute cost of ``node`` under ``rule``, priced by
        the cost model's blocks (``Devices.op_cost``) at this space's ratios.

        Under a sufficient-factor rule the sharded part is the forward and the input
        gradient; the weight gradient is rebuilt whole on every rank from the gathered
        factors (one matmul of the full shape)."""
        key = (node.name, rule)
        hit = self._cost_memo.get(key)
        if hit is not None:
            return hit
        letter = sharded_letter(node, rule)
        if rule.note == "sfb":
            x_grad = int(self.cap.node(node.inputs[0]).requires_grad)
            part = self.devs.op_cost(op_work(node, self.cap, x_grad), letter, True, self.b)
            whole = self.devs.op_cost(op_work(node, self.cap, 0), None, False, self.b)
            out = Cost(part.const_s + whole.const_s, 0.0, part.shard_s)
        else:
            out = self.devs.op_cost(op_work(node, self.cap), letter, rule.sharded, self.b)
        self._cost_memo[key] = out
        return out

    def intrinsic(self, i: int, rule: Rule) -> float:
        """Returns a lower bound of any step's cost under ``rule`` (the heuristic's term)."""
        node = self.nodes[i]
        if node.op == "compute":
            t = self.compute_cost(node, rule).at(self.b)
            if rule.note == "sfb":
                for name in (node.inputs[0], node.name):
                    t += self.gather(self.cap.node(name).bytes)[1].at(self.b)
            for name, lay in zip(node.inputs, rule.inputs, strict=True):
                if name in self.inline and lay.kind in ("R", "P"):
                    costs = [
                        sum(x.cost.at(self.b) for x in v[0])
                        for v in self.place(self.cap.node(name), lay)
                    ]
                    t += min(costs, default=0.0)
            return t
        if node.op == "param" and rule.output == REPLICATED and node.requires_grad:
            return self.devs.allreduce(node.bytes).at(self.b)
        return 0.0

    def _mem(self, node: GNode, lay: Layout, factor: float = 1.0) -> tuple[float, float]:
        size = node.bytes * factor
        return (0.0, size) if lay.kind == "S" else (size, 0.0)

    def fits(self, rep_bytes: float, shard_bytes: float) -> bool:
        """Returns whether every device holds ``rep_bytes + b_i * shard_bytes``."""
        if self.capacity is None:
            return True
        return all(rep_bytes + b * shard_bytes <= c for b, c in self._cap_pairs)

    # -- placing sources --------------------------------------------------------------------

    def _storages(self, t: GNode, want: Layout) -> list[Layout]:
        if t.op == "param":
            if self.restrict == "dp":
                return [REPLICATED]
            if want == SFB:
                return [SFB] if t.name in self.sfb else []
            if want.kind == "S":
                return [want]
            zero = [
                shard(d)
                for d in sorted(range(len(t.shape)), key=lambda d: -t.shape[d])
                if self.valid_shard(t, shard(d))
            ][:1]
            return [REPLICATED, *zero]
        if self.restrict == "dp" and t.op == "input" and self.valid_shard(t, shard(0)):
            return [shard(0)]
        if want == SFB:
            return []
        return [want] if want.kind in ("R", "S") else [REPLICATED]

    def place(self, t: GNode, want: Layout) -> list[Variant]:
        """Returns the ways to store source ``t`` and make it available as ``want``."""
        out: list[Variant] = []
        factor = param_state_factor(t.itemsize) if t.op == "param" else 1.0
        for store in self._storages(t, want):
            if not self.valid_shard(t, store):
                continue
            zero = t.op == "param" and store.kind == "S" and want.kind != "S"
            instrs = [
                Instr(t.op, t.name, store, note="zero" if zero else "sfb" if store == SFB else "")
            ]
            if t.op == "param" and store == REPLICATED and t.requires_grad:
                instrs.append(
                    Instr(
                        "grad_all_reduce",
                        t.name,
                        REPLICATED,
                        src=PARTIAL,
                        cost=self.devs.allreduce(t.bytes),
                    )
                )
            rep, shd = self._mem(t, store, factor)
            conv = self.convert(t, frozenset([store]), want)
            if conv is None:
                continue
            for new in conv[1] - {store}:
                r, s = self._mem(t, new)
                rep, shd = rep + r, shd + s
            out.append((instrs + conv[0], rep, shd))
        return out

    # -- steps ----------------------------------------------------------------------------

    def steps(self, i: int, avail: dict[str, frozenset[Layout]]) -> list[Step]:
        """Returns every step from a state whose live tensors have ``avail`` layouts."""
        node = self.nodes[i]
        key = (i, tuple(avail.get(t, frozenset()) for t in node.inputs))
        hit = self._memo.get(key)
        if hit is None:
            last = self.last_use
            hit = [
                s
                if all(last[t] > i for t, _ in s.updates)
                else replace(s, updates=tuple(u for u in s.updates if last[u[0]] > i))
                for r in self.rules[i]
                for s in self._steps(i, r, avail)
            ]
            self._memo[key] = hit
        return hit

    def successors(self, i: int, state: State) -> list[tuple[Step, State]]:
        """Returns every step from ``state`` at node ``i`` (``steps``) with the state after
        it (``advance``), the tensors that stay live read once for all of them."""
        kept = self._kept(i, state)
        return [(step, _after(kept, step)) for step in self.steps(i, dict(state))]

    def _kept(self, i: int, state: State) -> dict[str, frozenset[Layout]]:
        """Returns the tensors of ``state`` still used after node ``i``, in its order."""
        last = self.last_use
        return {t: ls for t, ls in state if last[t] > i}

    def _resolve(
        self, node: GNode, rule: Rule, avail: dict[str, frozenset[Layout]]
    ) -> list[tuple[list[Layout], Layout]]:
        grans = [1]
        for t, lay in zip(node.inputs, rule.inputs, strict=True):
            if lay.kind == "S" and lay.granule == MATCH:
                if t in self.inline:
                    grans = self.granules
                else:
                    have = [
                        h.granule for h in avail.get(t, ()) if h.kind == "S" and h.dim == lay.dim
                    ]
                    grans = [min(have, default=1)]
                break
        out = []
        for g in grans:
            ins = [
                shard(x.dim, g) if x.kind == "S" and x.granule == MATCH else x for x in rule.inputs
            ]
            res = rule.output
            if res.kind == "S" and res.granule == MATCH:
                if (g * rule.gran_mul) % rule.gran_div:
                    continue
                res = shard(res.dim, g * rule.gran_mul // rule.gran_div)
            if self.valid_shard(node, res):
                out.append((ins, res))
        return out

    def _source_step(self, node: GNode, rule: Rule) -> Step:
        lay = rule.output
        instrs = [Instr(node.op, node.name, lay, note=rule.note)]
        if node.op == "param" and lay == REPLICATED and node.requires_grad:
            instrs.append(
                Instr(
                    "grad_all_reduce",
                    node.name,
                    REPLICATED,
                    src=PARTIAL,
                    cost=self.devs.allreduce(node.bytes),
                )
            )
        factor = param_state_factor(node.itemsize) if node.op == "param" else 1.0
        rep, shd = self._mem(node, lay, factor)
        return Step(
            tuple(instrs),
            sum(x.cost.at(self.b) for x in instrs),
            ((node.name, frozenset([lay])),),
            rep,
            shd,
        )

    def _steps(self, i: int, rule: Rule, avail: dict[str, frozenset[Layout]]) -> list[Step]:
        node = self.nodes[i]
        if node.op in SOURCES:
            return [self._source_step(node, rule)]
        if node.op == "item":
            (lay,) = avail[node.inputs[0]]
            rep, shd = self._mem(node, lay)
            return [
                Step(
                    (Instr("item", node.name, lay),),
                    0.0,
                    ((node.name, frozenset([lay])),),
                    rep,
                    shd,
                )
            ]
        if node.op == "output":
            conv = self.convert(self.cap.node(node.inputs[0]), avail[node.inputs[0]], PARTIAL)
            if conv is None:
                return []
            instrs = [*conv[0], Instr("output", node.inputs[0], PARTIAL)]
            return [Step(tuple(instrs), sum(x.cost.at(self.b) for x in instrs), (), 0.0, 0.0)]
        return [
            s
            for ins, out in self._resolve(node, rule, avail)
            for s in self._compute_steps(node, rule, ins, out, avail)
        ]

    def _compute_steps(
        self,
        node: GNode,
        rule: Rule,
        ins: list[Layout],
        out: Layout,
        avail: dict[str, frozenset[Layout]],
    ) -> list[Step]:
        local = dict(avail)
        shared: list[Instr] = []
        rep = shd = 0.0
        choices: list[list[Variant]] = []
        for t, lay in zip(node.inputs, ins, strict=True):
            tn = self.cap.node(t)
            if t in self.inline:
                variants = self.place(tn, lay)
                if not variants:
                    return []
                if self.capacity is None or not self.exact_memory:
                    variants = [min(variants, key=lambda v: sum(x.cost.at(self.b) for x in v[0]))]
                choices.append(variants)
                continue
            conv = self.convert(tn, local[t], lay)
            if conv is None:
                return []
            shared += conv[0]
            for new in conv[1] - local[t]:
                r, s = self._mem(tn, new)
                rep, shd = rep + r, shd + s
            local[t] = conv[1]
        tail = [
            Instr(
                "op",
                node.name,
                out,
                tuple(ins),
                sharded=rule.sharded,
                note=rule.note,
                cost=self.compute_cost(node, rule),
                label=node.label(),
            )
        ]
        if rule.note == "sfb":
            for name in (node.inputs[0], node.name):
                form, c = self.gather(self.cap.node(name).bytes)
                tail.append(Instr("sfb_gather", name, REPLICATED, src=ins[0], form=form, cost=c))
        r, s = self._mem(node, out)
        updates = {t: local[t] for t in set(node.inputs) if t not in self.inline}
        updates[node.name] = frozenset([out])
        frozen = tuple(sorted(updates.items()))
        steps = []
        for combo in itertools.product(*choices):
            instrs = [x for v in combo for x in v[0]] + shared + tail
            steps.append(
                Step(
                    tuple(instrs),
                    sum(x.cost.at(self.b) for x in instrs),
                    frozen,
                    rep + r + sum(v[1] for v in combo),
                    shd + s + sum(v[2] for v in combo),
                )
            )
        return steps

    # -- heuristic ------------------------------------------------------------------------

    def _accepts(self, t: str) -> list[tuple[int, list[Layout]]]:
        """Returns, per later consumer of ``t`` (by index), the layouts its rules take."""
        out = []
        for j, node in enumerate(self.nodes):
            if t not in node.inputs or node.op not in ("compute", "output"):
                continue
            lays: list[Layout] = []
            for rule in self.rules[j]:
                if node.op == "output":
                    lays.append(PARTIAL)
                    continue
                for name, lay in zip(node.inputs, rule.inputs, strict=True):
                    if name == t:
                        lays.append(lay)
            out.append((j, sorted(set(lays))))
        return out

    def _lower_conv(self, t: str, have: frozenset[Layout], i: int) -> float:
        key = (t, have, i)
        hit = self._lb_memo.get(key)
        if hit is not None:
            return hit
        if t not in self._accept_memo:
            self._accept_memo[t] = self._accepts(t)
        wants = [lay for j, lays in self._accept_memo[t] if j >= i for lay in lays]
        node = self.cap.node(t)
        best = 0.0
        if wants and not node.is_tuple:
            kinds = {(h.kind, h.dim) for h in have}
            if not any(
                w in have
                or (w.kind == "S" and ("S", w.dim) in kinds)
                or (w.kind == "P" and REPLICATED in have)
                for w in wants
            ):
                costs = []
                for w in wants:
                    conv = self.convert(node, have, shard(w.dim) if w.kind == "S" else w)
                    if conv is not None:
                        costs.append(sum(x.cost.at(self.b) for x in conv[0]))
                best = min(costs, default=0.0)
        self._lb_memo[key] = best
        return best

    def h(self, i: int, state: State) -> float:
        """Returns the admissible cost-to-go estimate of ``state`` before node ``i``.

        The cheapest rule of every remaining node, plus, for every live tensor that no
        remaining consumer can take in a layout it already has, the cheapest first
        conversion to a layout some consumer takes.
        """
        return self.h_suffix[i] + sum(self._lower_conv(t, have, i) for t, have in state)

    def advance(self, i: int, state: State, step: Step) -> State:
        """Returns the state after ``step`` at node ``i``, dropping dead tensors (the step's
        own updates hold only tensors used after node ``i``: ``steps``)."""
        return _after(self._kept(i, state), step)


def _after(kept: dict[str, frozenset[Layout]], step: Step) -> State:
    """Returns the state of the tensors ``kept`` once ``step`` has run: the layouts it
    changes where they are, its node's tensor last."""
    live = kept.copy()
    live.update(step.updates)
    return tuple(live.items())

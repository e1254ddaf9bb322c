"""Synthesis: alternate A* (program at fixed ratios) and the ratio LP until no gain."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hetplan.spmd.capture import Captured
from hetplan.spmd.costmodel import Devices, check_ratios
from hetplan.spmd.program import Program
from hetplan.spmd.ratios import solve_ratios
from hetplan.spmd.search import SearchResult, search
from hetplan.spmd.space import Space

TOLERANCE = 1e-3
"""Relative gain below which the search/LP alternation stops (0.1%: far below the cost
model's accuracy; the LP's efficiencies are frozen at the searched ratios, so rounds
creep by such steps)."""


@dataclass
class Synthesis:
    """The synthesised program with its baselines."""

    program: Program
    predicted_time_s: float
    dp_ev_time_s: float
    dp_cp_time_s: float
    synthesis_time_s: float
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON object printed by ``hetplan spmd plan --json``."""
        b = self.program.ratios
        return {
            "program": [i.to_dict(b) for i in self.program.instrs],
            "devices": list(self.program.devices),
            "ratios": b,
            "predicted_time_s": self.predicted_time_s,
            "dp_ev_time_s": self.dp_ev_time_s,
            "dp_cp_time_s": self.dp_cp_time_s,
            "speedup_vs_dp_ev": self.dp_ev_time_s / self.predicted_time_s,
            "speedup_vs_dp_cp": self.dp_cp_time_s / self.predicted_time_s,
            "synthesis_time_s": self.synthesis_time_s,
            "rounds": self.rounds,
        }


def plan_at(
    cap: Captured,
    devs: Devices,
    ratios: Sequence[float],
    restrict: str | None = None,
    memory_limit: bool = True,
) -> SearchResult:
    """Returns the optimal program at fixed ``ratios`` ('dp' restricts to data parallel)."""
    b = [float(x) for x in check_ratios(ratios, devs.n)]
    return search(Space(cap, devs, b, restrict, memory_limit))


def synthesize(
    cap: Captured,
    devs: Devices,
    ratios: Sequence[float] | None = None,
    max_rounds: int = 6,
    memory_limit: bool = True,
    fixed_ratios: bool = False,
) -> Synthesis:
    """Returns the best program and ratios, alternating A* and the ratio LP.

    Starts from ``ratios`` (default: FLOP/s-proportional). With ``fixed_ratios`` the
    ratios are kept (one A* run). The LP only proposes ratios (its times are linearised
    at the ratios the program was priced at, see ``costmodel``); every reported time is
    a search's own pricing at its ratios, and the best of those is returned.
    """
    start = time.process_time()
    b = [
        float(x)
        for x in check_ratios(ratios if ratios is not None else devs.flops_proportional(), devs.n)
    ]
    best: tuple[float, SearchResult, list[float]] | None = None
    rounds: list[dict[str, Any]] = []
    for _ in range(max_rounds):
        res = plan_at(cap, devs, b, memory_limit=memory_limit)
        rounds.append({"ratios": b, "search_time_s": res.cost_s, "expanded": res.expanded})
        if best is not None and res.cost_s >= best[0] * (1 - TOLERANCE):
            break
        best = (res.cost_s, res, b)
        if fixed_ratios:
            break
        lp = solve_ratios(res.instrs, devs, res.rep_bytes, res.shard_bytes, memory_limit)
        if lp is None or lp[1] >= res.cost_s * (1 - TOLERANCE):
            break
        rounds[-1]["lp_time_s"] = lp[1]
        b = lp[0]
    assert best is not None
    _, res, b = best
    program = Program(res.instrs, b, devs.names, {"expanded": res.expanded})
    ev = plan_at(cap, devs, devs.even(), "dp", memory_limit=False).cost_s
    cp = plan_at(cap, devs, devs.flops_proportional(), "dp", memory_limit=False).cost_s
    elapsed = time.process_time() - start
    return Synthesis(program, program.time_s(), ev, cp, elapsed, rounds)

"""The result of the heterogeneous search: its ranked plans, the two baselines, and what
it saw on the way."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetplan.cost.estimate_result import Estimate
from hetplan.plan import Plan


@dataclass
class HeteroResult:
    """The best plans found, the two baselines, and what the search saw."""

    ranked: list[tuple[Plan, Estimate]]
    baselines: dict[str, tuple[Plan, Estimate] | None]
    search_time_s: float
    notes: list[str] = field(default_factory=list)
    min_memory_bytes: float = math.inf
    """The least per-GPU peak of any plan weighed (inf: none was, no split of the layers
    fitting any stage)."""
    state_floor_bytes: float = 0.0
    """What every plan needs per GPU on average for weights, gradients and optimizer state,
    sharded over every GPU (so some GPU needs at least this)."""
    proven: bool = False
    """Whether the enumeration completed: the first plan is the best of the whole space."""
    evaluated: int = 0
    """Plans estimated (the rest were ruled out by their lower bound)."""

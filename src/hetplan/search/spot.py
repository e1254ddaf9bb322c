"""The spot-instance model used by provisioning: how preemptions stretch a run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.market import Offer


@dataclass(frozen=True)
class SpotTerms:
    """How preemptions stretch a spot run."""

    checkpoint_interval_s: float = 1800.0
    """Work lost per preemption is half an interval on average."""


def spot_slowdown(offer: Offer, nodes: int, terms: SpotTerms) -> float:
    """Returns wall time / useful time under preemptions (inf when the run never progresses).

    Preemptions arrive at ``rate x nodes`` per hour; each costs the restart plus, on average,
    half a checkpoint interval of lost work.
    """
    per_s = offer.preemption_rate_per_node_hour * nodes / 3600.0
    lost = offer.restart_s + terms.checkpoint_interval_s / 2.0
    useful = 1.0 - per_s * lost
    return math.inf if useful <= 0 else 1.0 / useful

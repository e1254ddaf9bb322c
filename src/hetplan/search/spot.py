"""The spot-instance model used by provisioning: how preemptions stretch a run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.elastic.recovery import expected_recovery_s
from hetplan.market import Offer

DEFAULT_STORAGE_BYTES_PER_S = 10e9 / 8
"""10 Gbit/s to object storage when the market names none: an assumption, not a measurement."""


@dataclass(frozen=True)
class SpotTerms:
    """How preemptions stretch a spot run."""

    checkpoint_interval_s: float = 1800.0
    """Work lost per preemption is half an interval on average."""
    state_bytes: float = 0.0
    """Training state a replacement node must recover (weights and optimizer states)."""
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S


def recovery_s(offer: Offer, nodes: int, terms: SpotTerms) -> float:
    """Returns the modelled time to restore a replaced node's state, peers first (elastic/)."""
    if terms.state_bytes <= 0:
        return 0.0
    return expected_recovery_s(
        terms.state_bytes, nodes, offer.network_bytes_per_s, terms.storage_bytes_per_s
    )


def spot_slowdown(offer: Offer, nodes: int, terms: SpotTerms) -> float:
    """Returns wall time / useful time under preemptions (inf when the run never progresses).

    Preemptions arrive at ``rate x nodes`` per hour; each costs the restart, the recovery of
    the lost node's training state (from surviving peers first, storage for the rest), and on
    average half a checkpoint interval of lost work.
    """
    per_s = offer.preemption_rate_per_node_hour * nodes / 3600.0
    lost = offer.restart_s + recovery_s(offer, nodes, terms) + terms.checkpoint_interval_s / 2.0
    useful = 1.0 - per_s * lost
    return math.inf if useful <= 0 else 1.0 / useful

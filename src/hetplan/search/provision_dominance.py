"""Offers another offer dominates: provisioning leaves their configurations out unplanned.

Offer A dominates offer B when a node of A is at least as good as a node of B in every
figure the cost model reads, and costs no more: the same GPUs per node; the same fitted
efficiencies (``CostParams.gpu``: one fitted set, or both on the default) and no measured
profile; at least B's peak FLOP/s at every precision B computes at, HBM bandwidth, memory
(after the user's headroom), intra-node and network bandwidth; no higher price at the
job's pricing; on spot, no more preemptions per node-hour and no longer restart (the
recovery reads the network, already no slower).

Then every plan of a configuration holding b nodes of B runs on the configuration with
those nodes swapped for b nodes of A (b up to A's ``max_nodes``): it fits (no less memory),
takes no longer (``estimate`` is monotone in these figures: faster compute, memory and
links never lengthen a step, the schedule's replay being a max-plus system), is preempted
no more often for no longer, and costs less an hour, so its point is dominated by the swapped
configuration's best. The swapped configuration is itself planned, pruned by a proven
bound, or left out the same way, so the front is the same:

* B alone with n nodes: A alone with n nodes (the homogeneous search's space depends only
  on the node shape and count, and memory);
* a mix of B and X: the mix of A and X at the same counts, where X is not A (both searched
  by the heterogeneous search over the same space).

A mix of A and B maps onto A alone, whose single-type search does not hold every mixed
plan's layout: it stays. Identical offers dominate each other; the first in the list is
kept (a strict order, so no chain of swaps comes back to where it began).
``tests/search/test_provision_dominance.py`` checks the premise plan by plan (every plan of
small mixes, swapped) and the front against provisioning without pruning."""

from __future__ import annotations

from hetplan.market import Offer
from hetplan.plan import PRECISIONS
from hetplan.search.provision_points import ProvisionJob, gpu_memory


def _peaks(offer: Offer) -> dict[str, float]:
    gpu = offer.gpu
    return {p: gpu.peak_flops(p) for p in PRECISIONS if gpu.supports(p)}


def at_least_as_good(job: ProvisionJob, a: Offer, b: Offer) -> bool:
    """Returns whether a node of offer ``a`` is at least as good as one of ``b`` in every
    figure the cost model and the spot terms read, at no higher price (module docstring)."""
    params = job.params
    if params.profile is not None or a.gpus_per_node != b.gpus_per_node:
        return False
    if params.gpu(a.gpu.name) != params.gpu(b.gpu.name):
        return False
    peaks_a, peaks_b = _peaks(a), _peaks(b)
    if any(p not in peaks_a or peaks_a[p] < f for p, f in peaks_b.items()):
        return False
    if (a.gpu.hbm_bytes_per_s < b.gpu.hbm_bytes_per_s
            or gpu_memory(job, a) < gpu_memory(job, b)
            or a.intra_node_bytes_per_s < b.intra_node_bytes_per_s
            or a.network_bytes_per_s < b.network_bytes_per_s):  # fmt: skip
        return False
    if a.price(job.pricing) > b.price(job.pricing):
        return False
    # on spot, no more preemptions and no longer restarts
    return not job.spot or (a.preemption_rate_per_node_hour <= b.preemption_rate_per_node_hour
                            and a.restart_s <= b.restart_s)  # fmt: skip


def dominators(job: ProvisionJob, offers: list[Offer]) -> dict[str, list[Offer]]:
    """Returns, per offer name, the offers that dominate it (none: not a key). Of two
    offers as good as each other, the one listed first dominates. Empty without pruning."""
    if not job.prune:
        return {}
    out: dict[str, list[Offer]] = {}
    for j, b in enumerate(offers):
        for i, a in enumerate(offers):
            if i == j or not at_least_as_good(job, a, b):
                continue
            if i > j and at_least_as_good(job, b, a):
                continue  # as good as each other: the first one stays
            out.setdefault(b.name, []).append(a)
    return out


def swap_cap(by: dict[str, list[Offer]], offer: Offer, partner: Offer | None = None) -> int:
    """Returns the most nodes of ``offer`` that a dominating offer other than ``partner``
    can stand in for (0: none): configurations with at most that many are left out."""
    return max(
        (a.max_nodes for a in by.get(offer.name, ()) if partner is None or a.name != partner.name),
        default=0,
    )


def described(by: dict[str, list[Offer]]) -> dict[str, str]:
    """Returns, per dominated offer, the first offer dominating it (for the report)."""
    return {name: offers[0].name for name, offers in by.items()}

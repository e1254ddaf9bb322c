"""Measured network figures: achieved bandwidth as a function of message size.

Two kinds of record answer ``ProfileDB.network_bandwidth``: Sailor's quadratic fits and
measured points (size, bytes/s). Pure functions here; the database stores and finds them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

SCOPES = ("intra", "inter")
"""intra: GPUs of one node; inter: between nodes (the count is GPUs per node)."""


@dataclass(frozen=True)
class SailorFit:
    """Sailor's fit of achieved bandwidth against message size, and the measured maximum.

    ``c2, c1, c0`` give GB/s (1e9 bytes/s) as ``c2 x^2 + c1 x + c0`` with
    ``x = log2(size_bytes / 1e6)`` (the message size in MB, on a log2 scale).
    """

    c2: float
    c1: float
    c0: float
    max_bytes_per_s: float


def sailor_bandwidth(fit: SailorFit, size_bytes: float) -> float | None:
    """Returns the achieved bytes/s Sailor's fit gives for ``size_bytes``, capped at the
    highest measured bandwidth; None where the fit is not positive (tiny messages, far
    outside the sizes it was fitted on).

    The evaluation is Sailor's own (eth-easl/sailor, ``sailor/providers/gcp/model_networking.py``
    ``get_bw_on_config``, and ``sailor/Planner/sailor_planner/cpp_src/network_utils.cpp``
    ``get_network_bandwidth``): ``x_mb = log2(size / 1e6)``, ``bw_gb = c2 x_mb^2 + c1 x_mb + c0``
    in GB/s; the coefficients come from ``np.polyfit(np.log2(bytes / 1e6), bw_GB_s, 2)``.
    Sailor's planner uses the polynomial uncapped; the cap is ours, since the parabola
    rises past the largest bandwidth ever measured for large messages.
    """
    if size_bytes <= 0:
        return None
    x = math.log2(size_bytes / 1e6)
    bw = ((fit.c2 * x + fit.c1) * x + fit.c0) * 1e9
    if bw <= 0:
        return None
    return min(bw, fit.max_bytes_per_s)


def point_bandwidth(points: Sequence[tuple[float, float]], size_bytes: float) -> float | None:
    """Returns bytes/s at ``size_bytes`` from measured (size_bytes, bytes_per_s) points sorted
    by size: linear in log2(size) between the two neighbours, the largest point's value
    beyond it (bandwidth saturates), None below the smallest (latency dominates there)."""
    if not points or size_bytes <= 0 or size_bytes < points[0][0]:
        return None
    if size_bytes >= points[-1][0]:
        return points[-1][1]
    i = bisect_left([p[0] for p in points], size_bytes)
    s_hi, b_hi = points[i]
    if s_hi == size_bytes:
        return b_hi
    s_lo, b_lo = points[i - 1]
    w = (math.log2(size_bytes) - math.log2(s_lo)) / (math.log2(s_hi) - math.log2(s_lo))
    return b_lo + (b_hi - b_lo) * w

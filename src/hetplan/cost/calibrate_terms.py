"""The cost model's fitted terms as the fit sees them: each term's unit, bounds, prior and
meaning (``TERMS``), the bounds and priors measurements of the hardware itself set in their
place (``MEASURED_BOUNDS``), their packing into the fit's vector (log-scaled where the term
is), the report of each fitted value, and the default for GPU types without runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetplan.cost.params import CostParams, GPUEfficiency


@dataclass(frozen=True)
class Term:
    """One fitted term of the cost model: a physical quantity with a unit and bounds."""

    name: str
    unit: str
    lower: float
    upper: float
    prior: float
    log: bool
    meaning: str
    scale: float = 0.0
    """Linear terms: the distance from the prior that costs as much as doubling a log term
    (0: the prior itself, for terms whose prior is not 0)."""

    def prior_residual(self, x: float, prior: float | None = None) -> float:
        """Returns the weighted distance of the packed value ``x`` from the prior (the
        term's own, or ``prior``)."""
        p = self.prior if prior is None else prior
        if self.log:
            return PRIOR_WEIGHT * (x - math.log(p))
        return PRIOR_WEIGHT * (x - p) / (self.scale or self.prior)


TERMS = (
    Term("gemm_max", "fraction of peak", 0.05, 0.95, 0.7, False,
         "large matmuls' share of the datasheet peak"),
    Term("gemm_half_dim", "elements", 4.0, 4096.0, 128.0, True,
         "smallest matmul dimension at which matmuls reach half of gemm_max (small "
         "micro-batches and narrow TP shards run far below peak)"),
    Term("mem_efficiency", "fraction of HBM bandwidth", 0.3, 0.95, 0.75, False,
         "elementwise kernels' share of the memory bandwidth"),
    Term("kernel_overhead_s", "s per kernel", 1e-6, 1e-4, 8e-6, True,
         "launch and framework cost of one kernel"),
    Term("microbatch_overhead_s", "s per micro-batch per stage", 1e-5, 0.05, 1e-3, True,
         "fixed cost of each micro-batch on each stage (pipeline engine, p2p handshakes)"),
    Term("link_efficiency", "fraction of intra-node bandwidth", 0.2, 0.95, 0.7, False,
         "collectives' and sends' share of the NVLink/PCIe bandwidth"),
    Term("network_efficiency", "fraction of network bandwidth", 0.1, 0.95, 0.6, False,
         "collectives' and sends' share of the inter-node network bandwidth"),
    Term("profile_sync_s", "s per profiled pass", 0.0, 2e-3, 0.0, False,
         "profiler synchronisation in each measured forward/backward pass, absent in a run "
         "(0 unless runs with a profile say otherwise)", scale=1e-4),
    Term("p2p_exposed", "fraction", 0.0, 1.0, 0.5, False,
         "share of each pipeline transfer the sending and receiving stages wait for"),
    Term("grad_overlap", "fraction", 0.0, 1.0, 0.7, False,
         "share of data-parallel traffic (gradient buckets, ZeRO-3 gathers and reduce-scatters) "
         "that runs concurrently with compute without slowing it"),
    Term("intra_latency_s", "s per collective step", 1e-6, 2e-4, 10e-6, True,
         "latency of one step of a collective or a send inside a node"),
    Term("inter_latency_s", "s per collective step", 2e-6, 1e-3, 30e-6, True,
         "latency of one step of a collective or a send between nodes"),
    Term("tp_overlap", "fraction", 0.0, 1.0, 0.5, False,
         "share of the tensor-parallel collectives hidden under the TP matmuls when overlapped"),
)  # fmt: skip
NVLINK4 = (0.75, 0.82, 0.95)
NVLINK3 = (0.65, 0.75, 0.85)
NVSWITCH_STEP = (1e-6, 1e-5, 2e-5)
MEASURED_BOUNDS: dict[str, dict[str, tuple[float, float, float]]] = {
    # NVLink/NVSwitch collectives as NCCL measures them (busbw / line rate per direction).
    # H100 (NVLink4, 450 GB/s): "with the protocol overhead (~20%) NCCL can get an effective
    # NVLink bandwidth of 370GB/s" for ring, all-gather and reduce-scatter; all-reduce over
    # NVLink SHARP peaks at ~480 GB/s busbw (NCCL maintainer, NVIDIA/nccl-tests#212), so
    # 0.82, and up to 1.07 for a plain all-reduce. A100 (NVLink3, 300 GB/s): 8 x A100 SXM4
    # measure ~200 GB/s (NVIDIA/nccl-tests#149) to 230-250 GB/s busbw, 0.67-0.83. A fit
    # left free put H100 at 0.28 and A100-80GB on the 0.95 bound, which no measurement of
    # these links supports; without runs that time TP collectives alone, the data cannot
    # separate link speed from the other terms.
    # Per-step latency inside an NVSwitch node: a whole small all-reduce takes ~6 us on 2
    # H100s over NVLink SHARP (NVIDIA/nccl#1259) and ~3.5 us on 4 H800s by ring
    # (NVIDIA/nccl#1984), under 2 us a step; 20 us a step (280 us for an 8-GPU ring) is
    # a generous ceiling. Left free, the fit used this term as a per-collective framework
    # cost (118 us a step on H100).
    "H100-80GB": {"link_efficiency": NVLINK4, "intra_latency_s": NVSWITCH_STEP},
    "A100-80GB": {"link_efficiency": NVLINK3, "intra_latency_s": NVSWITCH_STEP},
    "A100-40GB": {"link_efficiency": NVLINK3, "intra_latency_s": NVSWITCH_STEP},
}
"""(lower, prior, upper) set by measurements of the hardware itself (not by end-to-end
runs), per GPU type, in place of ``TERMS``' bounds and prior for the fit."""
PRIOR_WEIGHT = 0.05
"""Weight of the (log-)distance of each term from its prior: a weak pull that keeps
terms the data says nothing about at their prior, and few rows from driving a term to a
bound."""


def term_bounds(t: Term, gpu: str | None = None) -> tuple[float, float]:
    """Returns the fit's bounds of term ``t`` for GPU type ``gpu`` (``MEASURED_BOUNDS``
    where the hardware was measured, else the term's own)."""
    lower, _, upper = MEASURED_BOUNDS.get(gpu or "", {}).get(t.name, (t.lower, 0.0, t.upper))
    return lower, upper


def term_prior(t: Term, gpu: str | None = None) -> float:
    """Returns the fit's prior of term ``t`` for GPU type ``gpu``."""
    return MEASURED_BOUNDS.get(gpu or "", {}).get(t.name, (0.0, t.prior, 0.0))[1]


def pack_terms(
    eff: GPUEfficiency, gpu: str | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, lo, hi = [], [], []
    for t in TERMS:
        lower, upper = term_bounds(t, gpu)
        value = getattr(eff, t.name)
        value = t.prior if value is None else value
        f = math.log if t.log else float
        x.append(f(min(max(value, lower), upper)))
        lo.append(f(lower))
        hi.append(f(upper))
    return np.array(x), np.array(lo), np.array(hi)


def unpack_terms(x: np.ndarray) -> GPUEfficiency:
    return GPUEfficiency(
        **{t.name: math.exp(float(v)) if t.log else float(v) for v, t in zip(x, TERMS, strict=True)}
    )


def with_terms(base: CostParams, gpus: tuple[str, ...], x: np.ndarray) -> CostParams:
    n = len(TERMS)
    params = base
    for i, gpu in enumerate(gpus):
        params = params.with_gpu(gpu, unpack_terms(x[i * n : (i + 1) * n]))
    return params


def prior_eff(gpu: str | None = None) -> GPUEfficiency:
    return GPUEfficiency(**{t.name: term_prior(t, gpu) for t in TERMS})


def terms_report(eff: GPUEfficiency, gpu: str | None = None) -> dict[str, dict[str, Any]]:
    """Returns each fitted term's value, unit, meaning and whether it sits on a bound (the
    GPU type's measured bounds where it has them)."""
    out = {}
    for t in TERMS:
        lower, upper = term_bounds(t, gpu)
        value = getattr(eff, t.name)
        value = t.prior if value is None else value
        clamped = min(max(value, lower), upper)
        span = (math.log(upper) - math.log(lower)) if t.log else (upper - lower)
        pos = (math.log(clamped) - math.log(lower)) if t.log else (clamped - lower)
        bound = "lower" if pos <= 1e-3 * span else "upper" if pos >= span * (1 - 1e-3) else None
        out[t.name] = {"value": value, "unit": t.unit, "meaning": t.meaning,
                       "bounds": [lower, upper], "at_bound": bound}  # fmt: skip
    return out


def with_default(params: CostParams) -> CostParams:
    """Returns ``params`` whose ``default`` (for GPU types without data) is the geometric
    mean of the fitted types, and whose global link efficiency is their mean."""
    effs = list(params.gpus.values())
    if not effs:
        return params
    mean: dict[str, float] = {}
    for t in TERMS:
        values = [getattr(e, t.name) for e in effs]
        if t.log:
            mean[t.name] = float(np.exp(np.mean(np.log(values))))
        else:
            mean[t.name] = float(np.mean(values))
    link = mean.pop("link_efficiency")
    mean.pop("network_efficiency")
    return replace(params, default=GPUEfficiency(**mean), link_efficiency=link)

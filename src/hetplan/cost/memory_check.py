"""Measured peak memory against ``estimate``'s: the tensors it counts per device (weights,
gradients, optimizer state, activations), without the reserve for what tensor accounting
leaves out (CUDA context, library workspaces, allocator slack), which a measured peak holds
in a share that depends on the framework and on how the peak was read.

The per-device tensors carry the physics (micro-batch size, recomputation, the micro-batches a
schedule keeps in flight, sharding); a set of runs of one framework on one GPU shares the rest.
So each set is reported with one offset, the median of measured minus modelled tensors, and
every run's error after it: the offset says what a plan needs beyond its tensors on that stack,
the errors whether the tensors move with the plan as measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from hetplan.cost.calibrate_data import resolve
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams
from hetplan.cost.runs import Run


@dataclass(frozen=True)
class MemoryRow:
    """One run's measured peak and the modelled tensors of its fullest device."""

    label: str
    measured_bytes: float
    tensor_bytes: float


def memory_rows(runs: list[Run], params: CostParams) -> list[MemoryRow]:
    """Returns the runs that state a measured peak, with the modelled tensors of their
    fullest device (``estimate``'s memory without its reserve)."""
    out = []
    for run in runs:
        if run.measured_peak_bytes is None:
            continue
        resolved = resolve(run, params)
        assert resolved.plan is not None
        est = estimate(resolved.plan, resolved.model, resolved.cluster, params, validate=False)
        tensors = max(s.memory.total - s.memory.reserve for s in est.stages)
        out.append(MemoryRow(run.label, run.measured_peak_bytes, tensors))
    return out


def offset_bytes(rows: list[MemoryRow]) -> float:
    """Returns the set's offset: the median of measured minus modelled tensors."""
    return statistics.median(r.measured_bytes - r.tensor_bytes for r in rows)


def errors_pct(rows: list[MemoryRow], offset: float) -> list[float]:
    """Returns each run's error of modelled tensors plus ``offset`` against its measured
    peak, per cent."""
    return [100.0 * ((r.tensor_bytes + offset) / r.measured_bytes - 1.0) for r in rows]

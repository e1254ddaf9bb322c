"""What ``estimate`` returns: per stage its times, memory and end of iteration
(``StageEstimate``), and per plan the iteration time with its breakdown, memory, throughput,
MFU and price (``Estimate``, with its JSON form)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from hetplan.cost.memory import MemoryBreakdown
from hetplan.cost.money import MoneyParts
from hetplan.cost.schedule import Replay
from hetplan.errors import InputError
from hetplan.plan import Pipeline


@dataclass
class StageEstimate:
    """One stage of one pipeline: per-micro-batch times, memory, and its end of iteration."""

    pipeline: int
    stage: int
    devices: tuple[str, ...]
    gpu: str
    layers: int
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    """Tensor-parallel collectives per micro-batch (forward, backward and recompute)."""
    send_s: float
    """Sending one micro-batch's activations to the next stage."""
    memory: MemoryBreakdown
    capacity_bytes: float
    grad_sync_s: float = 0.0
    optimizer_s: float = 0.0
    p2p_wait_s: float = 0.0
    """Per micro-batch, forward and backward: time blocked in its own pipeline transfers."""
    overhead_s: float = 0.0
    """Fixed per-micro-batch cost (all chunks, forward and backward), inside forward_s and
    backward_s."""
    zero_comm_s: float = 0.0
    """ZeRO-2/3 collectives per micro-batch not hidden behind its compute (ZeRO-2: with
    its gradient buffer's memory work, ``dp_sync.zero2_buffer_s``)."""
    param_gather_s: float = 0.0
    """ZeRO-2: all-gather of the updated parameter shards after the optimizer step."""
    compute_source: str = "analytical"
    """Where the stage's compute times came from: measured, interpolated, scaled or
    analytical (the least trustworthy of its pieces)."""
    busy_s: float = 0.0
    last_backward_end_s: float = 0.0
    sync_end_s: float = 0.0
    end_s: float = 0.0

    @property
    def per_micro_batch_s(self) -> float:
        """Returns the stage's time for one micro-batch, forward and backward."""
        return (
            self.forward_s
            + self.backward_s
            + self.recompute_s
            + self.tp_comm_s
            + self.zero_comm_s
            + self.p2p_wait_s
        )

    @property
    def headroom_bytes(self) -> float:
        """Returns free memory at the peak (negative if it does not fit)."""
        return self.capacity_bytes - self.memory.total


ITERATION_TERMS = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "tensor_parallel_comm_s",
    "pipeline_p2p_wait_s",
    "sharded_dp_comm_s",
    "pipeline_bubble_s",
    "data_parallel_sync_s",
    "optimizer_s",
    "step_collectives_s",
)
"""The breakdown's terms that add up to the iteration time of the critical stage; the
other keys (per-micro-batch send, total gradient sync, micro-batch overhead) describe
parts already inside these."""


@dataclass
class Estimate:
    """Predicted iteration time, memory, throughput and price of one plan."""

    iteration_time_s: float
    breakdown: dict[str, float]
    distinct_stages: list[StageEstimate]
    """The stages of each distinct pipeline (its first replica's index and devices):
    identical pipelines on identical hardware are costed once; ``stages`` expands them."""
    pipeline_times_s: list[float]
    fits: bool
    tokens_per_s: float
    tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    cost_usd_per_hour: float | None
    usd_per_million_tokens: float | None
    compute_source: str
    bottleneck: str
    replays: list[Replay] = field(default_factory=list, repr=False)
    peak_used: dict[str, str] = field(default_factory=dict)
    """Per GPU type: which datasheet peak the compute model and the MFU use."""
    warnings: list[str] = field(default_factory=list)
    """Why the prediction deserves less trust (uncalibrated GPU, regime no measured run
    covers, MFU above the best measured); filled by ``hetplan.cost.trust``."""
    pipeline_class: list[int] = field(default_factory=list, repr=False)
    """Per pipeline: the pipeline whose stages in ``distinct_stages`` it repeats."""
    plan_pipelines: tuple[Pipeline, ...] = field(default=(), repr=False)
    cost_parts: MoneyParts | None = None
    """``cost_usd_per_hour`` split into rental, amortisation and energy."""
    _expanded: list[StageEstimate] | None = field(default=None, repr=False, compare=False)

    @property
    def stages(self) -> list[StageEstimate]:
        """Returns every stage of every pipeline, pipeline by pipeline (a repeated pipeline
        gets copies of its class's stages with its own index and devices); built on first
        use."""
        if self._expanded is None:
            own: dict[int, list[StageEstimate]] = {}
            for st in self.distinct_stages:
                own.setdefault(st.pipeline, []).append(st)
            out: list[StageEstimate] = []
            for r, rep in enumerate(self.pipeline_class):
                if r == rep:
                    out.extend(own[rep])
                    continue
                pipe = self.plan_pipelines[r]
                out.extend(
                    replace(st, pipeline=r, devices=pipe.stages[st.stage].devices)
                    for st in own[rep]
                )
            self._expanded = out if self.pipeline_class else list(self.distinct_stages)
        return self._expanded

    @property
    def replicas(self) -> dict[int, int]:
        """Returns, per distinct pipeline (its first index), how many pipelines repeat it."""
        return dict(Counter(self.pipeline_class))

    @property
    def peak_memory_bytes(self) -> dict[str, float]:
        """Returns peak bytes per device name (every device: expands the stages)."""
        return {d: s.memory.total for s in self.stages for d in s.devices}

    @property
    def max_memory_bytes(self) -> float:
        """Returns the largest per-device peak."""
        return max(s.memory.total for s in self.distinct_stages)

    def memory_shortfall(self) -> str | None:
        """Returns None if every device holds its peak; else what the stage furthest over
        its memory needs, for a person: its first device, GPU type, place and layers, and
        its peak against its memory."""
        if self.fits:
            return None
        worst = max(self.distinct_stages, key=lambda s: s.memory.total - s.capacity_bytes)
        return (
            f"{worst.devices[0]} ({worst.gpu}, pipeline {worst.pipeline} stage {worst.stage}, "
            f"{worst.layers} layers) needs {worst.memory.total / 1e9:.1f} GB of "
            f"{worst.capacity_bytes / 1e9:.1f} GB"
        )

    def require_fit(self, option: str) -> None:
        """Raises InputError naming ``option`` where the plan does not fit in memory (a plan
        that cannot run is bad input, exit code 2), with ``memory_shortfall``."""
        shortfall = self.memory_shortfall()
        if shortfall is not None:
            raise InputError(option, f"does not fit in memory: {shortfall}")

    def to_json(self, expand: bool = False) -> dict[str, Any]:
        """Returns the JSON object the CLI prints: per distinct stage its replicas and peak
        memory; ``expand``: also the peak memory of every device."""
        count = self.replicas
        out = {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "fits": self.fits,
            "max_peak_memory_gb": round(self.max_memory_bytes / 1e9, 4),
            "cost_usd_per_hour": self.cost_usd_per_hour,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "cost_parts_usd_per_hour": None
            if self.cost_parts is None
            else self.cost_parts.to_json(),
            "cost_parts_usd_per_million_tokens": None
            if self.cost_parts is None
            else self.cost_parts.scaled(1e6 / (self.tokens_per_s * 3600)).to_json(),
            "breakdown": self.breakdown,
            "pipeline_times_s": self.pipeline_times_s,
            "compute_source": self.compute_source,
            "stages": [
                {
                    "pipeline": st.pipeline,
                    "replicas": count.get(st.pipeline, 1),
                    "stage": st.stage,
                    "gpu": st.gpu,
                    "tp": len(st.devices),
                    "layers": st.layers,
                    "peak_memory_gb": round(st.memory.total / 1e9, 4),
                    "compute_source": st.compute_source,
                }
                for st in self.distinct_stages
            ],
            "peak_used": self.peak_used,
            "bottleneck": self.bottleneck,
            "warnings": self.warnings,
        }
        if expand:
            out["peak_memory_gb"] = {
                d: round(b / 1e9, 4) for d, b in self.peak_memory_bytes.items()
            }
        return out

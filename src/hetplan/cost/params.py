"""Fitted efficiency parameters of the cost model (shipped as data/calibration.json)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from hetplan.errors import InputError


@dataclass(frozen=True)
class GPUEfficiency:
    """How close one GPU type gets to its datasheet peaks, as a function of shapes."""

    gemm_max: float = 0.75
    """Fraction of dense peak reached by a large matrix multiply."""
    gemm_half_dim: float = 128.0
    """Smallest matmul dimension at which efficiency is half of gemm_max."""
    mem_efficiency: float = 0.7
    """Fraction of HBM bandwidth reached by elementwise kernels."""
    kernel_overhead_s: float = 5e-6
    """Fixed cost per kernel launch (host-side: framework and launch latency)."""
    link_efficiency: float | None = None
    """Fraction of the nominal intra-node link bandwidth (NVLink, PCIe) that collectives and
    sends inside a node reach on nodes of this type; None: CostParams.link_efficiency."""
    network_efficiency: float | None = None
    """Fraction of the nominal network bandwidth (InfiniBand, Ethernet, Slingshot) that
    collectives and sends between nodes reach; None: the intra-node link efficiency."""
    microbatch_overhead_s: float = 0.0
    """Fixed time per micro-batch per stage and model chunk, split evenly between its forward
    and its backward action: kernel launches of the framework's step, the pipeline engine's
    bookkeeping, point-to-point handshakes (seconds)."""
    profile_sync_s: float = 0.0
    """Per timed forward or backward pass of a profiled piece: the profiler's synchronisation
    and timer cost, which a real run (queueing kernels ahead) does not pay; subtracted from
    measured times only."""
    p2p_exposed: float = 0.0
    """Share of each pipeline transfer its sending and receiving stages wait for (blocking
    send/recv: 1; transfers fully hidden behind compute: 0)."""
    grad_overlap: float = 1.0
    """Fraction of the data-parallel gradient reduction that can run under the last backward
    pass when the plan overlaps it (compute and collectives share the GPU; the last bucket
    stays exposed regardless); 0 = fully exposed."""
    intra_latency_s: float | None = None
    """Latency of one step of a collective or a send inside a node (s); None: the global
    CostParams.intra_latency_s."""
    inter_latency_s: float | None = None
    """Latency of one step of a collective or a send between nodes (s); None: the global
    CostParams.inter_latency_s."""
    tp_overlap: float = 0.5
    """Fraction of the tensor-parallel collectives hidden under the TP matmuls when the plan
    overlaps them (Megatron-Core/Transformer Engine userbuffers, with sequence
    parallelism); 0 = fully exposed."""

    def __post_init__(self) -> None:
        if not 0 < self.gemm_max <= 1 or not 0 < self.mem_efficiency <= 1:
            raise InputError("calibration", "efficiencies must lie in (0, 1]")
        for name in ("link_efficiency", "network_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise InputError(f"calibration.{name}", "must lie in (0, 1]")
        if self.gemm_half_dim < 0 or self.kernel_overhead_s < 0:
            raise InputError("calibration", "half dimension and overhead must be >= 0")
        for name in ("microbatch_overhead_s", "profile_sync_s"):
            if getattr(self, name) < 0:
                raise InputError(f"calibration.{name}", "must be >= 0")
        if not 0 <= self.p2p_exposed <= 1:
            raise InputError("calibration.p2p_exposed", "must lie in [0, 1]")
        for name in ("intra_latency_s", "inter_latency_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InputError(f"calibration.{name}", "must be >= 0")
        for name in ("grad_overlap", "tp_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise InputError(f"calibration.{name}", "must lie in [0, 1]")


SAME_SILICON = {"V100-16GB": "V100-32GB", "H200-141GB": "H100-80GB"}
"""GPU types that are one chip at the same clocks as another, which take its fitted
efficiencies when they have none of their own: the efficiencies are shares of each type's
own peaks. The SXM2 V100 with 16 or 32 GB: same GV100, 300 W, 900 GB/s HBM2. The SXM5 H200
and H100: same GH100 at 700 W with the same 989 TFLOP/s dense BF16, NVLink4 switch and one
400 Gb/s NIC per GPU in HGX nodes; the H200's HBM3e (141 GB, 4.8 TB/s) is a larger and
faster memory, which its own datasheet figures carry (gpu_specs.csv). Not here: PCIe and
SXM parts of one chip, whose power limits and clocks differ."""


@dataclass(frozen=True)
class CostParams:
    """Every fitted number of the cost model."""

    gpus: dict[str, GPUEfficiency] = field(default_factory=dict)
    """Per GPU type name; types without an entry use ``default``."""
    default: GPUEfficiency = field(default_factory=GPUEfficiency)
    link_efficiency: float = 0.8
    """Fraction of nominal link bandwidth that collectives and transfers reach."""
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 30e-6
    memory_reserve_bytes: float = 1.5e9
    """Per device, beyond the modelled tensors: CUDA context, library workspaces, caching
    allocator fragmentation, datasheet-vs-visible capacity; fitted by ``calibrate`` as the
    largest value with which every measured run still fits (OOM rows then flagged)."""
    fit_report: dict[str, Any] = field(default_factory=dict, compare=False)
    compute: Any = field(default=None, compare=False, repr=False)
    """Where compute times come from (a ``hetplan.cost.sources.ComputeSource``): measured
    profile first, analytical otherwise; set with ``with_profile``, not saved."""

    def __post_init__(self) -> None:
        if self.compute is None:
            from hetplan.cost.sources import ComputeSource

            object.__setattr__(self, "compute", ComputeSource(None))

    def with_profile(self, profile: Any) -> CostParams:
        """Returns a copy whose compute and link figures come from ``profile`` first."""
        from hetplan.cost.sources import ComputeSource

        return replace(self, compute=ComputeSource(profile))

    @property
    def profile(self) -> Any:
        """Returns the measured profile in use, or None."""
        return self.compute.profile

    def gpu(self, name: str) -> GPUEfficiency:
        """Returns the efficiency parameters of GPU type ``name``: its fitted ones, else
        those of the same chip at the same clocks (``SAME_SILICON``), else the default."""
        key = self.fitted_as(name)
        return self.default if key is None else self.gpus[key]

    def fitted(self, name: str) -> bool:
        """Returns whether GPU type ``name`` has fitted parameters (its own or its chip's)."""
        return self.fitted_as(name) is not None

    def fitted_as(self, name: str) -> str | None:
        """Returns the GPU type whose fitted parameters ``name`` takes (itself, or the same
        chip's: ``SAME_SILICON``), or None."""
        for key in (name, SAME_SILICON.get(name)):
            if key in self.gpus:
                return key
        return None

    def link_efficiency_of(self, gpu_name: str) -> float:
        """Returns the link efficiency on nodes of GPU type ``gpu_name``."""
        own = self.gpu(gpu_name).link_efficiency
        return self.link_efficiency if own is None else own

    def intra_latency_of(self, gpu_name: str) -> float:
        """Returns the per-step latency inside nodes of GPU type ``gpu_name``."""
        own = self.gpu(gpu_name).intra_latency_s
        return self.intra_latency_s if own is None else own

    def inter_latency_of(self, gpu_name: str) -> float:
        """Returns the per-step latency between nodes of GPU type ``gpu_name``."""
        own = self.gpu(gpu_name).inter_latency_s
        return self.inter_latency_s if own is None else own

    def network_efficiency_of(self, gpu_name: str) -> float:
        """Returns the network (between nodes) efficiency on nodes of GPU type ``gpu_name``."""
        own = self.gpu(gpu_name).network_efficiency
        return self.link_efficiency_of(gpu_name) if own is None else own

    def with_gpu(self, name: str, eff: GPUEfficiency) -> CostParams:
        """Returns a copy with ``eff`` for GPU type ``name``."""
        return replace(self, gpus={**self.gpus, name: eff})

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready mapping."""
        return {
            "gpus": {k: asdict(v) for k, v in self.gpus.items()},
            "default": asdict(self.default),
            "link_efficiency": self.link_efficiency,
            "intra_latency_s": self.intra_latency_s,
            "inter_latency_s": self.inter_latency_s,
            "memory_reserve_bytes": self.memory_reserve_bytes,
            "fit_report": self.fit_report,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CostParams:
        """Returns CostParams from the mapping written by ``to_dict``."""
        try:
            return CostParams(
                gpus={k: GPUEfficiency(**v) for k, v in data.get("gpus", {}).items()},
                default=GPUEfficiency(**data.get("default", {})),
                link_efficiency=float(data.get("link_efficiency", 0.8)),
                intra_latency_s=float(data.get("intra_latency_s", 10e-6)),
                inter_latency_s=float(data.get("inter_latency_s", 30e-6)),
                memory_reserve_bytes=float(data.get("memory_reserve_bytes", 1.5e9)),
                fit_report=dict(data.get("fit_report", {})),
            )
        except TypeError as exc:
            raise InputError("calibration", f"malformed parameters: {exc}") from None

    def save(self, path: Path, option: str = "--out") -> None:
        """Writes the parameters as JSON, whole or not at all (``outputs.write_text``)."""
        from hetplan.outputs import write_text

        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n", option)


@cache
def default_params() -> CostParams:
    """Returns the parameters fitted on the shipped calibration data."""
    res = resources.files("hetplan.data").joinpath("calibration.json")
    if not res.is_file():
        # a wheel without its fit would predict with priors and say nothing: refuse
        raise InputError("calibration", "the package's data/calibration.json is missing")
    return CostParams.from_dict(json.loads(res.read_text()))


def load_params(path: Path | None) -> CostParams:
    """Returns parameters from ``path``, or the shipped ones when ``path`` is None."""
    if path is None:
        return default_params()
    try:
        return CostParams.from_dict(json.loads(path.read_text()))
    except OSError as exc:
        raise InputError("--params", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InputError("--params", f"{path} is not valid JSON: {exc.msg}") from None

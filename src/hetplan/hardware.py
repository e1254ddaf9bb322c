"""GPU types: the catalog shipped in the package, and user-defined types."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

from hetplan.errors import InputError, shown


@dataclass(frozen=True)
class GPUType:
    """One kind of accelerator, with datasheet figures."""

    name: str
    memory_bytes: float
    """Device memory."""
    fp16_flops: float
    """Dense fp16 tensor-core peak, FLOP/s."""
    bf16_flops: float | None
    """Dense bf16 peak, FLOP/s; None where the GPU has no bf16."""
    fp32_flops: float
    """Dense fp32 peak on the CUDA cores (no tensor cores), FLOP/s."""
    hbm_bytes_per_s: float
    """Device memory bandwidth."""
    intra_node_bytes_per_s: float
    """Per GPU, per direction, to other GPUs of the same node (NVLink or PCIe)."""
    network_bytes_per_s: float
    """Default per-node network bandwidth to other nodes."""
    on_demand_usd_per_hour: float | None = None
    """Default on-demand price per GPU-hour; None where no price is known."""
    spot_usd_per_hour: float | None = None
    source: str = ""
    tf32_flops: float | None = None
    """Dense TF32 tensor-core peak, FLOP/s; None where the GPU has no TF32 tensor cores (before
    Ampere), so that tf32 runs at the fp32 peak."""

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "fp16_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s"):
            if not getattr(self, field) > 0:
                raise InputError(f"gpu_types.{self.name}.{field}", "must be positive")

    @property
    def has_tf32(self) -> bool:
        """Returns whether the GPU has TF32 tensor cores."""
        return self.tf32_flops is not None

    def peak_flops(self, precision: str) -> float:
        """Returns the dense peak FLOP/s at ``precision`` (fp32, tf32, bf16 or fp16)."""
        if precision == "tf32":
            return self.tf32_flops if self.tf32_flops is not None else self.fp32_flops
        if precision == "bf16":
            if self.bf16_flops is None:
                raise InputError("precision", f"{self.name} has no bf16 support; use fp16")
            return self.bf16_flops
        if precision == "fp16":
            return self.fp16_flops
        if precision == "fp32":
            return self.fp32_flops
        raise InputError(
            "precision", f"unknown precision {shown(precision)} (fp32, tf32, bf16 or fp16)"
        )

    def peak_label(self, precision: str) -> str:
        """Returns a phrase naming the units that run ``precision`` and their peak.

        E.g. 'TF32 tensor cores, 156 TFLOP/s'; a GPU without TF32 tensor cores (before Ampere)
        runs tf32 on its FP32 CUDA cores, and the phrase says so.
        """
        tflops = f"{round(self.peak_flops(precision) / 1e12, 1):g} TFLOP/s"
        if precision == "fp32":
            return f"FP32 CUDA cores, {tflops}"
        if precision == "tf32" and not self.has_tf32:
            return f"no TF32 tensor cores: FP32 CUDA cores, {tflops}"
        return f"{precision.upper()} tensor cores, {tflops}"

    def supports(self, precision: str) -> bool:
        """Returns whether the GPU computes at ``precision``."""
        return precision != "bf16" or self.bf16_flops is not None


def _float_or_none(text: str) -> float | None:
    text = text.strip()
    return float(text) if text else None


def _tflops_or_none(text: str) -> float | None:
    tflops = _float_or_none(text)
    return tflops * 1e12 if tflops else None


@cache
def _catalog() -> dict[str, GPUType]:
    out: dict[str, GPUType] = {}
    text = resources.files("hetplan.data").joinpath("gpu_catalog.csv").read_text()
    for row in csv.DictReader(text.splitlines()):
        fp16 = _float_or_none(row["fp16_tflops"]) or _float_or_none(row["bf16_tflops"])
        if fp16 is None:
            continue
        bf16 = _float_or_none(row["bf16_tflops"])
        gpu = GPUType(
            name=row["name"],
            memory_bytes=float(row["memory_gb"]) * 1e9,
            fp16_flops=fp16 * 1e12,
            bf16_flops=bf16 * 1e12 if bf16 else None,
            fp32_flops=float(row["fp32_tflops"]) * 1e12,
            tf32_flops=_tflops_or_none(row["tf32_tflops"]),
            hbm_bytes_per_s=float(row["hbm_gbyte_per_s"]) * 1e9,
            intra_node_bytes_per_s=float(row["intra_node_gbyte_per_s"]) * 1e9,
            network_bytes_per_s=float(row["network_gbit_per_s"]) * 1e9 / 8,
            on_demand_usd_per_hour=_float_or_none(row["on_demand_usd_per_gpu_hour"]),
            spot_usd_per_hour=_float_or_none(row["spot_usd_per_gpu_hour"]),
            source=row["source"],
        )
        out[_key(gpu.name)] = gpu
        for alias in filter(None, row["aliases"].split(";")):
            out[_key(alias)] = gpu
    return out


def _key(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "-")


def catalog_gpus() -> list[GPUType]:
    """Returns every GPU type of the built-in catalog, once each, in catalog order."""
    seen: dict[str, GPUType] = {}
    for gpu in _catalog().values():
        seen.setdefault(gpu.name, gpu)
    return list(seen.values())


def get_gpu(name: str, extra: dict[str, GPUType] | None = None, field: str = "gpu") -> GPUType:
    """Returns the GPU type called ``name`` (case-insensitive), from ``extra`` or the catalog."""
    if extra:
        for key, user_gpu in extra.items():
            if _key(key) == _key(name):
                return user_gpu
    found = _catalog().get(_key(name))
    if found is None:
        known = ", ".join(g.name for g in catalog_gpus())
        raise InputError(field, f"unknown GPU type {shown(name)} (known: {known})")
    return found


def gpu_from_mapping(name: str, spec: dict[str, object], field: str) -> GPUType:
    """Returns a user-defined GPU type from a cluster file's ``gpu_types`` entry."""
    allowed = {
        "bf16_tflops",
        "fp16_tflops",
        "fp32_tflops",
        "tf32_tflops",
        "memory_gb",
        "hbm_gbyte_per_s",
        "intra_node_gbyte_per_s",
        "network_gbit_per_s",
        "price_per_gpu_hour",
        "spot_price_per_gpu_hour",
    }
    unknown = set(spec) - allowed
    if unknown:
        raise InputError(
            f"{field}.{sorted(unknown)[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})"
        )

    def num(key: str, default: float | None = None) -> float | None:
        value = spec.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise InputError(f"{field}.{key}", f"expected a positive number, got {shown(value)}")
        return float(value)

    memory = num("memory_gb")
    if memory is None:
        raise InputError(f"{field}.memory_gb", "required")
    fp16 = num("fp16_tflops") or num("bf16_tflops")
    if fp16 is None:
        raise InputError(f"{field}.fp16_tflops", "required (or bf16_tflops)")
    bf16 = num("bf16_tflops")
    fp32 = num("fp32_tflops", fp16 / 8) or fp16 / 8
    tf32 = num("tf32_tflops")
    return GPUType(
        name=name,
        memory_bytes=memory * 1e9,
        fp16_flops=fp16 * 1e12,
        bf16_flops=bf16 * 1e12 if bf16 else None,
        fp32_flops=fp32 * 1e12,
        tf32_flops=tf32 * 1e12 if tf32 else None,
        hbm_bytes_per_s=(num("hbm_gbyte_per_s", 1000.0) or 1000.0) * 1e9,
        intra_node_bytes_per_s=(num("intra_node_gbyte_per_s", 31.5) or 31.5) * 1e9,
        network_bytes_per_s=(num("network_gbit_per_s", 100.0) or 100.0) * 1e9 / 8,
        on_demand_usd_per_hour=num("price_per_gpu_hour"),
        spot_usd_per_hour=num("spot_price_per_gpu_hour"),
        source="user cluster file",
    )

"""What the main CLI's commands share: the consoles, cost parameters with a measured
profile, JSON output, warnings, and the precision and batch a command resolves."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from hetplan.cluster import Cluster
from hetplan.commands.options import PROFILE_ENV
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, load_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.outputs import json_text
from hetplan.plan import PRECISIONS, Plan

# a pipe gets wide lines rather than rich's 80-column default, so tables stay readable
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

TF32_NOTE = (
    "note: fp32 uses the FP32 CUDA-core peak; PyTorch with TF32 enabled (NGC containers, "
    "torch.backends.cuda.matmul.allow_tf32=True) runs fp32 matmuls on TF32 tensor cores: "
    "--precision tf32"
)


def open_profile(profile_path: Path | None, option: str = "--profile") -> Any:
    """Returns the ProfileDB at ``profile_path`` (else at $HETPLAN_PROFILE), or None.

    The path must name an existing SQLite file: opening a profile never creates one.
    ``option`` names the path in messages."""
    origin = ""
    if profile_path is None:
        env = os.environ.get(PROFILE_ENV, "").strip()
        if not env:
            return None
        profile_path, origin = Path(env), f" (from ${PROFILE_ENV})"
    if not profile_path.is_file():
        raise InputError(option, f"no such file: {profile_path}{origin}")
    try:
        with profile_path.open("rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise InputError(option, f"cannot read {profile_path}{origin}: {exc.strerror}") from None
    if not head.startswith(b"SQLite format 3"):
        raise InputError(option, f"{profile_path}{origin} is not an SQLite profile database")
    import importlib
    import sqlite3

    try:  # the profile database moved from runtime/ to measured/
        module = importlib.import_module("hetplan.measured.profile_db")
    except ModuleNotFoundError:
        module = importlib.import_module("hetplan.runtime.profile_db")
    try:
        return module.ProfileDB(profile_path)
    except sqlite3.Error as exc:
        raise InputError(option, f"cannot open {profile_path}{origin}: {exc}") from None


def load_cost(params_path: Path | None, profile_path: Path | None) -> CostParams:
    """Returns the cost-model parameters of ``--params`` (else the shipped ones), reading
    compute times from the measured profile of ``--profile`` (else $HETPLAN_PROFILE) first."""
    params = load_params(params_path)
    db = open_profile(profile_path)
    return params if db is None else params.with_profile(db)


def print_json(obj: Any) -> None:
    """Writes one JSON object to stdout with the standard library (no highlighting: a
    large plan prints in milliseconds, not through rich)."""
    sys.stdout.write(json_text(obj))
    sys.stdout.write("\n")
    sys.stdout.flush()


def no_fit_message(
    min_bytes: float, cluster: Cluster, floor_bytes: float = 0.0, no_layout: str = ""
) -> str:
    """Returns why a search found no plan: the least per-GPU need of any plan it weighed
    against the largest GPU; where it weighed none (``min_bytes`` inf), that no split of the
    layers fits, with the state's own per-GPU need ``floor_bytes`` (0: no layout divides the
    model, batch and cluster at all; ``no_layout`` says why, where the caller knows)."""
    capacity = max(g.memory_bytes for g in cluster.gpu_types_used())
    if min_bytes == float("inf") and floor_bytes > capacity:
        return (
            f"no plan fits in memory: the model's weights, gradients and optimizer state "
            f"alone need at least {floor_bytes / 1e9:.1f} GB per GPU, sharded over all, "
            f"the largest GPU has {capacity / 1e9:.1f} GB"
        )
    if min_bytes == float("inf") and floor_bytes > 0:
        return (
            f"no plan fits in memory: no split of the model's layers over these GPUs fits "
            f"(the largest GPU has {capacity / 1e9:.1f} GB)"
        )
    if min_bytes == float("inf"):
        return "no plan: " + (
            no_layout or "no parallel layout divides this model, batch and cluster"
        )
    return (
        f"no plan fits in memory: the smallest per-GPU need of any plan is "
        f"{min_bytes / 1e9:.1f} GB, the largest GPU has {capacity / 1e9:.1f} GB"
    )


def tf32_note(gpus: Any, precision: str, as_json: bool) -> None:
    """Prints, once, that fp32 means CUDA cores when a GPU has TF32 tensor cores."""
    if precision == "fp32" and not as_json and any(g.has_tf32 for g in gpus):
        err.print(TF32_NOTE, highlight=False, soft_wrap=True)


def print_warnings(warnings: list[str]) -> None:
    for line in warnings:
        out.print(f"[bold yellow]warning:[/] {line}", highlight=False, soft_wrap=True)


def resolve_precision(cluster: Cluster, precision: str | None) -> str:
    if precision is None:
        return "bf16" if all(g.supports("bf16") for g in cluster.gpu_types_used()) else "fp16"
    if precision not in PRECISIONS:
        raise InputError("--precision", f"'{precision}' is not fp32, tf32, bf16 or fp16")
    for gpu in cluster.gpu_types_used():
        if not gpu.supports(precision):
            raise InputError("--precision", f"{gpu.name} has no {precision} support")
    return precision


def resolve_batch(model: ModelSpec, global_batch: int | None) -> int:
    if global_batch is None:
        return model.default_global_batch
    if global_batch <= 0:
        raise InputError("--global-batch-size", "must be positive")
    return global_batch


def write_pictures(
    plan: Plan,
    model: ModelSpec,
    cluster: Cluster,
    params: CostParams,
    trace: Path | None,
    timeline: Path | None,
) -> None:
    if trace is None and timeline is None:
        return
    recorded = estimate(plan, model, cluster, params, record=True)
    if trace is not None:
        from hetplan.report.trace import write_trace

        write_trace(trace, plan, recorded)
    if timeline is not None:
        from hetplan.report.timeline import write_timeline

        write_timeline(timeline, plan, recorded)

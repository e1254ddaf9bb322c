"""Sailor's measured data (github.com/eth-easl/sailor, MIT): its per-layer profile JSON and
its network tables, read into the rows of the profile database.

Profile: ``{model: {gpu: {mbs: {tp: {layer_id: [forward_s, backward_s, update_s]}}}}}`` with
layer 0 the embedding, the last layer the head with the loss and the ones between the
transformer layers; times in seconds per micro-batch on one GPU of the TP group.

Network: ``[[c2, c1, c0], max_bytes_per_s]`` per GPU type and count in Sailor's
``intra_node_bandwidths.json``, ``network_coeffs_all_homo.json`` (``intra`` and ``inter``)
and ``multizone_bandwidths_het.json`` (zone, GPU type, count of sender and receiver), or a
JSON object holding those three under their file names (as the shipped
``data/calibration/sailor_clariden_opt350/network_gh96.json`` does).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hetplan.cost.compute import LayerTimes
from hetplan.errors import InputError, shown
from hetplan.hardware import GPUType, get_gpu
from hetplan.measured.importers import (
    ImportBatch,
    NetworkFitRow,
    OptimizerRow,
    PartRow,
    positive_int,
    positive_number,
    resolve_gpu,
    resolve_model,
)
from hetplan.measured.network import SailorFit
from hetplan.measured.profile_db import UNKNOWN_S, LayerRecord, shape_key
from hetplan.model import ModelSpec

SAILOR_PRECISION = "tf32"
"""Sailor's profiles are fp32 training in NGC PyTorch containers, where fp32 matmuls run on
TF32 tensor cores (see docs/measured.md)."""

INTRA_FILE = "intra_node_bandwidths.json"
HOMO_FILE = "network_coeffs_all_homo.json"
HET_FILE = "multizone_bandwidths_het.json"


def _read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise InputError(where, f"cannot read {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(where, f"{path} is not valid JSON: {exc}") from None


def _mapping(value: Any, where: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise InputError(where, f"expected a non-empty JSON object of {what}")
    return value


def read_sailor_profile(
    path: Path, bindings: dict[str, ModelSpec], precision: str = SAILOR_PRECISION
) -> ImportBatch:
    """Returns the rows of a Sailor profile: per (GPU, micro-batch, TP) one layer row (the
    mean over the transformer layers; selective recomputation unknown), the embedding and
    head part rows, and per (GPU, TP) optimizer rows (median over micro-batches)."""
    data = _mapping(_read_json(path, "profile"), "profile", "models")
    batch = ImportBatch()
    for model_name, by_gpu in data.items():
        where = f"profile.{model_name}"
        model = resolve_model(model_name, bindings, where)
        for gpu_name, by_mbs in _mapping(by_gpu, where, "GPU types").items():
            batch.extend(_read_gpu(model, by_mbs, f"{where}.{gpu_name}", gpu_name, precision))
    return batch


def _read_gpu(
    model: ModelSpec, by_mbs: Any, where: str, gpu_name: str, precision: str
) -> ImportBatch:
    gpu = resolve_gpu(gpu_name, where, precision)
    batch = ImportBatch()
    updates: dict[tuple[int, str], list[float]] = {}
    for mbs_key, by_tp in _mapping(by_mbs, where, "micro-batch sizes").items():
        mb = positive_int(mbs_key, f"{where}.{mbs_key}", "the micro-batch size")
        for tp_key, layers in _mapping(by_tp, f"{where}.{mbs_key}", "TP degrees").items():
            at = f"{where}.{mbs_key}.{tp_key}"
            tp = positive_int(tp_key, at, "the TP degree")
            if model.heads % tp or model.ffn % tp:
                raise InputError(at, f"TP {tp} does not divide the heads and ffn of {model.name}")
            rows = _layers(layers, at)
            body = rows[1:-1]
            fwd = statistics.fmean(r[0] for r in body)
            bwd = statistics.fmean(r[1] for r in body)
            times = LayerTimes(fwd, bwd, UNKNOWN_S)
            key = shape_key(model)
            batch.layers.append(LayerRecord(gpu.name, key, tp, mb, precision, times, 0.0, 0))
            for part, r in (("embed", rows[0]), ("head", rows[-1])):
                t = LayerTimes(r[0], r[1], 0.0)
                batch.parts.append(PartRow(gpu.name, model, part, tp, mb, precision, t))
            if tp > 1:  # profiled in a real TP group: the layer times hold the collectives
                none = LayerTimes(0.0, 0.0, 0.0)
                batch.parts.append(PartRow(gpu.name, model, "tp_comm", tp, mb, precision, none))
            updates.setdefault((tp, "layer"), []).append(statistics.fmean(r[2] for r in body))
            updates.setdefault((tp, "embed"), []).append(rows[0][2])
            updates.setdefault((tp, "head"), []).append(rows[-1][2])
    for (tp, part), steps in sorted(updates.items()):
        step = statistics.median(steps)
        batch.optimizer.append(OptimizerRow(gpu.name, model, part, tp, precision, step))
    return batch


def _layers(layers: Any, where: str) -> list[tuple[float, float, float]]:
    """Returns the [forward, backward, update] seconds of layer ids 0..n-1, checked."""
    by_id: dict[int, Any] = {}
    for k, value in _mapping(layers, where, "layer ids").items():
        if not k.isdigit():
            raise InputError(f"{where}.{k}", "a layer id must be a non-negative integer")
        by_id[int(k)] = value
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) < 3:
        raise InputError(
            where,
            "layer ids must be 0 (embedding), 1.. (layers), last (head); got "
            + ", ".join(map(str, sorted(by_id))),
        )
    out = []
    for i in range(len(by_id)):
        at, value = f"{where}.{i}", by_id[i]
        if not isinstance(value, list) or len(value) != 3:
            raise InputError(at, f"expected [forward_s, backward_s, update_s], got {shown(value)}")
        names = ("forward_s", "backward_s", "update_s")
        f, b, u = (positive_number(v, at, n) for v, n in zip(value, names, strict=True))
        out.append((f, b, u))
    return out


def read_sailor_network(path: Path) -> ImportBatch:
    """Returns Sailor's network fits of the GPU types in the catalog (notes name the others):
    "intra" per GPU count, "inter" per GPUs per node (same zone, same GPU type and count at
    both ends; cross-type and cross-zone pairs are left out, the database has no pairs)."""
    data = _mapping(_read_json(path, "network"), "network", "network tables")
    if set(data) & {INTRA_FILE, HOMO_FILE, HET_FILE}:
        tables = {k: v for k, v in data.items() if k in (INTRA_FILE, HOMO_FILE, HET_FILE)}
    elif set(data) <= {"intra", "inter"}:
        tables = {HOMO_FILE: data}
    elif all(
        isinstance(v, dict) and _is_entry(next(iter(v.values()), None)) for v in data.values()
    ):
        tables = {INTRA_FILE: data}
    else:
        tables = {HET_FILE: data}
    found: dict[tuple[str, str, int], NetworkFitRow] = {}
    notes: set[str] = set()
    # the homogeneous table first: the multizone one only adds what it lacks
    for name in (HOMO_FILE, INTRA_FILE, HET_FILE):
        if name not in tables:
            continue
        where = f"network.{name}"
        table = _mapping(tables[name], where, "GPU types")
        entries: list[tuple[str, str, str, Any, str]] = []
        if name == HOMO_FILE:
            for scope in ("intra", "inter"):
                if scope not in table:
                    continue
                by_gpu = _mapping(table[scope], f"{where}.{scope}", "GPU types")
                for gpu_name, by_n in by_gpu.items():
                    at = f"{where}.{scope}.{gpu_name}"
                    for n, value in _mapping(by_n, at, "GPU counts").items():
                        entries.append((scope, gpu_name, n, value, f"{at}.{n}"))
        elif name == INTRA_FILE:
            entries = [
                ("intra", gpu_name, n, value, f"{where}.{gpu_name}.{n}")
                for gpu_name, by_n in table.items()
                for n, value in _mapping(by_n, f"{where}.{gpu_name}", "GPU counts").items()
            ]
        else:
            entries = _het_entries(table, where)
        for scope, gpu_name, n_key, value, at in entries:
            gpu = _catalog_gpu(gpu_name)
            if gpu is None:
                notes.add(f"network: {gpu_name} is not in the GPU catalog; left out")
                continue
            count = positive_int(n_key, at, "the GPU count")
            fit_key = (gpu.name, scope, count)
            if fit_key not in found:
                fit = _fit(value, at)
                found[fit_key] = NetworkFitRow(gpu.name, scope, count, fit, f"sailor:{name}")
    batch = ImportBatch(fits=[found[k] for k in sorted(found)], notes=sorted(notes))
    return batch


def _het_entries(table: dict[str, Any], where: str) -> list[tuple[str, str, str, Any, str]]:
    out = []
    for zone, by_gpu in table.items():
        for gpu, by_n in _mapping(by_gpu, f"{where}.{zone}", "GPU types").items():
            for n, peers in _mapping(by_n, f"{where}.{zone}.{gpu}", "GPU counts").items():
                at = f"{where}.{zone}.{gpu}.{n}.{zone}.{gpu}.{n}"
                value: Any = peers
                for step in (zone, gpu, n):
                    value = value.get(step) if isinstance(value, dict) else None
                if value is not None:
                    out.append(("inter", gpu, n, value, at))
    return out


def _is_entry(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], list)


def _fit(value: Any, where: str) -> SailorFit:
    if not _is_entry(value) or len(value[0]) != 3:
        raise InputError(where, f"expected [[c2, c1, c0], max_bytes_per_s], got {shown(value)}")
    coeffs = []
    for c in value[0]:
        if isinstance(c, bool) or not isinstance(c, int | float):
            raise InputError(where, f"coefficients must be numbers, got {shown(c)}")
        coeffs.append(float(c))
    peak = positive_number(value[1], where, "max_bytes_per_s")
    return SailorFit(coeffs[0], coeffs[1], coeffs[2], peak)


def _catalog_gpu(name: str) -> GPUType | None:
    try:
        return get_gpu(name)
    except InputError:
        return None

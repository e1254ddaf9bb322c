"""The CSV files anyone can write (docs/measured.md): measured times per GPU type, model,
TP, micro-batch, precision and part, and measured network bandwidth per message size.

Lines starting with ``#`` are comments; cells are trimmed; column order is free.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Iterator
from pathlib import Path

from hetplan.cost.compute import LayerTimes
from hetplan.errors import InputError, shown
from hetplan.measured.importers import (
    ImportBatch,
    NetworkPointRow,
    OptimizerRow,
    PartRow,
    check_precision,
    positive_int,
    positive_number,
    resolve_gpu,
    resolve_model,
)
from hetplan.measured.network import SCOPES
from hetplan.measured.profile_db import UNKNOWN_S, LayerRecord, shape_key
from hetplan.model import ModelSpec

PROFILE_COLUMNS = ("gpu", "model", "tp", "micro_batch", "precision", "part")
PROFILE_OPTIONAL = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "step_s",
    "activation_bytes",
    "params",
)
PROFILE_PARTS = ("layer", "embed", "head", "tp_comm", "optimizer")
NETWORK_COLUMNS = ("gpu", "scope", "gpus", "size_bytes", "bytes_per_s")


def _rows(
    path: Path, required: tuple[str, ...], optional: tuple[str, ...], what: str
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yields (line number, {column: trimmed cell}) of a CSV file with ``required`` columns."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InputError(what, f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(what, f"{path} is not a text file") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines)]
    numbered = [(i, ln) for i, ln in numbered if ln.strip() and not ln.lstrip().startswith("#")]
    if not numbered:
        raise InputError(f"{path.name}", "empty file: expected a header line")
    reader = csv.reader([ln for _, ln in numbered])
    header = [h.strip() for h in next(reader)]
    at = f"{path.name}:{numbered[0][0]}"
    missing = [c for c in required if c not in header]
    unknown = [c for c in header if c not in required + optional]
    if missing:
        raise InputError(at, f"missing column(s) {', '.join(missing)}")
    if unknown:
        raise InputError(at, f"unknown column(s) {', '.join(unknown)}")
    if len(set(header)) != len(header):
        raise InputError(at, "a column appears twice")
    for (lineno, _), cells in zip(numbered[1:], reader, strict=True):
        if len(cells) != len(header):
            raise InputError(
                f"{path.name}:{lineno}", f"{len(cells)} cells, the header has {len(header)}"
            )
        yield lineno, {h: c.strip() for h, c in zip(header, cells, strict=True)}


def read_profile_csv(
    path: Path, bindings: dict[str, ModelSpec], precision: str | None = None
) -> ImportBatch:
    """Returns the rows of a profile CSV (``precision`` fills empty precision cells)."""
    batch = ImportBatch()
    seen: dict[tuple[object, ...], int] = {}
    steps: dict[tuple[str, ModelSpec, str, int, str], list[tuple[float, float]]] = {}
    for lineno, row in _rows(path, PROFILE_COLUMNS, PROFILE_OPTIONAL, "profile"):
        at = f"{path.name}:{lineno}"
        prec = row["precision"] or precision
        if not prec:
            raise InputError(f"{at}:precision", "empty, and no --precision given")
        prec = check_precision(prec, f"{at}:precision")
        gpu = resolve_gpu(row["gpu"], f"{at}:gpu", prec)
        if not row["model"]:
            raise InputError(f"{at}:model", "missing model name")
        model = resolve_model(row["model"], bindings, f"{at}:model")
        part = row["part"]
        if part not in PROFILE_PARTS:
            raise InputError(
                f"{at}:part", f"{shown(part)} is not one of {', '.join(PROFILE_PARTS)}"
            )
        tp = positive_int(row["tp"], f"{at}:tp", "tp")
        if model.heads % tp or model.ffn % tp:
            raise InputError(
                f"{at}:tp", f"TP {tp} does not divide the heads and ffn of {model.name}"
            )
        piece = "layer" if part == "optimizer" else part
        if part == "optimizer" or (row.get("step_s") and part != "tp_comm"):
            step = positive_number(row.get("step_s", ""), f"{at}:step_s", "step_s")
            params = _optional(row, "params", at, allow_zero=True) or 0.0
            steps.setdefault((gpu.name, model, piece, tp, prec), []).append((step, params))
        if part == "optimizer":
            continue
        mb = positive_int(row["micro_batch"], f"{at}:micro_batch", "micro_batch")
        zero_ok = part == "tp_comm"  # zero: the layer times already hold the collectives
        fwd = positive_number(row.get("forward_s", ""), f"{at}:forward_s", "forward_s", zero_ok)
        bwd = positive_number(row.get("backward_s", ""), f"{at}:backward_s", "backward_s", zero_ok)
        _check_new(seen, (gpu.name, model, part, tp, mb, prec), lineno, at)
        if part == "layer":
            rc = _optional(row, "recompute_s", at)
            act = _optional(row, "activation_bytes", at, allow_zero=True) or 0.0
            t = LayerTimes(fwd, bwd, UNKNOWN_S if rc is None else rc)
            batch.layers.append(LayerRecord(gpu.name, shape_key(model), tp, mb, prec, t, act, 0))
        else:
            t = LayerTimes(fwd, bwd, 0.0)
            batch.parts.append(PartRow(gpu.name, model, part, tp, mb, prec, t))
    for (device, model, piece, tp, prec), found in steps.items():
        step = statistics.median(s for s, _ in found)
        params = max(p for _, p in found)
        batch.optimizer.append(OptimizerRow(device, model, piece, tp, prec, step, params))
    return batch


def _optional(row: dict[str, str], column: str, at: str, allow_zero: bool = False) -> float | None:
    text = row.get(column, "")
    return None if not text else positive_number(text, f"{at}:{column}", column, allow_zero)


def _check_new(
    seen: dict[tuple[object, ...], int], key: tuple[object, ...], lineno: int, at: str
) -> None:
    if key in seen:
        raise InputError(at, f"repeats the measurement of line {seen[key]}")
    seen[key] = lineno


def read_network_csv(path: Path) -> ImportBatch:
    """Returns the measured network points of a network CSV."""
    batch = ImportBatch()
    seen: dict[tuple[object, ...], int] = {}
    for lineno, row in _rows(path, NETWORK_COLUMNS, (), "network"):
        at = f"{path.name}:{lineno}"
        gpu = resolve_gpu(row["gpu"], f"{at}:gpu")
        scope = row["scope"]
        if scope not in SCOPES:
            raise InputError(f"{at}:scope", f"{shown(scope)} is not intra or inter")
        n = positive_int(row["gpus"], f"{at}:gpus", "gpus")
        size = positive_number(row["size_bytes"], f"{at}:size_bytes", "size_bytes")
        bps = positive_number(row["bytes_per_s"], f"{at}:bytes_per_s", "bytes_per_s")
        _check_new(seen, (gpu.name, scope, n, size), lineno, at)
        batch.points.append(NetworkPointRow(gpu.name, scope, n, size, bps, f"csv:{path.name}"))
    return batch

"""Importing measured data: the rows an import produces, model bindings, checked numbers,
and writing a database so that a failed import leaves nothing half-written.

The formats themselves live in ``sailor.py`` (Sailor's profile and network JSON) and
``csv_import.py`` (the documented CSV files); docs/measured.md describes them.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hetplan.cost.compute import LayerTimes
from hetplan.errors import InputError, shown
from hetplan.hardware import GPUType, get_gpu
from hetplan.measured.network import SailorFit
from hetplan.measured.profile_db import LayerRecord, ProfileDB
from hetplan.model import ModelSpec, catalog_models, load_model
from hetplan.plan import PRECISIONS


@dataclass(frozen=True)
class PartRow:
    """Measured forward/backward of an embedding, head or a layer's TP collectives."""

    device: str
    model: ModelSpec
    part: str
    tp: int
    micro_batch: int
    precision: str
    times: LayerTimes


@dataclass(frozen=True)
class OptimizerRow:
    """Measured optimizer step of one layer, embedding or head shard."""

    device: str
    model: ModelSpec
    part: str
    tp: int
    precision: str
    step_s: float
    params: float = 0.0


@dataclass(frozen=True)
class NetworkFitRow:
    """Sailor's bandwidth fit for one GPU type, scope and GPU count."""

    device: str
    scope: str
    gpus: int
    fit: SailorFit
    source: str


@dataclass(frozen=True)
class NetworkPointRow:
    """One measured achieved bandwidth at one message size."""

    device: str
    scope: str
    gpus: int
    size_bytes: float
    bytes_per_s: float
    source: str


@dataclass
class ImportBatch:
    """Everything one import writes, checked before any of it is written."""

    layers: list[LayerRecord] = field(default_factory=list)
    parts: list[PartRow] = field(default_factory=list)
    optimizer: list[OptimizerRow] = field(default_factory=list)
    fits: list[NetworkFitRow] = field(default_factory=list)
    points: list[NetworkPointRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the import skipped, and why (for the CLI to print)."""

    def extend(self, other: ImportBatch) -> None:
        """Appends the rows and notes of ``other``."""
        self.layers += other.layers
        self.parts += other.parts
        self.optimizer += other.optimizer
        self.fits += other.fits
        self.points += other.points
        self.notes += other.notes

    def counts(self) -> dict[str, int]:
        """Returns the number of rows per table."""
        return {
            "layer_times": len(self.layers),
            "part_times": len(self.parts),
            "optimizer_times": len(self.optimizer),
            "network_fits": len(self.fits),
            "network_points": len(self.points),
        }

    def write(self, db: ProfileDB) -> None:
        """Stores every row into ``db`` (in one transaction)."""
        with db.transaction():
            for rec in self.layers:
                db.put(rec)
            for p in self.parts:
                db.put_part(p.device, p.model, p.part, p.tp, p.micro_batch, p.precision, p.times)
            for o in self.optimizer:
                db.put_optimizer(o.device, o.model, o.part, o.tp, o.precision, o.step_s, o.params)
            for f in self.fits:
                db.put_network_fit(f.device, f.scope, f.gpus, f.fit, f.source)
            for n in self.points:
                db.put_network_point(
                    n.device, n.scope, n.gpus, n.size_bytes, n.bytes_per_s, n.source
                )


def parse_bindings(items: list[str]) -> dict[str, ModelSpec]:
    """Returns the models bound by ``--model NAME=MODEL`` options (MODEL: a catalog name or
    a config.json path)."""
    out: dict[str, ModelSpec] = {}
    for item in items:
        name, sep, target = item.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise InputError("--model", f"expected NAME=MODEL, got {shown(item)}")
        if name in out:
            raise InputError("--model", f"{shown(name)} is bound twice")
        out[name] = load_model(target)
    return out


def resolve_model(name: str, bindings: dict[str, ModelSpec], where: str) -> ModelSpec:
    """Returns the model a file calls ``name``: its binding, else the catalog model of that
    name; an unknown name is an InputError at ``where``."""
    if name in bindings:
        return bindings[name]
    if name.strip().lower() in catalog_models():
        return load_model(name)
    raise InputError(
        where, f"model {shown(name)} is not bound: add --model {name}=<catalog name or config.json>"
    )


def resolve_gpu(name: str, where: str, precision: str | None = None) -> GPUType:
    """Returns the catalog GPU type of ``name`` (aliases too), checking it runs ``precision``."""
    if not name.strip():
        raise InputError(where, "missing GPU type")
    gpu = get_gpu(name.strip(), field=where)
    if precision is not None and not gpu.supports(precision):
        raise InputError(where, f"{gpu.name} has no {precision} support")
    return gpu


def check_precision(precision: str, where: str) -> str:
    """Returns ``precision`` if it is one of PRECISIONS."""
    if precision not in PRECISIONS:
        raise InputError(where, f"{shown(precision)} is not one of {', '.join(PRECISIONS)}")
    return precision


def positive_int(value: object, where: str, what: str) -> int:
    """Returns ``value`` (an int, or its decimal text) if it is a positive integer."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) <= 0:
        raise InputError(where, f"{what} must be a positive integer, got {shown(value)}")
    return int(text)


def positive_number(value: object, where: str, what: str, allow_zero: bool = False) -> float:
    """Returns ``value`` as a float if it is a finite positive number (or zero if allowed)."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(where, f"{what} must be a number, got {shown(value)}") from None
    if isinstance(value, bool) or not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
        need = "a non-negative" if allow_zero else "a positive"
        raise InputError(where, f"{what} must be {need} number, got {shown(value)}")
    return x


def write_db(out: Path, batch: ImportBatch) -> ProfileDB:
    """Adds ``batch`` to the database at ``out`` (created if missing) and returns it: the rows
    go into a copy that replaces ``out`` only once all of them are written."""
    if out.is_dir():
        raise InputError("--out", f"cannot write {out}: it is a folder")
    if out.exists():
        with out.open("rb") as fh:
            if out.stat().st_size and not fh.read(16).startswith(b"SQLite format 3"):
                raise InputError("--out", f"{out} exists and is not an SQLite profile database")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise InputError("--out", f"cannot write {out}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        if out.exists():
            shutil.copyfile(out, tmp)
        else:
            os.chmod(tmp, 0o644)
        batch.write(ProfileDB(tmp))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ProfileDB(out)

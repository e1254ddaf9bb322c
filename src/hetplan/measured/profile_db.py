"""The SQLite profile database: measured per-layer times by device type, shape, TP and
micro-batch, and the rest of a training step (embedding, head with loss, optimizer step,
TP collectives per layer, the backend's point-to-point, all-reduce and pipelining costs).
It implements the cost model's LayerTimeSource with its optional methods, so ``estimate``
uses measured times wherever the database has them. No torch here: the planner reads it."""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from hetplan.cost.compute import LayerTimes
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec

SCHEMA = """
CREATE TABLE IF NOT EXISTS layer_times (
    device TEXT NOT NULL,
    shape TEXT NOT NULL,
    tp INTEGER NOT NULL,
    micro_batch INTEGER NOT NULL,
    precision TEXT NOT NULL,
    forward_s REAL NOT NULL,
    backward_s REAL NOT NULL,
    recompute_s REAL NOT NULL,
    activation_bytes REAL NOT NULL,
    threads INTEGER NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, shape, tp, micro_batch, precision)
);
CREATE TABLE IF NOT EXISTS devices (
    device TEXT PRIMARY KEY,
    fp32_tflops REAL NOT NULL,
    memory_gbyte_per_s REAL NOT NULL,
    threads INTEGER NOT NULL,
    measured_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS part_times (
    device TEXT NOT NULL,
    shape TEXT NOT NULL,
    part TEXT NOT NULL,
    tp INTEGER NOT NULL,
    micro_batch INTEGER NOT NULL,
    precision TEXT NOT NULL,
    forward_s REAL NOT NULL,
    backward_s REAL NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, shape, part, tp, micro_batch, precision)
);
CREATE TABLE IF NOT EXISTS optimizer_times (
    device TEXT NOT NULL,
    shape TEXT NOT NULL,
    part TEXT NOT NULL,
    tp INTEGER NOT NULL,
    precision TEXT NOT NULL,
    step_s REAL NOT NULL,
    params REAL NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, shape, part, tp, precision)
);
CREATE TABLE IF NOT EXISTS links (
    device TEXT NOT NULL,
    kind TEXT NOT NULL,
    latency_s REAL NOT NULL,
    bytes_per_s REAL NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, kind)
);
"""


def default_db_path() -> Path:
    """Returns the default database path under the user cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetplan" / "profile.sqlite"


def shape_key(model: ModelSpec) -> str:
    """Returns the key of what a layer's time depends on (not layer count or vocabulary)."""
    m = model
    return f"{m.family}:h{m.hidden}:a{m.heads}:kv{m.kv_heads}:f{m.ffn}:s{m.seq}"


def part_key(model: ModelSpec) -> str:
    """Returns the key of what the embedding's and head's times depend on (adds vocabulary)."""
    return f"{shape_key(model)}:v{model.vocab}:t{int(model.tie_embeddings)}"


PARTS = ("embed", "head", "tp_comm")
"""Measured pieces besides layers: embedding, head with loss, a layer's TP collectives."""
LINKS = ("p2p", "allreduce", "pipeline")
"""Measured link figures: point-to-point (one-way latency, bytes/s), ring all-reduce of a
gradient buffer as the runtime syncs one (latency per ring step, bus bytes/s) and the
pipelining runtime's overhead per action (latency)."""


def _key(model: ModelSpec, part: str) -> str:
    return shape_key(model) if part in ("layer", "tp_comm") else part_key(model)


@dataclass(frozen=True)
class LayerRecord:
    """One measured layer."""

    device: str
    shape: str
    tp: int
    micro_batch: int
    precision: str
    times: LayerTimes
    activation_bytes: float
    threads: int


class ProfileDB:
    """Measured layer times in SQLite; a LayerTimeSource for ``estimate``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def put(self, rec: LayerRecord) -> None:
        """Stores (or replaces) one measurement."""
        t = rec.times
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO layer_times VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rec.device,
                    rec.shape,
                    rec.tp,
                    rec.micro_batch,
                    rec.precision,
                    t.forward_s,
                    t.backward_s,
                    t.selective_recompute_s,
                    rec.activation_bytes,
                    rec.threads,
                    time.time(),
                ),
            )

    def put_device(
        self, device: str, fp32_tflops: float, memory_gbyte_per_s: float, threads: int
    ) -> None:
        """Stores a device's measured matmul rate and memory bandwidth."""
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO devices VALUES (?,?,?,?,?)",
                (device, fp32_tflops, memory_gbyte_per_s, threads, time.time()),
            )

    def device_figures(self, device: str) -> tuple[float, float] | None:
        """Returns (fp32 TFLOP/s, memory GB/s) measured for ``device``, or None."""
        with self._connect() as con:
            row = con.execute(
                "SELECT fp32_tflops, memory_gbyte_per_s FROM devices WHERE device = ?", (device,)
            ).fetchone()
        return (float(row[0]), float(row[1])) if row else None

    def lookup(
        self, device: str, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns the measured times of one layer, or None."""
        with self._connect() as con:
            row = con.execute(
                "SELECT forward_s, backward_s, recompute_s FROM layer_times WHERE device = ? "
                "AND shape = ? AND tp = ? AND micro_batch = ? AND precision = ?",
                (device, shape_key(model), tp, micro_batch, precision),
            ).fetchone()
        return LayerTimes(float(row[0]), float(row[1]), float(row[2])) if row else None

    def layer_times(
        self, gpu: GPUType, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns measured times of one transformer layer on ``gpu``, or None if not profiled."""
        return self.lookup(gpu.name, model, tp, micro_batch, precision)

    def put_part(
        self,
        device: str,
        model: ModelSpec,
        part: str,
        tp: int,
        micro_batch: int,
        precision: str,
        times: LayerTimes,
    ) -> None:
        """Stores the measured forward and backward time of one part (see PARTS)."""
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}")
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO part_times VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    device,
                    _key(model, part),
                    part,
                    tp,
                    micro_batch,
                    precision,
                    times.forward_s,
                    times.backward_s,
                    time.time(),
                ),
            )

    def lookup_part(
        self, device: str, model: ModelSpec, part: str, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns the measured times of one part, or None."""
        with self._connect() as con:
            row = con.execute(
                "SELECT forward_s, backward_s FROM part_times WHERE device = ? AND shape = ? "
                "AND part = ? AND tp = ? AND micro_batch = ? AND precision = ?",
                (device, _key(model, part), part, tp, micro_batch, precision),
            ).fetchone()
        return LayerTimes(float(row[0]), float(row[1]), 0.0) if row else None

    def part_times(
        self, gpu: GPUType, model: ModelSpec, part: str, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns measured times of "embed", "head" (with loss) or a layer's "tp_comm"."""
        return self.lookup_part(gpu.name, model, part, tp, micro_batch, precision)

    def put_optimizer(
        self,
        device: str,
        model: ModelSpec,
        part: str,
        tp: int,
        precision: str,
        step_s: float,
        params: float,
    ) -> None:
        """Stores the optimizer-step time of one layer ("layer"), "embed" or "head" shard."""
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO optimizer_times VALUES (?,?,?,?,?,?,?,?)",
                (device, _key(model, part), part, tp, precision, step_s, params, time.time()),
            )

    def optimizer_step_s(
        self, gpu: GPUType, model: ModelSpec, part: str, tp: int, precision: str
    ) -> float | None:
        """Returns the measured optimizer-step time of one "layer", "embed" or "head" shard."""
        with self._connect() as con:
            row = con.execute(
                "SELECT step_s FROM optimizer_times WHERE device = ? AND shape = ? AND part = ? "
                "AND tp = ? AND precision = ?",
                (gpu.name, _key(model, part), part, tp, precision),
            ).fetchone()
        return float(row[0]) if row else None

    def put_link(self, device: str, kind: str, latency_s: float, bytes_per_s: float) -> None:
        """Stores a measured link figure of ``device`` (see LINKS)."""
        if kind not in LINKS:
            raise ValueError(f"unknown link kind {kind!r}")
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO links VALUES (?,?,?,?,?)",
                (device, kind, latency_s, bytes_per_s, time.time()),
            )

    def link_figures(self, gpu: GPUType, kind: str) -> tuple[float, float] | None:
        """Returns the measured (latency s, bytes/s) of a link kind on ``gpu``, or None."""
        with self._connect() as con:
            row = con.execute(
                "SELECT latency_s, bytes_per_s FROM links WHERE device = ? AND kind = ?",
                (gpu.name, kind),
            ).fetchone()
        return (float(row[0]), float(row[1])) if row else None

    def records(self) -> list[tuple[str, str, int, int, str, float, float]]:
        """Returns (device, shape, tp, micro_batch, precision, forward_s, backward_s) rows."""
        with self._connect() as con:
            rows = con.execute(
                "SELECT device, shape, tp, micro_batch, precision, forward_s, backward_s "
                "FROM layer_times ORDER BY device, shape, tp, micro_batch"
            ).fetchall()
        return [tuple(r) for r in rows]

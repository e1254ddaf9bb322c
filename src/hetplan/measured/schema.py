"""The profile database's schema, keys and row types (docs/measured.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hetplan.cost.compute import LayerTimes
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
CREATE TABLE IF NOT EXISTS network_fits (
    device TEXT NOT NULL,
    scope TEXT NOT NULL,
    gpus INTEGER NOT NULL,
    c2 REAL NOT NULL,
    c1 REAL NOT NULL,
    c0 REAL NOT NULL,
    max_bytes_per_s REAL NOT NULL,
    source TEXT NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, scope, gpus)
);
CREATE TABLE IF NOT EXISTS network_points (
    device TEXT NOT NULL,
    scope TEXT NOT NULL,
    gpus INTEGER NOT NULL,
    size_bytes REAL NOT NULL,
    bytes_per_s REAL NOT NULL,
    source TEXT NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (device, scope, gpus, size_bytes)
);
"""

UNKNOWN_S = -1.0
"""A stored time that was not measured (e.g. selective recomputation in a Sailor profile):
the cost model models that piece instead."""


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


def shape_from_key(key: str) -> ModelSpec:
    """Returns a one-layer ModelSpec with the shape of ``key`` (see shape_key; a part_key's
    vocabulary and tying are kept, else vocab is 1: a layer's time does not depend on it)."""
    fields = key.split(":")
    family, vals = fields[0], {}
    for f in fields[1:]:
        for prefix in ("kv", "h", "a", "f", "s", "v", "t"):
            if f.startswith(prefix) and f[len(prefix) :].isdigit():
                vals[prefix] = int(f[len(prefix) :])
                break
    if family not in ("gpt", "llama") or not {"h", "a", "kv", "f", "s"} <= set(vals):
        raise ValueError(f"not a shape key: {key!r}")
    return ModelSpec(
        name=key,
        family=family,  # type: ignore[arg-type]
        layers=1,
        hidden=vals["h"],
        heads=vals["a"],
        kv_heads=vals["kv"],
        ffn=vals["f"],
        vocab=vals.get("v", 1),
        seq=vals["s"],
        tie_embeddings=bool(vals.get("t", 0)),
    )


PARTS = ("embed", "head", "tp_comm", "tp_comm_sp")
"""Measured pieces besides layers: embedding, head with loss, a layer's TP collectives
(``tp_comm_sp``: with sequence parallelism), and ``zero3_comm_dpN`` (is_part): one layer's
ZeRO-3 gathers and reduce-scatters over N ranks, as the runtime's profile measures them."""
LAYER_SHAPED_PARTS = ("layer", "tp_comm", "tp_comm_sp")
"""Parts keyed by the whole layer shape (the others by part_key)."""


def is_part(name: str) -> bool:
    """Returns whether ``name`` is a part the profile stores (PARTS or zero3_comm_dpN)."""
    suffix = name.removeprefix("zero3_comm_dp")
    return name in PARTS or (suffix != name and suffix.isdigit() and int(suffix) > 1)


OPTIMIZER_PARTS = ("layer", "embed", "head")
"""Pieces whose optimizer step is stored: one transformer layer, the embedding, the head."""
LINKS = ("p2p", "allreduce", "pipeline", "allgather", "reduce_scatter", "scalar")
"""Measured link figures: point-to-point (one-way latency, bytes/s), ring all-reduce of a
gradient buffer as the runtime syncs one (latency per ring step, bus bytes/s), the
pipelining runtime's overhead per action (latency), ZeRO's all-gather of the
parameters and reduce-scatter of the gradients as the runtime issues them (latency per
ring step, bus bytes/s; profiles without them price both as half an all-reduce), and the
all-reduce of one number (a loss, a gradient norm: latency per tree step, bytes/s 0)."""


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


@dataclass(frozen=True)
class LayerPoint:
    """One measured layer row, with its shape parsed back into a ModelSpec (for the cost
    model's measured/analytical scale factors)."""

    device: str
    shape: ModelSpec
    tp: int
    micro_batch: int
    precision: str
    times: LayerTimes

"""The SQLite profile database: measured per-layer times by device type, shape, TP and
micro-batch, and the rest of a training step (embedding, head with loss, optimizer step,
TP collectives per layer, the backend's point-to-point, all-reduce and pipelining costs,
achieved network bandwidth by message size). Schema and units: docs/measured.md.

Opening a database reads every row once into dictionaries; lookups are dictionary hits and
writes go to SQLite and the dictionaries alike. It implements the cost model's
LayerTimeSource with its optional methods, so ``estimate`` uses measured times wherever the
database has them. No torch here: the planner reads it."""

from __future__ import annotations

import sqlite3
import time
from bisect import bisect_left, insort
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hetplan.cost.compute import LayerTimes
from hetplan.errors import InputError
from hetplan.hardware import GPUType
from hetplan.measured.network import SCOPES, SailorFit, point_bandwidth, sailor_bandwidth
from hetplan.measured.schema import (
    LAYER_SHAPED_PARTS,
    LINKS,
    OPTIMIZER_PARTS,
    PARTS,
    SCHEMA,
    UNKNOWN_S,
    LayerPoint,
    LayerRecord,
    default_db_path,
    is_part,
    part_key,
    shape_from_key,
    shape_key,
)
from hetplan.model import ModelSpec

__all__ = [
    "LINKS",
    "OPTIMIZER_PARTS",
    "PARTS",
    "UNKNOWN_S",
    "LayerPoint",
    "LayerRecord",
    "ProfileDB",
    "default_db_path",
    "part_key",
    "shape_from_key",
    "shape_key",
]


def _key(model: ModelSpec, part: str) -> str:
    shaped = part in LAYER_SHAPED_PARTS or part.startswith("zero3_comm_dp")
    return shape_key(model) if shaped else part_key(model)


def _interpolate(mbs: list[int], table: dict[int, LayerTimes], mb: int) -> LayerTimes | None:
    """Returns the linear interpolation in micro-batch between the profiled neighbours of
    ``mb`` (None outside them); an unknown recomputation stays unknown."""
    i = bisect_left(mbs, mb)
    if i == 0 or i == len(mbs):
        return None
    lo, hi = mbs[i - 1], mbs[i]
    a, b = table[lo], table[hi]
    w = (mb - lo) / (hi - lo)
    rc = UNKNOWN_S
    if a.selective_recompute_s >= 0 and b.selective_recompute_s >= 0:
        rc = a.selective_recompute_s + (b.selective_recompute_s - a.selective_recompute_s) * w
    return LayerTimes(
        a.forward_s + (b.forward_s - a.forward_s) * w,
        a.backward_s + (b.backward_s - a.backward_s) * w,
        rc,
    )


class _Family:
    """Rows that differ only in micro-batch, kept sorted for interpolation."""

    __slots__ = ("mbs", "times")

    def __init__(self) -> None:
        self.mbs: list[int] = []
        self.times: dict[int, LayerTimes] = {}

    def put(self, mb: int, t: LayerTimes) -> None:
        if mb not in self.times:
            insort(self.mbs, mb)
        self.times[mb] = t

    def lookup(self, mb: int) -> tuple[LayerTimes, str] | None:
        hit = self.times.get(mb)
        if hit is not None:
            return hit, "measured"
        t = _interpolate(self.mbs, self.times, mb)
        return None if t is None else (t, "interpolated")


class ProfileDB:
    """Measured layer times in SQLite, held in memory; a LayerTimeSource for ``estimate``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tx: sqlite3.Connection | None = None
        con = self._connect()
        try:
            with con:
                con.executescript(SCHEMA)
            self._load(con)
        finally:
            con.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    # ---- memory -------------------------------------------------------------------------
    def _load(self, con: sqlite3.Connection) -> None:
        self._layers: dict[tuple[str, str, int, str], _Family] = {}
        self._layer_extra: dict[tuple[str, str, int, int, str], tuple[float, int]] = {}
        self._parts: dict[tuple[str, str, str, int, str], _Family] = {}
        self._optimizer: dict[tuple[str, str, str, int, str], tuple[float, float]] = {}
        self._devices: dict[str, tuple[float, float, int]] = {}
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        self._fits: dict[tuple[str, str, int], SailorFit] = {}
        self._points: dict[tuple[str, str, int], dict[float, float]] = {}
        self._sorted_points: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        q = "SELECT device, shape, tp, micro_batch, precision, forward_s, backward_s, "
        for row in con.execute(q + "recompute_s, activation_bytes, threads FROM layer_times"):
            self._mem_layer(*row)
        q = "SELECT device, shape, part, tp, micro_batch, precision, forward_s, backward_s "
        for row in con.execute(q + "FROM part_times"):
            self._mem_part(*row)
        q = "SELECT device, shape, part, tp, precision, step_s, params FROM optimizer_times"
        for d, s, p, tp, prec, step, n in con.execute(q):
            self._optimizer[(d, s, p, tp, prec)] = (step, n)
        q = "SELECT device, fp32_tflops, memory_gbyte_per_s, threads FROM devices"
        for d, tf, gb, th in con.execute(q):
            self._devices[d] = (tf, gb, th)
        for d, k, lat, bps in con.execute("SELECT device, kind, latency_s, bytes_per_s FROM links"):
            self._links[(d, k)] = (lat, bps)
        q = "SELECT device, scope, gpus, c2, c1, c0, max_bytes_per_s FROM network_fits"
        for d, sc, n, c2, c1, c0, mx in con.execute(q):
            self._fits[(d, sc, n)] = SailorFit(c2, c1, c0, mx)
        q = "SELECT device, scope, gpus, size_bytes, bytes_per_s FROM network_points"
        for d, sc, n, size, bps in con.execute(q):
            self._points.setdefault((d, sc, n), {})[size] = bps
        self._sorted_points.clear()

    def _mem_layer(
        self,
        d: str,
        s: str,
        tp: int,
        mb: int,
        prec: str,
        f: float,
        b: float,
        rc: float,
        act: float,
        threads: int,
    ) -> None:
        self._layers.setdefault((d, s, tp, prec), _Family()).put(mb, LayerTimes(f, b, rc))
        self._layer_extra[(d, s, tp, mb, prec)] = (act, threads)

    def _mem_part(
        self, d: str, s: str, part: str, tp: int, mb: int, prec: str, f: float, b: float
    ) -> None:
        self._parts.setdefault((d, s, part, tp, prec), _Family()).put(mb, LayerTimes(f, b, 0.0))

    def reload(self) -> None:
        """Reads the rows again (after another process wrote to the file)."""
        con = self._connect()
        try:
            self._load(con)
        finally:
            con.close()

    # ---- writes -------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[ProfileDB]:
        """Groups writes into one SQLite transaction (bulk imports); rolled back, and the
        memory reloaded, if the block raises."""
        if self._tx is not None:
            yield self
            return
        self._tx = self._connect()
        try:
            with self._tx:
                yield self
        except BaseException:
            self._tx.close()
            self._tx = None
            self.reload()
            raise
        self._tx.close()
        self._tx = None

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        if self._tx is not None:
            self._tx.execute(sql, args)
            return
        con = self._connect()
        try:
            with con:
                con.execute(sql, args)
        finally:
            con.close()

    def put(self, rec: LayerRecord) -> None:
        """Stores (or replaces) one measured layer (a negative recompute_s: not measured)."""
        t = rec.times
        key = (rec.device, rec.shape, rec.tp, rec.micro_batch, rec.precision)
        times = (t.forward_s, t.backward_s, t.selective_recompute_s)
        row = (*key, *times, rec.activation_bytes, rec.threads)
        sql = "INSERT OR REPLACE INTO layer_times VALUES (?,?,?,?,?,?,?,?,?,?,?)"
        self._write(sql, (*row, time.time()))
        self._mem_layer(*row)

    def put_device(
        self, device: str, fp32_tflops: float, memory_gbyte_per_s: float, threads: int
    ) -> None:
        """Stores a device's measured matmul rate and memory bandwidth."""
        row = (device, fp32_tflops, memory_gbyte_per_s, threads, time.time())
        self._write("INSERT OR REPLACE INTO devices VALUES (?,?,?,?,?)", row)
        self._devices[device] = (fp32_tflops, memory_gbyte_per_s, threads)

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
        if not is_part(part):
            raise ValueError(f"unknown part {part!r}")
        key = (device, _key(model, part), part, tp, micro_batch, precision)
        row = (*key, times.forward_s, times.backward_s)
        sql = "INSERT OR REPLACE INTO part_times VALUES (?,?,?,?,?,?,?,?,?)"
        self._write(sql, (*row, time.time()))
        self._mem_part(*row)

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
        """Stores the optimizer-step time of one layer ("layer"), "embed" or "head" shard
        (``params``: parameters of that shard, 0 where unknown)."""
        if part not in OPTIMIZER_PARTS:
            raise ValueError(f"unknown optimizer part {part!r}")
        key = (device, _key(model, part), part, tp, precision)
        row = (*key, step_s, params, time.time())
        self._write("INSERT OR REPLACE INTO optimizer_times VALUES (?,?,?,?,?,?,?,?)", row)
        self._optimizer[key] = (step_s, params)

    def put_link(self, device: str, kind: str, latency_s: float, bytes_per_s: float) -> None:
        """Stores a measured link figure of ``device`` (see LINKS)."""
        if kind not in LINKS:
            raise ValueError(f"unknown link kind {kind!r}")
        row = (device, kind, latency_s, bytes_per_s, time.time())
        self._write("INSERT OR REPLACE INTO links VALUES (?,?,?,?,?)", row)
        self._links[(device, kind)] = (latency_s, bytes_per_s)

    def put_network_fit(
        self, device: str, scope: str, gpus: int, fit: SailorFit, source: str = ""
    ) -> None:
        """Stores Sailor's bandwidth fit for ``gpus`` GPUs of ``device`` (scope intra or inter)."""
        _check_scope(scope, gpus)
        row = (device, scope, gpus, fit.c2, fit.c1, fit.c0, fit.max_bytes_per_s, source)
        sql = "INSERT OR REPLACE INTO network_fits VALUES (?,?,?,?,?,?,?,?,?)"
        self._write(sql, (*row, time.time()))
        self._fits[(device, scope, gpus)] = fit

    def put_network_point(
        self,
        device: str,
        scope: str,
        gpus: int,
        size_bytes: float,
        bytes_per_s: float,
        source: str = "",
    ) -> None:
        """Stores one measured achieved bandwidth at one message size."""
        _check_scope(scope, gpus)
        row = (device, scope, gpus, size_bytes, bytes_per_s, source, time.time())
        self._write("INSERT OR REPLACE INTO network_points VALUES (?,?,?,?,?,?,?)", row)
        self._points.setdefault((device, scope, gpus), {})[size_bytes] = bytes_per_s
        self._sorted_points.pop((device, scope, gpus), None)

    # ---- reads (the cost model's protocol) ----------------------------------------------
    def lookup(
        self, device: str, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns the measured times of one layer (exact row only), or None."""
        fam = self._layers.get((device, shape_key(model), tp, precision))
        return None if fam is None else fam.times.get(micro_batch)

    def layer_lookup(
        self, gpu: GPUType, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> tuple[LayerTimes, str] | None:
        """Returns one transformer layer's times on ``gpu`` and "measured" (an exact row) or
        "interpolated" (linear in micro-batch between the profiled neighbours), or None."""
        fam = self._layers.get((gpu.name, shape_key(model), tp, precision))
        return None if fam is None else fam.lookup(micro_batch)

    def layer_times(
        self, gpu: GPUType, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns measured (or interpolated) times of one transformer layer on ``gpu``, or
        None if not profiled; a negative selective_recompute_s means not measured."""
        found = self.layer_lookup(gpu, model, tp, micro_batch, precision)
        return None if found is None else found[0]

    def layer_points(self) -> list[LayerPoint]:
        """Returns every measured layer row (no interpolated ones)."""
        shapes: dict[str, ModelSpec | None] = {}
        out = []
        for (d, s, tp, prec), fam in self._layers.items():
            if s not in shapes:
                try:
                    shapes[s] = shape_from_key(s)
                except (ValueError, InputError):  # a row some other tool wrote: no shape
                    shapes[s] = None
            shape = shapes[s]
            if shape is None:
                continue
            for mb in fam.mbs:
                out.append(LayerPoint(d, shape, tp, mb, prec, fam.times[mb]))
        return out

    def lookup_part(
        self, device: str, model: ModelSpec, part: str, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns the measured (or interpolated) times of one part, or None."""
        fam = self._parts.get((device, _key(model, part), part, tp, precision))
        found = None if fam is None else fam.lookup(micro_batch)
        return None if found is None else found[0]

    def part_times(
        self, gpu: GPUType, model: ModelSpec, part: str, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns measured times of "embed", "head" (with loss) or a layer's "tp_comm",
        interpolated in micro-batch like layer_times."""
        return self.lookup_part(gpu.name, model, part, tp, micro_batch, precision)

    def optimizer_step_s(
        self, gpu: GPUType, model: ModelSpec, part: str, tp: int, precision: str
    ) -> float | None:
        """Returns the measured optimizer-step time of one "layer", "embed" or "head" shard."""
        hit = self._optimizer.get((gpu.name, _key(model, part), part, tp, precision))
        return None if hit is None else hit[0]

    def device_figures(self, device: str) -> tuple[float, float] | None:
        """Returns (fp32 TFLOP/s, memory GB/s) measured for ``device``, or None."""
        hit = self._devices.get(device)
        return None if hit is None else (hit[0], hit[1])

    def link_figures(self, gpu: GPUType, kind: str) -> tuple[float, float] | None:
        """Returns the measured (latency s, bytes/s) of a link kind on ``gpu``, or None."""
        return self._links.get((gpu.name, kind))

    def network_bandwidth(
        self, gpu_name: str, scope: str, n: int, size_bytes: float
    ) -> float | None:
        """Returns the achieved bytes/s of a ``size_bytes`` message among ``n`` GPUs of
        ``gpu_name`` inside a node (scope "intra") or between nodes with ``n`` GPUs per node
        ("inter"): from measured points where there are some, else from Sailor's fit (see
        ``network.sailor_bandwidth``); None where neither covers it."""
        key = (gpu_name, scope, n)
        if key in self._points:
            pts = self._sorted_points.get(key)
            if pts is None:
                pts = self._sorted_points[key] = sorted(self._points[key].items())
            return point_bandwidth(pts, size_bytes)
        fit = self._fits.get(key)
        return None if fit is None else sailor_bandwidth(fit, size_bytes)

    # ---- listings -----------------------------------------------------------------------
    def records(self) -> list[tuple[str, str, int, int, str, float, float]]:
        """Returns (device, shape, tp, micro_batch, precision, forward_s, backward_s) rows."""
        rows = [
            (d, s, tp, mb, prec, fam.times[mb].forward_s, fam.times[mb].backward_s)
            for (d, s, tp, prec), fam in self._layers.items()
            for mb in fam.mbs
        ]
        return sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3]))

    def network_entries(self) -> list[tuple[str, str, int, str]]:
        """Returns (device, scope, gpus, "fit" or "N points") for every network record."""
        out = [(d, sc, n, "fit") for (d, sc, n) in self._fits]
        out += [(d, sc, n, f"{len(p)} points") for (d, sc, n), p in self._points.items()]
        return sorted(out)

    def counts(self) -> dict[str, int]:
        """Returns the number of rows of each table."""
        return {
            "layer_times": len(self._layer_extra),
            "part_times": sum(len(f.mbs) for f in self._parts.values()),
            "optimizer_times": len(self._optimizer),
            "devices": len(self._devices),
            "links": len(self._links),
            "network_fits": len(self._fits),
            "network_points": sum(len(p) for p in self._points.values()),
        }

    def part_rows(self) -> list[tuple[str, str, str, int, int, str]]:
        """Returns (device, shape, part, tp, micro_batch, precision) of every part row."""
        return [(*k[:4], mb, k[4]) for k, fam in self._parts.items() for mb in fam.mbs]


def _check_scope(scope: str, gpus: int) -> None:
    if scope not in SCOPES:
        raise ValueError(f"unknown network scope {scope!r} (intra or inter)")
    if gpus < 1:
        raise ValueError(f"gpus must be positive, got {gpus}")

"""GPU availability traces: read (Sailor's JSON and pool CSV, a generic CSV) and synthesise.

A trace is a list of change points; each gives, from its time on, how many GPUs of each
type are available and, optionally, their spot price per GPU-hour. It ends at its last time
stamp. Formats (``docs/spot.md``):

- Sailor's JSON: ``[{"Time": s, "GPUs": n}, ...]``, one GPU type, bound to the cluster's;
- Sailor's pool CSV: ``,Timestamp,A100-40_us-central1-a,V100-16_us-central1-a``, one count
  column per GPU type (the type is the column name up to its first ``_``), Unix times;
- the generic CSV: a header ``time_s,gpu_type,count[,usd_per_hour]`` and one row per change
  of one type; rows of one time stamp form one change point; a type not yet named has none.

The synthetic generator draws, per node of the pool, up-times from an exponential
distribution of mean 1 / rate (Poisson preemptions) and outages of a given mean
(exponential), so arrivals are the ends of outages; every node starts up.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from hetplan.errors import InputError
from hetplan.hardware import GPUType, get_gpu

ANY_TYPE = "*"
"""The type of a one-type trace (Sailor's JSON) before it is bound to the cluster's type."""
GENERIC_HEADER = ("time_s", "gpu_type", "count")
SHIPPED = ("sailor_a100_16.json", "sailor_a100_original.json", "sailor_a100_v100_pools.csv")


@dataclass(frozen=True)
class TracePoint:
    """From ``time_s`` on: available GPUs per type and the spot prices the trace gives."""

    time_s: float
    counts: dict[str, int]
    prices: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Trace:
    """Change points in time order; the trace ends at ``end_s``."""

    points: tuple[TracePoint, ...]
    end_s: float
    source: str

    @property
    def types(self) -> list[str]:
        """Returns the GPU types the trace counts, in order of appearance."""
        out: dict[str, None] = {}
        for p in self.points:
            out.update(dict.fromkeys(p.counts))
        return list(out)

    @property
    def duration_s(self) -> float:
        """Returns the time from the first change point to the end."""
        return self.end_s - self.points[0].time_s

    def bind(self, gpu: str) -> Trace:
        """Returns the trace with its one untyped count bound to GPU type ``gpu``."""
        if self.types != [ANY_TYPE]:
            return self
        pts = tuple(
            TracePoint(
                p.time_s, {gpu: p.counts[ANY_TYPE]}, {gpu: p.prices[ANY_TYPE]} if p.prices else {}
            )
            for p in self.points
        )
        return Trace(pts, self.end_s, self.source)

    def decreases(self) -> int:
        """Returns the number of change points at which some type's count falls."""
        n = 0
        for a, b in zip(self.points, self.points[1:], strict=False):
            if any(b.counts.get(t, 0) < c for t, c in a.counts.items()):
                n += 1
        return n

    def changes(self) -> int:
        """Returns the number of change points that change a count or a price."""
        return sum(
            1
            for a, b in zip(self.points, self.points[1:], strict=False)
            if a.counts != b.counts or a.prices != b.prices
        )


def _number(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool):
        raise InputError(f"{where} {what}", f"expected a number, got {value}")
    try:
        out = float(str(value).strip())
    except ValueError:
        raise InputError(f"{where} {what}", f"expected a number, got '{value}'") from None
    if not math.isfinite(out):
        raise InputError(f"{where} {what}", f"expected a finite number, got {value}")
    return out


def _count(value: Any, where: str) -> int:
    x = _number(value, where, "count")
    if x < 0:
        raise InputError(f"{where} count", f"must be >= 0, got {value}")
    if x != int(x):
        raise InputError(f"{where} count", f"expected a whole number of GPUs, got {value}")
    return int(x)


def _price(value: Any, where: str) -> float:
    x = _number(value, where, "usd_per_hour")
    if x < 0:
        raise InputError(f"{where} usd_per_hour", f"must be >= 0, got {value}")
    return x


def _gpu(name: str, where: str, extra: dict[str, GPUType] | None) -> str:
    return get_gpu(name.strip(), extra, field=f"{where} gpu_type").name


def _build(rows: Iterable[tuple[float, str, int, float | None, str]], source: str) -> Trace:
    """Returns the trace of (time, type, count, price, where) rows, checking their order."""
    points: list[TracePoint] = []
    counts: dict[str, int] = {}
    prices: dict[str, float] = {}
    last = -math.inf
    for time_s, gpu, count, price, where in rows:
        if time_s < 0:
            raise InputError(f"{where} time_s", f"must be >= 0, got {time_s:g}")
        if time_s < last:
            raise InputError(
                f"{where} time_s", f"times must not decrease: {time_s:g} after {last:g}"
            )
        counts[gpu] = count
        if price is not None:
            prices[gpu] = price
        point = TracePoint(time_s, dict(counts), dict(prices))
        if points and points[-1].time_s == time_s:
            points[-1] = point
        else:
            points.append(point)
        last = time_s
    if not points:
        raise InputError(source, "the trace has no entries")
    return Trace(tuple(points), points[-1].time_s, source)


def _sailor_json(text: str, name: str) -> Trace:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(name, f"not valid JSON (line {exc.lineno}): {exc.msg}") from None
    if not isinstance(data, list):
        raise InputError(name, 'expected a list of {"Time": seconds, "GPUs": count} entries')
    rows = []
    for i, entry in enumerate(data):
        where = f"{name}[{i}]"
        if not isinstance(entry, dict) or "Time" not in entry or "GPUs" not in entry:
            raise InputError(where, 'expected {"Time": seconds, "GPUs": count}')
        rows.append((_number(entry["Time"], where, "Time"), ANY_TYPE,
                     _count(entry["GPUs"], where), None, where))  # fmt: skip
    return _build(rows, name)


def _generic_csv(lines: list[list[str]], name: str, extra: dict[str, GPUType] | None) -> Trace:
    header = [h.strip().lower() for h in lines[0]]
    if (
        tuple(header[:3]) != GENERIC_HEADER
        or len(header) > 4
        or (len(header) == 4 and header[3] != "usd_per_hour")
    ):
        raise InputError(f"{name}:1", "the header must be time_s,gpu_type,count[,usd_per_hour]")
    rows = []
    for n, row in enumerate(lines[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        where = f"{name}:{n}"
        if len(row) not in (3, len(header)):
            raise InputError(where, f"expected {len(header)} columns, got {len(row)}")
        price = _price(row[3], where) if len(row) > 3 and row[3].strip() else None
        rows.append((_number(row[0], where, "time_s"), _gpu(row[1], where, extra),
                     _count(row[2], where), price, where))  # fmt: skip
    return _build(rows, name)


def _pool_csv(lines: list[list[str]], name: str, extra: dict[str, GPUType] | None) -> Trace:
    header = [h.strip() for h in lines[0]]
    at = header.index("Timestamp")
    columns = [(j, _gpu(h.split("_")[0], f"{name}:1 column {h}", extra))
               for j, h in enumerate(header) if j > at and h]  # fmt: skip
    if not columns:
        raise InputError(f"{name}:1", "no GPU-type columns after Timestamp")
    rows = []
    start: float | None = None
    for n, row in enumerate(lines[1:], start=2):
        if not any(c.strip() for c in row):
            continue
        where = f"{name}:{n}"
        if len(row) < len(header):
            raise InputError(where, f"expected {len(header)} columns, got {len(row)}")
        stamp = _number(row[at], where, "Timestamp")
        start = stamp if start is None else start
        for j, gpu in columns:
            rows.append((stamp - start, gpu, _count(row[j], where), None, where))
    return _build(rows, name)


def parse_trace(text: str, name: str, extra: dict[str, GPUType] | None = None) -> Trace:
    """Returns the trace in ``text``; ``name`` (the file name) tells the format and prefixes
    every error, with the line or entry at fault."""
    if name.lower().endswith(".json"):
        return _sailor_json(text, name)
    lines = list(csv.reader(io.StringIO(text)))
    while lines and not any(c.strip() for c in lines[0]):
        lines.pop(0)
    if not lines:
        raise InputError(name, "the trace is empty")
    if "Timestamp" in [h.strip() for h in lines[0]]:
        return _pool_csv(lines, name, extra)
    return _generic_csv(lines, name, extra)


def load_trace(path: str, extra: dict[str, GPUType] | None = None) -> Trace:
    """Returns the trace in file ``path``, or a shipped one by its file name."""
    p = Path(path)
    if not p.exists() and p.name in SHIPPED:
        text = resources.files("hetplan.data").joinpath("spot_traces", p.name).read_text()
        return parse_trace(text, p.name, extra)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InputError("--trace", f"cannot read {path}: {exc.strerror}") from None
    return parse_trace(text, p.name, extra)


@dataclass(frozen=True)
class PoolType:
    """One GPU type of a synthetic pool: node size, node count, preemption model."""

    gpu: str
    gpus_per_node: int
    nodes: int
    preemptions_per_node_hour: float
    mean_outage_s: float
    usd_per_hour: float | None = None


def synthesize(pool: list[PoolType], duration_s: float, seed: int) -> Trace:
    """Returns a seeded synthetic trace: every node alternates exponential up-times (mean
    1 / rate: Poisson preemptions) and exponential outages (the given mean); all start up."""
    if duration_s <= 0:
        raise InputError("--duration", "must be positive")
    rng = random.Random(seed)
    events: list[tuple[float, str, int]] = []  # (time, type, +-GPUs)
    for t in pool:
        if t.preemptions_per_node_hour < 0 or t.mean_outage_s < 0:
            raise InputError("--preemption-rate", "rates and outages must be >= 0")
        for _ in range(t.nodes):
            now = 0.0
            while t.preemptions_per_node_hour > 0:
                now += rng.expovariate(t.preemptions_per_node_hour / 3600.0)
                if now >= duration_s:
                    break
                events.append((now, t.gpu, -t.gpus_per_node))
                now += rng.expovariate(1.0 / t.mean_outage_s) if t.mean_outage_s > 0 else 0.0
                if now >= duration_s:
                    break
                events.append((now, t.gpu, t.gpus_per_node))
    counts = {t.gpu: t.gpus_per_node * t.nodes for t in pool}
    prices = {t.gpu: t.usd_per_hour for t in pool if t.usd_per_hour is not None}
    points = [TracePoint(0.0, dict(counts), dict(prices))]
    for time_s, gpu, delta in sorted(events):
        counts[gpu] += delta
        points.append(TracePoint(time_s, dict(counts), dict(prices)))
    points.append(TracePoint(duration_s, dict(counts), dict(prices)))
    return Trace(tuple(points), duration_s, f"synthetic (seed {seed})")


def trace_csv(trace: Trace) -> str:
    """Returns the trace in the generic CSV form (one row per type per change point)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    priced = any(p.prices for p in trace.points)
    w.writerow([*GENERIC_HEADER, "usd_per_hour"] if priced else list(GENERIC_HEADER))
    prev: TracePoint | None = None
    for p in trace.points:
        for gpu, count in p.counts.items():
            price = p.prices.get(gpu)
            same = prev is not None and (prev.counts.get(gpu), prev.prices.get(gpu)) == (
                count,
                price,
            )
            if same and p.time_s != trace.end_s:
                continue
            row: list[object] = [f"{p.time_s:.3f}", gpu, count]
            if priced:
                row.append("" if price is None else f"{price:g}")
            w.writerow(row)
        prev = p
    return buf.getvalue()

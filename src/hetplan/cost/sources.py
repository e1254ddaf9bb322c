"""Where compute times come from: a measured profile wherever it covers the point, the
analytical blocks of ``compute`` otherwise, scaled by what the profile says about them.

``estimate`` and every search ask one :class:`ComputeSource` for per-layer, embedding,
head and optimizer times, so a profile changes the ranking exactly as it changes a
prediction. Each answer carries its provenance:

- ``measured``: a profiled row for this GPU type, shape, TP, micro-batch and precision;
- ``interpolated``: between two profiled micro-batches of the same row family (linear);
- ``scaled``: the analytical figure times the geometric mean of measured/analytical over
  the most specific profiled points available (same GPU and shape; else same GPU; else
  every profiled point): an unprofiled shape or GPU borrows the profile's calibration;
- ``analytical``: no profile, or a profile with no usable point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from hetplan.cost.compute import (
    LayerTimes,
    embedding_times,
    head_times,
    layer_times,
    optimizer_time_s,
)
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.errors import InputError
from hetplan.hardware import GPUType, get_gpu
from hetplan.model import ModelSpec

SOURCE_ORDER = ("measured", "interpolated", "scaled", "analytical")
_MISSING = object()
_BY_ID = {ModelSpec, GPUType, GPUEfficiency}


class LayerTimeSource(Protocol):
    """Measured per-layer times (a profile database), consulted before the analytical model.

    A source may also offer, and the cost model then uses where they return a value:
    ``layer_lookup(gpu, model, tp, micro_batch, precision) -> (LayerTimes, kind) | None``
    (kind "measured" or "interpolated"); ``layer_points() -> list`` of records with
    ``device``, ``shape`` (a ModelSpec-like object), ``tp``, ``micro_batch``, ``precision``
    and ``times`` (for scale factors); ``part_times(gpu, model, part, tp, micro_batch,
    precision) -> LayerTimes | None`` for part "embed", "head" (with loss) or "tp_comm" (one
    layer's TP collectives); ``optimizer_step_s(gpu, model, part, tp, precision) -> float |
    None`` for part "layer", "embed" or "head"; ``link_figures(gpu, kind) -> (latency_s,
    bytes_per_s) | None`` for kind "p2p", "allreduce" and "pipeline";
    ``network_bandwidth(gpu_name, scope, n, size_bytes) -> float | None``.
    """

    def layer_times(
        self, gpu: GPUType, model: ModelSpec, tp: int, micro_batch: int, precision: str
    ) -> LayerTimes | None:
        """Returns measured times of one transformer layer, or None if not profiled."""
        ...


@dataclass(frozen=True)
class Sourced:
    """Times of one piece and where they came from (one of SOURCE_ORDER)."""

    times: LayerTimes
    source: str


def combine_sources(sources: list[str]) -> str:
    """Returns the least trustworthy provenance of ``sources`` (analytical if empty)."""
    if not sources:
        return "analytical"
    return max(sources, key=SOURCE_ORDER.index)


def _scale(t: LayerTimes, f_fwd: float, f_bwd: float) -> LayerTimes:
    return LayerTimes(t.forward_s * f_fwd, t.backward_s * f_bwd, t.selective_recompute_s * f_fwd)


def _unsynced(t: LayerTimes, sync_s: float) -> LayerTimes:
    """Returns measured times without the profiler's synchronisation per timed pass (a real
    run queues the next kernels while the GPU works; a profiler waits for each piece),
    never below a tenth of the measured value."""
    if sync_s <= 0:
        return t
    return LayerTimes(
        max(t.forward_s - sync_s, 0.1 * t.forward_s),
        max(t.backward_s - sync_s, 0.1 * t.backward_s),
        t.selective_recompute_s,
    )


def _points(source: Any) -> list[Any]:
    """Returns the source's measured layer points (``device``, ``shape``, ``tp``,
    ``micro_batch``, ``precision``, ``times``), or none if it lists no points."""
    fn = getattr(source, "layer_points", None)
    return list(fn()) if fn is not None else []


def _gpu_or_none(name: str) -> GPUType | None:
    try:
        return get_gpu(name)
    except InputError:
        return None


class ComputeSource:
    """Per-piece compute times for the cost model: measured first, analytical otherwise.

    One instance serves one profile (or none) and memoizes every answer, so searches can
    ask it millions of times; it is what ``CostParams.compute`` hands out.
    """

    def __init__(self, profile: LayerTimeSource | None = None) -> None:
        self.profile = profile
        self._memo: dict[tuple[Any, ...], Any] = {}
        self._points: list[Any] | None = None
        self._alive: dict[int, Any] = {}

    def cached(self, key: tuple[Any, ...], make: Any) -> Any:
        """Returns ``make()``, computed once per ``key`` for this source (searches' tables)."""
        key = ("cached", *key)
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # ---- raw access to the optional methods of the profile ------------------------------
    def ask(self, method: str, *args: Any) -> Any:
        """Returns ``profile.method(*args)``, or None without a profile or such a method."""
        if self.profile is None:
            return None
        key = ("ask", method, *map(self._ident, args))
        hit = self._memo.get(key, _MISSING)
        if hit is _MISSING:
            fn = getattr(self.profile, method, None)
            hit = self._memo[key] = fn(*args) if fn is not None else None
        return hit

    def _ident(self, obj: Any) -> Any:
        """Returns a cheap memo key of ``obj``: its id for models, GPU types and efficiencies
        (hashing a frozen dataclass walks its fields; the object is kept alive here, so its
        id stays unique), the object itself otherwise."""
        if type(obj) in _BY_ID:
            ident = id(obj)
            if ident not in self._alive:
                self._alive[ident] = obj
            return ident
        return obj

    def network_bw(self, gpu_name: str, scope: str, n: int, size_bytes: float) -> float | None:
        """Returns the measured achieved bandwidth (bytes/s) of a message of ``size_bytes``
        among ``n`` GPUs of one node (scope "intra") or with ``n`` GPUs per node talking
        between nodes ("inter", the node's aggregate), or None where not measured."""
        if self.profile is None or not hasattr(self.profile, "network_bandwidth"):
            return None
        # bandwidth curves are smooth in log size: memoize on a 1/16-octave grid
        bucket = round(math.log2(max(size_bytes, 1.0)) * 16)
        key = ("net", gpu_name, scope, n, bucket)
        if key not in self._memo:
            bw = self.profile.network_bandwidth(gpu_name, scope, n, 2.0 ** (bucket / 16))
            self._memo[key] = bw if bw is not None and bw > 0 else None
        return self._memo[key]

    def _layer_lookup(
        self, gpu: GPUType, model: ModelSpec, tp: int, mb: int, precision: str
    ) -> tuple[LayerTimes, str] | None:
        if self.profile is None:
            return None
        if hasattr(self.profile, "layer_lookup"):
            found = self.ask("layer_lookup", gpu, model, tp, mb, precision)
            return None if found is None else (found[0], found[1])
        lt = self.ask("layer_times", gpu, model, tp, mb, precision)
        return None if lt is None else (lt, "measured")

    # ---- scale factors for what the profile does not cover ------------------------------
    def _profiled_points(self) -> list[Any]:
        if self._points is None:
            self._points = _points(self.profile) if self.profile is not None else []
        return self._points

    def scale_factors(
        self,
        gpu: GPUType,
        model: ModelSpec,
        eff: GPUEfficiency,
        precision: str,
        flash: bool,
        borrow: bool = True,
    ) -> tuple[float, float] | None:
        """Returns (forward, backward) measured/analytical ratios from the most specific
        profiled points (same GPU and shape; same GPU; with ``borrow``, every point), or
        None without points. A GPU type with fitted parameters does not borrow: its
        analytical model is already calibrated on its own runs."""
        key = ("scale", gpu.name, model, eff, precision, flash, borrow)
        if key in self._memo:
            return self._memo[key]
        points = self._profiled_points()
        same_gpu = [p for p in points if get_name(p.device) == gpu.name]
        same_shape = [p for p in same_gpu if _same_shape(p.shape, model)]
        chosen = same_shape or same_gpu or (points if borrow else [])
        logs_f, logs_b = [], []
        for p in chosen:
            pgpu = gpu if get_name(p.device) == gpu.name else _gpu_or_none(p.device)
            if pgpu is None or not pgpu.supports(p.precision):
                continue
            ana = layer_times(p.shape, pgpu, eff, p.tp, p.micro_batch, p.precision, flash)
            if p.times.forward_s > 0 and ana.forward_s > 0:
                logs_f.append(math.log(p.times.forward_s / ana.forward_s))
            if p.times.backward_s > 0 and ana.backward_s > 0:
                logs_b.append(math.log(p.times.backward_s / ana.backward_s))
        out = None
        if logs_f and logs_b:
            out = (math.exp(sum(logs_f) / len(logs_f)), math.exp(sum(logs_b) / len(logs_b)))
        self._memo[key] = out
        return out

    # ---- the pieces ---------------------------------------------------------------------
    def layer(
        self,
        model: ModelSpec,
        gpu: GPUType,
        params: CostParams,
        tp: int,
        mb: int,
        precision: str,
        flash: bool,
        sequence_parallel: bool = False,
    ) -> Sourced:
        """Returns one transformer layer's times for one micro-batch on one TP rank (with
        ``sequence_parallel``, the sequence-split norms and dropouts of Megatron's SP)."""
        sp = sequence_parallel and tp > 1
        eff = params.gpu(gpu.name)
        borrow = not params.fitted(gpu.name)
        key = ("layer", id(model), id(gpu), self._ident(eff), borrow, tp, mb, precision, flash,
               sp)  # fmt: skip
        self._ident(model)
        self._ident(gpu)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        ana = layer_times(model, gpu, eff, tp, mb, precision, flash)
        split = layer_times(model, gpu, eff, tp, mb, precision, flash, True) if sp else ana
        found = self._layer_lookup(gpu, model, tp, mb, precision)
        if found is not None:
            lt, kind = found
            lt = _unsynced(lt, eff.profile_sync_s)
            if lt.selective_recompute_s < 0:  # not profiled: the attention core, modelled
                ratio = lt.forward_s / ana.forward_s if ana.forward_s > 0 else 1.0
                lt = LayerTimes(lt.forward_s, lt.backward_s, ana.selective_recompute_s * ratio)
            if sp:  # profiled without SP: scale by the modelled saving of the split region
                lt = LayerTimes(
                    lt.forward_s * split.forward_s / ana.forward_s,
                    lt.backward_s * split.backward_s / ana.backward_s,
                    lt.selective_recompute_s,
                )
            out = Sourced(lt, kind)
        else:
            out = self._modelled(split, gpu, model, eff, precision, flash, borrow)
        self._memo[key] = out
        return out

    def _modelled(
        self,
        ana: LayerTimes,
        gpu: GPUType,
        model: ModelSpec,
        eff: GPUEfficiency,
        precision: str,
        flash: bool,
        borrow: bool,
    ) -> Sourced:
        """Returns an analytical figure, scaled where the profile has points to scale by."""
        factors = self.scale_factors(gpu, model, eff, precision, flash, borrow)
        if factors is None:
            return Sourced(ana, "analytical")
        return Sourced(_scale(ana, *factors), "scaled")

    def _part(
        self,
        part: str,
        model: ModelSpec,
        gpu: GPUType,
        params: CostParams,
        tp: int,
        mb: int,
        precision: str,
        flash: bool,
    ) -> Sourced:
        eff = params.gpu(gpu.name)
        borrow = not params.fitted(gpu.name)
        key = (part, self._ident(model), self._ident(gpu), self._ident(eff), borrow, tp, mb,
               precision, flash)  # fmt: skip
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        measured = self.ask("part_times", gpu, model, part, tp, mb, precision)
        if measured is not None:
            out = Sourced(_unsynced(measured, eff.profile_sync_s), "measured")
        else:
            fn = embedding_times if part == "embed" else head_times
            ana = fn(model, gpu, eff, tp, mb, precision)
            out = self._modelled(ana, gpu, model, eff, precision, flash, borrow)
        self._memo[key] = out
        return out

    def embedding(
        self,
        model: ModelSpec,
        gpu: GPUType,
        params: CostParams,
        tp: int,
        mb: int,
        precision: str,
        flash: bool = True,
    ) -> Sourced:
        """Returns the input embedding's times for one micro-batch."""
        return self._part("embed", model, gpu, params, tp, mb, precision, flash)

    def head(
        self,
        model: ModelSpec,
        gpu: GPUType,
        params: CostParams,
        tp: int,
        mb: int,
        precision: str,
        flash: bool = True,
    ) -> Sourced:
        """Returns the final norm, output head and loss times for one micro-batch."""
        return self._part("head", model, gpu, params, tp, mb, precision, flash)

    def action_overhead_s(self, gpu: GPUType) -> float:
        """Returns the pipelining runtime's measured cost per forward or backward action of
        one chunk (the runtime's profile, link kind "pipeline"), 0 where not measured."""
        over = self.ask("link_figures", gpu, "pipeline")
        return 0.0 if over is None else float(over[0])

    def tp_comm_included(self, gpu: GPUType, model: ModelSpec, tp: int, mb: int, prec: str) -> bool:
        """Returns whether the profile's layer times at ``tp`` already hold the TP collectives
        (a ``tp_comm`` part measured as zero: profiled inside a real TP group)."""
        lc = self.ask("part_times", gpu, model, "tp_comm", tp, mb, prec)
        return lc is not None and lc.forward_s == 0 and lc.backward_s == 0

    def optimizer_s(
        self,
        model: ModelSpec,
        gpu: GPUType,
        eff: GPUEfficiency,
        tp: int,
        precision: str,
        pieces: list[tuple[str, int]],
        params_local: float,
        shards: int,
    ) -> tuple[float, str]:
        """Returns the optimizer step of a stage: measured per piece ("layer", "embed",
        "head") with their counts when every piece is profiled, else the memory-bound
        model over ``params_local`` parameters; divided among ``shards`` (ZeRO). Measured
        pieces lose the profiler's synchronisation, as layer passes do."""
        steps = [
            (self.ask("optimizer_step_s", gpu, model, part, tp, precision), k)
            for part, k in pieces
            if k
        ]
        if steps and all(t is not None for t, _ in steps):
            # each piece was timed on its own, behind the profiler's synchronisation
            sync = eff.profile_sync_s
            total = sum(max(t - sync, 0.1 * t) * k for t, k in steps)
            return total / shards, "measured"
        return optimizer_time_s(params_local / shards, gpu, eff, precision), "analytical"


def get_name(device: str) -> str:
    """Returns the catalog name of a profiled device name (itself if not a catalog GPU)."""
    gpu = _gpu_or_none(device)
    return gpu.name if gpu is not None else device


def _same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    return (a.family, a.hidden, a.heads, a.kv_heads, a.ffn, a.seq) == (
        b.family,
        b.hidden,
        b.heads,
        b.kv_heads,
        b.ffn,
        b.seq,
    )

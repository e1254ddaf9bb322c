"""Cost model of SPMD instructions on a set of devices of different speeds.

Every instruction's time is affine in the sharding ratios ``b``: a constant, plus a
coefficient times the largest share ``max_i b_i`` (padded collectives send the
largest shard from everyone), plus ``max_i b_i * t_i`` for sharded compute (``t_i``
is device i's time for the whole operator). The ratio LP optimises exactly this form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster, Node
from hetplan.cost.comm import group_allreduce_s
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError

OPTIMIZER_STATE_FACTOR = 4.0
"""Bytes held per parameter byte: weight, gradient and two Adam moments."""
BACKWARD_FACTOR = 2.0
"""A collective on a tensor that needs a gradient has a dual of the same size in backward."""


@dataclass(frozen=True)
class Cost:
    """An affine time in the ratios: const + coef x max(b) + max_i(b_i x shard_s[i])."""

    const_s: float = 0.0
    max_share_s: float = 0.0
    shard_s: tuple[float, ...] | None = None

    def at(self, ratios: Sequence[float]) -> float:
        """Returns the time in seconds at ``ratios``."""
        out = self.const_s + self.max_share_s * max(ratios)
        if self.shard_s is not None:
            out += max(b * t for b, t in zip(ratios, self.shard_s, strict=True))
        return out

    def scaled(self, k: float) -> Cost:
        """Returns the cost times ``k``."""
        shard = None if self.shard_s is None else tuple(k * t for t in self.shard_s)
        return Cost(k * self.const_s, k * self.max_share_s, shard)


ZERO = Cost()


@dataclass(frozen=True)
class Devices:
    """Per-device speeds and the collective cost coefficients of the whole group."""

    names: tuple[str, ...]
    flops: tuple[float, ...]
    """Achievable FLOP/s of large matrix multiplies."""
    mem_bytes_per_s: tuple[float, ...]
    """Achievable memory bandwidth of elementwise kernels."""
    capacity_bytes: tuple[float, ...]
    """Memory available for the model (capacity less the framework reserve)."""
    ar_lat_s: float
    ar_s_per_byte: float
    """All-reduce time: ar_lat_s + ar_s_per_byte x tensor bytes."""
    ag_lat_s: float
    ag_s_per_byte: float
    """Ring all-gather time: ag_lat_s + ag_s_per_byte x gathered (total) bytes."""
    kernel_s: float = 0.0

    @property
    def n(self) -> int:
        """Returns the number of devices."""
        return len(self.names)

    def flops_proportional(self) -> list[float]:
        """Returns ratios proportional to FLOP/s (the DP-CP split)."""
        total = sum(self.flops)
        return [f / total for f in self.flops]

    def even(self) -> list[float]:
        """Returns the even split (DP-EV)."""
        return [1.0 / self.n] * self.n

    # -- collectives on a tensor of ``size_bytes`` (global size) ---------------------------

    def allreduce(self, size_bytes: float) -> Cost:
        """Returns the all-reduce cost (uneven shards do not matter)."""
        if self.n == 1:
            return ZERO
        return Cost(self.ar_lat_s + self.ar_s_per_byte * size_bytes)

    def allgather(self, size_bytes: float, form: str) -> Cost:
        """Returns an all-gather (or reduce-scatter) cost in ``form`` 'padded' or 'grouped'.

        Padded: every shard is padded to the largest and a ring all-gather moves n of
        them. Grouped: each rank broadcasts its own shard, n broadcasts of exact size.
        """
        n = self.n
        if n == 1:
            return ZERO
        if form == "padded":
            return Cost(self.ag_lat_s, self.ag_s_per_byte * n * size_bytes)
        per_byte = self.ag_s_per_byte * n / (n - 1)
        return Cost(n * self.ag_lat_s + per_byte * size_bytes)

    def alltoall(self, size_bytes: float, form: str) -> Cost:
        """Returns an all-to-all cost: each rank sends its shard, cut by the new split.

        Padded: one collective whose chunks are padded to the largest shard's. Grouped:
        n-1 exact-size rounds (fewer bytes, more latency).
        """
        n = self.n
        if n == 1:
            return ZERO
        per_byte = self.ag_s_per_byte * n / (n - 1)
        if form == "padded":
            return Cost(self.ag_lat_s, per_byte * size_bytes)
        return Cost(n * self.ag_lat_s, per_byte * size_bytes * (n - 1) / n)

    def compute(self, flops: float, bytes_moved: float, sharded: bool) -> Cost:
        """Returns the roofline cost of an operator, sharded by the ratios or replicated."""
        t = tuple(
            max(flops / f, bytes_moved / m)
            for f, m in zip(self.flops, self.mem_bytes_per_s, strict=True)
        )
        if sharded:
            return Cost(self.kernel_s, 0.0, t)
        return Cost(self.kernel_s + max(t))


def _affine(fn: object, lo: float = 1e6, hi: float = 2e6) -> tuple[float, float]:
    f_lo, f_hi = fn(lo), fn(hi)  # type: ignore[operator]
    slope = (f_hi - f_lo) / (hi - lo)
    return max(f_lo - slope * lo, 0.0), slope


def devices_from_cluster(
    cluster: Cluster,
    precision: str = "fp16",
    params: CostParams | None = None,
    devices: Sequence[str] | None = None,
) -> Devices:
    """Returns the Devices of ``cluster`` (all of them unless ``devices`` names some)."""
    params = params or default_params()
    names = tuple(devices) if devices is not None else tuple(cluster.devices())
    if not names:
        raise InputError("--cluster", "no devices")
    nodes: list[Node] = [cluster.device_node(d) for d in names]
    flops, mem, cap = [], [], []
    for node in nodes:
        eff = params.gpu(node.gpu.name)
        flops.append(node.gpu.peak_flops(precision) * eff.gemm_max)
        mem.append(node.gpu.hbm_bytes_per_s * eff.mem_efficiency)
        cap.append(node.gpu.memory_bytes - params.memory_reserve_bytes)
    ar = _affine(lambda s: group_allreduce_s(s, nodes, params))
    ag = _affine(lambda s: group_allreduce_s(s, nodes, params, volume=0.5))
    kernel = max(params.gpu(n.gpu.name).kernel_overhead_s for n in nodes)
    return Devices(names, tuple(flops), tuple(mem), tuple(cap), ar[0], ar[1], ag[0], ag[1], kernel)


def uniform_link_devices(
    flops: Sequence[float],
    bytes_per_s: float = 10e9,
    latency_s: float = 20e-6,
    capacity_bytes: float = float("inf"),
) -> Devices:
    """Returns devices of the given speeds on one ring of ``bytes_per_s`` links (for tests)."""
    n = len(flops)
    ring = 2.0 * (n - 1) / n if n > 1 else 0.0
    return Devices(
        names=tuple(f"dev{i}" for i in range(n)),
        flops=tuple(float(f) for f in flops),
        mem_bytes_per_s=tuple(float(f) / 10 for f in flops),
        capacity_bytes=(capacity_bytes,) * n,
        ar_lat_s=2 * (n - 1) * latency_s,
        ar_s_per_byte=ring / bytes_per_s,
        ag_lat_s=(n - 1) * latency_s,
        ag_s_per_byte=ring / 2 / bytes_per_s,
    )


def check_ratios(ratios: Sequence[float], n: int) -> np.ndarray:
    """Returns the ratios as an array after checking them (n entries, >= 0, sum 1)."""
    b = np.asarray(ratios, dtype=float)
    if b.shape != (n,) or (b < 0).any() or abs(b.sum() - 1.0) > 1e-6:
        raise InputError("ratios", f"need {n} non-negative ratios summing to 1, got {list(b)}")
    return b

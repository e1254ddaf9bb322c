"""Cost model of SPMD instructions on a set of devices of different speeds.

Every instruction's time is affine in the sharding ratios ``b``: a constant, plus a
coefficient times the largest share ``max_i b_i`` (padded collectives send the
largest shard from everyone), plus ``max_i b_i * t_i`` for sharded work (``t_i`` is
device i's time for the whole operator). The ratio LP optimises exactly this form.

There is one physics: every time here comes from the cost model's blocks in
``hetplan.cost`` with the fitted per-GPU-type ``CostParams``:

- matmuls: ``compute.gemm_time_s`` at the operator's real (m, k, n) shape, at the
  shape-dependent efficiency ``gemm_max * d / (d + gemm_half_dim)`` of its smallest
  dimension ``d``; attention: ``compute.attention_gemm_s`` (fused kernel);
- elementwise, normalisation, reduction and loss kernels: their bytes at
  ``compute.elementwise_bytes_per_s`` (the fitted share of HBM bandwidth);
- a launch cost ``kernel_overhead_s`` per kernel (forward and each backward kernel);
- collectives: ``comm.group_allreduce_s`` over the nodes the devices sit on
  (hierarchical ring across nodes, the node's network link shared by its members,
  fitted link efficiencies and per-step latencies, or the profile's measured links);
- optimizer and gradient memory: ``memory.state_bytes`` (Adam, no ZeRO; the SPMD
  program's sharded parameters shard all of it).

Linearisations (the LP needs times affine in ``b``):

- A sharded operator's time on device i is ``T_i(b_i) / b_i`` evaluated at the shard
  shape of the ratios the program is searched at (``b_i D`` of the sharded dimension
  ``D``): the efficiency of a small shard is honoured at those ratios and frozen while
  the LP moves them; the search/LP alternation (``synth.py``) prices again at the new
  ratios. A shard along a dimension that is not the smallest keeps its efficiency, so
  the time is then exactly linear in ``b_i``.
- A collective whose size depends on ``max(b)`` (padded forms) uses the secant of its
  size-to-time curve through the sizes at the even split and twice that: exact for the
  alpha-beta model wherever one phase (intra- or inter-node) stays the bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetplan.cluster import Cluster, Node
from hetplan.cost.comm import group_allreduce_s
from hetplan.cost.compute import attention_gemm_s, elementwise_bytes_per_s, gemm_time_s
from hetplan.cost.memory import state_bytes
from hetplan.cost.params import CostParams, GPUEfficiency, default_params
from hetplan.errors import InputError
from hetplan.hardware import GPUType

BACKWARD_FACTOR = 2.0
"""A collective on a tensor that needs a gradient has a dual of the same size in backward."""
FP32_BYTES = 4


def param_state_factor(itemsize: int) -> float:
    """Returns the bytes held per parameter byte under Adam (weights, gradients, optimizer
    states), from the cost model's ``memory.state_bytes`` table: 4 for fp32 parameters
    (4 + 4 + 8 bytes per parameter), 9 for 16-bit ones (2 + 4 + 12)."""
    precision = "fp32" if itemsize >= FP32_BYTES else "bf16"
    return sum(state_bytes(1.0, precision, 0, 1)) / itemsize


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
class OpWork:
    """What one operator does, by the letters of its index map (``ops.OpSpec``).

    ``gemms``: (batch, m, k, n) letter groups of each matmul; ``attention``: (batch,
    query, key, head, value) letter groups of a fused attention; ``square_flops``: the
    FLOPs of a contraction with no matmul form (priced as the square matmul of the same
    FLOPs); ``backward``: backward matmul passes per forward one; ``forward_bytes`` and
    ``backward_bytes``: the bytes its elementwise kernels move; ``kernels``: forward +
    backward kernel launches.
    """

    sizes: dict[str, int]
    gemms: tuple[tuple[str, str, str, str], ...] = ()
    attention: tuple[str, str, str, str, str] | None = None
    square_flops: float = 0.0
    backward: float = 0.0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    kernels: int = 0

    def size(self, letters: str, letter: str | None, share: float) -> float:
        """Returns the product of ``letters``' sizes, ``letter``'s cut to ``share``."""
        out = float(math.prod(self.sizes.get(c, 1) for c in letters))
        return out * share if letter is not None and letter in letters else out


@dataclass(frozen=True)
class Devices:
    """The devices of one SPMD group: their nodes, GPU types and the fitted parameters."""

    names: tuple[str, ...]
    nodes: tuple[Node, ...]
    """Each device's node (its GPU type and links)."""
    params: CostParams
    precision: str
    capacity_bytes: tuple[float, ...]
    """Memory available for the model (capacity less the fitted per-device reserve)."""
    _memo: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n(self) -> int:
        """Returns the number of devices."""
        return len(self.names)

    def gpu(self, i: int) -> GPUType:
        """Returns device i's GPU type."""
        return self.nodes[i].gpu

    def eff(self, i: int) -> GPUEfficiency:
        """Returns device i's fitted efficiency terms."""
        return self.params.gpu(self.nodes[i].gpu.name)

    def matmul_flops(self) -> list[float]:
        """Returns each device's achievable FLOP/s on large matmuls (peak x gemm_max)."""
        return [
            self.gpu(i).peak_flops(self.precision) * self.eff(i).gemm_max for i in range(self.n)
        ]

    def flops_proportional(self) -> list[float]:
        """Returns ratios proportional to large-matmul FLOP/s (the DP-CP split)."""
        flops = self.matmul_flops()
        total = sum(flops)
        return [f / total for f in flops]

    def even(self) -> list[float]:
        """Returns the even split (DP-EV)."""
        return [1.0 / self.n] * self.n

    # -- collectives on a tensor of ``size_bytes`` (global size) ---------------------------

    def _coll(self, size_bytes: float, volume: float) -> float:
        key = ("coll", size_bytes, volume)
        hit = self._memo.get(key)
        if hit is None:
            hit = group_allreduce_s(size_bytes, self.nodes, self.params, volume=volume)
            self._memo[key] = hit
        return float(hit)  # type: ignore[arg-type]

    def _line(self, fn: Callable[[float], float], size_bytes: float) -> tuple[float, float]:
        """Returns (latency, seconds per byte): the secant of ``fn`` through ``size_bytes``
        and twice it, its intercept kept >= 0 (then exact at ``size_bytes``)."""
        if size_bytes <= 0:
            return 0.0, 0.0
        lo, hi = fn(size_bytes), fn(2.0 * size_bytes)
        slope = (hi - lo) / size_bytes
        lat = lo - slope * size_bytes
        if lat < 0:
            return 0.0, lo / size_bytes
        return lat, slope

    def allreduce(self, size_bytes: float) -> Cost:
        """Returns the all-reduce cost (``comm.group_allreduce_s``; shards do not matter)."""
        if self.n == 1:
            return ZERO
        return Cost(self._coll(size_bytes, 1.0))

    def _allgather_s(self, total_bytes: float) -> float:
        return self._coll(total_bytes, 0.5)

    def allgather(self, size_bytes: float, form: str) -> Cost:
        """Returns an all-gather (or reduce-scatter) cost in ``form`` 'padded' or 'grouped'.

        Padded: every shard is padded to the largest, a ring all-gather of ``n max(b)``
        shards (half an all-reduce's volume in ``comm``). Grouped: each rank broadcasts its
        own shard; a pipelined broadcast of x bytes costs what an all-gather of
        ``n x / (n - 1)`` bytes does (x per link, n - 1 latency steps), so n of them at the
        even split cost n all-gathers of ``size / (n - 1)`` (any split, for an affine curve).
        """
        n = self.n
        if n == 1:
            return ZERO
        if form == "padded":
            lat, slope = self._line(self._allgather_s, size_bytes)
            return Cost(lat, slope * n * size_bytes)
        return Cost(n * self._allgather_s(size_bytes / (n - 1)))

    def alltoall(self, size_bytes: float, form: str, ratios: Sequence[float]) -> Cost:
        """Returns an all-to-all cost: each rank's shard is cut by the new split.

        Padded: one collective whose n - 1 outgoing chunks per rank are padded to
        ``max(b) size / n``, priced as the all-gather of the same per-rank volume
        (``(n - 1)/n`` of ``max(b) size``). Grouped: n - 1 exact-size rounds (latency each
        time); rank i sends ``b_i (1 - b_i) size``, with ``1 - b_i`` taken at ``ratios``.
        """
        n = self.n
        if n == 1:
            return ZERO
        lat, slope = self._line(self._allgather_s, size_bytes / n)
        if form == "padded":
            return Cost(lat, slope * size_bytes)
        per_byte = slope * n / (n - 1)  # seconds per byte one rank sends
        shard = tuple(per_byte * size_bytes * (1.0 - float(b)) for b in ratios)
        return Cost((n - 1) * lat, 0.0, shard)

    # -- compute ----------------------------------------------------------------------------

    def op_time_s(self, i: int, work: OpWork, letter: str | None, share: float) -> float:
        """Returns device i's forward + backward time of ``work`` on a ``share`` of
        ``letter`` (the whole operator with ``letter`` None), without launch costs."""
        gpu, eff = self.gpu(i), self.eff(i)
        peak = gpu.peak_flops(self.precision)
        gemm = 0.0
        for groups in work.gemms:
            batch, m, k, n = (work.size(g, letter, share) for g in groups)
            gemm += gemm_time_s(eff, peak, m, k, n, batch)
        if work.attention is not None:
            heads, q, s, d, e = (work.size(g, letter, share) for g in work.attention)
            gemm += attention_gemm_s(eff, peak, q, s, d, heads, True, value_dim=e)
        if work.square_flops > 0:
            side = (work.square_flops * share / 2.0) ** (1.0 / 3.0)
            gemm += gemm_time_s(eff, peak, side, side, side)
        traffic = (work.forward_bytes + work.backward_bytes) * share
        return gemm * (1.0 + work.backward) + traffic / elementwise_bytes_per_s(gpu, eff)

    def launch_s(self, kernels: int) -> float:
        """Returns the launch cost of ``kernels`` kernels on the slowest-launching device."""
        worst = self._memo.get(("launch",))
        if worst is None:
            worst = self._memo[("launch",)] = max(e.kernel_overhead_s for e in self._effs())
        return kernels * float(worst)  # type: ignore[arg-type]

    def _effs(self) -> list[GPUEfficiency]:
        return [self.params.gpu(name) for name in {node.gpu.name for node in self.nodes}]

    def op_cost(
        self, work: OpWork, letter: str | None, sharded: bool, ratios: Sequence[float]
    ) -> Cost:
        """Returns the cost of ``work``: split by the ratios along ``letter`` (``sharded``),
        or run whole by every device. See the module docstring for the linearisation."""
        launch = self.launch_s(work.kernels)
        seen: dict[tuple[str, float], float] = {}  # devices of one type at one share
        if not sharded:
            for i in range(self.n):
                key = (self.nodes[i].gpu.name, 1.0)
                if key not in seen:
                    seen[key] = self.op_time_s(i, work, None, 1.0)
            return Cost(launch + max(seen.values()))
        t = []
        for i, b in enumerate(ratios):
            share = float(b) if b > 0 else 1.0 / self.n
            key = (self.nodes[i].gpu.name, share)
            if key not in seen:
                seen[key] = self.op_time_s(i, work, letter, share) / share
            t.append(seen[key])
        return Cost(launch, 0.0, tuple(t))


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
    nodes = tuple(cluster.device_node(d) for d in names)
    for node in nodes:
        if not node.gpu.supports(precision):
            raise InputError("--precision", f"{node.gpu.name} has no {precision} support")
    cap = tuple(node.gpu.memory_bytes - params.memory_reserve_bytes for node in nodes)
    return Devices(names, nodes, params, precision, cap)


def uniform_link_devices(
    flops: Sequence[float],
    bytes_per_s: float = 10e9,
    latency_s: float = 20e-6,
    capacity_bytes: float = float("inf"),
) -> Devices:
    """Returns devices of the given FLOP/s, one per node, the nodes on one ring of
    ``bytes_per_s`` links with ``latency_s`` per step (for tests): matmuls at their peak
    whatever their shape, memory at a tenth of the FLOP/s in bytes/s, no launch cost."""
    nodes, gpus = [], {}
    for i, f in enumerate(flops):
        gpu = GPUType(
            name=f"test-{float(f):g}",
            memory_bytes=capacity_bytes,
            fp16_flops=float(f),
            bf16_flops=float(f),
            fp32_flops=float(f),
            hbm_bytes_per_s=float(f) / 10,
            intra_node_bytes_per_s=bytes_per_s,
            network_bytes_per_s=bytes_per_s,
        )
        gpus[gpu.name] = GPUEfficiency(
            gemm_max=1.0,
            gemm_half_dim=0.0,
            mem_efficiency=1.0,
            kernel_overhead_s=0.0,
            link_efficiency=1.0,
            network_efficiency=1.0,
            intra_latency_s=latency_s,
            inter_latency_s=latency_s,
        )
        nodes.append(Node(f"dev{i}", gpu, 1, bytes_per_s, bytes_per_s, None))
    params = CostParams(gpus=gpus, memory_reserve_bytes=0.0)
    names = tuple(node.devices()[0] for node in nodes)
    return Devices(names, tuple(nodes), params, "fp16", (capacity_bytes,) * len(nodes))


def check_ratios(ratios: Sequence[float], n: int) -> np.ndarray:
    """Returns the ratios as an array after checking them (n entries, >= 0, sum 1)."""
    b = np.asarray(ratios, dtype=float)
    if b.shape != (n,) or (b < 0).any() or abs(b.sum() - 1.0) > 1e-6:
        got = ", ".join(f"{x:g}" for x in b.ravel())
        raise InputError("ratios", f"need {n} non-negative ratios summing to 1, got {got}")
    return b

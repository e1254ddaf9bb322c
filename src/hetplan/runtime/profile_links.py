"""The backend's collectives and the pipelining runtime's overhead, measured between local
processes (gloo), together with the compute profile of each process (see profile.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from hetplan.cost.comm import tree_steps
from hetplan.cost.compute import LayerTimes
from hetplan.measured.profile_db import ProfileDB
from hetplan.model import ModelSpec
from hetplan.runtime.model_torch import Block, Features
from hetplan.runtime.profile import _ALIGN, _init, measure_compute

ZERO3_PART = "zero3_comm_dp"
"""Part name of one layer's measured ZeRO-3 cost, followed by the group size."""
P2P_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
ALLREDUCE_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Returns (latency s, bytes/s) of the least-squares line time = latency + size / rate."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True)) / sxx
    slope = max(slope, 1e-15)
    return max(my - slope * mx, 0.0), 1.0 / slope


def _timed_all(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Returns each function's median time, the functions taking turns (the ranks aligned by a
    barrier before each), so that load from elsewhere falls on all of them alike."""
    import torch.distributed as dist

    out: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for i, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if rep:  # the first round warms up
                out[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in out]


def _timed(fn: Callable[[], object], reps: int) -> float:
    return _timed_all([fn], reps)[0]


def _p2p(rank: int, size: int, reps: int) -> float:
    """Returns the one-way time of ``size`` bytes (half a ping-pong between ranks 0 and 1)."""
    import torch.distributed as dist

    buf = torch.zeros(size // 4)

    def ping() -> None:
        if rank > 1:
            return
        peer = 1 - rank
        for op in (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend):
            work = op(buf, peer)
            assert work is not None
            work.wait()

    return _timed(ping, reps) / 2


def _pieces(size: int, n: int = 8) -> list[torch.Tensor]:
    return [torch.randn(size // 4 // n) for _ in range(n)]


def _grad_allreduce(grads: list[torch.Tensor]) -> None:
    """Sums ``grads`` over the ranks as the runtime syncs gradients: assembled into a new
    flat buffer, all-reduced, copied back."""
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    pos = 0
    for g in grads:
        g.copy_(flat[pos : pos + g.numel()].view_as(g))
        pos += g.numel()


def _zero_bucket(size: int, group: Any) -> Any:
    """Returns a ZeRO-1 bucket of the runtime (``zero.ZeroBucket``) over ``group`` holding
    8 parameters of ``size`` bytes in all, its gradient buffer started."""
    from hetplan.runtime.grad_sync import LocalParam
    from hetplan.runtime.optim_config import OptimConfig
    from hetplan.runtime.zero import ZeroBucket

    params = [
        LocalParam(f"layers.0.p{i}", torch.nn.Parameter(t), None)
        for i, t in enumerate(_pieces(size))
    ]
    bucket = ZeroBucket(params, group, 1, 1, OptimConfig())
    bucket.start()
    return bucket


def _zero_collectives(size: int, group: Any, reps: int) -> tuple[float, float]:
    """Returns (all-gather, reduce-scatter) times of a ``size``-byte ZeRO bucket as the
    runtime issues them (``runtime/zero.py``): the all-gather of the updated parameter
    shards into the flat buffer after the step, and the reduce-scatter of the gradient
    buffer (on gloo an all-reduce in place, whose slice is the shard)."""
    from hetplan.runtime.zero import _all_gather

    bucket = _zero_bucket(size, group)

    def gather() -> None:
        _all_gather(bucket.flat, bucket.master.detach().clone(), group=bucket.pg)

    def scatter() -> None:
        bucket._scatter(bucket.grads, async_op=False)

    ag, rs = _timed_all([gather, scatter], reps)
    return ag, rs


def ring_figures(latency: float, rate: float, steps: int, share: float) -> tuple[float, float]:
    """Returns the per-ring-step latency and bus bytes/s of a collective measured as
    ``latency + bytes / rate`` over a buffer of ``bytes``, run as a ring of ``steps`` steps
    that sends ``share`` of the buffer per member (all-reduce among n: 2(n-1) steps,
    2(n-1)/n; all-gather and reduce-scatter: n-1 steps, (n-1)/n). ``comm`` prices a group of
    the measured size at exactly ``latency + bytes / rate`` again."""
    return latency / steps, rate * share


def _pipeline_overhead(model: ModelSpec, mb: int, rank: int, world: int, reps: int) -> float:
    """Returns the pipelining runtime's time per action (a micro-batch's forward or
    backward) beyond the module's own compute, on a one-stage pipeline per rank."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    groups = [dist.new_group([r]) for r in range(world)]
    module = _init(torch.nn.Linear(model.hidden, model.hidden))
    cpu = torch.device("cpu")

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out * target).mean()

    fns: list[Callable[[], object]] = []
    counts = (2, 6)
    for m in counts:
        stage = PipelineStage(module, 0, 1, cpu, group=groups[rank])
        sched = Schedule1F1B(stage, m, loss_fn=loss_fn, scale_grads=False)
        x = torch.randn(m * mb, model.seq, model.hidden)
        target = torch.randn_like(x)

        def direct(x: torch.Tensor = x, target: torch.Tensor = target, m: int = m) -> None:
            for xc, tc in zip(x.chunk(m), target.chunk(m), strict=True):
                loss_fn(module(xc), tc).backward()

        def piped(sched: Any = sched, x: torch.Tensor = x, target: torch.Tensor = target) -> None:
            sched.step(x, target=target, losses=[])

        fns += [piped, direct]
    p2, d2, p6, d6 = _timed_all(fns, reps)
    # the difference of the two counts leaves out what a step costs once
    return max(((p6 - d6) - (p2 - d2)) / (counts[1] - counts[0]), 0.0) / 2


def _tp_comm(
    model: ModelSpec, tp: int, mb: int, group: object, reps: int, sequence_parallel: bool = False
) -> LayerTimes:
    """Returns one layer's TP collectives (forward, backward): the layer with its group minus
    the same shard without it, timed while every rank computes. With
    ``sequence_parallel`` the layer runs as the runtime's SP layers do (its 1/tp of the
    sequence in, all-gathers before the column-parallel linears, reduce-scatters after
    the row-parallel ones); the shard without a group runs the whole sequence."""
    torch.manual_seed(0)
    x = torch.randn(mb, model.seq, model.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    joined = _init(Block(model, tp, group, Features(sequence_parallel=sequence_parallel)))
    alone = Block(model, tp, None)
    alone.load_state_dict(joined.state_dict())
    xj = x
    if sequence_parallel:
        xj = torch.randn(mb, model.seq // tp, model.hidden, requires_grad=True)
    fns: list[Callable[[], object]] = []
    for block, xb in ((joined, xj), (alone, x)):
        gb = grad if xb is x else torch.randn_like(xb)
        fns.append(partial(block, xb))
        fns.append(partial(_forward_backward, block, xb, gb))
    fj, bj, fa, ba = _timed_all(fns, reps)
    total = max(bj - ba, 0.0)  # forward and backward: the robust difference
    forward = min(max(fj - fa, 0.0), total)
    return LayerTimes(forward, total - forward, 0.0)


def _forward_backward(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    torch.autograd.backward(module(x), grad)


def _zero3_comm(model: ModelSpec, mb: int, group: Any, reps: int) -> LayerTimes:
    """Returns one layer's ZeRO-3 cost (forward, backward) as the runtime runs it over
    ``group``: the layer ``fully_shard``ed (FSDP2: all-gather before forward and backward,
    gradients reduce-scattered, the runtime's gloo reduce-scatter) minus the same layer
    unsharded, timed while every rank computes. What runs under compute and what waits is
    measured, not assumed."""
    from hetplan.runtime.fsdp import shard_block

    torch.manual_seed(0)
    x = torch.randn(mb, model.seq, model.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    alone = _init(Block(model, 1, None))
    sharded = Block(model, 1, None)
    sharded.load_state_dict(alone.state_dict())
    shard_block(sharded, group, torch.device("cpu"))
    fns: list[Callable[[], object]] = []
    for block in (sharded, alone):
        fns.append(partial(_no_grad_forward, block, x))
        fns.append(partial(_forward_backward, block, x, grad))
    fs, bs, fa, ba = _timed_all(fns, reps)
    total = max(bs - ba, 0.0)
    forward = min(max(fs - fa, 0.0), total)
    return LayerTimes(forward, total - forward, 0.0)


def _no_grad_forward(module: torch.nn.Module, x: torch.Tensor) -> None:
    """A forward as in a training step (recording autograd), its graph dropped."""
    module(x)


def _links_worker(rank: int, world: int, init: str, job: dict, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    from hetplan.runtime.teardown import leave_and_exit

    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        reps, model = job["reps"], job["model"]
        _ALIGN.append(dist.barrier)  # every rank computes at once, as in a run
        compute = measure_compute(
            model, job["micro_batches"], job["tps"], torch.device("cpu"), reps, job["precisions"]
        )
        p2p = [_p2p(rank, s, reps) for s in P2P_SIZES]
        ar = [_timed(partial(_grad_allreduce, _pieces(s)), reps) for s in ALLREDUCE_SIZES]
        one = torch.zeros(1, dtype=torch.float64)  # a loss or a gradient norm, as the runtime
        scalar = _timed(partial(dist.all_reduce, one), reps)
        whole = dist.new_group(list(range(world)))
        ag, rs = zip(*(_zero_collectives(s, whole, reps) for s in ALLREDUCE_SIZES), strict=True)
        pipe = _pipeline_overhead(model, min(job["micro_batches"]), rank, world, reps)
        comm: dict[str, list[float]] = {}
        comm_sp: dict[str, list[float]] = {}
        for tp in job["tps"]:
            if tp > 1:
                group = dist.new_group(list(range(tp)))
                for mb in job["micro_batches"]:
                    if rank < tp:
                        t = _tp_comm(model, tp, mb, group, reps)
                        comm[f"{tp},{mb}"] = [t.forward_s, t.backward_s]
                        if model.seq % tp == 0:
                            t = _tp_comm(model, tp, mb, group, reps, sequence_parallel=True)
                            comm_sp[f"{tp},{mb}"] = [t.forward_s, t.backward_s]
                    dist.barrier()
        zero3 = {}
        for mb in job["micro_batches"]:
            t = _zero3_comm(model, mb, whole, reps)
            zero3[str(mb)] = [t.forward_s, t.backward_s]
        if rank == 0:
            res = {"p2p": p2p, "allreduce": ar, "pipeline": pipe, "tp_comm": comm, **compute}
            res["scalar"] = scalar
            res.update({"allgather": list(ag), "reduce_scatter": list(rs)})
            res.update({"tp_comm_sp": comm_sp, "zero3": zero3})
            Path(out).write_text(json.dumps(res))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit(0)


def profile_links(
    db: ProfileDB,
    device_name: str,
    model: ModelSpec,
    micro_batches: list[int],
    tps: list[int],
    threads: int = 1,
    reps: int = 5,
    precisions: tuple[str, ...] = ("fp32",),
) -> dict[str, Any]:
    """Measures gloo point-to-point, all-reduce, ZeRO's all-gather and reduce-scatter, the
    all-reduce of one number, the pipelining overhead and each TP degree's layer
    collectives between local processes (``threads`` each) and stores them; returns rank
    0's measurements, with its compute measurements (see measure_compute)."""
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    world = max(2, *tps)
    with tempfile.TemporaryDirectory(prefix="hetplan-links-") as tmp:
        out = Path(tmp) / "links.json"
        job = {"reps": reps, "model": model, "micro_batches": micro_batches, "tps": tps}
        job["threads"] = threads
        job["precisions"] = precisions
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(_links_worker, args=(world, init, job, str(out)), nprocs=world, join=True)
        res = json.loads(out.read_text())
    p2p = fit_alpha_beta([float(s) for s in P2P_SIZES], res["p2p"])
    sizes = [float(s) for s in ALLREDUCE_SIZES]
    # world ranks: a ring all-reduce takes 2(n-1) steps and moves 2(n-1)/n of the buffer;
    # an all-gather or a reduce-scatter n-1 steps and (n-1)/n
    n = world
    ring = ring_figures(*fit_alpha_beta(sizes, res["allreduce"]), 2 * (n - 1), 2 * (n - 1) / n)
    figures = {"p2p": p2p, "allreduce": ring, "pipeline": (float(res["pipeline"]), 0.0)}
    figures["scalar"] = (float(res["scalar"]) / tree_steps(n), 0.0)  # per tree step
    for kind in ("allgather", "reduce_scatter"):
        figures[kind] = ring_figures(*fit_alpha_beta(sizes, res[kind]), n - 1, (n - 1) / n)
    for kind, (latency, bps) in figures.items():
        db.put_link(device_name, kind, latency, bps)
    for part in ("tp_comm", "tp_comm_sp"):
        for key, (fwd, bwd) in res[part].items():
            tp, mb = (int(x) for x in key.split(","))
            db.put_part(device_name, model, part, tp, mb, "fp32", LayerTimes(fwd, bwd, 0.0))
    for key, (fwd, bwd) in res["zero3"].items():  # one layer over a group of ``world``
        part = f"{ZERO3_PART}{world}"
        db.put_part(device_name, model, part, 1, int(key), "fp32", LayerTimes(fwd, bwd, 0.0))
    res["links"] = figures
    return res

"""Time what a training step runs on this device: a layer's forward and backward (and saved
activations), the embedding, the head with its loss, the optimizer step, and (in several
local processes, profile_links.py) the backend's collectives.

Each precision is timed as the runtime runs it (``precision.py``): fp32 with TF32 off; tf32
with it on; bf16 and fp16 on 2-byte parameters and activations under autocast, the
optimizer stepping fp32 masters and rounding them into the parameters."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.nn import functional as F

from hetplan.cost.compute import LayerTimes
from hetplan.measured.profile_db import LayerRecord, ProfileDB, shape_key
from hetplan.model import ModelSpec
from hetplan.plan import PRECISIONS as PLAN_PRECISIONS
from hetplan.runtime.grad_sync import square_sum
from hetplan.runtime.model_torch import Block, Embed, Head
from hetplan.runtime.optim_config import OptimConfig
from hetplan.runtime.precision import autocast, autocast_dtype, set_matmul_precision
from hetplan.runtime.state import make_optimizer

PRECISIONS = PLAN_PRECISIONS
"""What ``profile_model`` can time: every precision a plan may state."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_ALIGN: list[Callable[[], object]] = []
"""Set in profiling processes: a barrier before each timed call, so that every process
times the same work at the same moment (as a run's ranks compute side by side)."""


def _medians_s(fns: list[Callable[[], object]], device: torch.device, reps: int) -> list[float]:
    """Returns each function's median time; they take turns, so load from elsewhere falls on
    all of them alike (their differences stay meaningful)."""
    out: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for i, fn in enumerate(fns):
            for align in _ALIGN:
                align()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rep:  # the first round warms up
                out[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in out]


def _median_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    return _medians_s([fn], device, reps)[0]


def _forward_backward_s(
    forward: Callable[[], torch.Tensor], grad: torch.Tensor | None, device: torch.device, reps: int
) -> tuple[float, float]:
    """Returns the median times of ``forward()`` (recording autograd) and of the backward
    from its output (with ``grad``, or of a scalar loss), each timed on its own."""
    fwd, bwd = [], []
    for rep in range(reps + 1):
        for align in _ALIGN:
            align()
        _sync(device)
        t0 = time.perf_counter()
        out = forward()
        _sync(device)
        t1 = time.perf_counter()
        torch.autograd.backward(out, grad)
        _sync(device)
        if rep:  # the first round warms up
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def _run_as(precision: str, device: torch.device, fn: Callable[[], Any]) -> Callable[[], Any]:
    """Returns ``fn`` run under the precision's autocast (none for fp32 and tf32)."""

    def run() -> Any:
        with autocast(precision, device):
            return fn()

    return run


def _dtype(precision: str) -> torch.dtype:
    """Returns the dtype of the parameters and activations a run of ``precision`` keeps."""
    return autocast_dtype(precision) or torch.float32


def profile_layer(
    model: ModelSpec,
    tp: int,
    micro_batch: int,
    device: torch.device,
    reps: int = 5,
    precision: str = "fp32",
) -> tuple[LayerTimes, float]:
    """Returns one layer's (times, saved activation bytes) for one TP rank's shard.

    The shard's compute is timed without its collectives: those are the cost model's
    communication terms. Layers run as in a stage, CHAIN of them in sequence (each time is
    per layer), so that no layer finds its weights and activations still in the caches.
    """
    dtype = _dtype(precision)
    block = _chain(model, tp).to(device, dtype)
    shape = (micro_batch, model.seq, model.hidden)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    n = len(block)

    forward = _run_as(precision, device, lambda: block(x))
    forward_s, backward_s = (t / n for t in _forward_backward_s(forward, grad, device, reps))
    hd, heads = model.head_dim, model.heads // tp
    q = torch.randn(micro_batch, heads, model.seq, hd, device=device, dtype=dtype)
    with torch.no_grad():
        attn_s = _median_s(
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device, reps
        )
    saved = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run_as(precision, device, lambda: block[0](x))()
    return LayerTimes(forward_s, backward_s, attn_s), saved[0]


CHAIN = 4
"""Layers profiled in sequence (fewer if the model has fewer)."""


def _init(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module


def _chain(model: ModelSpec, tp: int) -> torch.nn.Sequential:
    """Returns min(CHAIN, layers) initialised layer shards in sequence."""
    n = max(1, min(CHAIN, model.layers))
    return torch.nn.Sequential(*(_init(Block(model, tp, None)) for _ in range(n)))


def profile_parts(
    model: ModelSpec, micro_batch: int, device: torch.device, reps: int = 5, precision: str = "fp32"
) -> tuple[LayerTimes, LayerTimes]:
    """Returns the (embedding, head with loss) times for one micro-batch.

    Both are replicated within a TP group, so their times do not depend on TP.
    """
    dtype = _dtype(precision)
    shape = (micro_batch, model.seq)
    tokens = torch.randint(0, model.vocab, shape, device=device)
    embed = _init(Embed(model)).to(device, dtype)
    grad = torch.randn(micro_batch, model.seq, model.hidden, device=device, dtype=dtype)
    embed_s = _forward_backward_s(
        _run_as(precision, device, partial(embed, tokens)), grad, device, reps
    )
    head = _init(Head(model)).to(device, dtype)
    x = torch.randn(*shape, model.hidden, device=device, dtype=dtype, requires_grad=True)

    def loss() -> torch.Tensor:
        with autocast(precision, device):
            logits = head(x)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())

    head_s = _forward_backward_s(loss, None, device, reps)
    return LayerTimes(*embed_s, 0.0), LayerTimes(*head_s, 0.0)


def profile_optimizer(
    model: ModelSpec, tp: int, device: torch.device, reps: int = 5, precision: str = "fp32"
) -> dict[str, tuple[float, int]]:
    """Returns {part: (optimizer step seconds, parameters)} for a layer shard, embedding,
    head (a layer's: over a chain of layers, as profile_layer, per layer). The step is what
    the runtime's is: the gradients' share of the global norm (for clipping), then AdamW on
    the fp32 masters (bf16, fp16: then rounded into the 2-byte parameters)."""
    low = autocast_dtype(precision)
    out = {}
    chain = _chain(model, tp)
    parts: dict[str, tuple[torch.nn.Module, int]] = {
        "layer": (chain, len(chain)),
        "embed": (_init(Embed(model)), 1),
        "head": (_init(Head(model)), 1),
    }
    for part, (module, n) in parts.items():
        params = list(module.to(device).parameters())
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make_optimizer(params, OptimConfig(lr=1e-3))
        lows = [p.detach().to(low) for p in params] if low is not None else []

        def step(
            opt: torch.optim.Optimizer = opt, params: list[Any] = params, lows: list[Any] = lows
        ) -> None:
            for p in params:
                square_sum(p.grad)
            opt.step()
            with torch.no_grad():
                for lo, p in zip(lows, params[: len(lows)], strict=True):
                    lo.copy_(p)

        step_s = _median_s(step, device, reps) / n
        out[part] = (step_s, sum(p.numel() for p in params) // n)
    return out


def measure_device(
    device: torch.device, reps: int = 5, dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """Returns (TFLOP/s of a 1024^3 matmul in ``dtype``, GB/s of a 64 MiB fp32 copy) on
    ``device``."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _median_s(lambda: a @ b, device, reps)
    src = torch.empty(16 * 2**20, device=device)
    dst = torch.empty_like(src)
    cp_s = _median_s(lambda: dst.copy_(src), device, reps)
    return 2 * n**3 / mm_s / 1e12, 2 * src.numel() * 4 / cp_s / 1e9


def profile_model(
    db: ProfileDB,
    device_name: str,
    model: ModelSpec,
    micro_batches: list[int],
    tps: list[int],
    device: torch.device,
    reps: int = 5,
    links: bool = False,
    precisions: tuple[str, ...] = ("fp32",),
    rates: dict[str, float] | None = None,
) -> list[LayerRecord]:
    """Profiles one layer, the embedding, head and optimizer of ``model`` for each (TP,
    micro-batch) in each of ``precisions`` and stores the results; ``rates``, if given,
    receives each precision's measured matmul TFLOP/s.

    With ``links`` (CPU only) everything is measured in several local processes at once, as
    a run's ranks share this machine, together with the backend's collectives.
    """
    threads = torch.get_num_threads()
    if links and device.type != "cpu":
        raise ValueError("links are measured between CPU processes (gloo) only")
    if links:
        from hetplan.runtime.profile_links import profile_links

        res = profile_links(
            db, device_name, model, micro_batches, tps, max(threads, 1), reps, precisions
        )
    else:
        res = measure_compute(model, micro_batches, tps, device, reps, precisions)
    tflops, gbps = res["device"]
    db.put_device(device_name, tflops, gbps, threads)
    if rates is not None:
        rates.update(res.get("matmul_tflops", {}))
    out = []
    for prec, comp in res["compute"].items():
        for mb in micro_batches:
            embed, head = (LayerTimes(t[0], t[1], 0.0) for t in comp["parts"][str(mb)])
            for tp in tps:
                db.put_part(device_name, model, "embed", tp, mb, prec, embed)
                db.put_part(device_name, model, "head", tp, mb, prec, head)
        for tp in tps:
            for part, (step_s, n) in comp["optimizer"][str(tp)].items():
                db.put_optimizer(device_name, model, part, tp, prec, step_s, n)
            for mb in micro_batches:
                (fwd, bwd, attn), act = comp["layers"][f"{tp},{mb}"]
                times = LayerTimes(fwd, bwd, attn)
                rec = LayerRecord(device_name, shape_key(model), tp, mb, prec, times, act, threads)
                db.put(rec)
                out.append(rec)
    return out


def measure_compute(
    model: ModelSpec,
    micro_batches: list[int],
    tps: list[int],
    device: torch.device,
    reps: int,
    precisions: tuple[str, ...] = ("fp32",),
) -> dict[str, Any]:
    """Returns the compute measurements of profile_model as a JSON-ready mapping: the
    device's fp32 figures, each precision's matmul TFLOP/s, and per precision the parts,
    optimizer steps and layers."""
    res: dict[str, Any] = {"device": measure_device(device, reps), "compute": {}}
    res["matmul_tflops"] = {}
    for prec in precisions:
        set_matmul_precision(prec, device)
        res["matmul_tflops"][prec] = measure_device(device, reps, _dtype(prec))[0]
        comp: dict[str, Any] = {"parts": {}, "layers": {}}
        for mb in micro_batches:
            embed, head = profile_parts(model, mb, device, reps, prec)
            comp["parts"][str(mb)] = [[t.forward_s, t.backward_s] for t in (embed, head)]
        comp["optimizer"] = {
            str(tp): profile_optimizer(model, tp, device, reps, prec) for tp in tps
        }
        for tp in tps:
            for mb in micro_batches:
                t, act = profile_layer(model, tp, mb, device, reps, prec)
                comp["layers"][f"{tp},{mb}"] = [
                    [t.forward_s, t.backward_s, t.selective_recompute_s],
                    act,
                ]
        res["compute"][prec] = comp
    set_matmul_precision("fp32", device)
    return res

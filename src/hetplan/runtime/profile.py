"""Time one transformer layer's forward and backward (and saved activations) on this device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from hetplan.cost.compute import LayerTimes
from hetplan.model import ModelSpec
from hetplan.runtime.model_torch import Block
from hetplan.runtime.profile_db import LayerRecord, ProfileDB, shape_key


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def profile_layer(
    model: ModelSpec, tp: int, micro_batch: int, device: torch.device, reps: int = 5
) -> tuple[LayerTimes, float]:
    """Returns one layer's (times, saved activation bytes) for one TP rank's shard.

    The shard's compute is timed without its collectives: those are the cost model's
    communication terms.
    """
    block = Block(model, tp, None).to(device)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(micro_batch, model.seq, model.hidden, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def fwd() -> None:
        block(x)  # with autograd recording, as in training

    def fwd_bwd() -> None:
        torch.autograd.backward(block(x), grad)

    forward_s = _median_s(fwd, device, reps)
    backward_s = max(_median_s(fwd_bwd, device, reps) - forward_s, 0.0)
    hd, heads = model.head_dim, model.heads // tp
    q = torch.randn(micro_batch, heads, model.seq, hd, device=device)
    with torch.no_grad():
        attn_s = _median_s(
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device, reps
        )
    saved = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return LayerTimes(forward_s, backward_s, attn_s), saved[0]


def measure_device(device: torch.device, reps: int = 5) -> tuple[float, float]:
    """Returns (fp32 TFLOP/s of a 1024^3 matmul, GB/s of a 64 MiB copy) on ``device``."""
    n = 1024
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
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
) -> list[LayerRecord]:
    """Profiles one layer of ``model`` for each (TP, micro-batch) and stores the results."""
    threads = torch.get_num_threads()
    tflops, gbps = measure_device(device, reps)
    db.put_device(device_name, tflops, gbps, threads)
    out = []
    for tp in tps:
        for mb in micro_batches:
            times, act = profile_layer(model, tp, mb, device, reps)
            rec = LayerRecord(device_name, shape_key(model), tp, mb, "fp32", times, act, threads)
            db.put(rec)
            out.append(rec)
    return out

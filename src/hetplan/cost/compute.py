"""Compute time of layers on one GPU: matmuls at shape-dependent efficiency, elementwise
kernels at memory bandwidth, plus a per-kernel launch cost."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hetplan.cost.params import GPUEfficiency
from hetplan.hardware import GPUType
from hetplan.model import ModelSpec
from hetplan.plan import element_bytes


def gemm_efficiency(eff: GPUEfficiency, m: float, k: float, n: float) -> float:
    """Returns the fraction of peak a (m x k) @ (k x n) matmul reaches."""
    smallest = min(m, k, n)
    return eff.gemm_max * smallest / (smallest + eff.gemm_half_dim)


def gemm_time_s(
    eff: GPUEfficiency, peak_flops: float, m: float, k: float, n: float, batch: float = 1.0
) -> float:
    """Returns the time of ``batch`` (m x k) @ (k x n) matmuls."""
    flops = 2.0 * m * k * n * batch
    return flops / (peak_flops * gemm_efficiency(eff, m, k, n))


FLASH_ATTENTION_SLOWDOWN = 1.25
"""A fused attention kernel keeps the scores on chip; its matmuls run this much slower."""


def attention_gemm_s(
    eff: GPUEfficiency,
    peak_flops: float,
    q_len: float,
    kv_len: float,
    head_dim: float,
    batch: float,
    flash_attention: bool,
    value_dim: float | None = None,
) -> float:
    """Returns the forward matmul time of attention: scores (q_len x head_dim) @ (head_dim x
    kv_len) and context (q_len x kv_len) @ (kv_len x value_dim), ``batch`` heads of each."""
    dv = head_dim if value_dim is None else value_dim
    t = gemm_time_s(eff, peak_flops, q_len, head_dim, kv_len, batch) + gemm_time_s(
        eff, peak_flops, q_len, kv_len, dv, batch
    )
    return t * FLASH_ATTENTION_SLOWDOWN if flash_attention else t


def elementwise_bytes_per_s(gpu: GPUType, eff: GPUEfficiency) -> float:
    """Returns the memory bandwidth elementwise kernels reach (a fitted share of HBM's)."""
    return gpu.hbm_bytes_per_s * eff.mem_efficiency


@dataclass(frozen=True)
class LayerTimes:
    """Per micro-batch compute times of one piece of the model, in seconds."""

    forward_s: float
    backward_s: float
    """Backward without recomputation."""
    selective_recompute_s: float
    """Forward work redone under selective recomputation (attention core)."""


@lru_cache(maxsize=65536)
def layer_times(
    model: ModelSpec,
    gpu: GPUType,
    eff: GPUEfficiency,
    tp: int,
    micro_batch: int,
    precision: str,
    flash_attention: bool,
    sequence_parallel: bool = False,
) -> LayerTimes:
    """Returns the compute times of one transformer layer for one micro-batch on one TP rank.

    With ``sequence_parallel`` the forward's norms, residual adds and hidden-state dropouts
    run on the rank's 1/tp of the sequence (Korthikanti et al. 2022); without it every rank of
    the TP group repeats them on the whole sequence."""
    peak = gpu.peak_flops(precision)
    s, h, q, kv, f, a, dh = (
        model.seq,
        model.hidden,
        model.q_dim,
        model.kv_dim,
        model.ffn,
        model.heads,
        model.head_dim,
    )
    tokens = float(micro_batch * s)
    e = element_bytes(precision)
    # weight matmuls, forward: qkv, output projection, MLP
    mlp_in = (2 if model.gated else 1) * f / tp
    fwd_gemm = (
        gemm_time_s(eff, peak, tokens, h, (q + 2 * kv) / tp)
        + gemm_time_s(eff, peak, tokens, q / tp, h)
        + gemm_time_s(eff, peak, tokens, h, mlp_in)
        + gemm_time_s(eff, peak, tokens, f / tp, h)
    )
    heads_local = micro_batch * a / tp
    attn_gemm = attention_gemm_s(eff, peak, s, s, dh, heads_local, flash_attention)
    # elementwise traffic (bytes) per kernel, forward and backward: norms, residuals,
    # activation, dropout, biases, rope; a backward kernel reads what its forward saved and
    # the incoming gradient and writes the outgoing one
    drop = 1.0 if model.dropout else 0.0
    # the region every TP rank repeats on the whole sequence (without sequence parallelism):
    # two norms (forward r+w; backward reads x and dy, writes dx), two residual adds (2r+w;
    # backward sums the branch gradients, 2r+w) and three dropouts (read, write, mask;
    # backward reads dy and the mask, writes dx)
    rep_f = tokens * h * (e * (2 * 2 + 2 * 3) + drop * 3 * (2 * e + 1))
    rep_b = tokens * h * (e * (2 * 3 + 2 * 3) + drop * 3 * (2 * e + 1))
    if model.gated:  # silu(gate) * up: reads two, writes one; backward reads gate, up and
        # dy, writes both gradients; rotary on q and k (r+w, the same backward)
        elem_f = tokens * f / tp * e * 3 + tokens * (q + kv) / tp * e * 2 * 2
        elem_b = tokens * f / tp * e * 5 + tokens * (q + kv) / tp * e * 2 * 2
    else:  # bias + gelu (r+w; backward reads the input and dy, writes dx); the qkv bias
        # (r+w; its gradient is a sum over dy: one read)
        elem_f = tokens * f / tp * e * 2 + tokens * (q + 2 * kv) / tp * e * 2
        elem_b = tokens * f / tp * e * 3 + tokens * (q + 2 * kv) / tp * e
    scores = heads_local * s * s
    # a fused scale+mask+softmax (Megatron's) reads the scores and writes the probabilities
    # once, its backward reads them and their gradient and writes one; the dropout on them
    # as above. A fused attention kernel keeps the scores on chip (its matmuls' slowdown is
    # in attention_gemm_s)
    attn_elem = 0.0 if flash_attention else scores * (e * 2 + drop * (2 * e + 1))
    attn_back = 0.0 if flash_attention else scores * (e * 3 + drop * (2 * e + 1))
    mem_bw = elementwise_bytes_per_s(gpu, eff)
    kernels = 14 + (4 if model.dropout else 0) + (2 if model.gated else 0)
    launch = kernels * eff.kernel_overhead_s
    # sequence parallelism runs the forward's replicated region on 1/tp of the tokens; its
    # backward gains about nothing: the split norms and dropouts are offset by gathering the
    # column-parallel matmuls' inputs again for their weight gradients (measured per layer:
    # forward 7.7 -> 7.2 ms, backward 11.9 -> 11.8 ms; Korthikanti et al. 2022)
    split = tp if sequence_parallel else 1
    fwd = fwd_gemm + attn_gemm + (elem_f + rep_f / split + attn_elem) / mem_bw + launch
    # backward: two matmuls per forward matmul
    bwd = 2 * (fwd_gemm + attn_gemm) + (elem_b + rep_b + attn_back) / mem_bw + 2 * launch
    selective = attn_gemm + attn_elem / mem_bw
    return LayerTimes(fwd, bwd, selective)


@lru_cache(maxsize=65536)
def embedding_times(
    model: ModelSpec, gpu: GPUType, eff: GPUEfficiency, tp: int, micro_batch: int, precision: str
) -> LayerTimes:
    """Returns the compute times of the input embedding for one micro-batch."""
    e = element_bytes(precision)
    tokens = float(micro_batch * model.seq)
    traffic = tokens * model.hidden * e * (3 if model.family == "gpt" else 2)
    mem_bw = elementwise_bytes_per_s(gpu, eff)
    fwd = traffic / mem_bw + 3 * eff.kernel_overhead_s
    return LayerTimes(fwd, 2 * fwd, 0.0)


@lru_cache(maxsize=65536)
def head_times(
    model: ModelSpec, gpu: GPUType, eff: GPUEfficiency, tp: int, micro_batch: int, precision: str
) -> LayerTimes:
    """Returns the compute times of the final norm, output head and loss for one micro-batch."""
    peak = gpu.peak_flops(precision)
    e = element_bytes(precision)
    tokens = float(micro_batch * model.seq)
    gemm = gemm_time_s(eff, peak, tokens, model.hidden, model.vocab / tp)
    # norm, then the vocab-parallel cross-entropy on fp32 logits (max, exp-sum, gather)
    traffic = tokens * model.hidden * e * 2 + tokens * model.vocab / tp * (e + 4 * 3)
    mem_bw = elementwise_bytes_per_s(gpu, eff)
    fwd = gemm + traffic / mem_bw + 6 * eff.kernel_overhead_s
    return LayerTimes(fwd, 2 * gemm + 2 * traffic / mem_bw + 12 * eff.kernel_overhead_s, 0.0)


def optimizer_time_s(
    params_local: float, gpu: GPUType, eff: GPUEfficiency, precision: str
) -> float:
    """Returns the optimizer step time for ``params_local`` parameters (memory-bound): the
    gradient-norm pass of clipping (Megatron's ``clip_grad_norm_fp32``, the runtime's
    ``grad_sync.square_sum``), then Adam."""
    # the norm reads the fp32 grad; Adam reads fp32 grad, master, m, v and writes master, m,
    # v and the low-precision copy (none when the weights are stored in fp32: fp32 and tf32)
    e = element_bytes(precision)
    traffic = params_local * (4 + 4 * 4 + 4 * 3 + (0 if e == 4 else e))
    return traffic / elementwise_bytes_per_s(gpu, eff)

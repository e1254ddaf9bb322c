import pytest

from hetplan.cost.compute import gemm_efficiency, gemm_time_s, layer_times
from hetplan.cost.params import GPUEfficiency
from hetplan.hardware import get_gpu
from hetplan.model import ModelSpec

GPT = ModelSpec("t", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048)


def test_model_flops_follow_the_six_n_d_rule():
    """Weight matmuls: 2 FLOPs per parameter per token forward, 3x for forward + backward."""
    s, h, f = GPT.seq, GPT.hidden, GPT.ffn
    weights = 4 * h * h + 2 * h * f  # qkv + output projection + two MLP matrices
    assert GPT.layer_matmul_flops() == pytest.approx(2 * weights * s)
    per_seq = GPT.model_flops_per_sequence()
    dense = 6 * (GPT.layers * weights + GPT.vocab * h) * s
    attention = 3 * GPT.layers * 4 * s * s * h
    assert per_seq == pytest.approx(dense + attention)


def test_gemm_efficiency_is_monotone_and_saturates():
    eff = GPUEfficiency(gemm_max=0.8, gemm_half_dim=128.0)
    sizes = [16, 64, 128, 512, 4096, 65536]
    values = [gemm_efficiency(eff, n, n, n) for n in sizes]
    assert values == sorted(values)
    assert gemm_efficiency(eff, 128, 4096, 4096) == pytest.approx(0.4)  # half at half_dim
    assert values[-1] < 0.8
    assert values[-1] == pytest.approx(0.8, rel=0.01)


def test_gemm_time_is_flops_over_effective_peak():
    eff = GPUEfficiency(gemm_max=0.5, gemm_half_dim=0.0)
    assert gemm_time_s(eff, 100e12, 1024, 2048, 4096, batch=3) == pytest.approx(
        2 * 1024 * 2048 * 4096 * 3 / 50e12
    )


def test_large_layer_time_approaches_flops_over_peak():
    """With no overheads and free memory traffic, forward = layer FLOPs / (peak x gemm_max)."""
    gpu = get_gpu("A100-80GB")
    eff = GPUEfficiency(gemm_max=1.0, gemm_half_dim=0.0, mem_efficiency=1.0, kernel_overhead_s=0)
    lt = layer_times(GPT, gpu, eff, 1, 1, "bf16", True)
    ideal = GPT.layer_flops() / gpu.peak_flops("bf16")
    assert ideal < lt.forward_s < 1.25 * ideal  # the rest is elementwise traffic
    unfused = layer_times(GPT, gpu, eff, 1, 1, "bf16", False)
    # without flash attention the s^2 scores go through memory: mask, softmax, dropout
    scores = GPT.heads * GPT.seq**2
    assert unfused.forward_s > lt.forward_s + scores * 8 / gpu.hbm_bytes_per_s
    # the backward's weight matmuls are twice the forward's; its elementwise kernels read
    # less than twice the forward's traffic (per-kernel counts in the next test)
    assert 1.8 * lt.forward_s < lt.backward_s < 2 * lt.forward_s


def _traffic_only(model, flash):
    """Forward and backward bytes of a layer: matmuls free, memory at 1 byte/s."""
    from dataclasses import replace

    gpu = replace(get_gpu("A100-80GB"), fp16_flops=1e40, bf16_flops=1e40, hbm_bytes_per_s=1.0)
    eff = GPUEfficiency(gemm_max=1.0, gemm_half_dim=0.0, mem_efficiency=1.0, kernel_overhead_s=0)
    lt = layer_times(model, gpu, eff, 1, 2, "fp16", flash)
    return lt.forward_s, lt.backward_s


def test_elementwise_traffic_by_kernel():
    """Hand counts, kernel by kernel, of one layer's memory traffic in fp16 (2 B), micro-batch
    2: forward a kernel reads its inputs and writes its output; backward it reads what the
    forward saved and the incoming gradient and writes the outgoing one; a dropout mask is
    1 B an element. GPT (GeLU, biases, dropout) and Llama (SwiGLU, rotary, no dropout), with
    the attention scores through memory (no flash) and kept on chip (flash)."""
    t, h, f, a, s = 2 * 64, 32, 128, 4, 64  # tokens, hidden, ffn, heads, seq
    gpt = ModelSpec("g", "gpt", 2, h, a, a, f, 100, s)
    sc = 2 * a * s * s  # attention scores of the micro-batch
    norm_f, norm_b = 2 * (2 + 2) * t * h, 2 * (2 + 2 + 2) * t * h  # r+w | r x, r dy, w dx
    add_f = add_b = 2 * (2 + 2 + 2) * t * h  # two residual adds: two reads, one write
    drop = 3 * (2 + 2 + 1) * t * h  # three dropouts: read, write, 1-byte mask (and back)
    gelu_f, gelu_b = (2 + 2) * t * f, (2 + 2 + 2) * t * f
    bias_f, bias_b = (2 + 2) * t * 3 * h, 2 * t * 3 * h  # qkv bias | its gradient: read dy
    soft_f, soft_b = (2 + 2) * sc, (2 + 2 + 2) * sc  # fused scale-mask-softmax
    pdrop = (2 + 2 + 1) * sc
    fwd = norm_f + add_f + drop + gelu_f + bias_f
    bwd = norm_b + add_b + drop + gelu_b + bias_b
    assert _traffic_only(gpt, True) == pytest.approx((fwd, bwd), rel=1e-6)
    got = _traffic_only(gpt, False)
    assert got == pytest.approx((fwd + soft_f + pdrop, bwd + soft_b + pdrop), rel=1e-6)
    llama = ModelSpec("l", "llama", 2, h, a, 2, f, 100, s)
    kv = h // 2
    swiglu_f, swiglu_b = (2 + 2 + 2) * t * f, 5 * 2 * t * f  # r gate, r up, w | r 3, w 2
    rope = 2 * (2 + 2) * t * (h + kv)  # q and k: read, write (backward the same)
    fwd = norm_f + add_f + swiglu_f + rope
    bwd = norm_b + add_b + swiglu_b + rope
    assert _traffic_only(llama, True) == pytest.approx((fwd, bwd), rel=1e-6)
    assert _traffic_only(llama, False) == pytest.approx((fwd + soft_f, bwd + soft_b), rel=1e-6)


def test_tensor_parallelism_splits_the_work():
    gpu = get_gpu("A100-80GB")
    eff = GPUEfficiency(gemm_half_dim=0.0, kernel_overhead_s=0.0)
    one = layer_times(GPT, gpu, eff, 1, 2, "bf16", True).forward_s
    four = layer_times(GPT, gpu, eff, 4, 2, "bf16", True).forward_s
    assert four < one / 3  # the replicated norms and residuals keep it above one / 4


def test_kernel_overhead_adds_a_fixed_cost():
    gpu = get_gpu("T4")
    small = ModelSpec("s", "gpt", 2, 64, 1, 1, 256, 128, 16)
    fast = layer_times(small, gpu, GPUEfficiency(kernel_overhead_s=1e-6), 1, 1, "fp16", False)
    slow = layer_times(small, gpu, GPUEfficiency(kernel_overhead_s=1e-4), 1, 1, "fp16", False)
    assert slow.forward_s - fast.forward_s == pytest.approx(18 * 99e-6)


def test_sequence_parallelism_splits_the_replicated_elementwise_work():
    """Hand count on a tiny dropout-free layer: the two norms (read + write) and two residual
    adds (two reads + write) touch 10 elements per token and hidden unit; sequence parallelism
    runs them on 1/tp of the tokens forward, so tp = 4 saves 3/4 of that traffic. Backward
    re-gathers the matmul inputs instead (the paper's per-layer backward barely moves: 11.9 vs
    11.8 ms). Matmuls and the TP-split elementwise work are unchanged."""
    gpu = get_gpu("A100-80GB")
    eff = GPUEfficiency(mem_efficiency=1.0, kernel_overhead_s=0.0)
    tiny = ModelSpec("t", "llama", 2, 256, 4, 4, 1024, 1000, 128)  # no dropout
    assert not tiny.dropout
    off = layer_times(tiny, gpu, eff, 4, 2, "bf16", True)
    on = layer_times(tiny, gpu, eff, 4, 2, "bf16", True, sequence_parallel=True)
    tokens, bytes_per = 2 * 128, 2
    saved = tokens * 256 * bytes_per * 10 * (1 - 1 / 4) / gpu.hbm_bytes_per_s
    assert off.forward_s - on.forward_s == pytest.approx(saved, rel=1e-9)
    assert on.backward_s == off.backward_s
    assert on.selective_recompute_s == off.selective_recompute_s
    # one rank: nothing to split
    one = layer_times(tiny, gpu, eff, 1, 2, "bf16", True)
    assert layer_times(tiny, gpu, eff, 1, 2, "bf16", True, sequence_parallel=True) == one

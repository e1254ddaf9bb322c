"""Precision as the hardware runs it: fp32 (CUDA cores), tf32 (fp32 storage, TF32 tensor cores),
bf16/fp16 (mixed precision). Expected figures come from NVIDIA/AMD datasheets and from
Megatron-Core's distributed-optimizer table of bytes per parameter, not from hetplan's code."""

import dataclasses

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.compute import optimizer_time_s
from hetplan.cost.estimate import estimate
from hetplan.cost.memory import state_bytes
from hetplan.cost.params import default_params
from hetplan.errors import InputError
from hetplan.hardware import get_gpu, gpu_from_mapping
from hetplan.model import load_model
from hetplan.plan import PRECISIONS, check_plan_form, element_bytes
from hetplan.search.layout import uniform_plan

T = 1e12


def test_precisions_are_the_four_hardware_modes():
    assert set(PRECISIONS) == {"fp32", "tf32", "bf16", "fp16"}


@pytest.mark.parametrize(
    ("gpu", "fp32", "tf32", "bf16"),
    [
        # Volta / Turing: no TF32 tensor cores (None), tf32 runs at the FP32 CUDA-core peak
        ("V100-16GB", 15.7, None, None),
        ("T4", 8.1, None, None),
        ("Titan RTX", 16.3, None, None),
        ("RTX 2080", 10.1, None, None),
        # Ampere (A100 datasheet: FP32 19.5, TF32 156, BF16 312 dense)
        ("A100-40GB", 19.5, 156, 312),
        ("A100-80GB", 19.5, 156, 312),
        ("A10", 31.2, 62.5, 125),
        # GeForce Ampere/Ada: TF32 tensor cores at the FP32 CUDA-core rate
        ("RTX 3090", 35.6, 35.6, 71),
        # Ada (L40S datasheet: TF32 183 dense / 366 sparse)
        ("L40S", 91.6, 183, 362),
        ("RTX 4090", 82.6, 82.6, 165.2),
        # Hopper (H100 whitepaper: TF32 494.7 dense / 989.4 sparse; PCIe datasheet 756 sparse)
        ("H100-80GB", 67, 494.7, 989),
        ("H100-80GB-PCIe", 51, 378, 756),
        ("GH-96", 67, 494.7, 989.4),
    ],
)
def test_peaks_per_generation(gpu, fp32, tf32, bf16):
    g = get_gpu(gpu)
    assert g.peak_flops("fp32") == pytest.approx(fp32 * T, rel=1e-3)
    assert g.peak_flops("tf32") == pytest.approx((tf32 or fp32) * T, rel=1e-3)
    assert g.has_tf32 == (tf32 is not None)
    if bf16 is None:
        assert not g.supports("bf16")
    else:
        assert g.peak_flops("bf16") == pytest.approx(bf16 * T, rel=1e-3)


def test_peak_labels_say_which_units_run():
    a100, v100 = get_gpu("A100-40GB"), get_gpu("V100-16GB")
    assert a100.peak_label("tf32") == "TF32 tensor cores, 156 TFLOP/s"
    assert a100.peak_label("fp32") == "FP32 CUDA cores, 19.5 TFLOP/s"
    assert a100.peak_label("bf16") == "BF16 tensor cores, 312 TFLOP/s"
    assert v100.peak_label("tf32") == "no TF32 tensor cores: FP32 CUDA cores, 15.7 TFLOP/s"
    assert v100.peak_label("fp16") == "FP16 tensor cores, 125 TFLOP/s"


def test_gh200_from_its_datasheet():
    gh = get_gpu("GH-96")
    assert gh.name == "GH200-96GB"
    assert gh.memory_bytes == pytest.approx(96e9)
    assert gh.hbm_bytes_per_s == pytest.approx(4.0e12)
    # NVLink 4: 900 GB/s bidirectional per GPU
    assert gh.intra_node_bytes_per_s == pytest.approx(450e9)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("A100-40", "A100-40GB"),
        ("V100-16", "V100-16GB"),
        ("RTX-3090", "RTX 3090"),
        ("Titan-RTX", "Titan RTX"),
        ("TITAN RTX", "Titan RTX"),
        ("RTX-2080", "RTX 2080"),
        ("GH-96", "GH200-96GB"),
        ("GH200", "GH200-96GB"),
    ],
)
def test_aliases_resolve(alias, name):
    assert get_gpu(alias).name == name


def test_user_gpu_type_takes_tf32():
    spec = {"memory_gb": 24, "fp16_tflops": 100, "fp32_tflops": 20}
    with_tf32 = gpu_from_mapping("X", {**spec, "tf32_tflops": 50}, "gpu_types.X")
    without = gpu_from_mapping("X", spec, "gpu_types.X")
    assert with_tf32.peak_flops("tf32") == pytest.approx(50 * T)
    assert without.peak_flops("tf32") == pytest.approx(20 * T)
    assert not without.has_tf32


def test_element_bytes():
    assert [element_bytes(p) for p in ("fp32", "tf32", "bf16", "fp16")] == [4, 4, 2, 2]


def test_unknown_precision_names_precision():
    with pytest.raises(InputError) as info:
        get_gpu("A100-40GB").peak_flops("fp8")
    assert info.value.field == "precision"
    cl = parse_inline_cluster("A100-40GB:1x1")
    plan = uniform_plan(cl, 2, 1, 1, 1, 1, 1, precision="bf16")
    with pytest.raises(InputError) as info:
        check_plan_form(dataclasses.replace(plan, precision="fp8"))
    assert info.value.field == "precision"


P = 1e6


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_fp32_storage_state_bytes(precision):
    """Megatron-Core distrib_optimizer table, fp32: 16 bytes/param, 8 + 8/d distributed.

    By hand: 4P weights (they are the master copy) + 4P grads + 8P Adam m and v; nothing more.
    """
    assert state_bytes(P, precision, 0, 4) == (4 * P, 4 * P, 8 * P)
    assert sum(state_bytes(P, precision, 1, 4)) == pytest.approx((8 + 8 / 4) * P)


def test_mixed_precision_state_bytes():
    """Megatron-Core table, bf16 params + fp32 grads: 18 bytes/param, 6 + 12/d distributed."""
    assert state_bytes(P, "bf16", 0, 4) == (2 * P, 4 * P, 12 * P)
    assert sum(state_bytes(P, "bf16", 1, 4)) == pytest.approx((6 + 12 / 4) * P)


@pytest.mark.parametrize(("precision", "per_param"), [("fp32", 32), ("tf32", 32), ("bf16", 34)])
def test_adam_traffic(precision, per_param):
    """The step: the clipping norm reads the fp32 grad (4 B); Adam reads grad, weights, m, v
    (16 B), writes weights, m, v (12 B); mixed precision also writes the 2-byte working copy
    of the weights."""
    gpu = get_gpu("A100-40GB")
    eff = default_params().gpu(gpu.name)
    t = optimizer_time_s(P, gpu, eff, precision)
    assert t * gpu.hbm_bytes_per_s * eff.mem_efficiency == pytest.approx(per_param * P)


def _estimates(inline, precisions):
    model = load_model("gpt2-medium")
    cl = parse_inline_cluster(inline)
    out = {}
    for prec in precisions:
        plan = uniform_plan(cl, model.layers, 1, 1, 2, 1, 8, precision=prec)
        out[prec] = estimate(plan, model, cl)
    return out


def test_tf32_without_tensor_cores_is_fp32():
    est = _estimates("V100-16GB:1x2", ["fp32", "tf32"])
    assert est["tf32"].iteration_time_s == pytest.approx(est["fp32"].iteration_time_s)
    assert est["tf32"].peak_memory_bytes == est["fp32"].peak_memory_bytes


def test_tf32_changes_only_the_matmul_peak():
    est = _estimates("A100-40GB:1x2", ["fp32", "tf32", "bf16"])
    fp32, tf32, bf16 = est["fp32"], est["tf32"], est["bf16"]
    assert tf32.peak_memory_bytes == fp32.peak_memory_bytes
    assert bf16.breakdown["forward_s"] < tf32.breakdown["forward_s"] < fp32.breakdown["forward_s"]
    assert tf32.breakdown["optimizer_s"] == pytest.approx(fp32.breakdown["optimizer_s"])


def test_new_catalog_models():
    """OPT (Zhang et al. 2022, Table 1) and GPT-Neo 2.7B (EleutherAI config)."""
    opt = load_model("opt-30b")
    assert (opt.layers, opt.hidden, opt.heads, opt.ffn, opt.vocab) == (48, 7168, 56, 28672, 50272)
    assert opt.total_params() == pytest.approx(30e9, rel=0.02)
    small = load_model("opt-350m")
    assert (small.layers, small.hidden, small.heads, small.seq) == (24, 1024, 16, 2048)
    neo = load_model("gpt-neo-2.7b")
    assert (neo.layers, neo.hidden, neo.heads, neo.vocab) == (32, 2560, 20, 50257)
    assert neo.total_params() == pytest.approx(2.7e9, rel=0.03)

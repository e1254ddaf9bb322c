"""Trust signals: every estimate says when it leaves the ground measured runs cover."""

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost import params as params_module
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.search.layout import uniform_plan

COVERAGE = {
    "A100-80GB": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "zero": [0, 1], "precision": ["fp16"],
                  "max_gpus": 64, "best_mfu": 0.5, "runs": 3},
}  # fmt: skip


def _params(best_mfu: float = 0.5) -> CostParams:
    cov = {"A100-80GB": {**COVERAGE["A100-80GB"], "best_mfu": best_mfu}}
    return CostParams(gpus={"A100-80GB": GPUEfficiency()}, fit_report={"coverage": cov})


def test_plan_inside_the_covered_regime_has_no_warning():
    cluster = parse_inline_cluster("A100-80GB:2x8")
    plan = uniform_plan(cluster, 24, 2, 2, 4, 1, 64, precision="fp16")
    est = estimate(plan, load_model("gpt3-1.3b"), cluster, _params(best_mfu=0.99))
    assert est.warnings == []


def test_zero3_tp_and_scale_outside_the_runs_are_named():
    cluster = parse_inline_cluster("A100-80GB:32x8")
    plan = uniform_plan(cluster, 24, 1, 1, 256, 1, 256, precision="tf32", zero_stage=3)
    est = estimate(plan, load_model("gpt3-1.3b"), cluster, _params(best_mfu=0.99))
    (warning,) = est.warnings
    assert "ZeRO-3" in warning and "tf32" in warning and "256 GPUs" in warning


def test_mfu_above_the_best_measured_is_flagged():
    cluster = parse_inline_cluster("A100-80GB:1x8")
    plan = uniform_plan(cluster, 24, 1, 1, 8, 1, 64, precision="fp16")
    est = estimate(plan, load_model("gpt3-1.3b"), cluster, _params(best_mfu=0.05))
    assert est.mfu > 0.05
    assert any("above the best measured" in w for w in est.warnings)


def test_gpu_without_fitted_terms_is_flagged():
    cluster = parse_inline_cluster("L4:1x4")
    plan = uniform_plan(cluster, 24, 1, 1, 4, 1, 16, precision="bf16")
    est = estimate(plan, load_model("gpt3-350m"), cluster, _params())
    assert any("L4 has no fitted parameters" in w for w in est.warnings)


def test_a_gpu_taking_its_chips_fitted_terms_says_so_and_is_held_to_its_runs(monkeypatch):
    """The H200 takes the H100's fitted efficiencies (SAME_SILICON): its estimate names that
    instead of the default-terms warning, and the H100's measured regime and best MFU
    apply to it. Here the H100's runs reach PP 1 and an MFU of 0.05 only."""
    monkeypatch.setattr(params_module, "SAME_SILICON", {"H200-141GB": "H100-80GB"})
    cov = {"tp": [8], "pp": [1], "zero": [0, 1], "precision": ["bf16"], "max_gpus": 64,
           "best_mfu": 0.05, "runs": 2}  # fmt: skip
    params = CostParams(gpus={"H100-80GB": GPUEfficiency()},
                        fit_report={"coverage": {"H100-80GB": cov}})  # fmt: skip
    cluster = parse_inline_cluster("H200-141GB:1x8")
    plan = uniform_plan(cluster, 24, 1, 2, 4, 1, 64, precision="bf16")
    est = estimate(plan, load_model("gpt3-1.3b"), cluster, params)
    assert not any("no fitted parameters" in w for w in est.warnings)
    assert any("takes the fitted efficiencies of H100-80GB" in w for w in est.warnings)
    assert any("H200-141GB" in w and "PP 2 (runs reach PP 1)" in w for w in est.warnings)
    assert any("above the best measured" in w for w in est.warnings)


def test_missing_shipped_calibration_is_an_error(monkeypatch, tmp_path):
    class _Empty:
        def joinpath(self, name):
            return tmp_path / name

    monkeypatch.setattr(params_module.resources, "files", lambda _: _Empty())
    params_module.default_params.cache_clear()
    try:
        with pytest.raises(InputError) as info:
            params_module.default_params()
        assert info.value.field == "calibration"
    finally:
        monkeypatch.undo()
        params_module.default_params.cache_clear()


def test_precision_peak_is_reported():
    cluster = parse_inline_cluster("A100-80GB:1x8")
    plan = uniform_plan(cluster, 24, 1, 1, 8, 1, 64, precision="tf32")
    est = estimate(plan, load_model("gpt3-1.3b"), cluster, _params())
    assert "156" in est.peak_used["A100-80GB"]  # the datasheet's dense TF32 rate


def test_mfu_guard_compares_with_the_best_measured_at_the_plans_precision():
    # runs at fp16 reached 0.9 MFU, runs at tf32 only 0.05: a tf32 plan is held to the latter
    cluster = parse_inline_cluster("A100-80GB:1x8")
    cov = {**COVERAGE["A100-80GB"], "precision": ["fp16", "tf32"], "best_mfu": 0.9,
           "best_mfu_by_precision": {"fp16": 0.9, "tf32": 0.05}}  # fmt: skip
    params = CostParams(gpus={"A100-80GB": GPUEfficiency()},
                        fit_report={"coverage": {"A100-80GB": cov}})  # fmt: skip
    model = load_model("gpt3-1.3b")
    tf32 = estimate(uniform_plan(cluster, 24, 1, 1, 8, 1, 64, precision="tf32"), model,
                    cluster, params)  # fmt: skip
    fp16 = estimate(uniform_plan(cluster, 24, 1, 1, 8, 1, 64, precision="fp16"), model,
                    cluster, params)  # fmt: skip
    assert tf32.mfu > 0.05 * 1.02 and fp16.mfu < 0.9
    assert any("above the best measured" in w for w in tf32.warnings)
    assert not any("above the best measured" in w for w in fp16.warnings)


def test_mfu_guard_holds_a_large_plan_to_runs_of_its_scale():
    # 8-GPU runs reached 0.9 MFU, 256-GPU runs 0.05: a 256-GPU plan is held to the latter,
    # an 8-GPU plan to the former
    cov = {**COVERAGE["A100-80GB"], "precision": ["fp16"], "best_mfu": 0.9, "max_gpus": 256,
           "mfu_points": [[8, "fp16", 0.9], [256, "fp16", 0.05]]}  # fmt: skip
    params = CostParams(gpus={"A100-80GB": GPUEfficiency()},
                        fit_report={"coverage": {"A100-80GB": cov}})  # fmt: skip
    model = load_model("gpt3-1.3b")
    big = parse_inline_cluster("A100-80GB:32x8")
    small = parse_inline_cluster("A100-80GB:1x8")
    large = estimate(uniform_plan(big, 24, 1, 1, 256, 1, 256, precision="fp16"), model, big,
                     params)  # fmt: skip
    little = estimate(uniform_plan(small, 24, 1, 1, 8, 1, 64, precision="fp16"), model, small,
                      params)  # fmt: skip
    assert large.mfu > 0.05 * 1.02 and little.mfu < 0.9
    assert any("above the best measured" in w for w in large.warnings)
    assert not any("above the best measured" in w for w in little.warnings)


def test_mfu_guard_pools_fp16_and_bf16():
    # fp16 and bf16 share the tensor cores' peak: a bf16 run's 0.9 MFU covers an fp16 plan,
    # and a bf16 plan is held to a low fp16 figure
    cluster = parse_inline_cluster("A100-80GB:1x8")
    model = load_model("gpt3-1.3b")
    plan = uniform_plan(cluster, 24, 1, 1, 8, 1, 64, precision="fp16")
    for measured, flagged in ((0.9, False), (0.05, True)):
        cov = {**COVERAGE["A100-80GB"], "precision": ["bf16"], "best_mfu": measured,
               "best_mfu_by_precision": {"bf16": measured}}  # fmt: skip
        params = CostParams(gpus={"A100-80GB": GPUEfficiency()},
                            fit_report={"coverage": {"A100-80GB": cov}})  # fmt: skip
        est = estimate(plan, model, cluster, params)
        assert 0.05 * 1.02 < est.mfu < 0.9
        assert any("above the best measured" in w for w in est.warnings) is flagged
        assert not any("runs use bf16" in w for w in est.warnings)

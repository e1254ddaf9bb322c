"""Where compute times come from: measured rows first, then the analytical blocks scaled by
what the profile says about them, then the analytical blocks alone."""

from dataclasses import dataclass

import pytest

from hetplan.cost.compute import LayerTimes, layer_times
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.cost.sources import ComputeSource, combine_sources
from hetplan.hardware import get_gpu
from hetplan.model import load_model

MODEL = load_model("gpt3-350m")
A100 = get_gpu("A100-80GB")
L4 = get_gpu("L4")


@dataclass(frozen=True)
class Point:
    device: str
    shape: object
    tp: int
    micro_batch: int
    precision: str
    times: LayerTimes


class OneRow:
    """A profile with one measured layer: A100, TP 1, micro-batch 4, bf16."""

    row = LayerTimes(0.004, 0.009, -1.0)  # recomputation not measured

    def layer_times(self, gpu, model, tp, micro_batch, precision):
        if (gpu.name, tp, micro_batch, precision) == ("A100-80GB", 1, 4, "bf16"):
            return self.row
        return None

    def layer_points(self):
        return [Point("A100-80GB", MODEL, 1, 4, "bf16", self.row)]


def test_measured_row_and_unknown_recompute_scaled_by_the_forward_ratio():
    params = CostParams()
    got = ComputeSource(OneRow()).layer(MODEL, A100, params, 1, 4, "bf16", True)
    ana = layer_times(MODEL, A100, params.gpu("A100-80GB"), 1, 4, "bf16", True)
    assert got.source == "measured"
    assert (got.times.forward_s, got.times.backward_s) == (0.004, 0.009)
    expected = ana.selective_recompute_s * 0.004 / ana.forward_s
    assert got.times.selective_recompute_s == pytest.approx(expected)


def test_unprofiled_micro_batch_is_scaled_by_the_measured_ratio():
    params = CostParams()
    eff = params.gpu("A100-80GB")
    got = ComputeSource(OneRow()).layer(MODEL, A100, params, 1, 16, "bf16", True)
    at4 = layer_times(MODEL, A100, eff, 1, 4, "bf16", True)
    at16 = layer_times(MODEL, A100, eff, 1, 16, "bf16", True)
    assert got.source == "scaled"
    assert got.times.forward_s == pytest.approx(at16.forward_s * 0.004 / at4.forward_s)
    assert got.times.backward_s == pytest.approx(at16.backward_s * 0.009 / at4.backward_s)


def test_other_gpu_borrows_the_ratio_only_without_fitted_terms():
    plain = CostParams()
    got = ComputeSource(OneRow()).layer(MODEL, L4, plain, 1, 4, "bf16", True)
    assert got.source == "scaled"
    fitted = CostParams(gpus={"L4": GPUEfficiency()})
    got = ComputeSource(OneRow()).layer(MODEL, L4, fitted, 1, 4, "bf16", True)
    assert got.source == "analytical"
    assert got.times == layer_times(MODEL, L4, GPUEfficiency(), 1, 4, "bf16", True)


def test_no_profile_is_analytical_and_sources_combine_to_the_weakest():
    got = ComputeSource(None).layer(MODEL, A100, CostParams(), 2, 1, "bf16", True)
    assert got.source == "analytical"
    assert combine_sources(["measured", "interpolated"]) == "interpolated"
    assert combine_sources(["measured", "scaled", "measured"]) == "scaled"
    assert combine_sources([]) == "analytical"

"""Synthesised programs on 2 and 3 gloo ranks match the single-device loss and gradients."""

from __future__ import annotations

import pytest
import torch

from hetplan.spmd.capture import capture
from hetplan.spmd.costmodel import uniform_link_devices
from hetplan.spmd.execute import load_factory, reference, run_distributed
from hetplan.spmd.synth import synthesize

FAST = ("mlp", "moe")
MODELS = {
    "mlp": ("hetplan.spmd.examples:mlp", {"batch": 24, "hidden": 16, "layers": 2}),
    "bert": (
        "hetplan.spmd.examples:bert_base",
        {"batch": 6, "seq": 2, "hidden": 12, "layers": 2, "heads": 2, "vocab": 9},
    ),
    "moe": (
        "hetplan.spmd.examples:moe",
        {"tokens": 24, "hidden": 16, "ffn": 32, "experts": 6, "top_k": 2},
    ),
}
SETUPS = [(2, [0.7, 0.3], 1e9), (3, [0.5, 0.3, 0.2], 1e8)]
TOL = 1e-5


def _cases(ratios: list[float], bw: float, names=FAST) -> list[dict]:
    cases = []
    for name in names:
        factory, kwargs = MODELS[name]
        torch.manual_seed(0)
        module, inputs = load_factory(factory)(**kwargs)
        devs = uniform_link_devices([5e9 * r for r in ratios], bytes_per_s=bw)
        program = synthesize(capture(module, inputs), devs, ratios, fixed_ratios=True).program
        cases.append(
            {"name": name, "factory": factory, "kwargs": kwargs, "seed": 0, "program": program}
        )
    return cases


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "ratios", "bw"), SETUPS)
def test_programs_match_single_device(world: int, ratios: list[float], bw: float) -> None:
    _check(_cases(ratios, bw), world)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("world", "ratios", "bw"), SETUPS)
def test_bert_like_encoder_matches_single_device(
    world: int, ratios: list[float], bw: float
) -> None:
    _check(_cases(ratios, bw, ("bert",)), world)


def _check(cases: list[dict], world: int) -> None:
    results = run_distributed(cases, world, timeout_s=120)
    for case in cases:
        loss, grads = results[case["name"]]
        ref_loss, ref_grads = reference(case["factory"], case["kwargs"], 0)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), case["name"]
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        assert set(grads) == set(ref_grads)
        for key, ref in ref_grads.items():
            # gradients that are exactly zero in theory (e.g. a key bias under softmax)
            # are float noise: measure error against the model's gradient scale there
            denom = max(float(ref.abs().max()), 1e-3 * scale)
            err = float((grads[key] - ref).abs().max()) / denom
            assert err <= TOL, (case["name"], key, err)


@pytest.mark.distributed
def test_programs_use_communication() -> None:
    kinds = set()
    for case in _cases([0.5, 0.3, 0.2], 1e8):
        kinds |= set(case["program"].comm_bytes_kinds())
    assert kinds & {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}

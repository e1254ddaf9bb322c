"""Each memory term against hand-derived formulas, and the AMP OOM classification."""

from __future__ import annotations

import pytest

from hetplan.cost.calibrate import fit_reserve_bytes, load_runs, shipped_files
from hetplan.cost.estimate import estimate
from hetplan.cost.memory import stage_activation_bytes, state_bytes, zero3_working_bytes
from hetplan.cost.params import default_params
from hetplan.model import ModelSpec

GPT = ModelSpec("gpt2-medium", "gpt", 24, 1024, 16, 16, 4096, 52256, 1024, tie_embeddings=True)


@pytest.mark.parametrize(
    ("precision", "plain_bytes", "dist_fixed", "dist_sharded"),
    [("fp16", 18, 6, 12), ("bf16", 18, 6, 12), ("fp32", 16, 8, 8)],
)
def test_state_bytes_match_megatron_table(precision, plain_bytes, dist_fixed, dist_sharded):
    """Bytes/param equal the Megatron-Core distributed-optimizer table (fp32 grads: 18/16)."""
    assert sum(state_bytes(1.0, precision, 0, 8)) == pytest.approx(plain_bytes)
    assert sum(state_bytes(1.0, precision, 1, 8)) == pytest.approx(dist_fixed + dist_sharded / 8)


def test_state_bytes_fp16_split_and_zero():
    """fp16 with fp32 grads: grads sharded at ZeRO-2, Adam states at ZeRO-1, weights at 3."""
    assert state_bytes(1e9, "fp16", 0, 4) == (2e9, 4e9, 12e9)
    assert state_bytes(1e9, "fp16", 1, 4) == (2e9, 4e9, 3e9)
    assert state_bytes(1e9, "fp16", 2, 4) == (2e9, 1e9, 3e9)
    assert state_bytes(1e9, "fp16", 3, 4) == (0.5e9, 1e9, 3e9)


def test_layer_activation_bytes_korthikanti():
    """GPT layer without recomputation: s*h*(34 + 5*a*s/h), TP splits all but 10*s*h."""
    s, h, a = GPT.seq, GPT.hidden, GPT.heads
    assert GPT.layer_activation_bytes(1, False, "none", False) == pytest.approx(
        s * h * (34 + 5 * a * s / h)
    )
    assert GPT.layer_activation_bytes(4, False, "none", False) == pytest.approx(
        s * h * (10 + 24 / 4 + 5 * a * s / (h * 4))
    )
    assert GPT.layer_activation_bytes(4, True, "none", False) == pytest.approx(
        s * h * (34 + 5 * a * s / h) / 4
    )
    assert GPT.layer_activation_bytes(2, False, "full", False) == pytest.approx(2 * s * h)


def test_head_and_embedding_activation_bytes():
    """Loss peak: fp16 logits + fp32 copy + clone + exp = 14 B/logit; embedding 2sh + mask."""
    s, h, v = GPT.seq, GPT.hidden, GPT.vocab
    assert GPT.head_activation_bytes(2) == pytest.approx(2 * s * h + 14 * s * v / 2)
    assert GPT.embedding_activation_bytes(1, False) == pytest.approx(3 * s * h)


def test_stage_activation_bytes_sums_terms():
    """Single stage, 3 micro-batches in flight: layers, embedding per chunk, one loss."""
    mb, layers = 2, 5
    got = stage_activation_bytes(GPT, layers, 1, mb, False, "none", False, True, True, 3, 1)
    want = (
        3 * layers * mb * GPT.layer_activation_bytes(1, False, "none", False)
        + 3 * mb * GPT.embedding_activation_bytes(1, False)
        + mb * GPT.head_activation_bytes(1)
    )
    assert got == pytest.approx(want)


def test_zero3_working_bytes():
    """Two gathered layers in the compute dtype."""
    assert zero3_working_bytes(GPT, 2, "fp16") == pytest.approx(2 * GPT.layer_params() / 2 * 2)


def test_fit_reserve_is_largest_that_keeps_measured_rows():
    """The reserve is the tightest measured slack (less a guard); OOM rows do not bind it."""
    rows = [(3e9, True), (2e9, True), (1e9, False), (2.5e9, False)]
    r = fit_reserve_bytes(rows, 1.5e9)
    assert r < 2e9 and r > 2e9 - 2e6
    assert fit_reserve_bytes([(1e9, False)], 1.5e9) == 1.5e9


def test_amp_oom_classification_with_shipped_params():
    """With the shipped parameters every AMP run that ran fits and 3 of the 5 OOM rows do not."""
    params = default_params()
    path = next(p for p in shipped_files() if p.name.startswith("amp"))
    ran_fit, oom_flagged, oom = 0, 0, 0
    runs = load_runs(path)
    for run in runs:
        assert run.plan is not None
        fits = estimate(run.plan, run.model, run.cluster, params, validate=False).fits
        if run.measured is None:
            oom += 1
            oom_flagged += not fits
        else:
            ran_fit += fits
    assert ran_fit == sum(r.measured is not None for r in runs)
    assert (oom_flagged, oom) == (3, 5)

"""The measured peak of a rank is its weights, gradients and AdamW state plus the activations
its schedule keeps: for a one-stage 1F1B replica, one micro-batch's. (torch's pipelining,
left to infer stage shapes, kept a whole extra micro-batch of activations alive.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from hetplan.model import load_model
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.runtime.model_torch import full_model


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for one forward of ``tokens`` (each storage once, the
    parameters, which every layer saves for its backward, left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    return sum(seen.values())


@pytest.mark.distributed
def test_one_stage_peak_is_one_micro_batch(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    spec = load_model(str(inputs["gpt"]))
    model = full_model(spec, 0)
    n_params = sum(p.numel() for p in model.parameters())  # the tied table once
    static = 4 * n_params * 4  # fp32 weights, gradients, two AdamW moments
    one_mb = _saved_bytes(model, torch.randint(0, spec.vocab, (2, spec.seq)))
    plan = write_plan(tmp_path / "p.json", [(4, [(4, [0])]), (4, [(4, [1])])])
    cfg = RunConfig(str(plan), str(inputs["gpt"]), str(inputs["cluster"]), steps=3)
    peaks = run_local(cfg)["peak_memory_bytes"]
    for device in ("host:0", "host:1"):  # two micro-batches each, run one after the other
        assert peaks[device] == pytest.approx(static + one_mb, rel=0.02)


def test_meter_counts_only_its_hooked_steps() -> None:
    """With ``hooked_steps=1`` the second step's larger activations go uncounted (its
    hooks are off), while a meter without the limit counts them: one (4, 8) float32 saved
    by ``x * x`` is 128 bytes, one (8, 8) is 256."""
    from hetplan.runtime.memory_meter import MemoryMeter

    w = torch.nn.Parameter(torch.ones(8))
    for hooked, peak in ((1, 4 * 8 * 4), (0, 8 * 8 * 4)):
        meter = MemoryMeter(torch.device("cpu"), [w], hooked_steps=hooked)
        for rows in (4, 8):
            x = torch.full((rows, 8), 2.0, requires_grad=True)
            with meter.step():
                y = x * x  # saves x (twice: one storage, counted once)
            y.sum().backward()
        assert meter.peak_saved == peak


@pytest.mark.distributed
def test_bf16_pipeline_holds_no_weight_copy_per_micro_batch(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    """GPipe keeps all 4 micro-batches of a stage in flight. A bf16 run keeps 2-byte
    weights beside the fp32 masters, gradients and AdamW state of an fp32 run and saves
    half-size activations, so its peak stays under the fp32 run's; with fp32 parameters
    under plain autocast every micro-batch saved its own bf16 copy of the stage's weights
    for its backward (4 copies here, over the fp32 peak). Both within issue 15's 20% of
    ``estimate``'s peak."""
    from hetplan.cluster import load_cluster
    from hetplan.cost.estimate import estimate
    from hetplan.plan import load_plan

    cluster = tmp_path / "cluster.yaml"  # the shared one names no bf16 figure
    cluster.write_text(
        inputs["cluster"]
        .read_text()
        .replace("fp32_tflops: 0.1", "fp32_tflops: 0.1, bf16_tflops: 0.2")
    )
    peaks, predicted = {}, {}
    for precision in ("fp32", "bf16"):
        plan = write_plan(
            tmp_path / f"{precision}.json",
            [(8, [(2, [0]), (2, [1])])],
            schedule="GPipe",
            precision=precision,
        )
        cfg = RunConfig(str(plan), str(inputs["gpt"]), str(cluster), steps=2)
        peaks[precision] = run_local(cfg)["peak_memory_bytes"]
        est = estimate(load_plan(plan), cfg.model_spec(), load_cluster(str(cluster)))
        predicted[precision] = [s.memory.total for s in est.stages]
    for i, device in enumerate(("host:0", "host:1")):
        assert peaks["bf16"][device] < peaks["fp32"][device]
        for precision in ("fp32", "bf16"):
            assert peaks[precision][device] == pytest.approx(predicted[precision][i], rel=0.2)

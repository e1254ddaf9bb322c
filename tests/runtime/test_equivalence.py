"""Every plan computes the same training as one device: parameters after 3 AdamW steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetplan.model import load_model
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.runtime.reference import checkpoint_params, max_relative_error, reference_train

SEED = 7
STEPS = 3

# (name, model, pipelines, plan options)
CASES = [
    ("2 replicas x 2 stages", "gpt", [(4, [(2, [0]), (2, [1])]), (4, [(2, [2]), (2, [3])])], {}),
    (
        "asymmetric: 1 stage | 2 stages 1:3, batch 2:6",
        "gpt",
        [(2, [(4, [0])]), (6, [(1, [1]), (3, [2])])],
        {"schedule": "GPipe"},
    ),
    (
        "tensor parallel 2 beside a 2-stage replica",
        "llama",
        [(4, [(4, [0, 1])]), (4, [(2, [2]), (2, [3])])],
        {},
    ),
    (
        "Interleaved1F1B, 2 stages x 2 chunks",
        "llama",
        [(8, [(2, [0]), (2, [1])])],
        {"schedule": "Interleaved1F1B", "virtual_stages": 2},
    ),
    (
        "heads wider than hidden / heads, tensor parallel 2 beside a 2-stage replica",
        "llama_wide",
        [(4, [(4, [0, 1])]), (4, [(2, [2]), (2, [3])])],
        {},
    ),
    (
        "Interleaved1F1B, 3 micro-batches on 2 stages (one group of 3)",
        "llama",
        [(6, [(2, [0]), (2, [1])])],
        {"schedule": "Interleaved1F1B", "virtual_stages": 2},
    ),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "family", "pipes", "opts"), CASES, ids=[c[0] for c in CASES])
def test_plan_matches_single_device(
    tmp_path: Path,
    inputs: dict[str, Path],
    write_plan: Any,
    name: str,
    family: str,
    pipes: list,
    opts: dict,
) -> None:
    plan = write_plan(tmp_path / "plan.json", pipes, **opts)
    cfg = RunConfig(
        plan=str(plan),
        model=str(inputs[family]),
        cluster=str(inputs["cluster"]),
        steps=STEPS,
        seed=SEED,
        checkpoint_dir=str(tmp_path / "ckpt"),
        threads=1,
    )
    record = run_local(cfg, timeout_s=240)
    model = load_model(str(inputs[family]))
    ref, ref_losses = reference_train(model, sum(b for b, _ in pipes), STEPS, SEED)
    got = checkpoint_params(tmp_path / "ckpt")
    assert got.keys() == ref.keys()
    assert max_relative_error(got, ref) <= 1e-5, name
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    for s, want in zip(record["steps"], ref_losses, strict=True):
        assert s["loss"] == pytest.approx(want, rel=1e-5)

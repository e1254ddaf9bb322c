"""`launch` runs a plan at the sequence length its file states (unless given --seq-len)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetplan.model import load_model
from hetplan.plan import model_dict


def _launch(plan: Path, model: Path, cluster: Path, data: Path) -> subprocess.CompletedProcess[str]:
    from hetplan.runtime.launch import _env

    cmd = [sys.executable, "-m", "hetplan", "launch", str(plan), "--model", str(model),
           "--cluster", str(cluster), "--steps", "1", "--data", str(data), "--json"]  # fmt: skip
    return subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
def test_launch_takes_the_plans_sequence_length(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    model = load_model(str(inputs["gpt"]))
    assert model.seq == 16  # the config's n_positions
    # a token file of exactly one batch of 4 sequences of 8 (+1): enough at 8, short at 16
    data = tmp_path / "train.bin"
    (np.arange(4 * 8 + 1) % model.vocab).astype("<u2").tofile(data)
    stamp = model_dict(replace(model, seq=8))
    made = write_plan(tmp_path / "made.json", [(4, [(4, [0])])], model=stamp)
    res = _launch(made, inputs["gpt"], inputs["cluster"], data)
    assert res.returncode == 0, res.stderr
    # the same plan without the block runs at the config's 16 tokens: the file is too short
    bare = write_plan(tmp_path / "bare.json", [(4, [(4, [0])])])
    res = _launch(bare, inputs["gpt"], inputs["cluster"], data)
    assert res.returncode == 2, res.stderr
    assert "--data" in res.stderr and "Traceback" not in res.stderr

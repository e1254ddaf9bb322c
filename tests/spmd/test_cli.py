"""The spmd CLI: plan --json prints the promised fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hetplan.spmd.cli import app


def test_plan_json_has_program_ratios_and_baselines() -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--module",
            "hetplan.spmd.examples:mlp",
            "--inputs",
            "batch=32,hidden=16",
            "--cluster",
            "A100-80GB:1x2,V100-16GB:1x2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    for key in (
        "program",
        "ratios",
        "predicted_time_s",
        "dp_ev_time_s",
        "dp_cp_time_s",
        "synthesis_time_s",
    ):
        assert key in out
    assert len(out["ratios"]) == 4
    assert out["predicted_time_s"] <= out["dp_ev_time_s"] + 1e-12
    assert any(i["kind"] == "op" for i in out["program"])


def test_spmd_cli_import_does_not_import_torch() -> None:
    code = (
        "import sys; import hetplan.spmd, hetplan.spmd.cli, hetplan.cli; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_lazy_package_attributes_resolve() -> None:
    import hetplan.spmd
    from hetplan.spmd.synth import synthesize

    assert hetplan.spmd.synthesize is synthesize


@pytest.mark.slow
def test_bad_options_are_one_line_before_any_rank_starts(tmp_path, monkeypatch) -> None:
    """Through the installed console script: each user error is one line naming the option,
    exit 2 (they were tracebacks, or pages of them from every rank under torchrun); run
    starts torch's launcher from this interpreter, never a torchrun found first on PATH."""
    from pathlib import Path

    script = Path(sys.executable).parent / "hetplan"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/bin/sh\necho other torchrun >&2\nexit 3\n")
    (fake / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    mlp = "hetplan.spmd.examples:mlp"
    cpu = str(Path(__file__).parent.parent.parent / "examples" / "clusters" / "cpu2.yaml")
    cases = [
        (["plan", "--module", mlp, "--cluster", cpu, "--inputs", "foo=3"], "--inputs"),
        (["plan", "--module", mlp, "--cluster", cpu, "--inputs", "=3"], "--inputs"),
        (["plan", "--module", mlp, "--cluster", cpu, "--inputs", "batch=0"], "--inputs"),
        (["run", "--module", "nonexist.mod:f", "--cluster", cpu], "--module"),
        (["run", "--module", mlp, "--cluster", cpu, "--nproc", "3"], "--nproc"),
        (["run", "--module", mlp, "--cluster", cpu, "--threads", "a,b"], "--threads"),
        (["run", "--module", mlp, "--cluster", cpu, "--duty", "0,0"], "--duty"),
        (["run", "--module", mlp, "--cluster", cpu, "--steps", "0"], "--steps"),
    ]
    for args, option in cases:
        res = subprocess.run([str(script), "spmd", *args], capture_output=True, text=True,
                             timeout=120, env=env)  # fmt: skip
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {option}:"), res.stderr
    res = subprocess.run([str(script), "spmd", "run", "--module", mlp, "--cluster", cpu,
                          "--steps", "2", "--inputs", "batch=8,hidden=8"],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "other torchrun" not in res.stderr and "median step" in res.stdout


FACTORIES = """
import os

import torch
from torch import nn


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x).sum()


def good():
    return Lin(), (torch.randn(4, 8),)

def rank_one_fails():
    if os.environ.get("RANK") == "1":  # the command's own check builds it with no rank
        raise RuntimeError("rank one cannot build")
    return Lin(), (torch.randn(4, 8),)

def bare_tensor():
    return Lin(), torch.randn(4, 8)

def only_module():
    return Lin()

def not_a_module():
    return 3, (torch.randn(4, 8),)

def int_input():
    return Lin(), (torch.randn(4, 8), 3)

def two_inputs():
    return Lin(), (torch.randn(4, 8), torch.randn(4, 8))

def wrong_shape():
    return Lin(), (torch.randn(4, 7),)

def raises():
    raise RuntimeError("needs CUDA")
"""


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("only_module", "returned Lin"),
        ("not_a_module", "model of type int"),
        ("int_input", "input 1 is of type int"),
        ("two_inputs", "does not take the 2 inputs"),
        ("wrong_shape", "fails on its example inputs"),
        ("raises", "RuntimeError: needs CUDA"),
    ],
)
def test_a_factory_that_does_not_give_model_and_tensors_is_named(
    tmp_path, factory: str, words: str
) -> None:
    """Each of these was a traceback (a bare model, a non-module), or worse a plan of the
    wrong thing: a bare tensor was iterated into its rows, a non-tensor input ignored."""
    from hetplan.errors import InputError
    from hetplan.spmd.cli import plan_module

    path = tmp_path / "facts.py"
    path.write_text(FACTORIES)
    with pytest.raises(InputError) as err:
        plan_module(f"{path}:{factory}", "A100-80GB:1x2")
    assert err.value.field == "--module" and words in str(err.value), str(err.value)


def test_a_bare_tensor_input_is_one_input_not_its_rows(tmp_path) -> None:
    """The batch of 4 rows is one input of shape (4, 8): the same program as the tuple form,
    whose activations hold 4 x 8 values, not 8."""
    from hetplan.spmd.cli import plan_module

    path = tmp_path / "facts.py"
    path.write_text(FACTORIES)
    bare = plan_module(f"{path}:bare_tensor", "A100-80GB:1x2")
    tup = plan_module(f"{path}:good", "A100-80GB:1x2")
    assert bare.predicted_time_s == tup.predicted_time_s
    assert bare.program.lines() == tup.program.lines()


def test_a_factory_module_in_the_current_folder_imports(tmp_path) -> None:
    """`hetplan spmd plan --module facts:good` from the folder holding facts.py, as
    `python -m` would find it (the console script alone does not look there)."""
    from pathlib import Path

    (tmp_path / "facts.py").write_text(FACTORIES)
    script = Path(sys.executable).parent / "hetplan"
    res = subprocess.run([str(script), "spmd", "plan", "--module", "facts:good",
                          "--cluster", "A100-80GB:1x2", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["ratios"] == [0.5, 0.5]


def test_the_documented_factory_plans(tmp_path) -> None:
    """The factory example of docs/spmd.md, written to a file, plans as its comment says."""
    import re
    from pathlib import Path

    from hetplan.spmd.cli import plan_module

    doc = (Path(__file__).parent.parent.parent / "docs" / "spmd.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S)
    assert code is not None
    (tmp_path / "mymodel.py").write_text(code.group(1))
    res = plan_module(f"{tmp_path / 'mymodel.py'}:make", "A100-80GB:1x4", "batch=32")
    assert len(res.program.ratios) == 4 and abs(sum(res.program.ratios) - 1) < 1e-9
    assert res.predicted_time_s < res.dp_ev_time_s * 1.0001


RANK_CAPTURE = """
import multiprocessing
import sys

from multiprocessing import resource_tracker

multiprocessing.set_start_method("forkserver")  # a rank's, forked from the fork server
made = []
resource_tracker.register = lambda name, rtype: made.append(rtype)
if sys.argv[1] == "prepared":
    from hetplan.runtime.forkrun import prepare_rank

    prepare_rank()
from hetplan.spmd.capture import capture
from hetplan.spmd.examples import mlp

capture(*mlp())
print(made)
"""


def test_a_rank_capture_leaves_no_semaphore_to_leak() -> None:
    """A rank's capture (torch.fx's Interpreter draws a disabled tqdm bar) registers no
    semaphore with the resource tracker once the rank is prepared: a rank stopped mid-run
    left tqdm's multiprocessing lock registered, and the tracker printed "leaked semaphore
    objects" after the run's one-line cause. Unprepared, the same capture registers one
    (the check can fail)."""
    out = {}
    for how in ("prepared", "bare"):
        res = subprocess.run([sys.executable, "-c", RANK_CAPTURE, how], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert res.returncode == 0, res.stderr[-2000:]
        out[how] = res.stdout.strip().splitlines()[-1]
    assert out == {"prepared": "[]", "bare": "['semaphore']"}


def test_a_rank_that_fails_ends_the_run_with_its_cause(tmp_path) -> None:
    """`spmd run` forks its ranks from one import (forkrun.run_here): a rank that raises
    ends the command with exit 1 and one line naming the rank and its error."""
    from pathlib import Path

    (tmp_path / "facts.py").write_text(FACTORIES)
    script = Path(sys.executable).parent / "hetplan"
    res = subprocess.run([str(script), "spmd", "run", "--module", "facts:rank_one_fails",
                          "--cluster", "A100-80GB:1x2", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 1, res.stderr[-2000:]
    # the cause alone: no rank's traceback (torchrun printed pages of them: the failing
    # rank's, then its peers' "Connection closed by peer"), and no resource tracker's
    # warning of a semaphore the stopped peer held (test_a_rank_capture_leaves_no_...)
    assert res.stderr.splitlines() == [
        "training failed: rank 1 exited with 1: InputError: --module: facts:rank_one_fails "
        "failed: RuntimeError: rank one cannot build"
    ], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "[rank" not in res.stderr, res.stderr[-2000:]

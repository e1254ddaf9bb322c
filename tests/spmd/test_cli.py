"""The spmd CLI: plan --json prints the promised fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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

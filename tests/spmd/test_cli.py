"""The spmd CLI: plan --json prints the promised fields."""

from __future__ import annotations

import json
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

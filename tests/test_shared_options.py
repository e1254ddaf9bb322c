"""The options commands share do in each what they do in ``predict``: --precision overrides
a plan file's precision (checked against the GPUs where a cluster is read), --params and
--profile name files that must exist, --seq-len must be positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"
TINY = str(EXAMPLES / "models" / "tiny-gpt" / "config.json")
CPU2 = str(EXAMPLES / "clusters" / "cpu2.yaml")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _plan(tmp_path: Path) -> Path:
    out = tmp_path / "p.json"
    res = run("plan", "--model", "gpt3-1.3b", "--cluster", "V100-32GB:2x8",
              "--global-batch-size", "64", "--out", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["precision"] == "fp16"  # V100: no bf16
    return out


def test_export_and_replan_override_the_plans_precision(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    res = run("export", str(plan), "--model", "gpt3-1.3b", "--precision", "bf16")
    assert res.returncode == 0, res.stderr
    assert "--bf16" in res.stdout and "--fp16" not in res.stdout
    res = run("export", str(plan), "--model", "gpt3-1.3b", "--precision", "fp8")
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --precision: 'fp8' is not fp32, tf32, bf16 or fp16"
    base = ["--plan", str(plan), "--model", "gpt3-1.3b", "--cluster", "V100-32GB:2x8",
            "--lost", "v100-32gb-1"]  # fmt: skip
    res = run("replan", *base, "--precision", "fp32", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["plan"]["precision"] == "fp32"
    res = run("replan", *base, "--precision", "bf16")  # the cluster is read: V100 refuses
    assert res.returncode == 2
    assert res.stderr.strip() == "error: --precision: V100-32GB has no bf16 support"


def test_missing_files_and_bad_lengths_are_refused_before_any_work(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone")
    cases = [
        (["launch", "p.json", "--model", TINY, "--cluster", CPU2, "--params", gone],
         "--params"),
        (["spot", "simulate", "--trace", str(EXAMPLES / "traces" / "a100-spot.csv"),
          "--model", "gpt3-1.3b", "--cluster", "A100-80GB:2x8", "--profile", gone],
         "--profile"),
        (["profile", "--device", "cpu", "--model", TINY, "--seq-len", "0"], "--seq-len"),
        (["launch", "--plan", gone, "--model", TINY, "--cluster", CPU2], "--plan"),
    ]  # fmt: skip
    for args, option in cases:
        res = run(*args)
        assert res.returncode == 2, (args, res.stderr)
        line = res.stderr.strip()
        assert "\n" not in line and line.startswith(f"error: {option}:"), line
    assert not Path(gone).exists()


def test_a_plan_file_is_named_alike_in_every_command_that_reads_one(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    base = ["--model", "gpt3-1.3b"]
    cluster = ["--cluster", "V100-32GB:2x8"]
    for cmd, extra in (("predict", cluster), ("explain", cluster), ("export", []),
                       ("replan", [*cluster, "--lost", "v100-32gb-1"])):  # fmt: skip
        as_arg = run(cmd, str(plan), *base, *extra)
        as_opt = run(cmd, "--plan", str(plan), *base, *extra)
        assert as_arg.returncode == as_opt.returncode == 0, (cmd, as_arg.stderr, as_opt.stderr)
        if cmd != "replan":  # replan reports its own time
            assert as_arg.stdout == as_opt.stdout
        both = run(cmd, str(plan), "--plan", str(tmp_path / "other.json"), *base, *extra)
        assert both.returncode == 2 and both.stderr.startswith("error: --plan: two plan files")
    none = run("explain", *base, *cluster)
    assert none.returncode == 2
    assert (
        none.stderr.strip() == "error: PLAN: missing: the plan file, as the argument PLAN or --plan"
    )


def test_every_command_that_reads_a_model_or_a_cluster_takes_the_short_names() -> None:
    """-m for --model and -c for --cluster wherever they mean the model and the cluster to
    plan or run on (launch and profile lacked them); provision's --cluster is the nodes one
    owns, a different thing, and keeps its long name only. Read from each command's own
    parameters, not its help text."""
    import typer.main

    from hetplan.cli import app

    group = typer.main.get_command(app)

    def options(path: list[str]) -> dict[str, set[str]]:
        cmd = group
        for name in path:
            cmd = cmd.commands[name]  # type: ignore[attr-defined]
        return {o: set(p.opts) for p in cmd.params for o in p.opts if o.startswith("--")}

    takes = {  # (command path, reads --model, reads --cluster), listed by hand
        ("plan",): (True, True), ("predict",): (True, True), ("explain",): (True, True),
        ("replan",): (True, True), ("launch",): (True, True), ("export",): (True, False),
        ("provision",): (True, False), ("profile",): (True, False),
        ("spot", "simulate"): (True, True),
    }  # fmt: skip
    for path, (model, cluster) in takes.items():
        opts = options(list(path))
        if model:
            assert "-m" in opts["--model"], path
        if cluster:
            assert "-c" in opts["--cluster"], path

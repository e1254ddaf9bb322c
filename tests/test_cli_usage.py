"""Usage errors through the installed console script: one line naming the option and the
reason, exit code 2, never a traceback; --version."""

import subprocess
import sys
from pathlib import Path

import pytest

import hetplan

SCRIPT = Path(sys.executable).parent / "hetplan"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), "the console script is installed beside the interpreter"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        # unknown option
        (["plan", "--model", "gpt2", "--cluster", "A100-80GB:1x8", "--bogus"], "--bogus"),
        # missing required option (and a command given no options at all)
        (["plan", "--cluster", "A100-80GB:1x8"], "--model"),
        (["plan"], "--model"),
        # bad type
        (["plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--top", "many"], "--top"),
        # bad choice
        (["plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--precision", "fp8"], "--precision"),
        # an option without its value
        (["plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--precision"], "--precision"),
        # unknown command
        (["planify"], "planify"),
    ],
)
def test_usage_error_is_one_line_exit_2(args, names):
    res = run(*args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error:") and names in lines[0]
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_no_arguments_prints_help_and_exits_2():
    res = run()
    assert res.returncode == 2
    assert "plan" in res.stdout and "Traceback" not in res.stderr


def test_version():
    res = run("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"hetplan {hetplan.__version__}"

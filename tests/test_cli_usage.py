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


def _options(command: str) -> set[str]:
    from typer.main import get_command

    from hetplan.cli import app

    cmd = get_command(app)
    for word in command.split():
        cmd = cmd.commands[word]  # type: ignore[attr-defined]
    return {o for p in cmd.params for o in [*p.opts, *getattr(p, "secondary_opts", [])]}


# the README's promise (Options): "--seq-len and --precision wherever a model is [read]",
# "--params and --profile wherever the cost model runs"; listed by hand from what each
# command does, so a new command or a dropped option fails here
READ_A_MODEL = ("plan", "predict", "explain", "provision", "replan", "launch", "export",
                "profile", "spot simulate")  # fmt: skip
RUN_THE_COST_MODEL = ("plan", "predict", "explain", "provision", "replan", "launch",
                      "spot simulate")  # fmt: skip


@pytest.mark.parametrize("command", READ_A_MODEL)
def test_every_command_reading_a_model_takes_its_options(command):
    assert {"--model", "--seq-len", "--precision"} <= _options(command)


@pytest.mark.parametrize("command", RUN_THE_COST_MODEL)
def test_every_command_running_the_cost_model_takes_params_and_profile(command):
    assert {"--params", "--profile"} <= _options(command)


def test_a_command_runs_on_the_application_narrowed_to_it():
    """``main`` hands click only the command the arguments name (converting every command
    costs a tenth of a second of each start): each command's help reads the same on the
    narrowed application as on the whole one, and arguments naming no command get the
    whole application (the root's help and --version, an unknown command's message)."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from hetplan.cli import _app_for, app

    names = sorted(get_command(app).commands)  # type: ignore[attr-defined]
    assert {"plan", "predict", "provision", "launch", "spmd", "spot", "profile"} <= set(names)
    runner = CliRunner()
    for name in names:
        narrow = _app_for([name, "--help"])
        assert narrow is not app
        assert sorted(get_command(narrow).commands) == [name]  # type: ignore[attr-defined]
        whole = runner.invoke(app, [name, "--help"], prog_name="hetplan")
        alone = runner.invoke(narrow, [name, "--help"], prog_name="hetplan")
        assert whole.exit_code == alone.exit_code == 0
        assert alone.output == whole.output
    for argv in ([], ["--version"], ["planify", "--x"], ["--help"]):
        assert _app_for(argv) is app

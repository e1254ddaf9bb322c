"""The README's table of options for each command lists exactly what ``--help`` lists.

The expected side is the command as the CLI builds it (every visible option, every spelling,
``--no-`` forms included); the README side is read from its markdown. A new option, a
renamed one or a new command without a table fails here: regenerate the table with
``python tools/readme_options.py COMMAND``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"<summary><code>hetplan (?P<command>[a-z][a-z -]*)</code></summary>")


def _tool():
    spec = importlib.util.spec_from_file_location(
        "readme_options", ROOT / "tools/readme_options.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()
COMMANDS = TOOL.commands()


def readme_tables(markdown: str) -> dict[str, set[str]]:
    """Returns {command: option spellings in the first column of its table}."""
    out: dict[str, set[str]] = {}
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        match = SUMMARY.search(line)
        if match is None:
            continue
        options: set[str] = set()
        for row in lines[i + 1 :]:
            if row.startswith("</details>"):
                break
            if row.startswith("|"):
                first = row.split("|")[1]
                options |= {o for o in re.findall(r"`([^`]+)`", first) if o.startswith("-")}
        out[match["command"].strip()] = options
    return out


TABLES = readme_tables((ROOT / "README.md").read_text())


def test_table_reader_on_a_tiny_readme() -> None:
    text = (
        "<details><summary><code>hetplan a b</code></summary>\n\n| option | meaning | default |\n"
        "| --- | --- | --- |\n| `PLAN` | (argument) | required |\n"
        "| `--x`, `-x` | an `--y` in the text | - |\n| `--s`, `--no-s` | | on |\n</details>\n"
    )
    assert readme_tables(text) == {"a b": {"--x", "-x", "--s", "--no-s"}}


def test_every_command_has_a_table() -> None:
    assert set(COMMANDS) - set(TABLES) == set(), "commands without a README table"
    assert set(TABLES) - set(COMMANDS) == set(), "README tables of commands that do not exist"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_table_lists_exactly_the_help_options(command: str) -> None:
    want = TOOL.option_names(COMMANDS[command])
    got = TABLES.get(command, set())
    assert got - want == set(), f"README lists options hetplan {command} does not have"
    assert want - got == set(), f"hetplan {command} options missing from its README table"


def test_help_agrees_with_the_command_objects() -> None:
    """The spellings the test compares are the ones --help prints (plan, as a sample)."""
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "300", "PATH": ""},
    )
    assert res.returncode == 0, res.stderr
    printed = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", res.stdout))
    assert TOOL.option_names(COMMANDS["plan"]) <= printed | {"--help"}


def test_help_texts_have_no_source_markup() -> None:
    """A command's description and its options' help print as a person reads them: no
    reStructuredText literal (``x``), which --help printed as written (launch's)."""
    marked = {
        name: text
        for name, cmd in COMMANDS.items()
        for text in [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        if "``" in text
    }
    assert marked == {}

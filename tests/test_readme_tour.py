"""The README's shell blocks run as written.

Every ```sh (or bash, shell) block of README.md runs, in README order, with bash -e in one
temporary folder holding a copy of ``examples/`` and links to the repository's ``src/``
and virtual environment (so ``source .venv/bin/activate`` works), through the installed
``hetplan`` script. A block preceded by ``<!-- tour: skip (reason) -->`` is skipped with
that reason (a GPU, the network, the whole test suite); every other block must exit 0.
Blocks added to the README later are picked up the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELLS = ("sh", "bash", "shell", "console")
SKIP = re.compile(r"<!--\s*tour:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One fenced shell block: where it is, its text, and why it is skipped (if it is)."""

    line: int
    heading: str
    text: str
    skip: str | None

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-") or "top"
        return f"line{self.line}-{slug}"


def shell_blocks(markdown: str) -> list[Block]:
    """Returns the shell blocks of ``markdown`` with their heading and skip marker."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        match = FENCE.match(line)
        if match is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if match["lang"] in SHELLS:
            before = [ln for ln in lines[:i] if ln.strip()]
            marker = SKIP.search(before[-1]) if before else None
            text = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(i + 1, heading, text, marker["reason"] if marker else None))
        i = end + 1
    return blocks


def test_block_extraction_reads_markers_and_languages() -> None:
    text = (
        "# A\n```sh\necho one\n```\n\n<!-- tour: skip (needs a GPU) -->\n\n```bash\nx\n```\n"
        "```python\nprint()\n```\n## B\n```\nplain\n```\n```console\necho two\n```\n"
    )
    got = shell_blocks(text)
    assert [(b.line, b.heading, b.text, b.skip) for b in got] == [
        (2, "A", "echo one\n", None),
        (8, "A", "x\n", "needs a GPU"),
        (18, "B", "echo two\n", None),
    ]


BLOCKS = shell_blocks(README.read_text())
BIN = Path(sys.executable).parent
VENV = BIN.parent


@pytest.fixture
def tour_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole tour: later blocks use the files earlier ones wrote."""
    where = tmp_path_factory.mktemp("tour")
    shutil.copytree(ROOT / "examples", where / "examples")
    (where / "src").symlink_to(ROOT / "src")
    (where / ".venv").symlink_to(VENV)
    (where / "home").mkdir()
    return where


def _env(where: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPLAN_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(where / "home")  # ~/.cache/hetplan stays in the tour's folder
    env["MPLBACKEND"] = "Agg"
    env["VIRTUAL_ENV"] = str(VENV)
    return env


def test_the_readme_has_a_tour() -> None:
    runnable = [b for b in BLOCKS if b.skip is None]
    assert len(runnable) >= 5, "the README's tour lost its command blocks"
    commands = " ".join(b.text for b in runnable)
    for command in ("plan", "predict", "explain", "provision", "replan", "export"):
        assert f"hetplan {command} " in commands, f"no runnable block shows hetplan {command}"


@pytest.mark.skipif(not (BIN / "hetplan").exists(), reason="the hetplan script is not installed")
@pytest.mark.slow
def test_readme_tour_runs_in_order(tour_dir: Path) -> None:
    """Every runnable block, in the README's order, in one folder: later blocks read what
    earlier ones wrote (``plan.json``, profiles). One test, so no scheduler can run a block
    before the one it reads from (pytest-xdist keeps a group on one worker, not its order);
    the first block that fails is named with its line, heading and stderr."""
    ran = 0
    for block in BLOCKS:
        if block.skip is not None:
            continue
        start = time.perf_counter()
        res = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", block.text],
            cwd=tour_dir,
            env=_env(tour_dir),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
        elapsed = time.perf_counter() - start
        assert res.returncode == 0, (
            f"README.md line {block.line} ({block.heading}) exited {res.returncode} after "
            f"{elapsed:.1f} s\n--- block\n{block.text}--- stderr (end)\n{res.stderr[-3000:]}"
        )
        ran += 1
    assert ran == sum(b.skip is None for b in BLOCKS) >= 5

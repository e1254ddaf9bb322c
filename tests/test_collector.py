"""The command line paces the garbage collector (``hetplan.collector``); importing hetplan
as a library does not."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys

import pytest

from hetplan import cli


def test_the_command_line_paces_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's defaults
        monkeypatch.setattr(sys, "argv", ["hetplan", "--version"])
        with contextlib.suppress(SystemExit):
            cli.main()
        # young collections after 10,000 new containers; the older generations as they were
        assert gc.get_threshold() == (10_000, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_importing_the_planner_leaves_the_collector_alone() -> None:
    code = (
        "import gc; before = gc.get_threshold(); "
        "import hetplan.cli, hetplan.search.heterogeneous, hetplan.spmd.segments; "
        "print(before == gc.get_threshold())"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "True"

"""Shared inputs of the measured-data tests: the shipped Sailor GH200 files, a CLI runner."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import hetplan.data
from hetplan.cli import main
from hetplan.measured.importers import write_db
from hetplan.measured.profile_db import ProfileDB
from hetplan.measured.sailor import read_sailor_network, read_sailor_profile
from hetplan.model import load_model

SAILOR = Path(hetplan.data.__file__).parent / "calibration" / "sailor_clariden_opt350"
PROFILE_JSON = SAILOR / "profile_opt350_gh96.json"
NETWORK_JSON = SAILOR / "network_gh96.json"


@pytest.fixture(scope="session")
def sailor_db(tmp_path_factory: pytest.TempPathFactory) -> ProfileDB:
    """Returns a database holding the imported Sailor GH200 profile and network tables."""
    out = tmp_path_factory.mktemp("sailor") / "gh200.sqlite"
    batch = read_sailor_profile(PROFILE_JSON, {"OPT-350": load_model("opt-350m")})
    batch.extend(read_sailor_network(NETWORK_JSON))
    return write_db(out, batch)


Runner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Runner:
    """Returns a function running ``hetplan ARGS`` in this process: (exit code, out, err)."""

    def run(*args: str | Path) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["hetplan", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run

"""Dependencies are bounded and locked: every requirement has an upper bound, the lock file
pins each one inside its range, and what is installed is what the lock says."""

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from hetplan.errors import InputError
from hetplan.report import require_matplotlib

ROOT = Path(__file__).resolve().parents[1]


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs.extend(extra)
    return [Requirement(r) for r in reqs]


def lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version, f"lock line not pinned: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_requirement_has_an_upper_bound():
    for req in requirements():
        ops = {s.operator for s in req.specifier}
        assert ops & {"<", "<=", "==", "~="}, f"{req} is unbounded above"


def test_lock_pins_every_requirement_inside_its_range():
    pins = lock()
    for req in requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_installed_versions_are_the_locked_ones():
    pins = lock()
    for req in requirements():
        name = canonicalize_name(req.name)
        installed = Version(importlib.metadata.version(req.name))
        # a local label (torch's +cpu) is the build, not the version the lock names
        assert Version(installed.public) == pins[name], (req.name, installed, pins[name])


def test_a_picture_without_matplotlib_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    require_matplotlib("--timeline", None)  # no picture asked: nothing needed
    with pytest.raises(InputError) as info:
        require_matplotlib("--timeline", Path("t.png"))
    assert info.value.field == "--timeline" and "hetplan[plots]" in str(info.value)


def test_xdist_groups_run_on_one_worker(tmp_path):
    """``make test`` runs ``--dist loadgroup``: tests marked with one ``xdist_group`` share a
    worker (the README's tour and its files, runs made once for a group's tests). Under
    pytest 9.2 the mark is silently ignored (pytest-xdist#1386): the tests spread."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\n"
        "import pytest\n\n\n"
        "@pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_grouped(i):\n"
        "    with open(os.environ['GROUP_LOG'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_free(i):\n"
        "    pass\n"
    )
    log = tmp_path / "workers.txt"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p",
         "no:cacheprovider", "-o", "addopts=", str(tmp_path / "test_grouped.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "GROUP_LOG": str(log)},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:]
    workers = log.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers


def test_slow_tests_are_collected_first():
    """``tests/conftest.py`` hands the tests marked slow out first: the README's tour,
    collected after ``test_collector.py`` by name, is collected before it."""
    tour = "tests/test_readme_tour.py::test_readme_tour_runs_in_order"
    quick = "tests/test_collector.py::test_the_command_line_paces_the_collector"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=--import-mode=importlib", "tests/test_collector.py",
         "tests/test_readme_tour.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert tour in ids and quick in ids
    assert ids.index(tour) < ids.index(quick)

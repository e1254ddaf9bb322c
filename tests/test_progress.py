"""Search progress: the hook the searches call, the bar the CLI draws from it, and silence
under --json or without a terminal."""

import io
import subprocess
import sys

from rich.console import Console

from hetplan.cluster import load_cluster, parse_inline_cluster
from hetplan.model import load_model
from hetplan.report.progress import ProgressBar
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.progress import SearchProgress


def test_homogeneous_search_reports_every_estimate_and_its_best():
    calls = []
    res = search_homogeneous(load_model("gpt3-1.3b"), parse_inline_cluster("A100-80GB:2x8"),
                             64, "bf16", progress=calls.append)  # fmt: skip
    assert [c.explored for c in calls] == list(range(1, res.evaluated + 1))
    assert all(c.total == res.fitting for c in calls)
    assert calls[-1].best_s == res.ranked[0][1].iteration_time_s
    bests = [c.best_s for c in calls if c.best_s is not None]
    assert bests == sorted(bests, reverse=True)


def test_heterogeneous_search_reports_its_estimates():
    calls = []
    res = search_heterogeneous(load_model("gpt2-medium"), load_cluster("A100-80GB:1x4,T4:1x4"),
                               32, "fp16", progress=calls.append)  # fmt: skip
    assert calls and [c.explored for c in calls] == list(range(1, len(calls) + 1))
    best = res.ranked[0][1].iteration_time_s
    assert min(c.best_s for c in calls if c.best_s is not None) >= best * (1 - 1e-12)


def _bar(delay, enabled=True):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    return ProgressBar(enabled, delay_s=delay, console=console), buf


def test_bar_draws_once_the_search_ran_past_its_delay():
    bar, buf = _bar(0.0)
    with bar:
        for k in range(1, 4):
            bar(SearchProgress(k, 10, 2.5 - k / 10))
    assert bar.shown and "best so far 2.200 s" in buf.getvalue()


def test_bar_stays_silent_before_its_delay_and_when_disabled():
    for bar, buf in (_bar(3600.0), _bar(0.0, enabled=False)):
        with bar:
            bar(SearchProgress(1, 10, 1.0))
        assert not bar.shown and buf.getvalue() == ""


def test_plan_json_without_terminal_prints_no_progress():
    # llama3-405b on 16,384 H100 searches for more than a second on this machine
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "plan",
            "--model",
            "llama3-405b",
            "--cluster",
            "H100-80GB:2048x8",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "searching" not in res.stderr and "best so far" not in res.stderr
    assert res.stderr == ""
    assert ProgressBar.for_cli(as_json=True).enabled is False

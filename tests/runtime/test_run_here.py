"""Runs launched from the calling process (``forkrun.run_here``): a rank's error reaches the
one-line cause, a deadline stops the ranks, and the caller's process is left as it was
(signal handlers, environment, no rank left behind)."""

from __future__ import annotations

import os
import re
import signal
import time
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest

from hetplan.runtime.config import RunConfig
from hetplan.runtime.forkrun import run_here
from hetplan.runtime.launch import failed_run_cause, worker_args

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("run_here")]


def _children(pid: int) -> list[int]:
    """Returns the live (not zombie) processes whose parent is ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _cfg(tmp: Path, inputs: dict[str, Path], plan: Path, **kw: Any) -> RunConfig:
    return RunConfig(str(plan), str(inputs["gpt"]), str(inputs["cluster"]),
                     result=str(tmp / "result.json"), **kw)  # fmt: skip


def test_a_rank_that_raises_is_named_with_its_error(
    tmp_path: Path, inputs: dict[str, Path]
) -> None:
    """Both ranks join their group, then cannot read the plan: the first to fail (the agent
    stops the other) exits 1 with the error it raised, which the cause line repeats."""
    missing = tmp_path / "no_such_plan.json"
    cfg = _cfg(tmp_path, inputs, missing, steps=1)
    failures = run_here(worker_args(cfg), 2, str(tmp_path / "logs"))
    assert failures and set(failures) <= {0, 1}
    assert all(f.exitcode == 1 and "no_such_plan.json" in f.error for f in failures.values())
    line = failed_run_cause(failures, str(cfg.result))
    want = r"training failed: rank [01] exited with 1: \w+Error: .*no_such_plan\.json.*"
    assert re.fullmatch(want, line), line


def test_a_deadline_stops_the_ranks_and_leaves_the_caller_as_it_was(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "dp2.json", [(2, [(4, [0])]), (2, [(4, [1])])])
    one = write_plan(tmp_path / "one.json", [(2, [(4, [0])])])
    # the server started and the worker imported: the deadline then falls mid-training
    assert run_here(worker_args(_cfg(tmp_path, inputs, one, steps=1)), 1, str(tmp_path / "a")) == {}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    omp = os.environ.get("OMP_NUM_THREADS")
    # 2,000 steps take about a minute here (30 ms each): run whole, it fails the raises
    cfg = _cfg(tmp_path, inputs, plan, steps=2000)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no result after 6 s"):
        run_here(worker_args(cfg), 2, str(tmp_path / "b"), timeout_s=6)
    assert time.monotonic() - start < 30
    assert Path(f"{cfg.result}.steps").exists()  # it was training when stopped
    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while _children(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children(server) == []
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert os.environ.get("OMP_NUM_THREADS") == omp

"""The duty-cycle throttler stops and continues its target and leaves it running."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from hetplan.spmd import throttle


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]


def test_throttled_process_is_stopped_part_of_the_time_and_released() -> None:
    target = subprocess.Popen(["sleep", "30"])
    watcher = throttle.start(0.2, target.pid)
    assert watcher is not None
    try:
        states = []
        for _ in range(100):
            states.append(_state(target.pid))
            time.sleep(0.003)
        assert "T" in states  # stopped during the off part of the cycle
        watcher.terminate()
        watcher.wait(timeout=5)
        time.sleep(0.05)
        assert _state(target.pid) != "T"  # the watcher continued it on exit
    finally:
        target.kill()
        target.wait()
    assert throttle.start(1.0) is None

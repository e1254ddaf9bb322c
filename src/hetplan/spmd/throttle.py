"""Duty-cycle CPU throttling of a process (the method of the ``cpulimit`` tool).

A watcher process alternately stops (SIGSTOP) and continues (SIGCONT) the target, so
the target runs ``duty`` of every ``period_s``: a CPU rank that is 1/duty times slower,
used to emulate devices of different speeds on one machine. Linux/POSIX only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PERIOD_S = 0.02


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def watch(pid: int, duty: float, period_s: float = PERIOD_S) -> None:
    """Throttles ``pid`` to ``duty`` of the CPU time until it exits."""
    on, off = duty * period_s, (1.0 - duty) * period_s
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave the target running
    try:
        while _alive(pid):
            time.sleep(on)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(off)
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)


def start(duty: float, pid: int | None = None) -> subprocess.Popen[bytes] | None:
    """Starts a watcher throttling ``pid`` (default: this process); None if duty >= 1."""
    if duty >= 1.0:
        return None
    if not duty > 0.0:
        raise ValueError(f"duty must be in (0, 1], got {duty}")
    target = os.getpid() if pid is None else pid
    cmd = [sys.executable, "-m", "hetplan.spmd.throttle", str(target), str(duty)]
    return subprocess.Popen(cmd)


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]))

"""Runs every benchmark script in bench/ in turn (each prints its own table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    """Runs bench/bench_*.py one after another; returns the number that failed."""
    failed = 0
    for script in sorted(Path(__file__).parent.glob("bench_*.py")):
        print(f"== {script.name}", flush=True)
        failed += subprocess.run([sys.executable, str(script)], check=False).returncode != 0
    return failed


if __name__ == "__main__":
    sys.exit(main())

"""Times for a person: a table or a sentence reads in the unit of its longest time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hetplan.units import duration_text, duration_unit


def test_the_unit_follows_the_longest_time() -> None:
    assert duration_unit(3 * 86400) == ("days", 86400.0)
    assert duration_unit(2 * 86400 - 1) == ("hours", 3600.0)
    assert duration_unit(2 * 3600) == ("hours", 3600.0)
    assert duration_unit(7199) == ("minutes", 60.0)
    assert duration_text(45 * 60) == "45.00 minutes"
    assert duration_text(2.5 * 86400) == "2.50 days"
    # several share the longest one's unit: 90 minutes beside 3 hours reads 1.50 to 3.00
    assert duration_text(5400, 10800) == "1.50 to 3.00 hours"
    assert duration_text(10800, 5400, sep=" -> ") == "3.00 -> 1.50 hours"


def test_a_short_run_is_listed_in_minutes_not_hundredths_of_a_day() -> None:
    small = Path(__file__).parent.parent / "examples" / "markets" / "small.yaml"
    base = [sys.executable, "-m", "hetplan", "provision", "-m", "gpt3-1.3b", "--tokens", "1e9",
            "--market", str(small)]  # fmt: skip
    data = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True,
                                     timeout=300, check=True).stdout)  # fmt: skip
    longest = max(p["time_to_train_s"] for p in data["front"])
    assert longest < 7200  # a billion tokens on A100s: under two hours
    res = subprocess.run(base, capture_output=True, text=True, timeout=300, check=True)
    header = next(line for line in res.stdout.splitlines() if "GPUs" in line)
    assert "minutes" in header and "days" not in header
    fastest = min(p["time_to_train_s"] for p in data["front"])
    assert f"{fastest / 60:,.2f}" in res.stdout  # the fastest point's minutes, as computed

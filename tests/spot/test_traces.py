"""Trace formats, the synthetic generator, and bad traces through the CLI (exit 2, one line
naming the field)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hetplan.errors import InputError
from hetplan.spot.traces import (
    ANY_TYPE,
    PoolType,
    load_trace,
    parse_trace,
    synthesize,
    trace_csv,
)


def test_shipped_sailor_traces():
    t = load_trace("sailor_a100_16.json")
    assert t.types == [ANY_TYPE]
    counts = [p.counts[ANY_TYPE] for p in t.points]
    assert counts[0] == 14 and min(counts) == 7 and max(counts) == 14
    assert t.end_s == 13041 and t.points[1].time_s == 63
    bound = t.bind("A100-80GB")
    assert bound.types == ["A100-80GB"] and bound.points[10].counts == {"A100-80GB": 9}
    orig = load_trace("sailor_a100_original.json")
    assert len(orig.points) == 12 and orig.decreases() == 5 and orig.end_s == 5229
    pools = load_trace("sailor_a100_v100_pools.csv")
    assert pools.types == ["A100-40GB", "V100-16GB"]
    assert [p.counts["V100-16GB"] for p in pools.points] == [96, 240, 384]
    assert pools.points[1].time_s == pytest.approx(1712574137.19241 - 1712574014.0187)


def test_generic_csv_rows_of_one_time_form_one_change():
    t = parse_trace(
        "time_s,gpu_type,count,usd_per_hour\n0,T4,4,0.2\n0,V100-32GB,8,\n60,T4,0,0.3\n90,T4,4,\n",
        "g.csv",
    )
    assert [p.time_s for p in t.points] == [0, 60, 90]
    assert t.points[0].counts == {"T4": 4, "V100-32GB": 8}
    assert t.points[0].prices == {"T4": 0.2}
    assert t.points[1].counts == {"T4": 0, "V100-32GB": 8} and t.points[1].prices == {"T4": 0.3}
    assert t.points[2].prices == {"T4": 0.3}  # a price holds until the next one
    assert t.decreases() == 1 and t.changes() == 2
    again = parse_trace(trace_csv(t), "again.csv")
    assert again.points == t.points


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("time_s,gpu_type,count\n0,T4,-1\n", "g.csv:2 count"),
        ("time_s,gpu_type,count\n10,T4,1\n5,T4,2\n", "g.csv:3 time_s"),
        ("time_s,gpu_type,count\n0,Z80,1\n", "g.csv:2 gpu_type"),
        ("time_s,gpu_type,count\n", "g.csv"),
        ("", "g.csv"),
        ("time,gpu,n\n0,T4,1\n", "g.csv:1"),
    ],
)
def test_bad_csv_names_the_field(text, field):
    with pytest.raises(InputError) as info:
        parse_trace(text, "g.csv")
    assert info.value.field == field


def test_bad_json_names_the_entry():
    with pytest.raises(InputError) as info:
        parse_trace('[{"Time": 0, "GPUs": 4}, {"Time": 5, "GPUs": 2.5}]', "s.json")
    assert info.value.field == "s.json[1] count"
    with pytest.raises(InputError, match="no entries"):
        parse_trace("[]", "s.json")


def test_synthetic_preemptions_follow_the_stated_rate():
    rate, outage, hours = 0.5, 600.0, 400.0
    pool = [PoolType("A100-80GB", 8, 2, rate, outage), PoolType("T4", 4, 1, 0.0, outage)]
    t = synthesize(pool, hours * 3600, seed=3)
    assert synthesize(pool, hours * 3600, seed=3) == t  # seeded
    assert all(p.counts["T4"] == 4 for p in t.points)  # rate 0: never preempted
    falls = sum(
        1
        for a, b in zip(t.points, t.points[1:], strict=False)
        if b.counts["A100-80GB"] < a.counts["A100-80GB"]
    )
    # per node, a renewal process of mean up 1/rate and mean outage: 2 nodes x hours/cycle
    expected = 2 * hours * 3600 / (3600 / rate + outage)
    assert falls == pytest.approx(expected, rel=0.12)
    assert {p.counts["A100-80GB"] for p in t.points} <= {0, 8, 16}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetplan", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("text", "name", "field"),
    [
        ("time_s,gpu_type,count\n0,A100-80GB,-8\n", "neg.csv", "neg.csv:2 count"),
        (
            "time_s,gpu_type,count\n60,A100-80GB,8\n0,A100-80GB,16\n",
            "order.csv",
            "order.csv:3 time_s",
        ),
        ("time_s,gpu_type,count\n0,Z80,8\n", "unknown.csv", "unknown.csv:2 gpu_type"),
        ("", "empty.csv", "empty.csv"),
    ],
)
def test_bad_traces_exit_2_with_one_line(tmp_path, text, name, field):
    path = tmp_path / name
    path.write_text(text)
    res = run_cli(
        "spot", "simulate", "--trace", str(path), "--model", "gpt3-1.3b",
        "--cluster", "A100-80GB:2x8",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in res.stderr
    assert res.stdout == ""


def test_a_type_the_cluster_lacks_is_refused(tmp_path):
    path = tmp_path / "t4.csv"
    path.write_text("time_s,gpu_type,count\n0,T4,4\n")
    res = run_cli("spot", "simulate", "--trace", str(path), "--model", "gpt3-1.3b",
                  "--cluster", "A100-80GB:2x8")  # fmt: skip
    assert res.returncode == 2
    assert "--trace" in res.stderr and "T4" in res.stderr

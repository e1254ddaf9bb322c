"""Messages show values as a person writes them, never as a Python repr."""

import subprocess
import sys

from hetplan.errors import shown


def test_shown_writes_values_as_yaml_would():
    assert shown("abc") == "'abc'"
    assert shown(True) == "true" and shown(False) == "false"
    assert shown(None) == "null"
    assert shown(3) == "3" and shown(2.5) == "2.5"
    assert shown([1, "x"]) == "[1, 'x']"
    assert shown((1, 2)) == "[1, 2]"
    assert shown({"H200-141GB": 1024}) == "{H200-141GB: 1024}"


def test_a_bad_cluster_value_is_named_without_a_repr(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {gpu: T4, gpus: true}\n  - {gpu: T4, colour: red}\n")
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "--model", "gpt2", "--cluster", str(cluster)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: nodes[0].gpus: expected a positive integer, got true"), (
        res.stderr
    )
    cluster.write_text("nodes:\n  - {gpu: T4, colour: red}\n")
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "--model", "gpt2", "--cluster", str(cluster)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    line = res.stderr.strip()
    assert line.startswith("error: nodes[0].colour: unknown key (allowed: ")
    assert ", gpu, gpus, " in line
    assert "[" not in line.split("allowed:")[1] and "'" not in line, line

"""The files commands write: whole or not at all, and a path that cannot be written is one
line naming the option (exit 2), never a traceback, with nothing left behind."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.errors import InputError
from hetplan.outputs import check_output, output_file, write_text

SCRIPT = Path(sys.executable).parent / "hetplan"


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)  # fmt: skip


def test_written_whole_and_nothing_else(tmp_path):
    target = tmp_path / "plan.json"
    write_text(target, '{"a": 1}\n', "--out")
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_a_failure_mid_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), output_file(target, "--out") as tmp:
        tmp.write_text("half")
        raise RuntimeError("the draw failed")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize("where", ["missing/p.json", "folder", "file.txt/p.json"])
def test_an_unwritable_path_names_the_option(tmp_path, where):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InputError) as info:
        write_text(tmp_path / where, "text", "--trace")
    assert info.value.field == "--trace" and str(tmp_path / where) in info.value.reason
    with pytest.raises(InputError):
        check_output(tmp_path / where, "--trace")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--out", "no/such/plan.json"], "--out"),
        (["plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--out", "a_folder"], "--out"),
        (
            [
                "predict",
                "-m",
                "gpt2",
                "-c",
                "A100-80GB:1x8",
                "--tp",
                "1",
                "--pp",
                "1",
                "--dp",
                "8",
                "--trace",
                "no/such/t.json",
            ],
            "--trace",
        ),
        (["calibrate", "--runs", "no_runs.csv", "--out", "no/such/params.json"], "--out"),
    ],
)
def test_commands_refuse_an_unwritable_output(tmp_path, args, option):
    (tmp_path / "a_folder").mkdir()
    res = _run(tmp_path, *args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: cannot write"), res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder"]
    assert list((tmp_path / "a_folder").iterdir()) == []


def test_export_to_an_unwritable_path(tmp_path):
    plan = tmp_path / "plan.json"
    res = _run(tmp_path, "plan", "-m", "gpt2", "-c", "A100-80GB:1x8", "--tp", "1", "--pp", "1",
               "--out", str(plan))  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = _run(tmp_path, "export", str(plan), "-m", "gpt2", "--out", "no/such/args.sh")
    assert res.returncode == 2 and "error: --out: cannot write" in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_has_no_nan_or_infinity():
    from hetplan.outputs import json_text

    text = json_text({"a": float("nan"), "b": [1.5, float("inf"), -float("inf")], "c": (2,)})
    assert _strict(text) == {"a": None, "b": [1.5, None, None], "c": [2]}


def test_calibrate_json_is_standard_with_too_few_rows_for_a_rank(tmp_path):
    """Two rows have no rank correlation: JSON says null, not NaN."""
    runs = Path(__file__).parent.parent / "examples" / "runs" / "sailor.csv"
    res = _run(tmp_path, "calibrate", "--runs", str(runs), "--no-loo", "--json")
    assert res.returncode == 0, res.stderr
    data = _strict(res.stdout)
    assert isinstance(data, dict) and data["spearman"] is None and data["n"] == 2

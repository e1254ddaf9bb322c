"""Messages show values as a person writes them, never as a Python repr."""

import subprocess
import sys

import pytest

from hetplan.errors import InputError, shown


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


def test_a_cluster_price_must_be_a_finite_number(tmp_path):
    from hetplan.cluster import load_cluster
    from hetplan.errors import InputError

    cluster = tmp_path / "c.yaml"
    for value in (".nan", ".inf", "-1"):
        cluster.write_text(f"nodes:\n  - {{gpu: T4, price_per_gpu_hour: {value}}}\n")
        try:
            load_cluster(str(cluster))
        except InputError as exc:
            assert exc.field == "nodes[0].price_per_gpu_hour", exc
        else:
            raise AssertionError(f"price {value} accepted")


def test_a_second_cluster_is_named_by_its_own_option(tmp_path):
    """replan's --joined file: its errors name --joined, not --cluster."""
    from hetplan.cluster import load_cluster
    from hetplan.errors import InputError

    bad = tmp_path / "joined.yaml"
    bad.write_text("nodes:\n  - {gpu: Z80}\n")
    for spec, field in ((str(tmp_path / "none.yaml"), "--joined"),
                        (str(bad), "--joined nodes[0].gpu")):  # fmt: skip
        try:
            load_cluster(spec, "--joined")
        except InputError as exc:
            assert exc.field == field, exc
        else:
            raise AssertionError("accepted")


def test_a_file_is_named_as_the_user_gave_it(tmp_path):
    """A positional PLAN is 'PLAN', a manifest's plan its field; not '--plan', an option
    explain, export and calibrate do not have."""
    import subprocess
    import sys

    from hetplan.errors import InputError

    def line(*args: str) -> str:
        res = subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)  # fmt: skip
        assert res.returncode == 2, res.stderr
        return res.stderr.strip()

    assert line("explain", "nope.json", "-m", "gpt2", "-c", "A100-80GB:1x8").startswith(
        "error: PLAN: cannot read nope.json"
    )
    assert line("export", "nope.json", "-m", "gpt2").startswith("error: PLAN: cannot read")
    (tmp_path / "m.yaml").write_text(
        "runs:\n  - {plan: nope.json, model: gpt2, cluster: A100-80GB:1x8, measured_iter_s: 1}\n"
    )
    from hetplan.cost.runs import load_runs

    try:
        load_runs(tmp_path / "m.yaml")
    except InputError as exc:
        assert exc.field == "runs[0].plan", exc
    else:
        raise AssertionError("a missing plan accepted")


def test_a_generic_runs_file_may_leave_out_micro_batch(tmp_path):
    """inputs.md: micro_batch blank means searched; the column left out means the same."""
    from hetplan.cost.runs import load_runs

    runs = tmp_path / "r.csv"
    runs.write_text("label,layers,hidden,heads,ffn,vocab,seq,gpu,nodes,gpus_per_node,tp,pp,dp,"
                    "global_batch,iter_time_s\nx,24,1024,16,4096,50000,2048,A100-80GB,1,8,2,1,4,"
                    "64,1.5\n")  # fmt: skip
    (run,) = load_runs(runs)
    assert run.plan is None and run.knobs is not None and run.measured == 1.5


def test_a_spot_option_without_spot_is_refused():
    """provision --checkpoint-interval prices preemptions: without --spot it had no effect."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "hetplan", "provision", "-m", "gpt2",
                          "--tokens", "1e9", "--checkpoint-interval", "10m"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: --checkpoint-interval: it prices spot preemptions: add --spot"
    )


def test_a_message_in_brackets_prints_as_written(tmp_path):
    """Messages are text, not rich markup: '[[c2, c1, c0], max_bytes_per_s]' lost its
    brackets ('expected [, max_bytes_per_s]')."""
    import subprocess
    import sys

    net = tmp_path / "net.json"
    net.write_text('{"intra": {"GH-96": {"2": [[1, 2], 5]}}}')
    res = subprocess.run([sys.executable, "-m", "hetplan", "profile", "import", "--network",
                          str(net), "--out", str(tmp_path / "n.sqlite")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2
    assert "expected [[c2, c1, c0], max_bytes_per_s], got [[1, 2], 5]" in res.stderr, res.stderr


def test_a_cluster_no_layout_can_use_says_why_and_how_many():
    """gpt3-1.3b (24 layers, 32 heads, batch 512) on 8-GPU nodes: TP 8 x PP 24 x DP 512 =
    98,304 GPUs at most, which plan; one node more does not, and the message says the bound
    (it said only that no layout divides). 1,009 one-GPU nodes (a prime above 512 and 24)
    factor no way."""
    from typer.testing import CliRunner

    from hetplan.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "-m", "gpt3-1.3b", "-c", "A100-80GB:12288x8", "--json"])
    assert ok.exit_code == 0, ok.output
    # in process the command raises the InputError that ``hetplan.cli.main`` prints, exit 2
    over = runner.invoke(app, ["plan", "-m", "gpt3-1.3b", "-c", "A100-80GB:12289x8"])
    assert isinstance(over.exception, InputError) and over.exception.field == "plan"
    assert "uses at most 98,304 GPUs" in over.exception.reason
    assert "has 98,312" in over.exception.reason
    prime = runner.invoke(app, ["plan", "-m", "gpt3-1.3b", "-c", "A100-80GB:1009x1"])
    assert isinstance(prime.exception, InputError)
    assert "1,009 GPUs do not factor" in prime.exception.reason
    assert "--max-gpus" in prime.exception.reason


@pytest.mark.parametrize(
    ("change", "column", "words"),
    [
        (("A100-80GB", "Z100"), "gpu", "unknown GPU type 'Z100'"),
        (
            (",2,1,4,", ",2,1,8,"),
            "dp",
            "tp x pp x dp = 16, but the run's nodes x gpus_per_node = 8",
        ),
        (("1024,16,", "1024,15,"), "heads", "15 heads do not divide hidden 1024"),
        ((",64,1.5", ",64,1.5,x"), "zero_stage", "expected a whole number, got 'x'"),
    ],
)
def test_a_generic_runs_row_error_names_its_column_and_line(tmp_path, change, column, words):
    """A row's values checked as a cluster or a model were named as those (nodes[0].gpu,
    model.heads) without the file and line; a tp x pp x dp beyond the row's GPUs read 'no
    plan fits'; a bad zero_stage was a traceback."""
    from hetplan.cost.runs import load_runs

    head = ("label,layers,hidden,heads,ffn,vocab,seq,gpu,nodes,gpus_per_node,tp,pp,dp,"
            "global_batch,iter_time_s")  # fmt: skip
    row = "x,24,1024,16,4096,50000,2048,A100-80GB,1,8,2,1,4,64,1.5"
    if column == "zero_stage":
        head += ",zero_stage"
    runs = tmp_path / "r.csv"
    runs.write_text(f"{head}\n{row.replace(*change)}\n")
    with pytest.raises(InputError) as err:
        load_runs(runs)
    assert err.value.field == column, err.value
    assert err.value.reason.startswith("r.csv line 2: ") and words in err.value.reason, err.value


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # a flow list never closed: the parser meets the end of the file on line 2
        ("[1, 2\n", "line 2, column 1: expected ',' or ']', but got '<stream end>'"),
        # a tab indents line 2 (YAML allows only spaces): found at its first column
        ("nodes:\n\t- gpu: T4\n", "line 2, column 1: found character '\\t' that cannot "
         "start any token"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_yaml_is_one_line_with_where_and_what(tmp_path, text, where):
    """Every file read as YAML (cluster, market, runs manifest) says where the parser stopped
    and what it met, on one line: the runs manifest printed PyYAML's seven-line text with
    the file quoted, the market neither where nor what."""
    from pathlib import Path

    from hetplan.cluster import load_cluster
    from hetplan.cost.runs import load_runs
    from hetplan.market import load_market

    path = tmp_path / "in.yaml"
    path.write_text(text)
    cases = [
        (lambda: load_cluster(str(path)), f"--cluster: {path} is not valid YAML: {where}"),
        (lambda: load_market(str(path)), f"--market: {path} is not valid YAML: {where}"),
        (lambda: load_runs(Path(path)), f"--runs: in.yaml is not valid YAML: {where}"),
    ]
    for load, want in cases:
        with pytest.raises(InputError) as exc:
            load()
        assert str(exc.value) == want
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "calibrate", "--runs", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"error: --runs: in.yaml is not valid YAML: {where}"]

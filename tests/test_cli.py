"""The CLI end to end, in a subprocess: outputs, files, and one-line errors with exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "hetplan", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_plan_json_and_files(tmp_path):
    out = tmp_path / "best.json"
    trace = tmp_path / "trace.json"
    png = tmp_path / "timeline.png"
    res = run(
        "plan",
        "--model",
        "gpt3-1.3b",
        "--cluster",
        "A100-80GB:2x8",
        "--top",
        "3",
        "--json",
        "--out",
        str(out),
        "--trace",
        str(trace),
        "--timeline",
        str(png),
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert len(data["plans"]) == 3 and data["search_time_s"] > 0
    first = data["plans"][0]
    for key in (
        "iteration_time_s",
        "tokens_per_s",
        "tflops_per_gpu",
        "hardware_tflops_per_gpu",
        "mfu",
        "fits",
        "max_peak_memory_gb",
        "cost_usd_per_hour",
        "breakdown",
        "plan",
    ):
        assert key in first
    # per distinct stage: its replicas times its TP group cover the 16 GPUs once
    assert sum(s["replicas"] * s["tp"] for s in first["stages"]) == 16
    assert json.loads(out.read_text())["pipelines"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "backward" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_table():
    res = run(
        "plan",
        "--model",
        "gpt2-medium",
        "--cluster",
        "T4:4x4",
        "--global-batch-size",
        "32",
        "--precision",
        "fp16",
    )
    assert res.returncode == 0, res.stderr
    header = next(line for line in res.stdout.splitlines() if "┃ # ┃" in line)
    names = [c.strip() for c in header.strip("┃").split("┃")]
    rows = [
        dict(zip(names, (c.strip() for c in line.strip("│").split("│")), strict=True))
        for line in res.stdout.splitlines()
        if line.startswith("│") and len(line.split("│")) == len(names) + 2
    ]
    assert len(rows) == 5
    # by hand: a GPT layer's forward is 24 h^2 matmul FLOPs and 4 s h attention FLOPs per
    # token, the logits 2 h V; forward and backward are three forwards (Narayanan et al.
    # 2021: 72 l h^2 (1 + s/6h + V/12lh)); peak: 16 T4 at 65 TFLOP/s (FP16 datasheet)
    layers, hidden, seq, vocab = 24, 1024, 1024, 50257
    flops_per_token = 3 * (layers * (24 * hidden**2 + 4 * seq * hidden) + 2 * hidden * vocab)
    assert flops_per_token == 2_422_708_224
    for row in rows:
        tokens_per_s = float(row["tokens/s"].replace(",", ""))
        iteration_s = float(row["iter s"])
        assert tokens_per_s == pytest.approx(32 * 1024 / iteration_s, rel=1e-3)  # 3 decimals
        mfu_pct = 100 * tokens_per_s * flops_per_token / (16 * 65e12)
        assert float(row["MFU"].rstrip("%")) == pytest.approx(mfu_pct, abs=0.051)
    assert "Iteration breakdown" in res.stdout


def test_predict_flags_and_plan_file(tmp_path):
    res = run(
        "predict",
        "--model",
        "gpt3-1.3b",
        "--cluster",
        "A100-80GB:1x8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "16",
        "--recompute",
        "selective",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["fits"] and data["degrees"] == {"tp": 2, "pp": 2, "dp": 2, "uniform": True}
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(data["plan"]))
    again = run(
        "predict",
        "--model",
        "gpt3-1.3b",
        "--cluster",
        "A100-80GB:1x8",
        "--plan",
        str(plan),
        "--json",
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["iteration_time_s"] == pytest.approx(data["iteration_time_s"])


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--model", "gpt9", "--cluster", "T4:1x4"], "--model"),
        (["plan", "--model", "gpt2", "--cluster", "B9000:1x4"], "unknown GPU type"),
        (["plan", "--model", "gpt2", "--cluster", "{yaml}"], "not valid YAML"),
        (["plan", "--model", "gpt2", "--cluster", "{noyaml}"], "nodes"),
        (
            ["predict", "--model", "gpt2", "--cluster", "T4:1x4", "--plan", "{badplan}"],
            "not valid JSON",
        ),
        (
            ["predict", "--model", "gpt2", "--cluster", "T4:1x4", "--plan", "{missingdev}"],
            "not in the cluster",
        ),
        (
            [
                "predict",
                "--model",
                "gpt2",
                "--cluster",
                "T4:1x4",
                "--tp",
                "8",
                "--pp",
                "1",
                "--dp",
                "1",
                "--micro-batch-size",
                "1",
            ],
            "--tp",
        ),
        (
            [
                "predict",
                "--model",
                "gpt2",
                "--cluster",
                "T4:1x4",
                "--tp",
                "1",
                "--pp",
                "1",
                "--dp",
                "3",
                "--micro-batch-size",
                "4",  # 2 micro-batches for 3 replicas (with 1: shares 3, 3, 2 run)
                "--global-batch-size",
                "8",
            ],
            "--dp",
        ),
        (["plan", "--model", "gpt3-175b", "--cluster", "T4:1x4"], "no plan fits in memory"),
        (["plan", "--model", "gpt2", "--cluster", "V100-16GB:1x4", "--precision", "bf16"], "bf16"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    files = {
        "{yaml}": _write(tmp_path, "bad.yaml", "nodes: [\n  - {gpu: T4"),
        "{noyaml}": _write(tmp_path, "empty.yaml", "gpus: 3\n"),
        "{badplan}": _write(tmp_path, "bad.json", "{oops"),
        "{missingdev}": _write(
            tmp_path,
            "plan.json",
            json.dumps(
                {
                    "global_batch_size": 4,
                    "micro_batch_size": 1,
                    "pipelines": [
                        {"batch_size": 4, "stages": [{"layers": 12, "devices": ["elsewhere:0"]}]}
                    ],
                }
            ),
        ),
    }
    args = [files.get(a, a) for a in args]
    res = run(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr


def test_out_file_not_written_on_error(tmp_path):
    out = tmp_path / "best.json"
    res = run("plan", "--model", "gpt3-175b", "--cluster", "T4:1x4", "--out", str(out))
    assert res.returncode == 2
    assert not out.exists()


AMP_CSV = (
    Path(__file__).resolve().parents[1] / "src/hetplan/data/calibration/amp_t4_homogeneous.csv"
)


def test_calibrate_measured_runs_then_predict_a_held_out_one(tmp_path):
    # AMP's real T4 trials without the pure data-parallel one (mb1 tp1 dp16 pp1), which
    # measured 1.32 s per iteration (Li et al. NeurIPS'22, github.com/MccRee177/AMP)
    lines = AMP_CSV.read_text().splitlines()
    held = ",32,1,1,16,1,0;30,"
    kept = [line for line in lines[1:] if held not in line]
    assert len(kept) == len(lines) - 2
    runs = tmp_path / "amp.csv"
    runs.write_text("\n".join([lines[0], *kept]) + "\n")
    params = tmp_path / "params.json"
    res = run("calibrate", "--runs", str(runs), "--out", str(params), "--no-loo")
    assert res.returncode == 0, res.stderr
    assert "fitted terms" in res.stdout and "microbatch_overhead_s" in res.stdout
    fitted = json.loads(params.read_text())
    assert "T4" in fitted["gpus"]
    config = tmp_path / "gpt2-amp" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"n_embd": 1024, "n_layer": 24, "n_head": 16,
                                  "vocab_size": 52256, "n_positions": 1024}))  # fmt: skip
    cluster = tmp_path / "g4dn.yaml"
    cluster.write_text(
        "nodes:\n  - {gpu: T4, gpus: 4, count: 4, intra_node_bandwidth: 50 Gbit/s,"
        " network_bandwidth: 50 Gbit/s}\n"
    )
    pred = run(
        "predict", "--model", str(config), "--cluster", str(cluster), "--tp", "1", "--pp", "1",
        "--dp", "16", "--micro-batch-size", "1", "--global-batch-size", "32",
        "--precision", "fp16", "--no-flash-attention", "--no-overlap-grad-reduce",
        "--params", str(params), "--json",
    )  # fmt: skip
    assert pred.returncode == 0, pred.stderr
    assert json.loads(pred.stdout)["iteration_time_s"] == pytest.approx(1.32, rel=0.15)


def test_mixed_cluster_plan_explain_and_baselines(tmp_path):
    out = tmp_path / "plan.json"
    cluster = "A100-80GB:1x4,T4:1x4"
    res = run(
        "plan",
        "--model",
        "gpt2-medium",
        "--cluster",
        cluster,
        "--global-batch-size",
        "64",
        "--top",
        "2",
        "--explain",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert "Stages" in res.stdout and "Replicas" in res.stdout and "baseline" in res.stdout
    data = run(
        "plan",
        "--model",
        "gpt2-medium",
        "--cluster",
        cluster,
        "--global-batch-size",
        "64",
        "--top",
        "1",
        "--json",
    )
    assert data.returncode == 0, data.stderr
    baselines = json.loads(data.stdout)["baselines"]
    assert set(baselines) == {"single_type", "uniform"}
    info = run("explain", str(out), "--model", "gpt2-medium", "--cluster", cluster, "--json")
    assert info.returncode == 0, info.stderr
    explained = json.loads(info.stdout)
    assert explained["stages"] and explained["replicas"] and explained["bottleneck"]


def test_a_failed_run_exits_non_zero():
    # the worker cannot import its model factory: the command must not end with 0
    res = run("spmd", "run", "--module", "hetplan.no_such_module:fn", "--cluster", "T4:1x2",
              "--nproc", "1", "--steps", "1")  # fmt: skip
    assert res.returncode != 0, res.stderr


def test_provision_names_the_dominated_offers(tmp_path):
    """An L4 offer beside a no dearer RTX 4090 offer (faster in every figure, same node):
    its configurations are left out, counted in the title and --json, and named on a line."""
    market = tmp_path / "market.yaml"
    market.write_text(
        "offers:\n"
        "  - {gpu: L4, gpus_per_node: 1, max_nodes: 2, on_demand_usd_per_gpu_hour: 0.8}\n"
        "  - {gpu: RTX 4090, gpus_per_node: 1, max_nodes: 2, on_demand_usd_per_gpu_hour: 0.6}\n"
    )
    args = ("provision", "--model", "gpt2", "--tokens", "1e9", "--market", str(market))
    res = run(*args, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["dominated_offers"] == [{"offer": "l4", "by": "rtx-4090"}]
    assert data["configurations_dominated"] == 2
    assert all("RTX 4090" in p["gpus"] for p in data["front"])
    text = run(*args)
    assert text.returncode == 0, text.stderr
    words = " ".join(text.stdout.split())  # the title wraps
    assert "2 left out as dominated by a better, no dearer offer" in words
    assert "dominated offers" in words and "l4 by rtx-4090" in words


def test_calibration_summary_reads_as_sentences():
    from hetplan.commands.calibrate import summary_text

    summary = {"n": 47, "mae_pct": 4.21, "max_pct": 10.04, "spearman": 0.9876, "loo": False,
               "first_pick": {"groups": 2, "best_picked": 1, "worst_ratio": 1.0432,
                              "worst_pick": "mb2 tp2", "worst_best": "mb1 tp4"},
               "oom_rows": 5, "oom_rows_flagged": 3, "measured_rows_flagged": 1}  # fmt: skip
    assert summary_text(summary, "in-sample") == (
        "in-sample over 47 runs: mean error 4.2%, worst 10.0%; rank correlation 0.988; "
        "first pick: the best in 1 of 2 groups (worst 1.043x the best: picked mb2 tp2, best "
        "mb1 tp4); 5 ran out of memory, 3 of them predicted not to fit; 1 measured run "
        "predicted not to fit"
    )
    two = {"n": 2, "mae_pct": 0.84, "max_pct": 0.87, "spearman": float("nan"),
           "first_pick": {"groups": 0}, "oom_rows": 0, "measured_rows_flagged": 0}  # fmt: skip
    assert summary_text(two, "cold leave-one-out") == (
        "cold leave-one-out over 2 runs: mean error 0.8%, worst 0.9%; rank correlation n/a "
        "(fewer than 3 runs); first pick: no group of comparable runs"
    )


def test_predict_fills_the_one_degree_left_out():
    """On 32 GPUs, --tp 8 --pp 4 is DP 1 and --pp 2 --dp 8 is TP 2 (micro-batch 1 unless
    given): the same predictions as the degrees written out; two left out, or a pair that
    does not divide the GPUs, is refused naming the option that is missing."""
    base = ("predict", "-m", "gpt3-1.3b", "-c", "A100-80GB:4x8", "--json")
    for short, full in (
        (("--tp", "8", "--pp", "4"), ("--tp", "8", "--pp", "4", "--dp", "1")),
        (("--pp", "2", "--dp", "8"), ("--tp", "2", "--pp", "2", "--dp", "8")),
    ):
        a, b = run(*base, *short), run(*base, *full, "--micro-batch-size", "1")
        assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
        ja, jb = json.loads(a.stdout), json.loads(b.stdout)
        assert ja["degrees"] == jb["degrees"]
        assert ja["iteration_time_s"] == jb["iteration_time_s"]
    two = run(*base, "--tp", "2")
    assert two.returncode == 2 and two.stderr.startswith("error: --pp: required without --plan")
    odd = run(*base, "--tp", "3", "--pp", "1")
    assert odd.returncode == 2 and "does not divide the 32 GPUs" in odd.stderr, odd.stderr


def test_launch_json_prints_the_per_node_commands_as_data(tmp_path):
    """A plan over two nodes, without --node-rank: the commands each node runs. With --json
    they were printed to stderr as text and stdout stayed empty; now one JSON object names
    each node with its argv, the rendezvous address left for the user to fill."""
    plan = tmp_path / "p.json"
    res = run("plan", "-m", "gpt3-1.3b", "-c", "A100-80GB:2x8", "--out", str(plan))
    assert res.returncode == 0, res.stderr
    res = run("launch", str(plan), "-m", "gpt3-1.3b", "-c", "A100-80GB:2x8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [n["node"] for n in data["nodes"]] == ["a100-80gb-0", "a100-80gb-1"]
    for rank, node in enumerate(data["nodes"]):
        assert node["argv"][0] == "torchrun" and f"--node-rank={rank}" in node["argv"]
        assert "--master-addr=MASTER_HOST" in node["argv"]
    assert data["master_addr"] == "MASTER_HOST" and data["predicted_step_time_s"] > 0


def test_the_plans_table_names_groups_other_than_the_stages():
    """10 micro-batches per replica on 4 stages run in 2 groups of 5: the schedule column
    says so; 8 (groups of 4, the stages) reads as before."""
    base = ("predict", "-m", "gpt3-1.3b", "-c", "A100-80GB:1x8", "--tp", "1", "--pp", "4",
            "--dp", "2", "--schedule", "Interleaved1F1B", "--virtual-stages", "2")  # fmt: skip
    flex = run(*base, "-b", "20")
    assert flex.returncode == 0, flex.stderr
    assert "Interleaved1F1B(v=2, groups of 5)" in flex.stdout
    even = run(*base, "-b", "16")
    assert even.returncode == 0, even.stderr
    assert "Interleaved1F1B(v=2)" in even.stdout and "groups of" not in even.stdout

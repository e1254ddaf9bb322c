"""--profile / $HETPLAN_PROFILE on the estimating commands, predict's plan flags, the TF32
note and provision's default precision, end to end through the CLI (in a subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.cost.compute import LayerTimes
from hetplan.cost.params import default_params
from hetplan.model import load_model

try:
    from hetplan.measured.profile_db import LayerRecord, ProfileDB, shape_key
except ImportError:  # before the move to hetplan.measured
    from hetplan.runtime.profile_db import LayerRecord, ProfileDB, shape_key

GPU = "A100-80GB"
CLUSTER = f"{GPU}:1x1"
FWD, BWD = 0.010, 0.020  # one layer, one micro-batch
EMBED = LayerTimes(0.001, 0.002, 0.0)
HEAD = LayerTimes(0.003, 0.004, 0.0)
OPT = {"layer": 0.0005, "embed": 0.0002, "head": 0.0003}
BATCH = 4
TINY_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
}


def run(*args, env=None, cwd=None):
    base = {k: v for k, v in os.environ.items() if k != "HETPLAN_PROFILE"}
    return subprocess.run(
        [sys.executable, "-m", "hetplan", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=120,
    )


@pytest.fixture
def tiny(tmp_path):
    """Returns (config.json path, profile path): a 2-layer model and a profile holding every
    piece of its step on one A100-80GB at tp 1, micro-batch 1, bf16."""
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_CONFIG))
    model = load_model(str(config))
    path = tmp_path / "profile.sqlite"
    db = ProfileDB(path)
    db.put(LayerRecord(GPU, shape_key(model), 1, 1, "bf16", LayerTimes(FWD, BWD, 0.001), 0.0, 1))
    db.put_part(GPU, model, "embed", 1, 1, "bf16", EMBED)
    db.put_part(GPU, model, "head", 1, 1, "bf16", HEAD)
    for part, step in OPT.items():
        db.put_optimizer(GPU, model, part, 1, "bf16", step, 0.0)
    return config, path


def predict_args(config, *extra):
    return (
        "predict",
        "--model",
        str(config),
        "--cluster",
        CLUSTER,
        "--tp",
        "1",
        "--pp",
        "1",
        "--dp",
        "1",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(BATCH),
        "--precision",
        "bf16",
        *extra,
    )


def test_missing_profile_exits_2_with_one_line_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing.sqlite"
    res = run("predict", "--model", "gpt2", "--cluster", CLUSTER, "--profile", str(missing))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--profile" in lines[0] and "no such file" in lines[0]
    assert "Traceback" not in res.stderr
    assert not missing.exists()
    # the same through the environment, on a search command
    res = run(
        "plan", "--model", "gpt2", "--cluster", CLUSTER, env={"HETPLAN_PROFILE": str(missing)}
    )
    assert res.returncode == 2 and "--profile" in res.stderr and "HETPLAN_PROFILE" in res.stderr
    assert not missing.exists()


def test_not_a_database_is_refused(tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not sqlite")
    res = run("predict", "--model", "gpt2", "--cluster", CLUSTER, "--profile", str(bogus))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.stderr and bogus.read_text() == "not sqlite"


def test_launch_and_profile_check_their_db_as_predict_does(tmp_path):
    """launch --profile (or its former name --db) names an existing profile (a missing one
    was ignored in silence, a text file a traceback); profile --out (or --db) adds to a
    database or creates it, never a text file; profile --reps is at least 1."""
    examples = Path(__file__).parent.parent / "examples"
    tiny = str(examples / "models" / "tiny-gpt" / "config.json")
    cpu2 = str(examples / "clusters" / "cpu2.yaml")
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not sqlite")
    runs = [
        (["launch", "p.json", "--model", tiny, "--cluster", cpu2, "--profile", str(bogus)],
         "--profile", "not an SQLite profile database"),
        (["launch", "p.json", "--model", tiny, "--cluster", cpu2, "--db", "none.sqlite"],
         "--profile", "no such file"),
        (["profile", "--device", "cpu", "--model", tiny, "--out", str(bogus)],
         "--out", "not an SQLite profile database"),
        (["profile", "--device", "cpu", "--model", tiny, "--db", str(bogus)],
         "--out", "not an SQLite profile database"),
        (["profile", "--device", "cpu", "--model", tiny, "--reps", "0"], "--reps", "at least one"),
    ]  # fmt: skip
    for args, option, reason in runs:
        res = run(*args)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {option}:") and reason in lines[0]
    assert bogus.read_text() == "not sqlite"


def test_env_profile_gives_the_hand_computed_iteration(tiny):
    config, path = tiny
    res = run(*predict_args(config, "--json"), env={"HETPLAN_PROFILE": str(path)})
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    # One stage holds both layers, the embedding and the head; no TP, no DP, no pipeline,
    # so the iteration is the micro-batches run back to back, then the optimizer step:
    #   micro-batch = layers * (fwd + bwd) + embed (fwd + bwd) + head (fwd + bwd)
    #                 + the fitted per-micro-batch overhead of the GPU type (v = 1 chunk)
    #   iteration   = global batch / micro-batch * micro-batch time
    #                 + layers * opt(layer) + opt(embed) + opt(head)     (ZeRO 0: 1 shard)
    overhead = default_params().gpu(GPU).microbatch_overhead_s
    micro = (
        2 * (FWD + BWD)
        + EMBED.forward_s
        + EMBED.backward_s
        + HEAD.forward_s
        + HEAD.backward_s
        + overhead
    )
    optimizer = 2 * OPT["layer"] + OPT["embed"] + OPT["head"]
    expected = BATCH * micro + optimizer
    assert data["iteration_time_s"] == pytest.approx(expected, rel=1e-9)
    assert data["compute_source"] == "measured"
    assert [s["compute_source"] for s in data["stages"]] == ["measured"]
    assert "warnings" in data and "peak_used" in data
    assert data["peak_used"][GPU].startswith("BF16 tensor cores")
    # the option wins over the environment; without a profile the estimate is analytical
    res = run(*predict_args(config, "--json", "--profile", str(path)))
    assert json.loads(res.stdout)["iteration_time_s"] == pytest.approx(expected, rel=1e-9)
    res = run(*predict_args(config, "--json"), env={"HETPLAN_PROFILE": ""})
    assert json.loads(res.stdout)["compute_source"] == "analytical"


def test_profile_reaches_plan_and_explain(tiny, tmp_path):
    config, path = tiny
    best = tmp_path / "best.json"
    res = run(
        "plan",
        "--model",
        str(config),
        "--cluster",
        CLUSTER,
        "-b",
        str(BATCH),
        "--json",
        "--out",
        str(best),
        "--profile",
        str(path),
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert "warnings" in data
    # the search ranks with the profile: every plan's compute comes from it (measured at
    # micro-batch 1, scaled by the profile elsewhere)
    assert all(p["compute_source"] != "analytical" for p in data["plans"])
    explain = ("explain", str(best), "--model", str(config), "--cluster", CLUSTER)
    res = run(*explain, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["stages"][0]["compute_source"] == "analytical"
    assert "warnings" in info and GPU in info["peak_used"]
    env = {"HETPLAN_PROFILE": str(path)}
    res = run(*explain, "--json", env=env)
    assert (
        json.loads(res.stdout)["stages"][0]["compute_source"] == data["plans"][0]["compute_source"]
    )
    res = run(*explain, env=env)
    assert res.returncode == 0, res.stderr
    assert "compute" in res.stdout and data["plans"][0]["compute_source"] in res.stdout


def test_predict_plan_flags_and_overrides_of_a_plan_file(tmp_path):
    args = ("--model", "gpt2", "--cluster", "A100-80GB:1x2")
    degrees = ("--tp", "2", "--pp", "1", "--dp", "1", "--micro-batch-size", "1", "-b", "4")
    res = run("predict", *args, *degrees, "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)["plan"]
    assert plan["flash_attention"] and not plan["overlap_tp_comm"]
    assert plan["overlap_grad_reduce"]
    res = run(
        "predict",
        *args,
        *degrees,
        "--no-flash-attention",
        "--overlap-tp-comm",
        "--no-overlap-grad-reduce",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    plan = data["plan"]
    assert not plan["flash_attention"] and plan["overlap_tp_comm"]
    assert not plan["overlap_grad_reduce"]
    # a plan file keeps its fields unless a flag is given explicitly
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    res = run("predict", *args, "--plan", str(path), "--json")
    assert json.loads(res.stdout)["plan"] == plan
    res = run("predict", *args, "--plan", str(path), "--flash-attention", "--zero-stage", "1")
    assert res.returncode == 0, res.stderr
    res = run(
        "predict", *args, "--plan", str(path), "--flash-attention", "--zero-stage", "1", "--json"
    )
    again = json.loads(res.stdout)["plan"]
    assert again["flash_attention"] and again["zero_stage"] == 1
    assert again["overlap_tp_comm"] and not again["overlap_grad_reduce"]
    # the micro-batch is overridden too; the degrees and batch shares are the file's: beside
    # it they are refused (they were once dropped in silence)
    res = run("predict", *args, "--plan", str(path), "--micro-batch-size", "2", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["plan"]["micro_batch_size"] == 2
    for flag, value in (("--tp", "1"), ("--pp", "2"), ("--dp", "2"), ("-b", "8"),
                        ("--micro-batch-size", "3")):  # fmt: skip
        res = run("predict", *args, "--plan", str(path), flag, value)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        name = "--global-batch-size" if flag == "-b" else flag
        assert lines[0].startswith(f"error: {name}:"), lines


def test_fp32_on_a100_prints_the_tf32_note_once():
    base = ("--model", "gpt2", "--cluster", CLUSTER, "--tp", "1", "--pp", "1", "--dp", "1")
    base += ("--micro-batch-size", "1", "-b", "4", "--precision")
    res = run("predict", *base, "fp32")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("note: fp32 uses the FP32 CUDA-core peak") == 1
    assert "--precision tf32" in res.stderr
    assert "FP32 CUDA cores" in res.stdout  # the peak the table is against
    res = run("predict", *base, "fp32", "--json")
    assert "note:" not in res.stderr and json.loads(res.stdout)["peak_used"]
    res = run("predict", *base, "tf32")
    assert "note:" not in res.stderr


@pytest.mark.parametrize(
    ("gpus", "expected"), [(["A100-80GB", "H100-80GB"], "bf16"), (["A100-80GB", "T4"], "fp16")]
)
def test_provision_default_precision_follows_the_market(tmp_path, gpus, expected):
    market = tmp_path / "market.yaml"
    offers = "\n".join(
        f"  - {{gpu: {g}, gpus_per_node: 8, max_nodes: 2, on_demand_usd_per_gpu_hour: 2.0}}"
        for g in gpus
    )
    market.write_text(f"offers:\n{offers}\n")
    res = run("provision", "--model", "gpt2", "--tokens", "1e9", "--market", str(market), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["precision"] == expected


def test_replan_reads_the_profile(tiny, tmp_path):
    config, path = tiny
    cluster = "A100-80GB:2x1"
    plan = tmp_path / "plan.json"
    args = ("--model", str(config), "--cluster", cluster)
    res = run("plan", *args, "-b", str(BATCH), "--out", str(plan), "--json")
    assert res.returncode == 0, res.stderr
    replan = ("replan", "--plan", str(plan), *args, "--lost", "a100-80gb-1", "--json")
    missing = tmp_path / "missing.sqlite"
    res = run(*replan, "--profile", str(missing))
    assert res.returncode == 2 and "--profile" in res.stderr and not missing.exists()
    without = json.loads(run(*replan).stdout)
    measured = json.loads(run(*replan, env={"HETPLAN_PROFILE": str(path)}).stdout)
    # the profile's layers (10 + 20 ms) are far slower than the analytical A100 ones
    assert measured["old_iteration_time_s"] > 2 * without["old_iteration_time_s"]
    assert measured["new_iteration_time_s"] > 2 * without["new_iteration_time_s"]


def test_calibrate_fits_with_the_profile(tmp_path):
    from hetplan.cost.runs import load_runs

    # ten of AMP's measured T4 trials (the shipped calibration file)
    amp = Path(__file__).resolve().parents[1] / "src/hetplan/data/calibration"
    lines = (amp / "amp_t4_homogeneous.csv").read_text().splitlines()
    runs = tmp_path / "runs.csv"
    runs.write_text("\n".join(lines[:11]) + "\n")
    first = load_runs(runs)[0]
    path = tmp_path / "profile.sqlite"
    db = ProfileDB(path)
    # a T4 layer measured 3x slower than anything the runs imply: the fit must change
    key = shape_key(first.model)
    db.put(LayerRecord("T4", key, 1, 1, "fp16", LayerTimes(0.5, 1.0, 0.01), 0.0, 1))
    plain = run("calibrate", "--runs", str(runs), "--json", "--no-loo")
    assert plain.returncode == 0, plain.stderr
    measured = run("calibrate", "--runs", str(runs), "--json", "--no-loo", "--profile", str(path))
    assert measured.returncode == 0, measured.stderr
    assert json.loads(measured.stdout) != json.loads(plain.stdout)
    missing = tmp_path / "missing.sqlite"
    res = run("calibrate", "--runs", str(runs), "--profile", str(missing))
    assert res.returncode == 2 and "--profile" in res.stderr and not missing.exists()


def test_launch_predicts_with_the_profile_named_as_predict_does(tiny, tmp_path):
    """launch's prediction beside the run reads the profile predict reads: --profile, else
    $HETPLAN_PROFILE, else none (it once read ~/.cache/hetplan/profile.sqlite unasked)."""
    from hetplan.cluster import parse_inline_cluster
    from hetplan.runtime.cli import predicted
    from hetplan.search.layout import uniform_plan

    config, path = tiny
    model, cluster = load_model(str(config)), parse_inline_cluster(CLUSTER)
    plan = uniform_plan(cluster, model.layers, 1, 1, 1, 1, BATCH, precision="bf16")
    overhead = default_params().gpu(GPU).microbatch_overhead_s
    micro = 2 * (FWD + BWD) + EMBED.forward_s + EMBED.backward_s + HEAD.forward_s
    micro += HEAD.backward_s + overhead
    expected = BATCH * micro + 2 * OPT["layer"] + OPT["embed"] + OPT["head"]
    est = predicted(plan, model, cluster, default_params().with_profile(ProfileDB(path)))
    assert est.iteration_time_s == pytest.approx(expected, rel=1e-9)
    assert predicted(plan, model, cluster, None).compute_source == "analytical"
    # the environment names it for launch as for predict: a missing file is refused
    missing = tmp_path / "gone.sqlite"
    examples = Path(__file__).parent.parent / "examples"
    res = run("launch", "p.json", "--model", str(examples / "models" / "tiny-gpt" / "config.json"),
              "--cluster", str(examples / "clusters" / "cpu2.yaml"),
              env={"HETPLAN_PROFILE": str(missing)})  # fmt: skip
    assert res.returncode == 2 and res.stderr.startswith("error: --profile: no such file")
    assert "HETPLAN_PROFILE" in res.stderr and not missing.exists()

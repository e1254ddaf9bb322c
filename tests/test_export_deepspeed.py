"""``export --format deepspeed`` writes only keys DeepSpeed documents; the parallel sizes it
cannot carry go to the Megatron-DeepSpeed launcher arguments."""

import itertools
import json
import subprocess
import sys

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.report.export import deepspeed_config, deepspeed_launch_args
from hetplan.search.layout import uniform_plan

# Top-level keys of https://www.deepspeed.ai/docs/config-json/ (typed from its sections:
# batch size, optimizer and scheduler, communication, FP16/BF16/AMP, gradient clipping,
# ZeRO, asynchronous I/O, logging, flops profiler, activation checkpointing, sparse
# attention, data efficiency, curriculum learning, monitoring, elasticity, compression,
# checkpointing and data types).
DOCUMENTED = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "fp16",
    "bf16",
    "amp",
    "gradient_clipping",
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "aio",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "flops_profiler",
    "activation_checkpointing",
    "sparse_attention",
    "data_efficiency",
    "curriculum_learning",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "elasticity",
    "compression_training",
    "checkpoint",
    "data_types",
    "autotuning",
}


def _plans():
    model = load_model("gpt3-1.3b")
    cl = parse_inline_cluster("V100-32GB:2x8")
    for tp, pp, zero, recompute, prec in itertools.product(
        (1, 2), (1, 2), (0, 1, 2, 3), ("none", "selective", "full"), ("fp16", "fp32")
    ):
        if zero >= 2 and pp > 1:
            continue
        dp = 16 // (tp * pp)
        yield model, uniform_plan(
            cl, model.layers, tp, pp, dp, 2, 64, precision=prec, zero_stage=zero,
            recompute=recompute, sequence_parallel=tp > 1,
        )  # fmt: skip


def test_every_top_level_key_is_documented():
    seen = set()
    for model, plan in _plans():
        cfg = deepspeed_config(plan, model)
        assert set(cfg) <= DOCUMENTED, set(cfg) - DOCUMENTED
        seen |= set(cfg)
        json.dumps(cfg)  # JSON-serialisable, no None placeholders
        assert None not in cfg.values()
    assert {"fp16", "activation_checkpointing", "zero_optimization"} <= seen


def test_batch_arithmetic_by_hand():
    # 64 sequences over DP 4 (TP 2, PP 2 on 16 GPUs) in micro-batches of 2: 8 steps each
    model = load_model("gpt3-1.3b")
    plan = uniform_plan(parse_inline_cluster("V100-32GB:2x8"), model.layers, 2, 2, 4, 2, 64,
                        precision="fp16", zero_stage=1, recompute="full")  # fmt: skip
    cfg = deepspeed_config(plan, model)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (64, 2)
    assert cfg["gradient_accumulation_steps"] == 8
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["activation_checkpointing"]["number_checkpoints"] == 24
    args = deepspeed_launch_args(plan, "ds.json")
    assert args[:4] == [
        "--deepspeed",
        "--deepspeed_config=ds.json",
        "--tensor-model-parallel-size=2",
        "--pipeline-model-parallel-size=2",
    ]
    assert "--checkpoint-activations" in args and "--no-pipeline-parallel" not in args


def test_uneven_stages_are_refused_with_their_layers():
    model = load_model("gpt2-medium")
    plan = Plan(
        global_batch_size=8,
        micro_batch_size=1,
        precision="fp16",
        pipelines=(Pipeline(8, (Stage(10, ("a:0",)), Stage(14, ("a:1",)))),),
    )
    with pytest.raises(InputError, match="10, 14 layers"):
        deepspeed_config(plan, model)


def test_cli_writes_the_config_and_names_the_launcher_arguments(tmp_path):
    model = load_model("gpt3-1.3b")
    plan = uniform_plan(parse_inline_cluster("A100-80GB:1x8"), model.layers, 2, 1, 4, 1, 32,
                        precision="bf16", zero_stage=2)  # fmt: skip
    plan_file, out = tmp_path / "plan.json", tmp_path / "ds_config.json"
    plan.save(plan_file)
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "export", str(plan_file), "--model", "gpt3-1.3b",
         "--format", "deepspeed", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    cfg = json.loads(out.read_text())
    assert set(cfg) <= DOCUMENTED and cfg["bf16"] == {"enabled": True}
    assert cfg["gradient_accumulation_steps"] == 32 // 4
    assert f"--deepspeed_config={out}" in res.stderr
    assert "--tensor-model-parallel-size=2" in res.stderr

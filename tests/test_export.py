from dataclasses import replace

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.report.export import deepspeed_config, megatron_args
from hetplan.search.layout import uniform_plan


def test_megatron_arguments_follow_the_plan():
    model = load_model("llama2-13b")
    cl = parse_inline_cluster("A100-80GB:4x8")
    plan = uniform_plan(
        cl,
        model.layers,
        4,
        2,
        4,
        1,
        256,
        precision="bf16",
        schedule="Interleaved1F1B",
        virtual_stages=2,
        sequence_parallel=True,
        recompute="full",
        zero_stage=1,
    )
    args = megatron_args(plan, model)
    for expected in (
        "--tensor-model-parallel-size=4",
        "--pipeline-model-parallel-size=2",
        "--micro-batch-size=1",
        "--global-batch-size=256",
        "--bf16",
        "--swiglu",
        "--num-layers-per-virtual-pipeline-stage=10",
        "--sequence-parallel",
        "--recompute-granularity=full",
        "--use-distributed-optimizer",
    ):
        assert expected in args
    assert "--group-query-attention" not in args  # Llama-2 13B has as many kv heads as heads


def test_deepspeed_config_accumulates_the_rest_of_the_batch():
    model = load_model("gpt3-1.3b")
    cl = parse_inline_cluster("V100-32GB:1x8")
    plan = uniform_plan(cl, model.layers, 1, 1, 8, 2, 64, precision="fp16", zero_stage=2)
    cfg = deepspeed_config(plan, model)
    assert cfg["train_batch_size"] == 64
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 8 == 64
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["fp16"]["enabled"]


def test_asymmetric_plans_are_refused():
    model = load_model("gpt2-medium")
    plan = Plan(
        global_batch_size=16,
        micro_batch_size=1,
        precision="fp16",
        pipelines=(
            Pipeline(12, (Stage(24, ("a:0",)),)),
            Pipeline(4, (Stage(10, ("b:0",)), Stage(14, ("b:1",)))),
        ),
    )
    with pytest.raises(InputError, match="symmetric"):
        megatron_args(plan, model)
    with pytest.raises(InputError, match="symmetric"):
        deepspeed_config(plan, model)


def test_stages_of_different_tensor_parallel_degrees_are_refused():
    # the heterogeneous search's plans may give each stage its own TP degree (16 replicas of
    # TP 1, 1, 2 on the mixed 64-GPU cluster); Megatron-LM and DeepSpeed take one degree
    model = load_model("gpt3-6.7b")
    stages = (Stage(21, ("a:0",)), Stage(9, ("b:0",)), Stage(2, ("c:0", "c:1")))
    plan = Plan(global_batch_size=8, micro_batch_size=1, precision="fp16",
                pipelines=(Pipeline(8, stages),), sequence_parallel=True)  # fmt: skip
    for export in (megatron_args, deepspeed_config):
        with pytest.raises(InputError, match=r"one tensor-parallel degree.*TP 1, 1, 2"):
            export(plan, model)
    # one degree on every stage exports; sequence parallelism only where TP splits
    even = replace(plan, pipelines=(Pipeline(8, tuple(Stage(n, ("a:0", "a:1")) for n in
                                                      (11, 11, 10))),))  # fmt: skip
    assert "--tensor-model-parallel-size=2" in megatron_args(even, model)
    assert "--sequence-parallel" in megatron_args(even, model)
    one = replace(plan, pipelines=(Pipeline(8, (Stage(32, ("a:0",)),)),))
    assert "--sequence-parallel" not in megatron_args(one, model)


def test_distributed_optimizer_gathers_parameters_under_compute_only_when_it_reduces_so():
    """The model hides ZeRO-1's parameter all-gather behind compute when the plan overlaps
    the gradient reduction; Megatron-Core does that only with --overlap-param-gather, and
    without sharding the flag has nothing to gather."""
    model = load_model("gpt3-1.3b")
    cl = parse_inline_cluster("A100-80GB:2x8")
    sharded = uniform_plan(cl, model.layers, 2, 1, 8, 1, 64, zero_stage=1)
    args = megatron_args(sharded, model)
    assert "--overlap-grad-reduce" in args and "--overlap-param-gather" in args
    plain = uniform_plan(cl, model.layers, 2, 1, 8, 1, 64, zero_stage=0)
    assert "--overlap-param-gather" not in megatron_args(plain, model)
    blocking = replace(sharded, overlap_grad_reduce=False)
    assert "--overlap-param-gather" not in megatron_args(blocking, model)


def test_export_refuses_a_plan_whose_layers_are_not_the_models(tmp_path):
    """30 layers for a 32-layer model: export wrote --num-layers=32 beside first/last stages
    of 10 and 20; the model alone says no (one line, exit 2, nothing written)."""
    import json
    import subprocess
    import sys

    plan = tmp_path / "bad.json"
    stages = [{"layers": 10, "devices": ["a100-0:0"]}, {"layers": 20, "devices": ["a100-0:1"]}]
    plan.write_text(json.dumps({"global_batch_size": 8,
                                "pipelines": [{"batch_size": 8, "stages": stages}]}))  # fmt: skip
    out = tmp_path / "args.sh"
    cmd = [sys.executable, "-m", "hetplan", "export", str(plan), "-m", "gpt3-6.7b"]
    cmd += ["--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    want = "error: pipelines[0].stages: layers sum to 30, but gpt3-6.7b has 32"
    assert res.stderr.strip() == want
    assert not out.exists()


def test_megatron_groups_micro_batches_as_the_plan_was_costed():
    """gpt3-1.3b on 32 GPUs, PP 4 x DP 8, interleaved in 2 chunks: a batch of 80 is 10
    micro-batches per replica, run in 2 groups of 5 (Megatron-Core's default group is the
    4 stages, which 10 does not fill); a batch of 64 (8 each) keeps the default, unwritten."""
    model = load_model("gpt3-1.3b")
    cl = parse_inline_cluster("A100-80GB:4x8")

    def args(batch: int) -> list[str]:
        plan = uniform_plan(cl, model.layers, 1, 4, 8, 1, batch, schedule="Interleaved1F1B",
                            virtual_stages=2)  # fmt: skip
        return megatron_args(plan, model)

    assert "--microbatch-group-size-per-virtual-pipeline-stage=5" in args(80)
    assert not any("microbatch-group-size" in a for a in args(64))


def test_megatron_states_heads_of_another_width():
    """Megatron-LM takes the head width as --kv-channels (default hidden / heads)."""
    from hetplan.model import ModelSpec

    wide = ModelSpec("wide", "llama", 4, 1024, 16, 4, 2816, 32000, 2048, attn_head_dim=128)
    cl = parse_inline_cluster("A100-80GB:1x8")
    plan = uniform_plan(cl, wide.layers, 2, 1, 4, 1, 64)
    assert "--kv-channels=128" in megatron_args(plan, wide)
    plain = replace(wide, attn_head_dim=0)
    assert not any("kv-channels" in a for a in megatron_args(plan, plain))

"""Exports a plan to the settings of Megatron-LM and DeepSpeed.

Both frameworks run symmetric plans only (every replica the same stages on the same kind of
GPU, equal batch shares); an asymmetric plan is refused with the reason, not approximated.
"""

from __future__ import annotations

from typing import Any

from hetplan.chunk_layout import format_megatron_layout
from hetplan.cost.schedule import interleave_group
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan


def _require_uniform(plan: Plan, target: str) -> tuple[int, int, int]:
    if not plan.is_uniform():
        raise InputError(
            "plan",
            f"{target} runs only symmetric plans; this one has replicas with different "
            "stages or batch shares (run it with `hetplan launch`)",
        )
    first = plan.pipelines[0]
    tps = [s.tp for s in first.stages]
    if len(set(tps)) > 1:  # one --tensor-model-parallel-size for the whole model
        raise InputError(
            "plan",
            f"{target} runs one tensor-parallel degree on every stage; this plan's stages "
            f"use TP {', '.join(map(str, tps))} (run it with `hetplan launch`)",
        )
    return tps[0], len(first.stages), plan.dp


def megatron_args(plan: Plan, model: ModelSpec) -> list[str]:
    """Returns Megatron-LM command-line arguments for the plan and model."""
    tp, pp, dp = _require_uniform(plan, "Megatron-LM")
    layers = [s.layers for s in plan.pipelines[0].stages]
    args = [
        f"--tensor-model-parallel-size={tp}",
        f"--pipeline-model-parallel-size={pp}",
        f"--micro-batch-size={plan.micro_batch_size}",
        f"--global-batch-size={plan.global_batch_size}",
        f"--num-layers={model.layers}",
        f"--hidden-size={model.hidden}",
        f"--num-attention-heads={model.heads}",
        f"--ffn-hidden-size={model.ffn}",
        f"--seq-length={model.seq}",
        f"--max-position-embeddings={model.seq}",
        f"--{plan.precision}" if plan.precision in ("bf16", "fp16") else "",
    ]
    if model.kv_heads != model.heads:
        args += ["--group-query-attention", f"--num-query-groups={model.kv_heads}"]
    if model.attn_head_dim:  # heads of another width than hidden / heads
        args.append(f"--kv-channels={model.head_dim}")
    if model.family == "llama":
        args += [
            "--swiglu",
            "--normalization=RMSNorm",
            "--position-embedding-type=rope",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
        ]
    v = plan.virtual_stages if plan.schedule == "Interleaved1F1B" else 1
    chunks = [s.chunk_layers(v) for s in plan.pipelines[0].stages]
    even_chunks = len({n for ch in chunks for n in ch}) == 1
    middle = layers[1:-1]
    if v > 1 and even_chunks:
        args.append(f"--num-layers-per-virtual-pipeline-stage={chunks[0][0]}")
    elif len(set(layers)) > 1 and len(set(middle)) <= 1 and pp > 1 and v == 1:
        # Megatron-Core places uneven first/last stages with these two flags
        args += [
            f"--decoder-first-pipeline-num-layers={layers[0]}",
            f"--decoder-last-pipeline-num-layers={layers[-1]}",
        ]
    elif len(set(layers)) > 1 or not even_chunks:
        # any other layout: Megatron-Core's layout string (virtual stages in order)
        args.append(f"--pipeline-model-parallel-layout={format_megatron_layout(chunks)}")
    m = plan.num_micro_batches(plan.pipelines[0])
    if v > 1 and interleave_group(pp, m) != pp:
        # micro-batches through each chunk in groups other than the stages (Megatron-Core's
        # default group): as the plan was costed and as PyTorch's schedule groups them
        args.append(f"--microbatch-group-size-per-virtual-pipeline-stage={interleave_group(pp, m)}")
    if plan.schedule == "GPipe" and pp > 1:
        raise InputError("schedule", "Megatron-LM has no GPipe schedule (use 1F1B)")
    if plan.recompute == "full":
        args += [
            "--recompute-granularity=full",
            "--recompute-method=uniform",
            "--recompute-num-layers=1",
        ]
    elif plan.recompute == "selective":
        args.append("--recompute-granularity=selective")
    if plan.sequence_parallel and tp > 1:  # nothing to split the sequence over at TP 1
        args.append("--sequence-parallel")
    if plan.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif plan.zero_stage > 1:
        raise InputError(
            "zero_stage",
            f"Megatron-LM shards only optimizer states (ZeRO-1), "
            f"not ZeRO-{plan.zero_stage}; export to DeepSpeed instead",
        )
    if plan.flash_attention:
        args.append("--use-flash-attn")
    if plan.overlap_grad_reduce and dp > 1:
        args.append("--overlap-grad-reduce")
        if plan.zero_stage == 1:
            # the model hides the sharded parameters' all-gather behind compute, which
            # Megatron-Core does only with this flag (under the next step's forward)
            args.append("--overlap-param-gather")
    if plan.overlap_tp_comm and tp > 1:
        args.append("--tp-comm-overlap")
    return [a for a in args if a]


DEEPSPEED_TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "activation_checkpointing",
        "gradient_clipping",
        "fp16",
        "bf16",
    }
)
"""The keys ``deepspeed_config`` may write: all documented at deepspeed.ai/docs/config-json."""


def _deepspeed_layers(plan: Plan) -> list[int]:
    layers = [s.layers for s in plan.pipelines[0].stages]
    if len(set(layers)) > 1:
        raise InputError(
            "plan",
            f"DeepSpeed's pipeline engine splits layers evenly or by parameter count; this "
            f"plan's stages hold {', '.join(map(str, layers))} layers",
        )
    return layers


def deepspeed_config(plan: Plan, model: ModelSpec) -> dict[str, Any]:
    """Returns a DeepSpeed JSON configuration for the plan: only keys DeepSpeed documents
    (``DEEPSPEED_TOP_LEVEL_KEYS``). DeepSpeed takes the tensor- and pipeline-parallel sizes
    from the launcher, not from this file: ``deepspeed_launch_args`` gives them."""
    _, pp, dp = _require_uniform(plan, "DeepSpeed")
    if plan.zero_stage >= 2 and pp > 1:
        raise InputError("zero_stage", "DeepSpeed runs ZeRO-2/3 without pipeline parallelism")
    if plan.schedule == "Interleaved1F1B":
        raise InputError("schedule", "DeepSpeed's pipeline engine has no interleaved schedule")
    _deepspeed_layers(plan)
    per_replica = plan.global_batch_size // dp
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": per_replica // plan.micro_batch_size,
        "zero_optimization": {
            "stage": plan.zero_stage,
            "overlap_comm": plan.overlap_grad_reduce,
            "contiguous_gradients": True,
        },
        "gradient_clipping": 1.0,
    }
    if plan.recompute != "none":
        config["activation_checkpointing"] = {
            "partition_activations": plan.sequence_parallel,
            "contiguous_memory_optimization": False,
            "number_checkpoints": model.layers,
        }
    if plan.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def deepspeed_launch_args(plan: Plan, config_path: str) -> list[str]:
    """Returns the Megatron-DeepSpeed arguments that carry what a DeepSpeed configuration
    cannot: the parallel sizes and recomputation, with the configuration's path."""
    tp, pp, _ = _require_uniform(plan, "DeepSpeed")
    args = [
        "--deepspeed",
        f"--deepspeed_config={config_path}",
        f"--tensor-model-parallel-size={tp}",
        f"--pipeline-model-parallel-size={pp}",
    ]
    if pp == 1:
        args.append("--no-pipeline-parallel")
    args.append(f"--zero-stage={plan.zero_stage}")
    if plan.recompute == "full":
        args += ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
    elif plan.recompute == "selective":
        args.append("--recompute-granularity=selective")
    if plan.sequence_parallel and tp > 1:  # nothing to split the sequence over at TP 1
        args.append("--sequence-parallel")
    return args

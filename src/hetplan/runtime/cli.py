"""The ``launch`` and ``profile`` commands; the main CLI adds them with ``register(app)``."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hetplan.commands.options import PROFILE_ENV, PlanArg, PlanOpt, SeqOpt, plan_file
from hetplan.errors import InputError, shown
from hetplan.outputs import json_text
from hetplan.report.table import plan_label
from hetplan.runtime.config import RunConfig


def predicted(plan: Any, model: Any, cluster: Any, params: Any = None) -> Any:
    """Returns ``estimate`` of the plan as this runtime runs it, with the cost-model
    ``params`` (``commands.common.load_cost``: a measured profile's times first; None: the
    shipped fit, analytical), as ``predict`` with the same ``--params`` and ``--profile``."""
    from hetplan.cost.estimate import estimate

    # this runtime reduces gradients after the pipeline step, never under the backward,
    # and does not overlap TP collectives with matmuls
    ran = replace(plan, overlap_grad_reduce=False, overlap_tp_comm=False)
    return estimate(ran, model, cluster, params)


def overlap_notes(plan: Any) -> list[str]:
    """Returns one line per overlap the plan asks for that this runtime does not run (the
    run goes on without it, and the prediction it reports is made without it)."""
    notes = []
    if plan.overlap_grad_reduce and plan.dp > 1:
        notes.append(
            "overlap_grad_reduce: this runtime reduces gradients after the backward; "
            "run and prediction are without the overlap"
        )
    if plan.overlap_tp_comm and any(s.tp > 1 for p in plan.pipelines for s in p.stages):
        notes.append(
            "overlap_tp_comm: this runtime does not overlap TP collectives with the matmuls; "
            "run and prediction are without the overlap"
        )
    return notes


def launch(
    plan_arg: PlanArg = None,
    *,
    model: Annotated[str, typer.Option("--model", "-m", help="Catalog name or config.json.")],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster file or inline spec.")],
    plan_opt: PlanOpt = None,
    steps: Annotated[int, typer.Option(help="Train until this step.")] = 10,
    data: Annotated[
        Path | None,
        typer.Option(help="Token file (.bin uint16, .u32, .npy) or text read as bytes."),
    ] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Checkpoint directory.")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Save every K steps (0: at end).")] = 0,
    resume: Annotated[bool, typer.Option(help="Resume from --checkpoint-dir.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of initialisation and data.")] = 0,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate.")] = 1e-3,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.1,
    grad_clip: Annotated[float, typer.Option(help="Clip the global gradient norm (0: off).")] = 1.0,
    lr_warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 0,
    lr_decay_steps: Annotated[
        int, typer.Option(help="Cosine decay until this step (0: constant after warm-up).")
    ] = 0,
    min_lr_ratio: Annotated[float, typer.Option(help="Final learning rate / peak.")] = 0.1,
    dropout: Annotated[float, typer.Option(help="Hidden dropout probability.")] = 0.0,
    keep: Annotated[int, typer.Option(help="Checkpoints to keep (0: all).")] = 0,
    allow_batch_change: Annotated[
        bool, typer.Option("--allow-batch-change", help="Resume with another global batch.")
    ] = False,
    threads: Annotated[int, typer.Option(help="Threads per process (0: torch default).")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    nnodes: Annotated[int | None, typer.Option(help="Nodes (default: as the plan uses).")] = None,
    node_rank: Annotated[int | None, typer.Option(help="Run this node's ranks.")] = None,
    master_addr: Annotated[str | None, typer.Option(help="Rendezvous host (multi-node).")] = None,
    master_port: Annotated[int, typer.Option(help="Rendezvous port (multi-node).")] = 29500,
    profile_path: Annotated[
        Path | None,
        typer.Option(
            "--profile",
            "--db",
            help=f"Measured profile database (SQLite) for the prediction beside the run, as "
            f"predict's; --db is its former name (default: ${PROFILE_ENV}, else none)",
            show_default=False,
        ),
    ] = None,
    params_path: Annotated[
        Path | None,
        typer.Option("--params", help="Cost-model parameters (hetplan calibrate)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    elastic: Annotated[bool, typer.Option(help="Replan and recover on preemption.")] = False,
    local_dir: Annotated[Path | None, typer.Option(help="Node-local checkpoint disks.")] = None,
    storage: Annotated[str | None, typer.Option(help="Shard store: directory or URL.")] = None,
    init_from: Annotated[
        Path | None,
        typer.Option(help="Hugging Face model folder (config.json + safetensors) to start from."),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Override the sequence length")
    ] = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="Override the plan's fp32, tf32, bf16 or fp16")
    ] = None,
    recompute: Annotated[
        str | None, typer.Option("--recompute", help="Override: none, selective or full")
    ] = None,
    zero_stage: Annotated[
        int | None, typer.Option("--zero-stage", help="Override: 0, 1, 2 or 3")
    ] = None,
    sequence_parallel: Annotated[
        bool | None,
        typer.Option("--sequence-parallel/--no-sequence-parallel", help="Override the plan's"),
    ] = None,
    flash_attention: Annotated[
        bool | None,
        typer.Option("--flash-attention/--no-flash-attention", help="Override the plan's"),
    ] = None,
) -> None:
    """Train a real model under the plan with torchrun (one machine) or print per-node commands.

    The plan options given explicitly override the plan file's fields, as in `predict`."""
    from hetplan.runtime.launch import (
        check_host_memory,
        format_command,
        launcher,
        node_commands,
        preflight,
        run_command,
        run_ranks,
    )
    from hetplan.runtime.support import resolve_device

    if seq_len is not None and seq_len <= 0:
        raise InputError("--seq-len", "must be positive")
    from hetplan.commands.common import load_cost

    # read before anything starts, as predict reads them: a profile named must be one
    params = load_cost(params_path, profile_path)
    plan, named = plan_file(plan_arg, plan_opt)
    assert plan is not None
    if seq_len is None:  # the sequence length the plan was made for, where its file says
        from hetplan.plan import load_plan

        made_for = load_plan(plan, option=named).model
        seq_len = None if made_for is None else made_for.seq
    tmp_plan = tempfile.TemporaryDirectory(prefix="hetplan-plan-")
    plan = _override_plan(
        plan,
        Path(tmp_plan.name),
        precision=precision,
        recompute=recompute,
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
        flash_attention=flash_attention,
    )
    cfg = RunConfig(
        plan=str(plan),
        model=model,
        cluster=cluster,
        steps=steps,
        seed=seed,
        data=str(data) if data else None,
        checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
        checkpoint_every=checkpoint_every,
        resume=resume,
        threads=threads,
        lr=lr,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        min_lr_ratio=min_lr_ratio,
        dropout=dropout,
        keep=keep,
        allow_batch_change=allow_batch_change,
        seq_len=seq_len or 0,
        device=device,
        progress=not as_json,
        local_dir=str(local_dir) if local_dir else None,
        storage=storage,
        init_from=str(init_from) if init_from else None,
    )
    if elastic:
        from hetplan.elastic.cli import storage_bandwidth_bytes_per_s
        from hetplan.elastic.elastic_run import run_elastic

        if not (local_dir and storage and checkpoint_every):
            raise InputError("--elastic", "needs --local-dir, --storage and --checkpoint-every")
        cfg = replace(cfg, progress=False)
        try:
            rec = run_elastic(cfg, storage_bandwidth_bytes_per_s(cluster, None), params=params)
        except RuntimeError as exc:
            raise typer.Exit(_fail(str(exc))) from None
        typer.echo(
            json_text(rec)
            if as_json
            else f"finished at step {rec['final_step']}, {len(rec['recoveries'])} recoveries"
        )
        return
    checked = preflight(cfg)
    console = Console(stderr=as_json)
    est = predicted(checked.plan, checked.model, checked.cluster, params)
    est.require_fit(named)  # refused before any process starts, as predict refuses it
    pred_step, source = est.iteration_time_s, est.compute_source
    notes = overlap_notes(checked.plan)
    for note in notes:
        console.print(f"note: {note}", highlight=False)
    multi = len(checked.nodes) > 1
    if nnodes is not None and nnodes != len(checked.nodes):
        raise InputError("--nnodes", f"the plan uses {len(checked.nodes)} nodes, not {nnodes}")
    if multi and (node_rank is None or master_addr is None):
        per_node = node_commands(cfg, checked, master_addr or "MASTER_HOST", master_port)
        if as_json:  # the commands as data: one object on stdout, as every --json prints
            typer.echo(json_text({
                "nodes": [{"node": node, "argv": cmd, "command": format_command(cmd)}
                          for node, cmd in per_node],
                "master_addr": master_addr or "MASTER_HOST",
                "master_port": master_port,
                "predicted_step_time_s": pred_step,
                "notes": notes,
            }))  # fmt: skip
            return
        for node, cmd in per_node:
            console.print(f"# on {node}")
            console.print(format_command(cmd), soft_wrap=True, highlight=False)
        return
    with tempfile.TemporaryDirectory(prefix="hetplan-run-") as tmp:
        cfg = replace(cfg, result=str(Path(tmp) / "result.json"))
        here = checked.devices
        rank0 = not multi or node_rank == 0  # rank 0 runs here and writes the record
        if multi:
            assert master_addr is not None and node_rank is not None
            cmds = node_commands(cfg, checked, master_addr, master_port)
            if not 0 <= node_rank < len(cmds):
                raise InputError("--node-rank", f"must be in [0, {len(cmds)})")
            cmd = cmds[node_rank][1]
            cmd[0:1] = launcher()  # this node's ranks, as torchrun would start them
            here = [d for d in here if d.rpartition(":")[0] == cmds[node_rank][0]]
        if resolve_device(device) == "cpu":  # the ranks share this machine's memory
            tensors = {d: s.memory.total - s.memory.reserve for s in est.stages
                       for d in s.devices}  # fmt: skip
            check_host_memory(tensors, here)
        try:
            if multi:
                record = run_command(cmd, cfg, timeout_s=None, rank0=rank0)
            else:  # every rank forked from this process (torchrun's agent, no launcher)
                record = run_ranks(cfg, len(checked.devices), timeout_s=None)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            raise typer.Exit(_fail(str(exc))) from None
    if not rank0:  # another node's ranks: rank 0, on node rank 0, reports the run
        first = next(iter(checked.nodes))
        if as_json:
            typer.echo(json_text({"node_rank": node_rank, "ranks": len(here),
                                  "reported_by": first}))  # fmt: skip
        else:
            ranks = f"{len(here)} rank" + ("s" if len(here) != 1 else "")
            console.print(f"this node's {ranks} finished; {first} (node rank 0) reports the "
                          "run's figures", highlight=False)  # fmt: skip
        return
    record["predicted_step_time_s"] = pred_step
    record["predicted_tokens_per_s"] = est.tokens_per_s
    record["predicted_peak_memory_bytes"] = est.peak_memory_bytes
    record["compute_source"] = source
    record["notes"] = notes
    ran = checked.plan  # what ran: every field honoured or refused before the start
    record["ran"] = {"plan": plan_label(ran), "precision": ran.precision,
                     "sequence_parallel": ran.sequence_parallel,
                     "flash_attention": ran.flash_attention}  # fmt: skip
    if as_json:
        typer.echo(json_text(record))
        return
    measured = record.get("measured_step_time_s")
    if measured:
        extras = ", sequence parallel" if ran.sequence_parallel else ""
        extras += "" if ran.flash_attention else ", no flash attention"
        console.print(f"ran {plan_label(ran)}, {ran.precision}{extras}", highlight=False)
        console.print(
            f"measured step {measured:.4f} s, predicted {pred_step:.4f} s ({source} compute), "
            f"final loss {record['steps'][-1]['loss']:.4f}"
        )


def _fail(message: str) -> int:
    """Prints why training failed, on one line (stderr), and returns the exit code."""
    typer.echo(" ".join(message.split()), err=True)
    return 1


def _override_plan(path: Path, tmp: Path, **fields: Any) -> Path:
    """Returns ``path``, or a copy of the plan in ``tmp`` with the given fields replaced."""
    from hetplan.plan import load_plan

    knobs = {k: v for k, v in fields.items() if v is not None}
    if not knobs:
        return path
    plan = replace(load_plan(path, option="PLAN"), **knobs)
    out = tmp / path.name
    plan.save(out)
    return out


def profile(
    ctx: typer.Context,
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Catalog name or config.json.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    name: Annotated[str | None, typer.Option(help="Device type name (default cpu/GPU).")] = None,
    micro_batch_sizes: Annotated[str, typer.Option(help="Comma-separated.")] = "1,2,4",
    tp: Annotated[str, typer.Option(help="Comma-separated TP degrees.")] = "1",
    threads: Annotated[int, typer.Option(help="Threads (0: torch default).")] = 0,
    reps: Annotated[int, typer.Option(help="Timed repetitions (median).")] = 5,
    precision: Annotated[
        str,
        typer.Option(
            help="Comma-separated: fp32, tf32, bf16, fp16, each timed as the runtime runs it."
        ),
    ] = "fp32",
    db: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            "--db",
            help="Profile database to add the rows to, created if missing, as profile "
            "import's; --db is its former name (default: ~/.cache/hetplan/profile.sqlite)",
            show_default=False,
        ),
    ] = None,
    links: Annotated[
        bool,
        typer.Option(
            "--links",
            help="CPU: also measure gloo p2p, all-reduce, all-gather, reduce-scatter and "
            "pipelining overheads.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    seq_len: SeqOpt = None,
) -> None:
    """Time each layer's forward and backward on this device into the profile database
    (without a subcommand); ``import`` and ``show`` handle measured profiles."""
    if ctx.invoked_subcommand is not None:
        return
    if model is None:
        raise InputError("--model", "required to profile this device (or: profile import/show)")
    from hetplan.measured.profile_db import ProfileDB
    from hetplan.model import load_model

    spec = load_model(model, seq_len)
    if reps < 1:
        raise InputError("--reps", f"{reps}: at least one timed repetition")
    if db is not None and db.exists():  # added to: it must be a profile database
        from hetplan.commands.common import open_profile

        open_profile(db, "--out")
    mbs, tps = _ints(micro_batch_sizes, "--micro-batch-sizes"), _ints(tp, "--tp")
    for t in tps:
        if spec.heads % t or spec.kv_heads % t or spec.ffn % t:
            raise InputError("--tp", f"{t} does not divide the heads, kv heads and ffn")
    import torch

    from hetplan.runtime.profile import PRECISIONS, profile_model

    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError("--device", f"{shown(device)}: use cpu or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device", "CUDA is not available on this machine")
    precisions = tuple(dict.fromkeys(p.strip() for p in precision.split(",") if p.strip()))
    for p in precisions:
        if p not in PRECISIONS:
            raise InputError("--precision", f"{shown(p)}: use {', '.join(PRECISIONS)}")
    if not precisions:
        raise InputError("--precision", "name at least one of " + ", ".join(PRECISIONS))
    cuda_no_bf16 = device.startswith("cuda") and not torch.cuda.is_bf16_supported()
    if "bf16" in precisions and cuda_no_bf16:
        raise InputError("--precision", "bf16: this GPU has no bfloat16 support; use fp16")
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    label = name or ("cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev))
    store = ProfileDB(db)
    if links and dev.type != "cpu":
        raise InputError("--links", "the link measurement runs on the CPU (gloo) only")
    rates: dict[str, float] = {}
    records = profile_model(
        store, label, spec, mbs, tps, dev, reps, links=links, precisions=precisions, rates=rates
    )
    figures = store.device_figures(label)
    if as_json:
        rows = [
            {
                "device": r.device,
                "precision": r.precision,
                "tp": r.tp,
                "micro_batch": r.micro_batch,
                "forward_s": r.times.forward_s,
                "backward_s": r.times.backward_s,
                "activation_bytes": r.activation_bytes,
            }
            for r in records
        ]
        typer.echo(json_text({"db": str(store.path), "layers": rows, "device": figures}))
        return
    table = Table(title=f"{spec.name} layer on {label} ({store.path})")
    for col in ("precision", "tp", "micro-batch", "forward ms", "backward ms", "activations MB"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            r.precision,
            str(r.tp),
            str(r.micro_batch),
            f"{r.times.forward_s * 1e3:.3f}",
            f"{r.times.backward_s * 1e3:.3f}",
            f"{r.activation_bytes / 1e6:.2f}",
        )
    console = Console()
    console.print(table)
    console.print(f"plan, predict and launch use these times with --profile {store.path} "
                  f"(or ${PROFILE_ENV})", highlight=False, soft_wrap=True)  # fmt: skip
    if figures:
        console.print(cluster_entry_hint(label, figures, rates), highlight=False)


def cluster_entry_hint(label: str, figures: tuple[float, float], rates: dict[str, float]) -> str:
    """Returns the ``gpu_types`` entry a cluster file can take from a profile: the fp32
    matmul rate and memory bandwidth measured, and each low precision's matmul rate where
    it was profiled (``--precision``). A cluster file needs an fp16 or bf16 rate: where
    neither was measured the entry says so rather than repeat the fp32 figure."""
    keys = {"tf32": "tf32_tflops", "bf16": "bf16_tflops", "fp16": "fp16_tflops"}
    parts = [f"fp32_tflops: {figures[0]:.3f}"]
    parts += [f"{keys[p]}: {rates[p]:.3f}" for p in ("tf32", "bf16", "fp16") if p in rates]
    parts += [f"hbm_gbyte_per_s: {figures[1]:.1f}", "memory_gb: 16"]
    text = f"cluster file entry: gpu_types: {{{label}: {{{', '.join(parts)}}}}}"
    if "bf16" not in rates and "fp16" not in rates:
        text += ("\nadd fp16_tflops or bf16_tflops, which this profile did not measure: "
                 "run it with --precision fp32,bf16 (or fp16) to measure them")  # fmt: skip
    return text


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(
            field, f"{shown(text)} is not a comma-separated list of integers"
        ) from None
    if not out or any(x <= 0 for x in out):
        raise InputError(field, "needs positive integers")
    return out


def data_convert(
    text: Annotated[Path, typer.Argument(help="Text file (UTF-8).")],
    out: Annotated[Path, typer.Option("--out", help="Token file: .bin (uint16), .u16 or .u32.")],
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="Hugging Face tokenizer.json or a folder holding one; default: bytes."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Convert text to a token file for `launch --data` (flat little-endian ids)."""
    from hetplan.runtime.data_convert import convert_text

    summary = convert_text(text, out, tokenizer)
    if as_json:
        typer.echo(json_text(summary))
    else:
        typer.echo(
            f"wrote {summary['tokens']} {summary['dtype']} token ids "
            f"(vocabulary {summary['vocab']}) to {summary['out']}"
        )


def register(app: typer.Typer) -> None:
    """Adds the ``launch`` command, the ``profile`` group (measure this device, or
    ``profile import`` / ``profile show`` measured data) and ``data convert`` to ``app``."""
    from hetplan.measured.cli import profile_group

    app.command("launch")(launch)
    app.add_typer(profile_group(profile), name="profile")
    data = typer.Typer(help="Training data for launch.", no_args_is_help=True)
    data.command("convert")(data_convert)
    app.add_typer(data, name="data")

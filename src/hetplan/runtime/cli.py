"""The ``launch`` and ``profile`` commands; the main CLI adds them with ``register(app)``."""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hetplan.errors import InputError
from hetplan.runtime.config import RunConfig


def predicted_step_time_s(
    plan: Any, model: Any, cluster: Any, db: Path | None
) -> tuple[float, str]:
    """Returns the cost model's iteration time for the plan and which compute source it used."""
    from hetplan.cost.estimate import estimate
    from hetplan.measured.profile_db import ProfileDB, default_db_path

    path = db or default_db_path()
    profile = ProfileDB(path) if path.exists() else None
    # this runtime reduces gradients after the pipeline step, never under the backward
    est = estimate(replace(plan, overlap_grad_reduce=False), model, cluster, profile=profile)
    return est.iteration_time_s, est.compute_source


def launch(
    plan: Annotated[Path, typer.Argument(help="Plan file (JSON).")],
    model: Annotated[str, typer.Option("--model", help="Catalog name or config.json.")],
    cluster: Annotated[str, typer.Option("--cluster", help="Cluster file or inline spec.")],
    steps: Annotated[int, typer.Option(help="Train until this step.")] = 10,
    data: Annotated[Path | None, typer.Option(help="Text file, read as byte tokens.")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Checkpoint directory.")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Save every K steps (0: at end).")] = 0,
    resume: Annotated[bool, typer.Option(help="Resume from --checkpoint-dir.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of initialisation and data.")] = 0,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-3,
    threads: Annotated[int, typer.Option(help="Threads per process (0: torch default).")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    nnodes: Annotated[int | None, typer.Option(help="Nodes (default: as the plan uses).")] = None,
    node_rank: Annotated[int | None, typer.Option(help="Run this node's ranks.")] = None,
    master_addr: Annotated[str | None, typer.Option(help="Rendezvous host (multi-node).")] = None,
    master_port: Annotated[int, typer.Option(help="Rendezvous port (multi-node).")] = 29500,
    db: Annotated[Path | None, typer.Option(help="Profile database for the prediction.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    elastic: Annotated[bool, typer.Option(help="Replan and recover on preemption.")] = False,
    local_dir: Annotated[Path | None, typer.Option(help="Node-local checkpoint disks.")] = None,
    storage: Annotated[str | None, typer.Option(help="Shard store: directory or URL.")] = None,
) -> None:
    """Train a real model under the plan with torchrun (one machine) or print per-node commands."""
    from hetplan.runtime.launch import (
        format_command,
        local_command,
        node_commands,
        preflight,
        run_command,
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
        device=device,
        progress=not as_json,
        local_dir=str(local_dir) if local_dir else None,
        storage=storage,
    )
    if elastic:
        from hetplan.elastic.cli import storage_bandwidth_bytes_per_s
        from hetplan.elastic.elastic_run import run_elastic

        if not (local_dir and storage and checkpoint_every):
            raise InputError("--elastic", "needs --local-dir, --storage and --checkpoint-every")
        cfg = replace(cfg, progress=False)
        rec = run_elastic(cfg, storage_bandwidth_bytes_per_s(cluster, None))
        typer.echo(
            json.dumps(rec)
            if as_json
            else f"finished at step {rec['final_step']}, {len(rec['recoveries'])} recoveries"
        )
        return
    checked = preflight(cfg)
    console = Console(stderr=as_json)
    predicted, source = predicted_step_time_s(checked.plan, checked.model, checked.cluster, db)
    multi = len(checked.nodes) > 1
    if nnodes is not None and nnodes != len(checked.nodes):
        raise InputError("--nnodes", f"the plan uses {len(checked.nodes)} nodes, not {nnodes}")
    if multi and (node_rank is None or master_addr is None):
        for node, cmd in node_commands(cfg, checked, master_addr or "MASTER_HOST", master_port):
            console.print(f"# on {node}")
            console.print(format_command(cmd), soft_wrap=True, highlight=False)
        return
    with tempfile.TemporaryDirectory(prefix="hetplan-run-") as tmp:
        cfg = replace(cfg, result=str(Path(tmp) / "result.json"))
        if multi:
            assert master_addr is not None and node_rank is not None
            cmds = node_commands(cfg, checked, master_addr, master_port)
            if not 0 <= node_rank < len(cmds):
                raise InputError("--node-rank", f"must be in [0, {len(cmds)})")
            cmd = cmds[node_rank][1]
            cmd[0:1] = [*local_command(cfg, 1)[:3]]  # the same interpreter's torchrun
        else:
            cmd = local_command(cfg, len(checked.devices))
        try:
            record = run_command(cmd, cfg, timeout_s=None)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            raise typer.Exit(_fail(console, str(exc))) from None
    record["predicted_step_time_s"] = predicted
    record["compute_source"] = source
    if as_json:
        typer.echo(json.dumps(record))
        return
    measured = record.get("measured_step_time_s")
    if measured:
        console.print(
            f"measured step {measured:.4f} s, predicted {predicted:.4f} s ({source} compute), "
            f"final loss {record['steps'][-1]['loss']:.4f}"
        )


def _fail(console: Console, message: str) -> int:
    console.print(message, highlight=False)
    return 1


def profile(
    ctx: typer.Context,
    model: Annotated[
        str | None, typer.Option("--model", help="Catalog name or config.json.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N.")] = "cpu",
    name: Annotated[str | None, typer.Option(help="Device type name (default cpu/GPU).")] = None,
    micro_batch_sizes: Annotated[str, typer.Option(help="Comma-separated.")] = "1,2,4",
    tp: Annotated[str, typer.Option(help="Comma-separated TP degrees.")] = "1",
    threads: Annotated[int, typer.Option(help="Threads (0: torch default).")] = 0,
    reps: Annotated[int, typer.Option(help="Timed repetitions (median).")] = 5,
    db: Annotated[Path | None, typer.Option(help="Profile database path.")] = None,
    links: Annotated[
        bool,
        typer.Option(
            "--links", help="CPU: also measure gloo p2p, all-reduce and pipelining overheads."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Time each layer's forward and backward on this device into the profile database
    (without a subcommand); ``import`` and ``show`` handle measured profiles."""
    if ctx.invoked_subcommand is not None:
        return
    if model is None:
        raise InputError("--model", "required to profile this device (or: profile import/show)")
    from hetplan.measured.profile_db import ProfileDB
    from hetplan.model import load_model

    spec = load_model(model)
    mbs, tps = _ints(micro_batch_sizes, "--micro-batch-sizes"), _ints(tp, "--tp")
    for t in tps:
        if spec.heads % t or spec.kv_heads % t or spec.ffn % t:
            raise InputError("--tp", f"{t} does not divide the heads, kv heads and ffn")
    import torch

    from hetplan.runtime.profile import profile_model

    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError("--device", f"{device!r}: use cpu or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device", "CUDA is not available on this machine")
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    label = name or ("cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev))
    store = ProfileDB(db)
    if links and dev.type != "cpu":
        raise InputError("--links", "the link measurement runs on the CPU (gloo) only")
    records = profile_model(store, label, spec, mbs, tps, dev, reps, links=links)
    figures = store.device_figures(label)
    if as_json:
        rows = [
            {
                "device": r.device,
                "tp": r.tp,
                "micro_batch": r.micro_batch,
                "forward_s": r.times.forward_s,
                "backward_s": r.times.backward_s,
                "activation_bytes": r.activation_bytes,
            }
            for r in records
        ]
        typer.echo(json.dumps({"db": str(store.path), "layers": rows, "device": figures}))
        return
    table = Table(title=f"{spec.name} layer on {label} ({store.path})")
    for col in ("tp", "micro-batch", "forward ms", "backward ms", "activations MB"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(
            str(r.tp),
            str(r.micro_batch),
            f"{r.times.forward_s * 1e3:.3f}",
            f"{r.times.backward_s * 1e3:.3f}",
            f"{r.activation_bytes / 1e6:.2f}",
        )
    console = Console()
    console.print(table)
    if figures:
        console.print(
            f"cluster file entry: gpu_types: {{{label}: {{fp32_tflops: {figures[0]:.3f}, "
            f"fp16_tflops: {figures[0]:.3f}, hbm_gbyte_per_s: {figures[1]:.1f}, memory_gb: 16}}}}",
            highlight=False,
        )


def _ints(text: str, field: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(field, f"{text!r} is not a comma-separated list of integers") from None
    if not out or any(x <= 0 for x in out):
        raise InputError(field, "needs positive integers")
    return out


def register(app: typer.Typer) -> None:
    """Adds the ``launch`` command and the ``profile`` group (measure this device, or
    ``profile import`` / ``profile show`` measured data) to ``app``."""
    from hetplan.measured.cli import profile_group

    app.command("launch")(launch)
    app.add_typer(profile_group(profile), name="profile")

"""``hetplan spmd plan`` and ``hetplan spmd run`` (mounted by the main CLI)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from hetplan.cluster import load_cluster
from hetplan.errors import InputError
from hetplan.outputs import json_text

if TYPE_CHECKING:  # torch is imported only when a command runs (keeps `hetplan --help` fast)
    from hetplan.spmd.synth import Synthesis

MODULE_HELP = "pkg.mod:factory or file.py:factory, returning (model, inputs)"

app = typer.Typer(help="Synthesise SPMD programs for any PyTorch model (HAP-style).")


def _parse_kwargs(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (text or "").split(",")):
        key, _, value = part.partition("=")
        if not key.strip().isidentifier() or not value.strip().isdigit():
            raise InputError("--inputs", f"'{part}' is not NAME=INT (e.g. batch=16,seq=128)")
        if int(value) <= 0:
            raise InputError("--inputs", f"'{part}': sizes are positive")
        out[key.strip()] = int(value)
    return out


def build_example(module: str, inputs: str | None) -> tuple[Any, Any]:
    """Returns the factory's (module, example inputs) for ``--inputs``; a name the factory
    does not take, or values it refuses, are errors naming --inputs, a result that is not
    (model, tensors) or a factory that fails otherwise are errors naming --module."""
    from hetplan.spmd.execute import checked_example, load_factory

    factory = load_factory(module)
    kwargs = _parse_kwargs(inputs)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise InputError("--inputs", f"{module} takes no such arguments: {exc}") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        made = factory(**kwargs)
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise InputError(
            "--inputs", f"{module} refused {inputs or 'its defaults'}: {exc}"
        ) from None
    except Exception as exc:  # the user's code failed: its own words, on one line
        raise InputError("--module", f"{module} failed: {type(exc).__name__}: {exc}") from None
    return checked_example(module, made)


def plan_module(
    module: str, cluster: str, inputs: str | None = None, precision: str = "fp16"
) -> Synthesis:
    """Returns the synthesis for a factory 'pkg.mod:fn' on a cluster spec."""
    from hetplan.spmd.capture import capture
    from hetplan.spmd.costmodel import devices_from_cluster
    from hetplan.spmd.synth import synthesize

    mod, example = build_example(module, inputs)
    cap = capture(mod, example, meta=True)
    devs = devices_from_cluster(load_cluster(cluster), precision)
    return synthesize(cap, devs)


def _per_rank(text: str, option: str, kind: Any, ok: Any) -> None:
    """Raises unless ``text`` is empty or a comma list of ``kind`` values passing ``ok``."""
    for part in filter(None, text.split(",")):
        try:
            value = kind(part)
        except ValueError:
            raise InputError(option, f"'{part}' is not a number (e.g. 2,1)") from None
        if not ok(value):
            raise InputError(option, f"'{part}' is out of range")


@app.command()
def plan(
    module: str = typer.Option(..., "--module", help=MODULE_HELP),
    cluster: str = typer.Option(
        ..., "--cluster", "-c", help="Cluster YAML, or inline 'A100-80GB:4x8,T4:1x4'"
    ),
    inputs: str | None = typer.Option(
        None, "--inputs", help="factory arguments, e.g. batch=16,seq=128"
    ),
    precision: str | None = typer.Option(
        None,
        "--precision",
        help="fp32, tf32, bf16 or fp16 (default: bf16 where every GPU supports it, else fp16)",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
) -> None:
    """Synthesise a program and print it with ratios and DP-EV / DP-CP baselines."""
    from hetplan.commands.common import resolve_precision

    result = plan_module(
        module, cluster, inputs, resolve_precision(load_cluster(cluster), precision)
    )
    if as_json:
        print(json_text(result.to_dict()))
        return
    con = Console()
    for line in result.program.lines():
        con.print(line, markup=False, highlight=False)
    ratios = ", ".join(
        f"{d}={r:.4f}" for d, r in zip(result.program.devices, result.program.ratios, strict=True)
    )
    con.print(f"ratios: {ratios}", markup=False)
    r = result
    ev, cp = r.dp_ev_time_s / r.predicted_time_s, r.dp_cp_time_s / r.predicted_time_s
    con.print(
        f"predicted step time: {r.predicted_time_s * 1e3:.3f} ms  "
        f"(DP-EV {r.dp_ev_time_s * 1e3:.3f} ms, x{ev:.2f}; "
        f"DP-CP {r.dp_cp_time_s * 1e3:.3f} ms, x{cp:.2f})",
        markup=False,
    )
    con.print(f"synthesis time: {result.synthesis_time_s:.2f} s")


@app.command()
def run(
    module: str = typer.Option(..., "--module", help=MODULE_HELP),
    cluster: str = typer.Option(
        ..., "--cluster", "-c", help="Cluster YAML, or inline 'A100-80GB:4x8,T4:1x4'"
    ),
    inputs: str | None = typer.Option(
        None, "--inputs", help="factory arguments, e.g. batch=16,seq=128"
    ),
    nproc: int = typer.Option(0, "--nproc", help="ranks (default: cluster devices)"),
    steps: int = typer.Option(5, "--steps", help="Training steps to time"),
    threads: str = typer.Option("", "--threads", help="CPU threads per rank, e.g. 2,1"),
    duty: str = typer.Option(
        "", "--duty", help="CPU duty cycle per rank, e.g. 1,0.5 (SIGSTOP/SIGCONT throttling)"
    ),
    program: str = typer.Option("synth", "--program", help="synth, dp-ev or dp-cp"),
) -> None:
    """Train with the synthesised program under torchrun (gloo on CPU, NCCL on CUDA)."""
    devices = load_cluster(cluster).num_gpus
    n = nproc or devices
    if not 1 <= n <= devices:
        raise InputError("--nproc", f"{n}: one rank per device, 1 to the cluster's {devices}")
    if steps < 1:
        raise InputError("--steps", f"{steps}: at least one step")
    _per_rank(threads, "--threads", int, lambda v: v >= 0)
    _per_rank(duty, "--duty", float, lambda v: 0 < v <= 1)
    if program not in ("synth", "dp-ev", "dp-cp"):
        raise InputError("--program", f"'{program}' is not synth, dp-ev or dp-cp")
    build_example(module, inputs)  # the module and its inputs, checked before any rank starts
    import tempfile

    from hetplan.runtime.forkrun import run_here, run_spmd_rank
    from hetplan.runtime.launch import failed_run_cause

    argv = ["--module", module, "--cluster", cluster, "--steps", str(steps)]
    if inputs:
        argv += ["--inputs", inputs]
    if threads:
        argv += ["--threads", threads]
    if duty:
        argv += ["--duty", duty]
    argv += ["--program", program]
    # torchrun's agent from this process, the ranks forked from one import (forkrun): each
    # prints to this command's own output
    with tempfile.TemporaryDirectory(prefix="hetplan-spmd-") as logs:
        failures = run_here(argv, n, logs, quiet=False, entry=run_spmd_rank)
    if failures:
        typer.echo(failed_run_cause(failures), err=True)
        raise typer.Exit(1)

"""Option declarations shared by the main CLI's commands: model, cluster, precision, batch,
outputs, cost parameters and profile, and the plan constraints (a value pins, a list or
range limits) that plan and provision take."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hetplan.errors import InputError

PROFILE_ENV = "HETPLAN_PROFILE"

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Catalog name or config.json")]
PlanArg = Annotated[
    Path | None,
    typer.Argument(help="Plan JSON file (or --plan)", metavar="PLAN", show_default=False),
]
PlanOpt = Annotated[
    Path | None, typer.Option("--plan", help="Plan JSON file (or as the argument PLAN)")
]


def plan_file(arg: Path | None, opt: Path | None, required: bool = True) -> tuple[Path | None, str]:
    """Returns the plan file a command was given, as its argument PLAN or as --plan (every
    command that reads one takes both), and the name its messages use."""
    if arg is not None and opt is not None and arg != opt:
        raise InputError("--plan", f"two plan files given ({arg} and {opt}): give one")
    if arg is None and opt is None and required:
        raise InputError("PLAN", "missing: the plan file, as the argument PLAN or --plan")
    return (arg, "PLAN") if arg is not None else (opt, "--plan")


ClusterOpt = Annotated[
    str, typer.Option("--cluster", "-c", help="Cluster YAML, or inline 'A100-80GB:4x8,T4:1x4'")
]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="Override the sequence length")]
PrecOpt = Annotated[
    str | None,
    typer.Option("--precision", help="fp32, tf32, bf16 or fp16 (default: bf16 where supported)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object")]
BatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch-size", "-b", help="Sequences per iteration (default: the model's)"
    ),
]
TraceOpt = Annotated[Path | None, typer.Option("--trace", help="Write a Chrome-trace JSON")]
TimelineOpt = Annotated[Path | None, typer.Option("--timeline", help="Write a timeline PNG")]
ParamsOpt = Annotated[
    Path | None, typer.Option("--params", help="Cost-model parameters (hetplan calibrate)")
]
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help=f"Measured profile database (SQLite): its times replace modelled ones wherever "
        f"it has them (default: ${PROFILE_ENV}, else none)",
        show_default=False,
    ),
]
LIMIT = "a value pins, a list (1,2,4) or a range (2..16) limits"
TpLimit = Annotated[str | None, typer.Option("--tp", help=f"Tensor-parallel degrees: {LIMIT}")]
PpLimit = Annotated[str | None, typer.Option("--pp", help=f"Pipeline stages: {LIMIT}")]
DpLimit = Annotated[str | None, typer.Option("--dp", help=f"Data-parallel replicas: {LIMIT}")]
MbLimit = Annotated[
    str | None, typer.Option("--micro-batch-size", help=f"Micro-batch sizes: {LIMIT}")
]
VsLimit = Annotated[
    str | None, typer.Option("--virtual-stages", help=f"Model chunks per stage: {LIMIT}")
]
ZeroLimit = Annotated[str | None, typer.Option("--zero-stage", help=f"ZeRO stages: {LIMIT}")]
RecomputeLimit = Annotated[
    str | None, typer.Option("--recompute", help="none, selective, full, or a list of them")
]
ScheduleLimit = Annotated[
    str | None,
    typer.Option("--schedule", help="1F1B, Interleaved1F1B, GPipe, or a list of them"),
]
SpLimit = Annotated[
    bool | None,
    typer.Option(
        "--sequence-parallel/--no-sequence-parallel",
        help="Sequence parallelism (default: searched)",
    ),
]
FlashLimit = Annotated[
    bool | None,
    typer.Option("--flash-attention/--no-flash-attention", help="Flash attention (default: on)"),
]
GpuTypesLimit = Annotated[
    str | None, typer.Option("--gpu-types", help="Use only these GPU types, e.g. A100-80GB,T4")
]
HeadroomLimit = Annotated[
    float | None,
    typer.Option("--memory-headroom", help="Share of each GPU's memory to leave free, e.g. 0.1"),
]
MaxGpusLimit = Annotated[
    int | None,
    typer.Option("--max-gpus", help="At most this many GPUs (plan: the cluster's first nodes)"),
]
OverlapTpOpt = Annotated[
    bool,
    typer.Option(
        "--overlap-tp-comm/--no-overlap-tp-comm",
        help="Plans overlap TP collectives with the matmuls, as predict's option: a fitted "
        "share hidden, with sequence parallelism only (default: off)",
    ),
]

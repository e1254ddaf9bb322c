"""``export``: a plan as Megatron-LM arguments or a DeepSpeed configuration."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Annotated

import typer

from hetplan.commands.common import err, out
from hetplan.commands.options import ModelOpt, PlanArg, PlanOpt, SeqOpt, plan_file
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.outputs import write_text
from hetplan.plan import PRECISIONS, check_plan_model, load_plan, model_for_plan


def register(app: typer.Typer) -> None:
    """Adds ``export`` to ``app``."""
    app.command()(export)


def export(
    plan_arg: PlanArg = None,
    *,
    model: ModelOpt,
    plan_opt: PlanOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="megatron or deepspeed")] = "megatron",
    seq_len: SeqOpt = None,
    precision: Annotated[
        str | None, typer.Option("--precision", help="Override the plan's precision")
    ] = None,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file")] = None,
) -> None:
    """Export a plan to Megatron-LM arguments or a DeepSpeed configuration.

    The DeepSpeed configuration holds only keys DeepSpeed documents; the parallel sizes
    DeepSpeed takes from its launcher are printed on stderr as Megatron-DeepSpeed arguments."""
    from hetplan.report.export import deepspeed_config, deepspeed_launch_args, megatron_args

    plan_path, named = plan_file(plan_arg, plan_opt)
    assert plan_path is not None
    spec = load_model(model, seq_len)
    the_plan = load_plan(plan_path, option=named)
    spec = model_for_plan(the_plan, spec, seq_len)
    if precision is not None:  # no cluster here: the name alone is checked
        if precision not in PRECISIONS:
            raise InputError("--precision", f"'{precision}' is not fp32, tf32, bf16 or fp16")
        the_plan = dataclasses.replace(the_plan, precision=precision)
    check_plan_model(the_plan, spec)  # no cluster here: what the model alone can check
    if fmt == "megatron":
        text = " \\\n  ".join(shlex.quote(a) for a in megatron_args(the_plan, spec)) + "\n"
    elif fmt == "deepspeed":
        text = json.dumps(deepspeed_config(the_plan, spec), indent=2) + "\n"
    else:
        raise InputError("--format", f"'{fmt}' is not megatron or deepspeed")
    if out_path is None:
        out.print(text, end="", highlight=False, soft_wrap=True)
    else:
        write_text(out_path, text, "--out")
    if fmt == "deepspeed":  # DeepSpeed takes the parallel sizes from the launcher
        launch = deepspeed_launch_args(the_plan, str(out_path or "ds_config.json"))
        err.print(f"Megatron-DeepSpeed arguments: {shlex.join(launch)}", highlight=False,
                  soft_wrap=True, markup=False)  # fmt: skip

"""The hetplan command line: builds the application from the main commands
(``hetplan.commands``: plan, predict, explain, calibrate, provision, export) and the
sub-CLIs (runtime, elastic, SPMD, spot), and runs it with one-line errors."""

from __future__ import annotations

import copy
import logging
import sys
from typing import Annotated

import typer
from rich.markup import escape
from typer.main import get_command_name

from hetplan.collector import pace_collector
from hetplan.commands import calibrate, export, planning, provision
from hetplan.commands.common import err, out
from hetplan.errors import InputError

app = typer.Typer(
    name="hetplan",
    help="Plan and run large-model training on clusters of mixed GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
planning.register(app)
calibrate.register(app)
provision.register(app)
export.register(app)


def _show_version(value: bool) -> None:
    if value:
        from hetplan import __version__

        out.print(f"hetplan {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit", is_eager=True, callback=_show_version
        ),
    ] = False,
) -> None:
    """Plan and run large-model training on clusters of mixed GPUs."""


def _mount_subcommands() -> None:
    """Adds the runtime, elastic and SPMD commands; their modules import torch only when a
    command runs, so the planner works without it."""
    from hetplan.elastic.cli import register as register_elastic
    from hetplan.runtime.cli import register as register_runtime
    from hetplan.spmd.cli import app as spmd_app

    register_runtime(app)
    register_elastic(app)
    app.add_typer(spmd_app, name="spmd", help="SPMD program synthesis (HAP-style)")
    from hetplan.spot.cli import app as spot_app

    app.add_typer(spot_app, name="spot", help="Replay GPU availability traces (spot market)")


_mount_subcommands()


def _app_for(argv: list[str]) -> typer.Typer:
    """Returns the application narrowed to the command ``argv`` names: click converts only
    that one (every command's options, a tenth of a second, otherwise); the whole
    application where ``argv`` names none of them (the root's help and options, an unknown
    command's message)."""
    name = next((a for a in argv if not a.startswith("-")), None)
    if name is None:
        return app
    commands = [
        c
        for c in app.registered_commands
        if c.callback is not None and (c.name or get_command_name(c.callback.__name__)) == name
    ]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    narrow = copy.copy(app)
    narrow.registered_commands = commands
    narrow.registered_groups = groups
    return narrow


def main() -> None:
    """Runs the CLI; bad input ends with one line naming the field and exit code 2."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    pace_collector()
    try:
        # without standalone mode click returns a command's typer.Exit code instead of
        # exiting with it: a failed run must not end with 0
        code = _app_for(sys.argv[1:])(standalone_mode=False)
        if isinstance(code, int) and code != 0:
            sys.exit(code)
    except InputError as exc:
        # the message is text, never markup: "[forward_s, backward_s]" must print as written
        err.print(f"[bold red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click's usage errors arrive here with standalone_mode off
        # typer >= 0.20 raises its vendored click's exceptions, even where a separate click
        # is installed (huggingface_hub brings one): check against typer's own first
        try:
            from typer._click import exceptions as click_exc
        except ModuleNotFoundError:  # an older typer that depends on click
            from click import exceptions as click_exc  # type: ignore[no-redef]

        if isinstance(exc, click_exc.NoArgsIsHelpError):
            exc.show()  # a bare command group prints its help
            sys.exit(2)
        if isinstance(exc, click_exc.ClickException):
            # one line: the command, then click's message, which names the option
            ctx = getattr(exc, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None else ""
            message = " ".join(exc.format_message().split())
            text = escape(f"{where}{message} (see --help)")
            err.print(f"[bold red]error[/]: {text}", highlight=False, soft_wrap=True)
            sys.exit(2)
        if isinstance(exc, typer.Exit):
            sys.exit(exc.exit_code)
        raise

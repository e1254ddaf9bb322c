"""Prints the README's table of options for each hetplan command, from the commands
themselves (the options --help lists, their help and default), so the tables can be
regenerated after an option changes: python tools/readme_options.py --write (or
print some: python tools/readme_options.py [COMMAND ...]).

tests/test_readme_options.py checks that the README's tables list exactly these options.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import typer

DEFAULT = re.compile(r"\s*\((?:default|Default):\s*(?P<value>[^)]*)\)\.?\s*$")


def commands() -> dict[str, Any]:
    """Returns {'plan': click command, 'profile import': ..., ...} for every leaf command."""
    from hetplan.cli import app

    out: dict[str, Any] = {}

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            if path and any(getattr(p, "opts", None) for p in cmd.params):
                out[" ".join(path)] = cmd  # a group that runs itself too (hetplan profile)
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return out


def visible_params(cmd: Any) -> list[Any]:
    """Returns the parameters --help lists (hidden ones and --help itself left out)."""
    return [p for p in cmd.params if not getattr(p, "hidden", False) and p.name != "help"]


def option_names(cmd: Any) -> set[str]:
    """Returns every option spelling --help shows for the command."""
    return {o for p in visible_params(cmd) for o in (*p.opts, *p.secondary_opts) if o[0] == "-"}


def _cells(param: Any) -> tuple[str, str, str]:
    if param.param_type_name == "argument":
        name = param.metavar or param.name.upper().removesuffix("_PATH")
        help_text = " ".join((getattr(param, "help", None) or "").split()).rstrip(".")
        return f"`{name}`", help_text, "required" if param.required else "-"
    names = ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
    text = " ".join((param.help or "").split()).rstrip(".")
    match = DEFAULT.search(text)
    if match is not None:
        text, default = text[: match.start()].rstrip(" .,;"), match["value"]
    elif param.required:
        default = "required"
    elif param.default is None or param.default == "":
        default = "-"
    elif param.is_flag:
        default = "on" if param.default else "off"
    else:
        default = str(param.default)
    return names, text.replace("|", "\\|"), default.replace("|", "\\|")


def table(cmd: Any) -> str:
    """Returns the markdown table of one command's options."""
    rows = ["| option | meaning | default |", "| --- | --- | --- |"]
    for param in visible_params(cmd):
        if param.param_type_name == "argument":
            name, help_text, default = _cells(param)
            meaning = f"(argument) {help_text}".rstrip()
            rows.append(f"| {name} | {meaning} | {default} |")
        else:
            rows.append("| {} | {} | {} |".format(*_cells(param)))
    return "\n".join(rows)


BEGIN, END = "<!-- options: begin -->", "<!-- options: end -->"


def tables(names: list[str]) -> str:
    """Returns the collapsible tables of the named commands (all of them if none)."""
    found = commands()
    out = []
    for name in names or list(found):
        if name not in found:
            sys.exit(f"no command {name} (commands: {', '.join(found)})")
        out.append(
            f"<details><summary><code>hetplan {name}</code></summary>\n\n"
            f"{table(found[name])}\n\n</details>\n"
        )
    return "\n".join(out)


def main(argv: list[str]) -> None:
    if argv == ["--write"]:  # regenerate the README's tables between the markers
        readme = Path(__file__).resolve().parents[1] / "README.md"
        text = readme.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        readme.write_text(f"{text[:start]}\n{tables([])}{text[end:]}")
        return
    print(tables(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

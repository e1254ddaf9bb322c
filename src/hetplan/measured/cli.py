"""``hetplan profile import`` and ``hetplan profile show``; the runtime mounts them in the
``profile`` group (whose bare invocation measures this device, see runtime/cli.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from hetplan.errors import InputError
from hetplan.outputs import json_text

FORMATS = ("sailor", "csv")


def _console() -> Console:
    # a pipe gets wide lines rather than rich's 80-column default, as in hetplan.cli
    return Console(width=None if sys.stdout.isatty() else 200)


def _format(fmt: str | None, path: Path) -> str:
    if fmt is None:
        guess = {".json": "sailor", ".csv": "csv"}.get(path.suffix.lower())
        if guess is None:
            raise InputError("--format", f"cannot tell the format of {path.name}: sailor or csv")
        return guess
    if fmt not in FORMATS:
        raise InputError("--format", f"'{fmt}' is not sailor or csv")
    return fmt


def import_profile(
    file: Annotated[
        Path | None, typer.Argument(help="Profile file: Sailor JSON or the CSV of docs/measured.md")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Database to add the rows to.")
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="sailor or csv (default: by suffix).")
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option("--model", help="NAME=MODEL: the file's model NAME is MODEL (catalog/json)."),
    ] = None,
    network: Annotated[
        Path | None,
        typer.Option("--network", help="Network figures: Sailor JSON (.json) or network CSV."),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option("--precision", help="Precision of the data (sailor default: tf32)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Import measured times (and network figures) into a profile database."""
    from hetplan.measured.csv_import import read_network_csv, read_profile_csv
    from hetplan.measured.importers import (
        ImportBatch,
        check_precision,
        parse_bindings,
        write_db,
    )
    from hetplan.measured.sailor import SAILOR_PRECISION, read_sailor_network, read_sailor_profile

    if out is None:
        raise InputError("--out", "required: the database to write")
    if file is None and network is None:
        raise InputError("FILE", "give a profile file, --network FILE, or both")
    if precision is not None:
        check_precision(precision, "--precision")
    bindings = parse_bindings(model or [])
    batch = ImportBatch()
    if file is not None:
        if not file.is_file():
            raise InputError("FILE", f"no such file: {file}")
        if _format(fmt, file) == "sailor":
            batch.extend(read_sailor_profile(file, bindings, precision or SAILOR_PRECISION))
        else:
            batch.extend(read_profile_csv(file, bindings, precision))
    if network is not None:
        if not network.is_file():
            raise InputError("--network", f"no such file: {network}")
        if network.suffix.lower() == ".json":
            batch.extend(read_sailor_network(network))
        else:
            batch.extend(read_network_csv(network))
    db = write_db(out, batch)
    counts = batch.counts()
    if as_json:
        typer.echo(json_text({"db": str(out), "added": counts, "notes": batch.notes}))
        return
    console = _console()
    added = ", ".join(f"{n} {table}" for table, n in counts.items() if n)
    console.print(f"{out}: added {added or 'nothing'}", highlight=False)
    for note in batch.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"now {sum(db.counts().values())} rows in all", highlight=False)


def _open(db_path: Path) -> Any:
    from hetplan.measured.profile_db import ProfileDB

    if not db_path.is_file():
        raise InputError("DB", f"no such file: {db_path}")
    with db_path.open("rb") as fh:
        if not fh.read(16).startswith(b"SQLite format 3"):
            raise InputError("DB", f"{db_path} is not an SQLite profile database")
    return ProfileDB(db_path)


def summary(db: Any) -> list[dict[str, Any]]:
    """Returns one entry per (device, shape, precision, TP): micro-batches and row counts."""
    groups: dict[tuple[str, str, str, int], list[int]] = {}
    for device, shape, tp, mb, prec, _f, _b in db.records():
        groups.setdefault((device, shape, prec, tp), []).append(mb)
    parts: dict[tuple[str, str, str, int], int] = {}
    for device, shape, _part, tp, _mb, prec in db.part_rows():
        key = (device, ":".join(shape.split(":")[:6]), prec, tp)  # part keys add vocab, tying
        parts[key] = parts.get(key, 0) + 1
    return [
        {
            "device": d,
            "shape": s,
            "precision": p,
            "tp": tp,
            "micro_batches": sorted(mbs),
            "layer_rows": len(mbs),
            "part_rows": parts.get((d, s, p, tp), 0),
        }
        for (d, s, p, tp), mbs in sorted(groups.items())
    ]


def show_profile(
    db_path: Annotated[Path, typer.Argument(metavar="DB", help="Profile database (SQLite).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Summarise a profile database: devices, shapes, TP degrees, micro-batches, rows."""
    db = _open(db_path)
    rows = summary(db)
    network = db.network_entries()
    if as_json:
        payload = {"db": str(db_path), "counts": db.counts(), "layers": rows}
        payload["network"] = [
            {"device": d, "scope": s, "gpus": n, "kind": k} for d, s, n, k in network
        ]
        typer.echo(json_text(payload))
        return
    console = _console()
    table = Table(title=f"layer profiles in {db_path}")
    for col in ("device", "shape", "precision", "tp", "micro-batches", "layer rows", "part rows"):
        table.add_column(col, justify="right" if col.endswith("rows") else "left")
    for r in rows:
        table.add_row(
            r["device"],
            r["shape"],
            r["precision"],
            str(r["tp"]),
            ",".join(str(m) for m in r["micro_batches"]),
            str(r["layer_rows"]),
            str(r["part_rows"]),
        )
    console.print(table)
    if network:
        net = Table(title="network")
        for col in ("device", "scope", "gpus", "record"):
            net.add_column(col)
        for d, s, n, k in network:
            net.add_row(d, s, str(n), k)
        console.print(net)
    counts = ", ".join(f"{table} {n}" for table, n in db.counts().items())
    console.print(f"rows: {counts}", highlight=False)


def profile_group(measure: Callable[..., None]) -> typer.Typer:
    """Returns the ``profile`` command group: ``measure`` runs when no subcommand is given."""
    group = typer.Typer(
        help="Measure this device into the profile database (no subcommand), or import and "
        "show measured profiles.",
        add_completion=False,
    )
    group.callback(invoke_without_command=True)(measure)
    group.command("import")(import_profile)
    group.command("show")(show_profile)
    return group

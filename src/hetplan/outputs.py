"""The files a command writes: whole or not at all, and a path that cannot be written is
the user's error (one line naming the option and the reason, exit 2), never a traceback.

Every writer goes through ``output_file``: the content goes to a hidden temporary file
beside the target, renamed over it only once complete (``os.replace``: atomic on one file
system); on any failure the temporary file is removed and the target is left as it was.
``check_output`` tells the same error before a command spends time computing what it would
write.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from hetplan.errors import InputError


def _reason(path: Path, exc: OSError) -> str:
    return f"cannot write {path}: {exc.strerror or exc}"


def check_output(path: Path | None, option: str) -> None:
    """Raises ``InputError(option, ...)`` when ``path`` cannot be a file written later: its
    folder missing or not a folder, or ``path`` itself a folder."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(option, f"cannot write {path}: it is a folder")
    if not parent.exists():
        raise InputError(option, f"cannot write {path}: no folder {parent}")
    if not parent.is_dir():
        raise InputError(option, f"cannot write {path}: {parent} is not a folder")


@contextmanager
def output_file(path: Path, option: str, fsync: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` (same suffix, so tools that pick a format
    from it still do) to write in full; renamed over ``path`` when the block ends. Any
    ``OSError`` becomes ``InputError(option, ...)``; on any failure the temporary file is
    removed. ``fsync``: the data reaches the disk before the rename."""
    check_output(path, option)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        if fsync:
            with tmp.open("rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(option, _reason(path, exc)) from None
    finally:
        with suppress(OSError):  # a folder of that name: nothing of ours to remove
            tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str, option: str) -> None:
    """Writes ``text`` to ``path`` whole (``output_file``)."""
    with output_file(path, option) as tmp:
        tmp.write_text(text)


def finite(obj: Any) -> Any:
    """Returns ``obj`` with every non-finite float (NaN, inf) as None: JSON has neither,
    and a strict parser rejects Python's ``NaN``/``Infinity``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: Any) -> str:
    """Returns ``obj`` as standard JSON on one line (non-finite numbers as null: the copy
    ``finite`` makes only where there is one)."""
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False)

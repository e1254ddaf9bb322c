"""Reports: rich tables, Chrome traces, timeline pictures, exports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hetplan.errors import InputError
from hetplan.outputs import check_output


def require_matplotlib(option: str, path: object) -> None:
    """Raises an InputError naming ``option`` when a picture is asked for (``path`` set)
    and matplotlib, an optional extra, is not installed, or ``path`` cannot be written
    (``outputs.check_output``): checked before any work."""
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise InputError(option, "needs matplotlib: pip install 'hetplan[plots]'")
    if isinstance(path, Path):
        check_output(path, option)


def save_figure(fig: Any, path: Path, option: str) -> None:
    """Writes a matplotlib figure to ``path`` whole or not at all (``outputs.output_file``:
    a failed draw never leaves half a picture; a path that cannot be written is an error
    naming ``option``) and closes it."""
    import matplotlib.pyplot as plt

    from hetplan.outputs import output_file

    fig.tight_layout()
    try:
        with output_file(path, option) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)

"""Reports: rich tables, Chrome traces, timeline pictures, exports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hetplan.errors import InputError


def require_matplotlib(option: str, path: object) -> None:
    """Raises an InputError naming ``option`` when a picture is asked for (``path`` set)
    and matplotlib, an optional extra, is not installed: checked before any work."""
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise InputError(option, "needs matplotlib: pip install 'hetplan[plots]'")


def save_figure(fig: Any, path: Path) -> None:
    """Writes a matplotlib figure to ``path`` atomically (a temporary file renamed over it,
    so a failed draw never leaves half a picture) and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

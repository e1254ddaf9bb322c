"""Reports: rich tables, Chrome traces, timeline pictures, exports."""

from __future__ import annotations

import importlib.util

from hetplan.errors import InputError


def require_matplotlib(option: str, path: object) -> None:
    """Raises an InputError naming ``option`` when a picture is asked for (``path`` set)
    and matplotlib, an optional extra, is not installed: checked before any work."""
    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise InputError(option, "needs matplotlib: pip install 'hetplan[plots]'")

"""What a running search reports to whoever shows its progress (no display code here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SearchProgress:
    """A search's progress: candidates estimated so far, how many it may estimate at most
    (None where unknown), and the best iteration time found so far (None before any)."""

    explored: int
    total: int | None
    best_s: float | None


ProgressHook = Callable[[SearchProgress], None]
"""Called by a search after each candidate it estimates."""

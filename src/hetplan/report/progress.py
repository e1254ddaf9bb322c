"""The search's progress bar on stderr, for people: shown once a search has run a second,
never with --json or when stderr is not a terminal."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

from hetplan.search.progress import SearchProgress


class ProgressBar:
    """A search progress hook that draws a bar (candidates estimated, best so far) on
    stderr after ``delay_s`` of searching, and removes it when the search ends.

    ``enabled`` False (``--json``, stderr not a terminal) makes every call a no-op."""

    def __init__(self, enabled: bool, delay_s: float = 1.0, console: Any = None) -> None:
        self.enabled = enabled
        self.delay_s = delay_s
        self.start = time.monotonic()
        self._console = console
        self._bar: Any = None
        self._task: Any = None
        self.shown = False
        """Whether the bar was drawn."""

    @classmethod
    def for_cli(cls, as_json: bool) -> ProgressBar:
        """Returns the bar a CLI command uses: off under --json or without a terminal."""
        return cls(enabled=not as_json and sys.stderr.isatty())

    def __call__(self, progress: SearchProgress) -> None:
        if not self.enabled:
            return
        opening = self._bar is None
        if opening:
            if time.monotonic() - self.start < self.delay_s:
                return
            self._open()
        best = "-" if progress.best_s is None else f"{progress.best_s:.3f} s"
        self._bar.update(self._task, completed=progress.explored, total=progress.total, best=best)
        if opening:
            self._bar.start()
            self.shown = True

    def _open(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        console = self._console or Console(stderr=True)
        self._bar = Progress(
            TextColumn("searching"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("estimated, best so far {task.fields[best]}"),
            console=console,
            transient=True,
        )
        self._task = self._bar.add_task("search", total=None, best="-")

    def close(self) -> None:
        """Removes the bar (if drawn)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

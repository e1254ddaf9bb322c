"""The simulated schedule of one iteration as a matplotlib picture, one row per stage."""

from __future__ import annotations

from pathlib import Path

from hetplan.cost.estimate_result import Estimate
from hetplan.plan import Plan

MAX_ROWS = 64


def write_timeline(path: Path, plan: Plan, est: Estimate) -> None:
    """Writes a PNG of forward/backward/sync/optimizer slices per stage, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetplan.report import save_figure

    rows: list[tuple[str, list[tuple[float, float, str]]]] = []
    by_key = {(s.pipeline, s.stage): s for s in est.stages}
    for r, pipe in enumerate(plan.pipelines):
        rep = est.replays[r]
        for j, stage in enumerate(pipe.stages):
            st = by_key[(r, j)]
            slices = [
                (a, b - a, "tab:blue" if k == "F" else "tab:orange")
                for s, k, _, _, a, b in rep.events
                if s == j
            ]
            if st.sync_end_s > st.last_backward_end_s:
                slices.append(
                    (st.last_backward_end_s, st.sync_end_s - st.last_backward_end_s, "tab:red")
                )
            slices.append((st.sync_end_s, st.optimizer_s, "tab:green"))
            label = f"r{r} s{j} {st.gpu} x{stage.tp}"
            rows.append((label, slices))
    rows = rows[:MAX_ROWS]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    for i, (_, slices) in enumerate(rows):
        for start, width, color in slices:
            ax.broken_barh([(start, width)], (i - 0.4, 0.8), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(
        f"one iteration: {est.iteration_time_s:.3f} s (blue forward, orange backward, "
        "red gradient sync, green optimizer)"
    )
    save_figure(fig, path, "--timeline")

"""The simulated schedule of one iteration as Chrome-trace JSON (opens in Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetplan.cost.estimate_result import Estimate
from hetplan.outputs import write_text
from hetplan.plan import Plan

MAX_DEVICE_ROWS = 512


def trace_events(plan: Plan, est: Estimate) -> list[dict[str, Any]]:
    """Returns Chrome-trace events: one row per device, one slice per action.

    Needs an estimate made with ``record=True``. Plans with more than MAX_DEVICE_ROWS devices
    show the first device of each tensor-parallel group only.
    """
    events: list[dict[str, Any]] = []
    many = len(plan.devices()) > MAX_DEVICE_ROWS
    by_key = {(s.pipeline, s.stage): s for s in est.stages}
    for r, pipe in enumerate(plan.pipelines):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": r,
                "args": {"name": f"replica {r} (batch {pipe.batch_size})"},
            }
        )
        rep = est.replays[r]
        for j, stage in enumerate(pipe.stages):
            st = by_key[(r, j)]
            devs = stage.devices[:1] if many else stage.devices
            for k, dev in enumerate(devs):
                tid = j * 1000 + k
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": r,
                        "tid": tid,
                        "args": {"name": f"{dev} ({st.gpu}, stage {j})"},
                    }
                )
                for s, kind, mb, chunk, start, end in rep.events:
                    if s != j:
                        continue
                    events.append(
                        {
                            "ph": "X",
                            "pid": r,
                            "tid": tid,
                            "name": f"{kind}{mb}"
                            + (f".{chunk}" if plan.virtual_stages > 1 else ""),
                            "cat": "forward" if kind == "F" else "backward",
                            "ts": start * 1e6,
                            "dur": (end - start) * 1e6,
                        }
                    )
                if st.sync_end_s > st.last_backward_end_s:
                    events.append(
                        {
                            "ph": "X",
                            "pid": r,
                            "tid": tid,
                            "name": "grad sync",
                            "cat": "comm",
                            "ts": st.last_backward_end_s * 1e6,
                            "dur": (st.sync_end_s - st.last_backward_end_s) * 1e6,
                        }
                    )
                events.append(
                    {
                        "ph": "X",
                        "pid": r,
                        "tid": tid,
                        "name": "optimizer",
                        "cat": "optimizer",
                        "ts": st.sync_end_s * 1e6,
                        "dur": st.optimizer_s * 1e6,
                    }
                )
    return events


def write_trace(path: Path, plan: Plan, est: Estimate) -> None:
    """Writes the Chrome-trace JSON file atomically."""
    data = {"traceEvents": trace_events(plan, est), "displayTimeUnit": "ms"}
    write_text(path, json.dumps(data), "--trace")

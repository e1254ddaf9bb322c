"""One policy's run through a trace: progress, checkpoints, losses and the bill.

Between events the plan in force trains at its modelled rate (tokens/s from ``estimate``).
Training runs in checkpoint cycles: ``interval_s`` of training, then ``checkpoint_s`` of
writing, after which the tokens so far are committed. A preemption throws away everything
since the last commit (the wall time since it is redone), then the run is down for the
restart, replan and recovery. A planned change (an arrival used) first commits a checkpoint,
so it loses nothing but that write and the downtime. GPUs held are paid for all the time,
training, down or waiting; nothing is paid once the token target is reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Ledger:
    """The state and the running totals of one policy."""

    name: str
    start_s: float
    interval_s: float
    checkpoint_s: float
    target_tokens: float | None = None
    t: float = 0.0
    tokens: float = 0.0
    committed: float = 0.0
    since_commit_s: float = 0.0
    """Wall time since the last committed checkpoint (training and writing)."""
    rate: float = 0.0
    """Tokens/s of the plan in force; 0 while nothing runs."""
    gpus: int = 0
    usd_per_hour: float = 0.0
    down_until: float = 0.0
    finish_s: float | None = None
    usd: float = 0.0
    gpu_hours: float = 0.0
    recovery_s: float = 0.0
    """Downtime: restarts, replans, recoveries, the commit before a planned change."""
    redone_s: float = 0.0
    """Wall time whose work a preemption threw away."""
    waiting_s: float = 0.0
    """Time with nothing training for want of GPUs (or of a plan that fits)."""
    checkpoint_write_s: float = 0.0
    preemptions: int = 0
    replans: int = 0
    joins: int = 0
    timeline: list[tuple[float, float, int]] = field(default_factory=list)
    """(time, tokens/s training, GPUs held) at every change."""

    def __post_init__(self) -> None:
        self.t = self.down_until = self.start_s

    @property
    def done(self) -> bool:
        """Returns whether the token target is reached."""
        return self.finish_s is not None

    def _mark(self) -> None:
        running = self.rate if self.t >= self.down_until and not self.done else 0.0
        point = (self.t, running, 0 if self.done else self.gpus)
        if self.timeline and self.timeline[-1][0] == self.t:
            self.timeline[-1] = point
        else:
            self.timeline.append(point)

    def _pay(self, dt: float) -> None:
        self.usd += self.usd_per_hour * dt / 3600.0
        self.gpu_hours += self.gpus * dt / 3600.0

    def advance(self, until: float) -> None:
        """Runs the policy's current state up to time ``until``."""
        while self.t < until and not self.done:
            if self.t < self.down_until:
                dt = min(self.down_until, until) - self.t
                self.recovery_s += dt
                self._pay(dt)
                self.t += dt
                if self.t >= self.down_until:
                    self._mark()
                continue
            if self.rate <= 0:
                dt = until - self.t
                self.waiting_s += dt
                self._pay(dt)
                self.t = until
                continue
            if self.since_commit_s < self.interval_s:  # training
                dt = min(self.interval_s - self.since_commit_s, until - self.t)
                if self.target_tokens is not None:
                    need = (self.target_tokens - self.tokens) / self.rate
                    if need <= dt:
                        self._pay(need)
                        self.tokens = self.target_tokens
                        self.t += need
                        self.finish_s = self.t
                        self._mark()
                        return
                self.tokens += self.rate * dt
            else:  # writing a checkpoint
                dt = min(self.interval_s + self.checkpoint_s - self.since_commit_s, until - self.t)
                self.checkpoint_write_s += dt
            self._pay(dt)
            self.t += dt
            self.since_commit_s += dt
            if self.since_commit_s >= self.interval_s + self.checkpoint_s - 1e-12:
                self.committed = self.tokens
                self.since_commit_s = 0.0

    def preempt(self) -> None:
        """Loses the work since the last committed checkpoint."""
        if self.done:
            return
        self.preemptions += 1
        if self.t < self.down_until:  # struck while recovering: the downtime so far is lost
            self.down_until = self.t
        self.redone_s += self.since_commit_s
        self.tokens = self.committed
        self.since_commit_s = 0.0

    def commit_cost(self) -> float:
        """Returns the time a checkpoint taken now would stall the run (nothing when nothing
        trained since the last commit or the run never checkpoints)."""
        trained = self.since_commit_s > 0 and self.t >= self.down_until and self.rate > 0
        return self.checkpoint_s if trained and math.isfinite(self.interval_s) else 0.0

    def commit(self) -> None:
        """Commits a checkpoint now (before a planned change; ``run`` charges its time)."""
        self.committed = self.tokens
        self.since_commit_s = 0.0

    def run(self, rate: float, gpus: int, usd_per_hour: float, downtime_s: float) -> None:
        """Switches to a new plan (or none) after ``downtime_s`` of restart and recovery."""
        if self.done:
            return
        self.rate, self.gpus, self.usd_per_hour = rate, gpus, usd_per_hour
        self.down_until = self.t + downtime_s
        self.since_commit_s = 0.0  # resumed from a checkpoint
        self._mark()

    def reprice(self, usd_per_hour: float) -> None:
        """Sets the price of the GPUs held (a price change in the trace)."""
        self.usd_per_hour = usd_per_hour

    def summary(self) -> dict[str, Any]:
        """Returns the JSON object of this policy's run."""
        wall = None if self.finish_s is None else self.finish_s - self.start_s
        return {
            "name": self.name,
            "tokens": self.tokens,
            "reached_target": self.finish_s is not None,
            "time_to_target_s": wall,
            "elapsed_s": self.t - self.start_s,
            "gpu_hours": self.gpu_hours,
            "dollars": self.usd,
            "usd_per_million_tokens": self.usd / (self.tokens / 1e6) if self.tokens > 0 else None,
            "tokens_per_dollar": self.tokens / self.usd if self.usd > 0 else None,
            "recovery_s": self.recovery_s,
            "redone_s": self.redone_s,
            "waiting_s": self.waiting_s,
            "checkpoint_write_s": self.checkpoint_write_s,
            "preemptions": self.preemptions,
            "replans": self.replans,
            "joins": self.joins,
            "timeline": [list(p) for p in self.timeline],
        }

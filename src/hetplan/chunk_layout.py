"""Uneven pipeline layouts: layers per stage and per model chunk (virtual stage).

Two written forms are read (``predict --layout``; grammar in docs/plan-format.md):

- Megatron-Core's ``--pipeline-model-parallel-layout`` string: virtual stages in
  execution order (chunk ``c`` of stage ``j`` is virtual stage ``c * pp + j``) separated by
  ``|``; ``E`` the embedding, ``t`` one transformer layer, ``L`` the loss (output head);
  ``x*n`` repeats one character, ``(...)*n`` a group; commas are cosmetic. ``E`` must open
  the first virtual stage and ``L`` close the last, each exactly once.
- A JSON list with one entry per stage: a layer count (one chunk) or a list of per-chunk
  layer counts, e.g. ``[[3,4],[4,4],[4,3]]``.

The embedding always runs on the first virtual stage and the head on the last: layer 0
needs the embedding's output and the loss the last layer's (Megatron-Core enforces the
same order).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

from hetplan.errors import InputError
from hetplan.plan import Pipeline, Plan, Stage

_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT = re.compile(r"([^()|*\d])\*(\d+)")


def _expand(text: str, option: str) -> str:
    """Returns the layout string with every repetition written out."""
    s = text.replace(",", "").replace(" ", "")
    s = _GROUP.sub(lambda g: g.group(1) * int(g.group(2)), s)
    s = _REPEAT.sub(lambda g: g.group(1) * int(g.group(2)), s)
    bad = sorted(set(s) - set("EtL|"))
    if bad:
        shown = " ".join(repr(c) for c in bad)
        raise InputError(
            option,
            f"unexpected {shown} in '{text}': use E (embedding), t (layer), L (loss/head), "
            "| between virtual stages, x*n and (...)*n to repeat",
        )
    return s


def parse_megatron_layout(text: str, pp: int, option: str = "--layout") -> list[tuple[int, ...]]:
    """Returns per stage its chunks' layer counts from a Megatron-Core layout string."""
    s = _expand(text, option)
    virtual = s.split("|")
    if len(virtual) % pp:
        raise InputError(
            option, f"{len(virtual)} virtual stages do not divide among {pp} pipeline stages"
        )
    if s.count("E") != 1 or not s.startswith("E"):
        raise InputError(option, "the embedding E must appear once, first in the first stage")
    if s.count("L") != 1 or not s.endswith("L"):
        raise InputError(option, "the loss L must appear once, last in the last stage")
    v = len(virtual) // pp
    return [tuple(virtual[c * pp + j].count("t") for c in range(v)) for j in range(pp)]


def parse_layout(text: str, pp: int, option: str = "--layout") -> list[tuple[int, ...]]:
    """Returns per stage its chunks' layer counts from either written form."""
    text = text.strip()
    if not text.startswith("["):
        return parse_megatron_layout(text, pp, option)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(option, f"not a valid JSON list: {exc.msg}") from None
    if not isinstance(raw, list) or len(raw) != pp:
        count = len(raw) if isinstance(raw, list) else 0
        raise InputError(option, f"lists {count} stages, but --pp is {pp}")
    out = []
    for j, entry in enumerate(raw):
        chunks = entry if isinstance(entry, list) else [entry]
        if not chunks or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in chunks
        ):
            raise InputError(option, f"stage {j}: expected layer counts >= 0, got {entry}")
        out.append(tuple(chunks))
    if len({len(c) for c in out}) != 1:
        raise InputError(option, "every stage must list the same number of chunks")
    return out


def format_megatron_layout(stages: list[tuple[int, ...]]) -> str:
    """Returns the Megatron-Core layout string of per-stage chunk layer counts, runs of equal
    virtual stages written once with a repeat count."""
    pp, v = len(stages), len(stages[0])
    parts = []
    for c in range(v):
        for j in range(pp):
            n = stages[j][c]
            body = "t" * n if n <= 2 else f"t*{n}"
            first, last = c == 0 and j == 0, c == v - 1 and j == pp - 1
            parts.append(("E" if first else "") + body + ("L" if last else ""))
    runs: list[tuple[str, int]] = []
    for part in parts:
        if runs and runs[-1][0] == part:
            runs[-1] = (part, runs[-1][1] + 1)
        else:
            runs.append((part, 1))

    def run_text(body: str, k: int) -> str:  # k virtual stages, each followed by '|'
        group = f"({body}|)*{k},"
        return group if len(group) < k * (len(body) + 1) else f"{body}|" * k

    body, k = runs.pop()  # the last virtual stage closes the string without a '|'
    text = "".join(run_text(b, n) for b, n in runs)
    return text + (run_text(body, k - 1) if k > 1 else "") + body


def apply_layout(plan: Plan, stages: list[tuple[int, ...]], option: str = "--layout") -> Plan:
    """Returns ``plan`` with every pipeline's stages laid out as ``stages`` (per stage, its
    chunks' layers), interleaved when there is more than one chunk per stage."""
    v = len(stages[0])
    pipes = []
    for r, pipe in enumerate(plan.pipelines):
        if len(pipe.stages) != len(stages):
            raise InputError(
                option, f"lists {len(stages)} stages, pipeline {r} has {len(pipe.stages)}"
            )
        new = tuple(
            Stage(sum(ch), st.devices, ch if v > 1 else None)
            for st, ch in zip(pipe.stages, stages, strict=True)
        )
        pipes.append(Pipeline(pipe.batch_size, new))
    schedule = "Interleaved1F1B" if v > 1 else plan.schedule
    if v > 1 and plan.schedule not in ("1F1B", "Interleaved1F1B"):
        raise InputError(option, f"{v} chunks per stage need Interleaved1F1B, not {plan.schedule}")
    return replace(plan, pipelines=tuple(pipes), schedule=schedule, virtual_stages=v)


def lightened_chunks(split: list[int] | tuple[int, ...], v: int) -> tuple[tuple[int, ...], ...]:
    """Returns per stage ``v`` chunks splitting its layers as evenly as possible; the first
    stage's lighter chunks come first (beside the embedding), the last stage's last (beside
    the head), other stages' extra layers go to their later chunks."""
    out = []
    p = len(split)
    for j, n in enumerate(split):
        base, extra = divmod(n, v)
        chunks = [base] * v
        order = range(v - 1, -1, -1) if j < p - 1 or p == 1 else range(v)
        for c in list(order)[:extra]:
            chunks[c] += 1
        out.append(tuple(chunks))
    return tuple(out)

"""Memory caps compared at one position per distinct cap key (``cap_positions``) decide
exactly what comparing every ``caps_row`` decides, and ``caps_row`` is ``max_layers`` at
every position: against the full comparison, position by position."""

from __future__ import annotations

import itertools

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search.grouping import device_classes
from hetplan.search.het_tables import Knobs, cap_key, cap_positions, class_table

MODEL = load_model("gpt3-1.3b")
CLUSTER = parse_inline_cluster("A100-40GB:1x8,V100-16GB:1x8,T4:1x4")
SCHEDULES = [("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)]


def _tables(rc: str, mb: int, sched: str, v: int, zeros: tuple[int, ...]):
    knobs = Knobs(mb, rc, zeros[0], 2, "fp16", True, sched, v, zero_choices=zeros)
    return [class_table(MODEL, c, 1, knobs, default_params()) for c in device_classes(CLUSTER)]


@pytest.mark.parametrize(("sched", "v"), SCHEDULES)
def test_caps_row_is_max_layers_everywhere(sched, v):
    for table in _tables("none", 2, sched, v, (1,)):
        for p in range(1, 25):
            assert table.caps_row(p) == tuple(table.max_layers(j, p) for j in range(p))


@pytest.mark.parametrize(("sched", "v"), SCHEDULES)
def test_cap_positions_decide_as_full_rows(sched, v):
    most = 24
    settings = [
        (rc, mb, zeros)
        for rc, mb, zeros in itertools.product(
            ("none", "selective", "full"), (1, 2, 4, 8), ((1,), (2, 3))
        )
    ]
    tables = {s: _tables(s[0], s[1], sched, v, s[2]) for s in settings}
    same = differ = 0
    for a, b in itertools.combinations(settings, 2):
        for x, y in zip(tables[a], tables[b], strict=True):
            full = all(x.caps_row(p) == y.caps_row(p) for p in range(1, most + 1))
            short = all(
                x.max_layers(j, p) == y.max_layers(j, p) for j, p in cap_positions(sched, v, most)
            )
            assert full == short
            same += full
            differ += not full
    assert same > 0 and differ > 0  # both outcomes occur: the comparison is exercised


@pytest.mark.parametrize(("sched", "v"), SCHEDULES)
def test_cap_positions_cover_every_key_once(sched, v):
    most = 32
    every = {cap_key(sched, v, j, p) for p in range(1, most + 1) for j in range(p)}
    got = [cap_key(sched, v, j, p) for j, p in cap_positions(sched, v, most)]
    assert len(got) == len(set(got)) and set(got) == every


@pytest.mark.parametrize(("sched", "v"), SCHEDULES)
def test_max_layers_depends_on_the_key_alone(sched, v):
    """Computed afresh at every position (a new table each time, no shared cache), the
    caps of positions with one key agree."""
    by_key: dict[tuple[object, ...], set[tuple[int, ...]]] = {}
    for p in range(1, 11):
        for j in range(p):
            caps = tuple(t.max_layers(j, p) for t in _tables("selective", 4, sched, v, (1,)))
            by_key.setdefault(cap_key(sched, v, j, p), set()).add(caps)
    assert all(len(found) == 1 for found in by_key.values())
    assert len({c for found in by_key.values() for c in found}) > 1


def _tables_tp(rc: str, mb: int, flash: bool, tp: int, sp: bool | None = None):
    knobs = Knobs(mb, rc, 1, 2, "fp16", flash, "1F1B", 1, sequence_parallel=sp, zero_choices=(1,))
    return [class_table(MODEL, c, tp, knobs, default_params()) for c in device_classes(CLUSTER)]


def test_flash_attention_leaves_selective_recomputation_nothing_to_drop():
    # Korthikanti et al. 2022: selective recomputation drops the attention's s^2 terms
    # (softmax output, dropout mask and output), which flash attention never stores
    for tp in (1, 2):
        for x, y in zip(_tables_tp("selective", 2, True, tp), _tables_tp("none", 2, True, tp),
                        strict=True):  # fmt: skip
            assert x.same_activations(y)
        for x, y in zip(_tables_tp("selective", 2, False, tp), _tables_tp("none", 2, False, tp),
                        strict=True):  # fmt: skip
            assert not x.same_activations(y)
        for x, y in zip(_tables_tp("full", 2, True, tp), _tables_tp("none", 2, True, tp),
                        strict=True):  # fmt: skip
            assert not x.same_activations(y)


def test_same_activations_means_the_same_caps_everywhere():
    """The shortcut of the recomputation dominance check: wherever it says two settings
    hold the same activations, ``max_layers`` agrees at every position of up to 24 stages
    (computed in full); over settings where both answers occur."""
    settings = list(itertools.product(("none", "selective", "full"), (1, 4), (True, False),
                                      (1, 2), (None, False)))  # fmt: skip
    tables = {s: _tables_tp(*s) for s in settings}
    shortcut = 0
    for a, b in itertools.combinations(settings, 2):
        if a[1:] != b[1:]:  # the check compares recomputations of one setting
            continue
        for x, y in zip(tables[a], tables[b], strict=True):
            if x.same_activations(y):
                shortcut += 1
                for p in range(1, 25):
                    assert x.caps_row(p) == y.caps_row(p)
    assert shortcut > 0

"""The interleaved stage orders are PyTorch's own (``ScheduleInterleaved1F1B``, the schedule
``launch`` runs): every stage of every pipeline of 2-5 stages, 2-3 chunks and every count of
micro-batches it runs, including the counts p does not divide (micro-batches in groups of
m // (m // p), ``interleave_group``), which the cost model used to refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hetplan.cost.schedule import interleave_fits, interleave_group, stage_order

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Returns the actions PyTorch computes for ``rank`` as (kind, micro-batch, chunk). The
    stages are descriptors of the fields the schedule reads to order its actions (it runs
    nothing here)."""
    stages = [
        SimpleNamespace(num_stages=p * v, group_size=p, group_rank=rank, stage_index=rank + c * p,
                        is_last=rank + c * p == p * v - 1, stage_index_to_group_rank=None)
        for c in range(v)
    ]  # fmt: skip
    schedule = torch_schedules.ScheduleInterleaved1F1B(stages, m, loss_fn=lambda a, b: a)
    kinds = torch_schedules._ComputationType
    out = []
    for act in schedule.pipeline_order[rank]:
        if act is None:
            continue
        kind = "F" if act.computation_type == kinds.FORWARD else "B"
        out.append((kind, act.microbatch_index, act.stage_index // p))
    return out


def test_interleaved_orders_are_pytorchs():
    checked = flexible = 0
    for p in range(2, 6):
        for v in (2, 3):
            for m in range(1, 4 * p + 3):
                if not interleave_fits(p, m):
                    continue
                flexible += m % p != 0
                for rank in range(p):
                    ours = stage_order("Interleaved1F1B", p, m, v, rank)
                    assert ours == _torch_order(p, v, m, rank), (p, v, m, rank)
                    checked += 1
    assert flexible >= 20 and checked > 200


def test_groups_by_hand():
    """p = 4: 8 micro-batches in groups of 4; 10 in two rounds of 5; 7 in one of 7; not 9
    or 11 (2 rounds of 4.5 or 5.5), nor 3 (fewer than the stages)."""
    assert interleave_group(4, 8) == 4 and interleave_group(4, 10) == 5
    assert interleave_group(4, 7) == 7
    assert [interleave_fits(4, m) for m in (3, 7, 8, 9, 10, 11, 12)] == [
        False, True, True, False, True, False, True,
    ]  # fmt: skip
    # stage 0 of 4 with 2 chunks at m = 10 runs (v - 1) 5 + 2 (4 - 1) = 11 forwards first:
    # micro-batches 0-4 through chunk 0, 0-4 through chunk 1, then 5 through chunk 0
    order = stage_order("Interleaved1F1B", 4, 10, 2, 0)
    assert order[:11] == [("F", i, 0) for i in range(5)] + [("F", i, 1) for i in range(5)] + [
        ("F", 5, 0)
    ]
    assert order[11:13] == [("F", 6, 0), ("B", 0, 1)]

"""``memory_micro_batches``: past it, a stage holds no more (``peak_in_flight`` and
``held_layers`` the same at every larger micro-batch count), brute force over small
pipelines and every schedule."""

import itertools

from hetplan.cost.schedule import held_layers, memory_micro_batches, peak_in_flight

SCHEDULES = [("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 3),
             ("Interleaved1F1B", 4), ("GPipe", 1), ("GPipe", 2)]  # fmt: skip


def _held(schedule, p, m, v, j, chunks):
    return peak_in_flight(schedule, p, m, v, j), held_layers(schedule, p, m, j, chunks)


def test_memory_stops_growing_at_memory_micro_batches():
    for (schedule, v), p in itertools.product(SCHEDULES, range(1, 7)):
        for j in range(p):
            # uneven chunks, so that which chunk is in flight matters
            chunks = tuple(range(1, v + 1)) if v > 1 else (3,)
            # interleaved, the counts p divides (groups of p); the others group otherwise
            # (``interleave_group``) and are their own (tested below)
            step = p if schedule == "Interleaved1F1B" else 1
            for m in range(step, 4 * p * v + 3, step):
                k = memory_micro_batches(schedule, p, m, v, j)
                assert 1 <= k <= m
                assert _held(schedule, p, k, v, j, chunks) == _held(schedule, p, m, v, j, chunks)
                if k < m:  # saturated: so it is at every larger count
                    assert memory_micro_batches(schedule, p, m + step, v, j) == k


def test_interleaved_groups_other_than_p_hold_more_at_fewer_micro_batches():
    """p = 4, v = 2: at 7 micro-batches (one group of 7) stage 0 runs (2 - 1) 7 + 2 (4 - 1)
    = 13 forwards before its first backward and holds 14 chunk-micro-batches; at 8 (groups
    of 4) it runs 4 + 6 = 10 and holds 11. A count grouped otherwise is its own
    ``memory_micro_batches``."""
    assert peak_in_flight("Interleaved1F1B", 4, 7, 2, 0) == 14
    assert peak_in_flight("Interleaved1F1B", 4, 8, 2, 0) == 11
    assert memory_micro_batches("Interleaved1F1B", 4, 7, 2, 0) == 7
    assert memory_micro_batches("Interleaved1F1B", 4, 10, 2, 0) == 10


def test_one_f_one_b_saturates_at_the_stages_after_it_by_hand():
    # 1F1B: stage j holds p - j micro-batches once m reaches p - j
    assert memory_micro_batches("1F1B", 4, 10, 1, 0) == 4
    assert memory_micro_batches("1F1B", 4, 10, 1, 3) == 1
    assert memory_micro_batches("1F1B", 4, 2, 1, 0) == 2
    assert peak_in_flight("1F1B", 4, 10, 1, 0) == peak_in_flight("1F1B", 4, 4, 1, 0) == 4
    assert memory_micro_batches("GPipe", 4, 10, 1, 0) == 10

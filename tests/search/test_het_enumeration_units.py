"""The enumeration's shortcut for each stage's micro-batches in flight is the schedule's
own count (``peak_in_flight``), at every count, for every schedule, and once two counts in
a row hold the same (GPipe aside) no later count holds more."""

import itertools

from hetplan.cost.schedule import peak_in_flight, warmup_forwards
from hetplan.search.het_enumeration import held_units


def test_held_units_are_peak_in_flight():
    checked = 0
    for schedule, p, v in itertools.product(("GPipe", "1F1B", "Interleaved1F1B"),
                                            range(1, 9), range(1, 5)):  # fmt: skip
        big = p * (p + v + 2)
        warm = [warmup_forwards(schedule, p, big, v, j) for j in range(p)]
        gpipe, interleaved = schedule == "GPipe", schedule == "Interleaved1F1B" and v > 1
        before, settled = None, None
        # interleaved, the enumeration visits the counts p divides (``_Budget.step``): their
        # groups are p, which its warm-ups assume
        step = p if interleaved else 1
        for m in range(step, 3 * p * v + 3, step):
            want = [peak_in_flight(schedule, p, m, v, j) for j in range(p)]
            assert held_units(gpipe, interleaved, v, warm, m) == want, (schedule, p, v, m)
            # the enumeration stops counting once two counts in a row hold the same (but
            # under GPipe): it must never change again
            if settled is not None:
                assert want == settled, (schedule, p, v, m)
            elif want == before and not gpipe:
                settled = want
            before = want
            checked += 1
    assert checked > 1000

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


def test_the_budget_bounds_the_selection_steps(monkeypatch):
    """Each extension of a selection of pipelines is a step of the budget, and a complete
    selection costs a bound and a memory check per pipeline and ZeRO choice: on eight
    single-GPU nodes of two types (GPT-2, where the selections multiply) the enumeration
    takes no more extensions than its budget, and gives up unproven once it is spent."""
    from hetplan.cluster import Cluster
    from hetplan.model import load_model
    from hetplan.search import het_enumeration
    from hetplan.search.heterogeneous import search_with

    from .conftest import one_offer

    calls = {"dfs": 0, "run": 0}
    dfs, run = het_enumeration.Enumeration._dfs, het_enumeration.Enumeration.run

    def counted_dfs(self, *args):
        calls["dfs"] += 1
        return dfs(self, *args)

    def counted_run(self):
        calls["run"] += 1
        return run(self)

    monkeypatch.setattr(het_enumeration.Enumeration, "_dfs", counted_dfs)
    monkeypatch.setattr(het_enumeration.Enumeration, "run", counted_run)
    a, b = one_offer("RTX 3090", 1, 6), one_offer("L4", 1, 2)
    cluster = Cluster(a.cluster(6).nodes + b.cluster(2).nodes)
    budget = 1_000_000
    res = search_with(load_model("gpt2"), cluster, 16, "fp16", enumerate_budget=budget)
    assert res.ranked
    assert calls["run"] >= 1
    # every call but each setting's first is an extension, paid for before it is made
    assert calls["dfs"] - calls["run"] <= budget
    assert any("not proven" in n for n in res.notes)

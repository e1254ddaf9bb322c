"""Placements of a selection's stages on nodes (``het_variants.placements``): with copies
of single-stage pipelines told apart (``kinds``), every placement up to swapping copies
comes once, and the same ones as the labelled enumeration, compared up to relabelling
interchangeable nodes (by brute force over node permutations). And the plan bound of a
placed plan charges the reductions of the nodes its holders really span."""

import itertools
import random

import pytest

from hetplan.cluster import cluster_from_dict, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage, validate_plan
from hetplan.search.grouping import device_classes
from hetplan.search.het_bounds import PlanBounds
from hetplan.search.het_variants import placements


class _Table:
    """What ``placements`` reads of a class table: the class and its TP degree."""

    def __init__(self, cls, tp):
        self.cls, self.tp = cls, tp


def _norm(layout, seqs, kinds, perms):
    """A placement as a plan sees it, the same under swaps of copies, of a node's GPUs and
    of a class's nodes: per pipeline its kind and its stages' nodes, least over the node
    relabellings."""
    base = [(kinds[r], tuple(layout[(r, j)][0].rpartition(":")[0] for j in range(len(seq))))
            for r, seq in enumerate(seqs)]  # fmt: skip
    return min(tuple(sorted((k, tuple(pm[x] for x in st)) for k, st in base)) for pm in perms)


@pytest.mark.parametrize(
    "spec", ["A100-80GB:3x4,T4:1x2", "A100-80GB:2x4,T4:2x2", "T4:4x2,L4:3x1", "V100-16GB:3x2"]
)
def test_copies_are_placed_once_each(spec):
    rng = random.Random(spec)
    classes = device_classes(parse_inline_cluster(spec))
    names = [[n.name for n in c.nodes] for c in classes]
    flat = [x for ns in names for x in ns]
    perms = [
        dict(zip(flat, [x for p in ps for x in p], strict=True))
        for ps in itertools.product(*(itertools.permutations(ns) for ns in names))
    ]
    checked = 0
    for _ in range(60):
        tables = [_Table(c, rng.choice([1, 2]) if c.gpus_per_node % 2 == 0 else 1)
                  for c in classes]  # fmt: skip
        room = [
            len(c.nodes) * (c.gpus_per_node // t.tp) for c, t in zip(classes, tables, strict=True)
        ]
        seqs, kinds = [], []
        for _ in range(rng.randint(2, 9)):
            seq = tuple(rng.randrange(len(classes)) for _ in range(rng.choice([1, 1, 1, 2])))
            need = [seq.count(c) for c in range(len(classes))]
            if any(n > r for n, r in zip(need, room, strict=True)):
                continue
            room = [r - n for r, n in zip(room, need, strict=True)]
            seqs.append(seq)
            kinds.append((seq, rng.choice("ab") if len(seq) == 1 else len(seqs)))
        labelled = {_norm(x, seqs, kinds, perms) for x in placements(tables, seqs)}
        once = [_norm(x, seqs, kinds, perms) for x in placements(tables, seqs, kinds)]
        assert set(once) == labelled
        assert len(once) == len(set(once))
        checked += len(labelled) > 1
    assert checked > 10


def test_plan_bound_charges_the_nodes_the_holders_span():
    """Eight single-GPU replicas of a GPT-2-sized model on three nodes of four A100 joined
    by 10 Gbit/s. Packed 4 + 4, each layer's all-reduce sends a quarter of its fp32
    gradients once around two nodes from four GPUs sharing a link: 1 byte per byte of
    gradients over the link. Spread 4 + 3 + 1, the lone member's node makes the shard the
    whole buffer, 2 x 2/3 of it around three nodes from the four of the fullest: 16/3 bytes
    per byte. The bound of the spread plan charges that (the floor that did not know the
    nodes charged 1 byte per byte for every placement): within 2% of ``estimate``, never
    above, and the packed plan's bound still never above its own."""
    nodes = [{"name": f"n{i}", "gpu": "A100-80GB", "gpus": 4, "network_bandwidth": "10Gbit/s"}
             for i in range(3)]  # fmt: skip
    cluster = cluster_from_dict({"nodes": nodes})
    model = ModelSpec("gpt2ish", "gpt", 12, 768, 12, 12, 3072, 50257, 1024)
    params = default_params()
    net = cluster.nodes[0].network_bytes_per_s * params.network_efficiency_of("A100-80GB")
    fp32 = 4.0 * model.total_params()
    got = {}
    for name, devs in (("packed", ["n0:0", "n0:1", "n0:2", "n0:3", "n1:0", "n1:1", "n1:2",
                                   "n1:3"]),
                       ("spread", ["n0:0", "n0:1", "n0:2", "n0:3", "n1:0", "n1:1", "n1:2",
                                   "n2:0"])):  # fmt: skip
        pipes = tuple(Pipeline(2, (Stage(12, (d,)),)) for d in devs)
        plan = Plan(global_batch_size=16, micro_batch_size=2, pipelines=pipes, zero_stage=0)
        validate_plan(plan, model, cluster)
        est = estimate(plan, model, cluster, params).iteration_time_s
        bound = PlanBounds(model, cluster, params).bound_s(plan)
        assert bound <= est
        got[name] = (bound, est)
    bound, est = got["spread"]
    assert bound >= 16 / 3 * fp32 / net  # the whole reduction, by hand
    assert bound >= 0.98 * est
    assert got["packed"][0] < 0.5 * bound  # the packed plan reduces five times faster


def test_kept_placements_are_those_of_each_selection(monkeypatch):
    """The enumeration keeps a selection's placements for the selections of the same shape
    (``Enumeration._layouts``: TP degrees, classes per pipeline, which pipelines are
    copies): each selection placed in a search of GPT-2 on three A100 nodes of 4 and a T4
    node of 2 gets exactly the placements ``placements`` gives it afresh, and most of them
    come from the memo, from selections of other pipelines and micro-batches."""
    from hetplan.cluster import Cluster
    from hetplan.model import load_model
    from hetplan.search import het_enumeration
    from hetplan.search.heterogeneous import search_with

    from .conftest import one_offer

    seen = {"calls": 0, "kept": 0, "other": 0}
    first: dict[object, tuple[tuple[int, int], ...]] = {}
    place = het_enumeration.Enumeration.place

    def checked(self, bound_s, sel, z, sp):
        seqs = [self.pipes[i].classes for i, _ in sel]
        key = (self.tps, tuple(seqs), tuple(list(sel).index(x) for x in sel))
        kept = key in self.layouts
        got = list(self._layouts(seqs, sel))
        assert got == list(placements(self.tables, seqs, list(sel)))
        seen["calls"] += 1
        seen["kept"] += kept
        seen["other"] += kept and first.setdefault(key, sel) != sel
        first.setdefault(key, sel)
        return place(self, bound_s, sel, z, sp)

    monkeypatch.setattr(het_enumeration.Enumeration, "place", checked)
    a, t4 = one_offer("A100-80GB", 4, 3), one_offer("T4", 2, 1)
    cluster = Cluster(a.cluster(3).nodes + t4.cluster(1).nodes)
    res = search_with(load_model("gpt2"), cluster, 16, "fp16")
    assert res.ranked
    assert seen["calls"] > 20
    assert seen["other"] > seen["calls"] / 2


def test_placed_bounds_kept_by_segment_floors_are_each_placements_own(monkeypatch):
    """The enumeration keeps a placed selection's bound by its segments' reduction floors
    (``Enumeration._placed_bound_s``: placements moving holders between alike nodes share
    it). In a search of GPT-2 on three A100 nodes of 4 and a T4 node of 2, every placement's
    kept bound equals the bound computed afresh from its plan's own floors
    (``dp_sync.placed_reduction_floors``, the path ``PlanBounds`` takes), and most bounds
    come from the memo."""
    from hetplan.cluster import Cluster
    from hetplan.cost.dp_sync import placed_reduction_floors
    from hetplan.model import load_model
    from hetplan.search import het_enumeration
    from hetplan.search.heterogeneous import search_with

    from .conftest import one_offer

    model = load_model("gpt2")
    seen = {"calls": 0, "kept": 0}
    kept_bound = het_enumeration.Enumeration._placed_bound_s

    def checked(self, sel, shards, kind, layout, segments):
        before = len(self._placed)
        got = kept_bound(self, sel, shards, kind, layout, segments)
        seen["calls"] += 1
        seen["kept"] += len(self._placed) == before
        k = self.knobs
        pipes = [
            Pipeline(m * k.micro_batch,
                     tuple(Stage(x, layout[(r, j)]) for j, x in enumerate(self.pipes[i].layers)))
            for r, (i, m) in enumerate(sel)
        ]  # fmt: skip
        plan = Plan(self.s.global_batch, k.micro_batch, tuple(pipes), precision=k.precision,
                    zero_stage=1, schedule=k.schedule, virtual_stages=k.virtual_stages)  # fmt: skip
        floors = placed_reduction_floors(plan, model, self.s.bounds.node, self.s.params)
        want = self.selection_bound_s(sel, shards, kind, floors)
        assert got == pytest.approx(want, rel=1e-12, abs=0)
        return got

    monkeypatch.setattr(het_enumeration.Enumeration, "_placed_bound_s", checked)
    a, t4 = one_offer("A100-80GB", 4, 3), one_offer("T4", 2, 1)
    cluster = Cluster(a.cluster(3).nodes + t4.cluster(1).nodes)
    res = search_with(model, cluster, 16, "fp16")
    assert res.ranked
    assert seen["calls"] > 10_000
    assert seen["kept"] > seen["calls"] / 2

"""Search by segments: exact (equals A* and exhaustive enumeration) and reuses layers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetplan.spmd.capture import capture
from hetplan.spmd.costmodel import uniform_link_devices
from hetplan.spmd.examples import bert_base, vit
from hetplan.spmd.search import astar, exhaustive, greedy, search
from hetplan.spmd.segments import segment_search, segments
from hetplan.spmd.space import Space


class Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return F.mse_loss(x, y)


def _exhaustive_memo(space: Space) -> float:
    """Every rule choice enumerated, cost-to-go memoised by full state (no memory limit)."""
    assert space.capacity is None
    memo: dict[tuple[int, object], float] = {}

    def go(i: int, state) -> float:
        if i == len(space.nodes):
            return 0.0
        key = (i, state)
        if key not in memo:
            memo[key] = min(
                (
                    s.cost_s + go(i + 1, space.advance(i, state, s))
                    for s in space.steps(i, dict(state))
                ),
                default=math.inf,
            )
        return memo[key]

    return go(0, ())


def test_memoised_reference_equals_plain_enumeration() -> None:
    space = Space(_stack(1), uniform_link_devices([1e9, 3e9], bytes_per_s=1e8), [0.25, 0.75])
    assert _exhaustive_memo(space) == pytest.approx(exhaustive(space), abs=1e-12)


def _stack(layers: int, batch: int = 8, d: int = 4):
    torch.manual_seed(0)
    return capture(Stack(d, layers), (torch.randn(batch, d), torch.randn(batch, d)))


def _bert(layers: int = 2):
    torch.manual_seed(0)
    module, inputs = bert_base(batch=6, seq=4, hidden=12, layers=layers, heads=2, vocab=9)
    return capture(module, inputs)


def _vit(layers: int = 2):
    torch.manual_seed(0)
    module, inputs = vit(batch=6, image=8, patch=4, hidden=12, layers=layers, heads=2, classes=5)
    return capture(module, inputs)


@pytest.mark.parametrize(
    ("flops", "ratios", "bw"),
    [([1e9, 3e9], [0.25, 0.75], 1e8), ([1e9, 2e9, 1e9], [0.25, 0.5, 0.25], 1e7)],
)
def test_segments_equal_exhaustive_enumeration(flops, ratios, bw) -> None:
    space = Space(_stack(3), uniform_link_devices(flops, bytes_per_s=bw), ratios)
    res = segment_search(space)
    assert res is not None
    assert res.cost_s == pytest.approx(_exhaustive_memo(space), abs=1e-9)
    assert sum(i.cost.at(ratios) for i in res.instrs) == pytest.approx(res.cost_s, abs=1e-12)


@pytest.mark.parametrize(
    ("make", "flops", "ratios", "bw"),
    [
        (lambda: _stack(4), [1e9, 3e9], [0.3, 0.7], 1e9),
        (lambda: _stack(4), [2e9, 1e9, 1e9], [0.5, 0.3, 0.2], 1e8),
        (_bert, [1e9, 3e9], [0.3, 0.7], 1e9),
        (_bert, [2e9, 1e9, 1e9], [0.5, 0.3, 0.2], 1e8),
        (_vit, [2e9, 1e9, 1e9], [0.5, 0.3, 0.2], 1e8),
    ],
)
def test_segments_equal_astar(make, flops, ratios, bw) -> None:
    cap = make()
    devs = uniform_link_devices(flops, bytes_per_s=bw)
    space = Space(cap, devs, ratios)
    res = segment_search(space)
    assert res is not None
    ref = astar(Space(cap, devs, ratios), greedy(Space(cap, devs, ratios)))
    assert res.cost_s == pytest.approx(ref.cost_s, abs=1e-9)
    # the joined program is a complete program of this graph: every compute node runs
    # once, under its own name, and the instruction costs add up to the reported time
    ran = [i.node for i in res.instrs if i.kind == "op"]
    computes = [n.name for n in cap.nodes if n.op == "compute"]
    assert sorted(ran) == sorted(computes)
    assert sum(i.cost.at(ratios) for i in res.instrs) == pytest.approx(res.cost_s, abs=1e-12)


def test_transformer_layers_are_solved_once() -> None:
    space = Space(_bert(layers=3), uniform_link_devices([1e9, 2e9]), [0.4, 0.6])
    segs = segments(space)
    signatures = [s.signature for s in segs]
    assert len(set(signatures)) < len(signatures)
    # the layers' segments repeat with the layer's period
    period = len(segs) - len(segments(Space(_bert(layers=2), space.devs, space.b)))
    assert period > 0
    assert any(signatures[k] == signatures[k + period] for k in range(len(segs) - period))
    one = segment_search(space)
    assert one is not None
    # three layers enumerate as many states as two: the third reuses the tables
    two = segment_search(Space(_bert(layers=2), space.devs, space.b))
    assert two is not None and one.expanded == two.expanded


def test_memory_limit_falls_back_to_astar() -> None:
    cap = _stack(3, batch=512, d=64)
    free = segment_search(Space(cap, uniform_link_devices([1e9, 1e9], bytes_per_s=1e11), [0.5] * 2))
    assert free is not None
    need = free.rep_bytes + 0.5 * free.shard_bytes
    devs = uniform_link_devices([1e9, 1e9], bytes_per_s=1e11, capacity_bytes=0.98 * need)
    space = Space(cap, devs, [0.5, 0.5])
    assert segment_search(space) is None
    res = search(space)
    assert space.fits(res.rep_bytes, res.shard_bytes)
    assert res.cost_s > free.cost_s


def test_states_list_live_tensors_in_production_order_once() -> None:
    # Every state reachable on a two-layer BERT, position by position, two ways: through
    # ``successors`` (which keeps a state's tensors in the order they were produced, with
    # no sort), and by hand from each step's updates (dead tensors dropped, then sorted by
    # name: one canonical form per content). The same contents
    # at every position, each exactly once, with the same least cost.
    space = Space(_bert(layers=2), uniform_link_devices([1e9, 2e9]), [0.4, 0.6])
    position = {node.name: i for i, node in enumerate(space.nodes)}
    ours: dict[tuple, float] = {(): 0.0}
    theirs: dict[tuple, float] = {(): 0.0}
    for i in range(len(space.nodes)):
        nxt: dict[tuple, float] = {}
        for state, g in ours.items():
            pairs = space.successors(i, state)
            assert [s for s, _ in pairs] == space.steps(i, dict(state))
            for step, new in pairs:
                assert new == space.advance(i, state, step)
                assert [position[t] for t, _ in new] == sorted(position[t] for t, _ in new)
                nxt[new] = min(nxt.get(new, math.inf), g + step.cost_s)
        ref: dict[tuple, float] = {}
        for state, g in theirs.items():
            for step in space.steps(i, dict(state)):
                live = dict(state) | dict(step.updates)
                new = tuple(sorted((t, ls) for t, ls in live.items() if space.last_use[t] > i))
                ref[new] = min(ref.get(new, math.inf), g + step.cost_s)
        ours, theirs = nxt, ref
        assert len(ours) == len(theirs)
        assert {frozenset(s): g for s, g in ours.items()} == {
            frozenset(s): g for s, g in theirs.items()
        }
    assert min(ours.values()) == pytest.approx(segment_search(space).cost_s, abs=1e-12)

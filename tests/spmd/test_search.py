"""A* against exhaustive enumeration, heuristic admissibility, ratio LP and rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetplan.spmd.capture import capture
from hetplan.spmd.costmodel import uniform_link_devices
from hetplan.spmd.layout import shard_sizes, split_units
from hetplan.spmd.ratios import solve_ratios
from hetplan.spmd.search import astar, exhaustive, greedy, search
from hetplan.spmd.space import Space
from hetplan.spmd.synth import synthesize


class TwoLayer(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(torch.relu(self.a(x))), y)


class Tiny(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.a(x), y)


def _two_layer(batch: int = 8, d: int = 4, h: int = 8):
    torch.manual_seed(0)
    return capture(TwoLayer(d, h), (torch.randn(batch, d), torch.randn(batch, d)))


def _tiny():
    torch.manual_seed(0)
    return capture(Tiny(6), (torch.randn(12, 6), torch.randint(0, 6, (12,))))


CASES = [
    (_tiny, [1e9, 3e9], [0.25, 0.75], 1e8),
    (_tiny, [1e9, 2e9, 1e9], [0.25, 0.5, 0.25], 1e9),
    (_two_layer, [1e9, 2e9], [0.4, 0.6], 1e9),
    (_two_layer, [2e9, 1e9], [0.5, 0.5], 1e7),
]


@pytest.mark.parametrize(("make", "flops", "ratios", "bw"), CASES)
def test_astar_equals_exhaustive(make, flops, ratios, bw) -> None:
    cap = make()
    space = Space(cap, uniform_link_devices(flops, bytes_per_s=bw), ratios)
    best = astar(space, greedy(space))
    assert best.cost_s == pytest.approx(exhaustive(space), abs=1e-9)
    assert sum(i.cost.at(ratios) for i in best.instrs) == pytest.approx(best.cost_s, abs=1e-12)


@pytest.mark.parametrize(("make", "flops", "ratios", "bw"), CASES)
def test_heuristic_never_overestimates(make, flops, ratios, bw) -> None:
    cap = make()
    space = Space(cap, uniform_link_devices(flops, bytes_per_s=bw), ratios)
    checked = []

    def check(i, state, g, h) -> None:
        exact = exhaustive(space, i, state)
        assert h <= exact + 1e-12, (i, state, h, exact)
        checked.append(h)

    astar(space, None, check)
    assert checked and any(h > 0 for h in checked)


def test_lp_ratios_do_not_increase_the_program_time() -> None:
    cap = _two_layer(batch=64, d=16, h=64)
    devs = uniform_link_devices([1e9, 4e9, 2e9], bytes_per_s=1e9)
    start = [1 / 3] * 3
    res = search(Space(cap, devs, start))
    lp = solve_ratios(res.instrs, devs)
    assert lp is not None
    ratios, time_s = lp
    assert sum(ratios) == pytest.approx(1.0)
    assert time_s <= res.cost_s + 1e-12
    assert time_s == pytest.approx(sum(i.cost.at(ratios) for i in res.instrs), rel=1e-6)
    assert ratios[1] > ratios[2] > ratios[0]


def test_synthesis_beats_or_matches_data_parallel() -> None:
    cap = _two_layer(batch=64, d=16, h=64)
    devs = uniform_link_devices([1e9, 4e9, 2e9], bytes_per_s=1e9)
    out = synthesize(cap, devs)
    assert out.predicted_time_s <= out.dp_cp_time_s + 1e-12
    assert out.predicted_time_s <= out.dp_ev_time_s + 1e-12
    assert out.program.time_s() == pytest.approx(out.predicted_time_s)


def test_memory_limit_is_respected() -> None:
    cap = _two_layer(batch=8, d=64, h=256)
    weights_bytes = (64 * 256 * 2 + 256) * 4 * 4.0
    devs = uniform_link_devices([1e9, 1e9], bytes_per_s=1e9, capacity_bytes=0.75 * weights_bytes)
    space = Space(cap, devs, [0.5, 0.5])
    res = search(space)
    assert space.fits(res.rep_bytes, res.shard_bytes)
    params = [i for i in res.instrs if i.kind == "param"]
    assert any(i.output is not None and i.output.kind == "S" for i in params)


@pytest.mark.parametrize("units", [0, 1, 7, 100, 1023])
@pytest.mark.parametrize("ratios", [[0.5, 0.3, 0.2], [0.1] * 10, [0.7, 0.3], [1 / 3] * 3])
def test_rounding_stays_within_one_unit(units, ratios) -> None:
    counts = split_units(units, ratios)
    assert sum(counts) == units
    assert all(abs(c - r * units) < 1 for c, r in zip(counts, ratios, strict=True))


def test_shard_sizes_keep_whole_granules() -> None:
    assert shard_sizes(96, 8, [0.5, 0.3, 0.2]) == [48, 32, 16]

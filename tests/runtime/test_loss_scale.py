"""fp16's dynamic loss scaling (Micikevicius et al. 2018) by hand on a one-process gloo
group: unscaling divides by the scale, an inf or NaN skips the step and halves the scale,
``growth_interval`` good steps in a row double it; bf16/fp32 use a fixed scale of 1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetplan.runtime.precision import LossScaler


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dynamic_loss_scale_by_hand(one_rank: None) -> None:
    cpu = torch.device("cpu")
    s = LossScaler(True, init_scale=8.0, growth_interval=3)
    grads = [torch.tensor([4.0, -2.0]), torch.tensor([8.0])]
    assert s.unscale_and_check(grads, cpu)
    assert [g.tolist() for g in grads] == [[0.5, -0.25], [1.0]]  # divided by 8
    s.update(True)
    # an overflow in any gradient: the step is skipped and the scale halved, the count reset
    assert not s.unscale_and_check([torch.tensor([1.0]), torch.tensor([float("inf")])], cpu)
    s.update(False)
    assert (s.scale, s.skipped, s.good_steps) == (4.0, 1, 0)
    assert not s.unscale_and_check([torch.tensor([float("nan")])], cpu)
    s.update(False)
    assert s.scale == 2.0
    for _ in range(2):  # two good steps: not yet
        assert s.unscale_and_check([torch.tensor([1.0])], cpu)
        s.update(True)
    assert s.scale == 2.0
    s.update(True)  # the third in a row doubles it
    assert (s.scale, s.good_steps, s.skipped) == (4.0, 0, 2)


def test_fixed_scale_without_fp16() -> None:
    s = LossScaler(False)
    g = torch.tensor([float("inf"), 3.0])
    assert s.scale == 1.0 and s.unscale_and_check([g], torch.device("cpu"))  # no collective
    s.update(False)
    assert s.scale == 1.0 and s.skipped == 0 and g[1].item() == 3.0

"""ZeRO-3 layers in a pipeline stage sync as the cost model prices them
(``cost.sharding.deferred_sync``): with ``DeferredStage`` a step of m micro-batches
reduce-scatters each layer's gradients once (after the last backward) and gathers its
parameters once, where plain FSDP per micro-batch does m reduce-scatters and 2m gathers;
the summed gradients are the same. Deferred, ranks running different micro-batch counts
(replicas with unequal batch shares) issue the same collectives and sum the same
gradients."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

MICRO_BATCHES = 4
HIDDEN = 8


def _worker(
    rank: int, world: int, init: str, deferred: bool, out: str, micro: tuple[int, ...]
) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hetplan.runtime import fsdp
    from hetplan.runtime.pipeline import DeferredStage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    counts = {"reduce_scatter": 0, "all_gather": 0}

    class Counting(fsdp.GlooReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            counts["reduce_scatter"] += 1
            return super().__call__(*args, **kwargs)

    class CountingGather(DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            counts["all_gather"] += 1
            return super().__call__(*args, **kwargs)

    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1))
        whole = dist.new_group([0, 1])
        layers = list(module)
        for layer in layers:
            fsdp.shard_block(layer, whole, torch.device("cpu"), reshard_after_forward=not deferred)
            layer.set_custom_reduce_scatter(Counting())  # type: ignore[operator]
            layer.set_custom_all_gather(CountingGather())  # type: ignore[operator]
        own = dist.new_group([rank])  # a one-stage pipeline per rank
        cls = DeferredStage if deferred else PipelineStage
        n = micro[rank]
        x = torch.randn(n * 2, HIDDEN, generator=torch.Generator().manual_seed(rank))
        y = torch.empty(2, 1, device="meta", requires_grad=True)  # no forward to infer it
        stage = cls(module, 0, 1, torch.device("cpu"), input_args=x[:2], output_args=y, group=own)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return (out * target).sum()

        sched = Schedule1F1B(stage, n, loss_fn=loss_fn, scale_grads=False)
        target = torch.ones(n * 2, 1)
        sched.step(x, target=target, losses=[])
        grads = [p.grad.full_tensor().tolist() for p in module.parameters()]
        Path(f"{out}.{rank}").write_text(json.dumps({"counts": counts, "grads": grads}))
    finally:
        dist.destroy_process_group()


def _run(
    tmp_path: Path, deferred: bool, micro: tuple[int, ...] = (MICRO_BATCHES, MICRO_BATCHES)
) -> list[dict]:
    """Returns each rank's collective counts and gathered gradients."""
    import torch.multiprocessing as mp

    tag = f"{int(deferred)}_{'_'.join(map(str, micro))}"
    out = tmp_path / f"out{tag}.json"
    init = f"file://{tmp_path / f'rdv{tag}'}"
    mp.spawn(_worker, args=(2, init, deferred, str(out), micro), nprocs=2, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def _reference(micro: tuple[int, ...] = (MICRO_BATCHES, MICRO_BATCHES)) -> list:
    """The same two layers unsharded, both ranks' micro-batches summed on one device."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1))
    for rank in (0, 1):
        x = torch.randn(micro[rank] * 2, HIDDEN, generator=torch.Generator().manual_seed(rank))
        module(x).sum().backward()
    return [p.grad.tolist() for p in module.parameters()]


@pytest.mark.distributed
@pytest.mark.slow
def test_deferred_stage_syncs_zero3_layers_once_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the spawned workers unpickle ``_worker`` from this module (``tests.runtime...`` under
    # pytest's importlib mode): the repository root must be on the path they inherit, which
    # the ``pytest`` console script, unlike ``python -m pytest``, does not put there
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    ref = _reference()
    plain = _run(tmp_path, deferred=False)[0]
    deferred = _run(tmp_path, deferred=True)[0]
    for got in (plain, deferred):
        for g, r in zip(got["grads"], ref, strict=True):
            assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-5, atol=1e-6)
    layers = 2
    # per micro-batch: a gather before the forward and the backward, a reduce-scatter after
    assert plain["counts"] == {
        "reduce_scatter": layers * MICRO_BATCHES,
        "all_gather": 2 * layers * MICRO_BATCHES,
    }
    # deferred: gathered at the first forward and held, reduce-scattered once at the end
    assert deferred["counts"] == {"reduce_scatter": layers, "all_gather": layers}


@pytest.mark.distributed
@pytest.mark.slow
def test_deferred_zero3_lines_up_unequal_micro_batch_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replicas with batch shares 6:4 (3 and 2 micro-batches of 2): per micro-batch the first
    # would gather each layer 6 times against the second's 4; deferred, both gather and
    # reduce-scatter each layer once, and the gradients are the sum over all 10 rows
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    micro = (3, 2)
    ref = _reference(micro)
    ranks = _run(tmp_path, deferred=True, micro=micro)
    for got in ranks:
        assert got["counts"] == {"reduce_scatter": 2, "all_gather": 2}
        for g, r in zip(got["grads"], ref, strict=True):
            assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-5, atol=1e-6)

"""A rank joins the process group on its own GPU: NCCL's barrier and object collectives use
the current CUDA device, so it is set to LOCAL_RANK's before the group is joined (on a
machine with several GPUs every rank would otherwise use GPU 0). No GPU here: the calls are
recorded, in order."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hetplan.runtime import worker  # noqa: E402


def test_cuda_rank_sets_its_device_before_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(worker.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend)))  # fmt: skip
    device = worker.init_distributed("cuda")
    assert device == torch.device("cuda", 3)
    assert calls == [("set_device", torch.device("cuda", 3)), ("init", "nccl")]


def test_cpu_rank_joins_gloo_without_touching_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(worker.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend)))  # fmt: skip
    assert worker.init_distributed("cpu") == torch.device("cpu")
    assert calls == [("init", "gloo")]


def test_launch_refuses_more_processes_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank r of a node uses GPU r: a node of 4 processes on a 1-GPU machine is refused
    before any process starts, naming --device."""
    from hetplan.errors import InputError
    from hetplan.runtime.launch import check_gpu_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpu_count(1)
    with pytest.raises(InputError) as exc:
        check_gpu_count(4)
    assert exc.value.field == "--device"
    assert "4 processes" in exc.value.reason and "has 1" in exc.value.reason

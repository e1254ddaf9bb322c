"""Capture: normalisation and reports of unsupported operators."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetplan.errors import InputError
from hetplan.spmd import examples
from hetplan.spmd.capture import capture


class Cumsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x * self.w, 0).sum()


def test_unsupported_operator_is_named_with_location() -> None:
    with pytest.raises(InputError) as err:
        capture(Cumsum(), (torch.randn(3, 4),))
    assert "cumsum" in str(err.value)
    assert "test_capture.py" in str(err.value)
    # the user's own line: the module's forward, not the test that called capture
    line = Cumsum.forward.__code__.co_firstlineno + 1
    assert f"test_capture.py:{line} in forward" in str(err.value)


def test_loss_must_be_scalar() -> None:
    with pytest.raises(InputError):
        capture(nn.Linear(3, 2), (torch.randn(4, 3),))


@pytest.mark.parametrize("name", ["mlp", "bert_base", "vit", "moe"])
def test_examples_capture_to_supported_ops(name: str) -> None:
    small = {
        "mlp": {},
        "bert_base": {"batch": 2, "seq": 4, "hidden": 8, "layers": 1, "heads": 2, "vocab": 11},
        "vit": {
            "batch": 2,
            "image": 8,
            "patch": 4,
            "hidden": 8,
            "layers": 1,
            "heads": 2,
            "classes": 3,
        },
        "moe": {},
    }[name]
    module, inputs = getattr(examples, name)(**small)
    cap = capture(module, inputs)
    assert cap.loss and cap.params
    linear_params = [n for n in cap.nodes if n.op == "param"]
    assert len(linear_params) == len(list(module.parameters()))
    assert all(n.spec is not None for n in cap.nodes if n.op == "compute")

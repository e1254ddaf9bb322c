"""The runtime's MLP runs the model's activation: ReLU for a ReLU model (OPT), tanh-GeLU
otherwise, against the two matmuls written out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from hetplan.model import load_model  # noqa: E402
from hetplan.runtime.model_torch import MLP  # noqa: E402


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_mlp_applies_the_models_activation(activation: str) -> None:
    spec = replace(load_model("gpt2"), hidden=8, heads=2, kv_heads=2, ffn=16,
                   activation=activation)  # fmt: skip
    mlp = MLP(spec, 1, None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    hidden = x @ mlp.up.weight.T + mlp.up.bias
    if activation == "relu":
        act = torch.clamp(hidden, min=0.0)
    else:  # tanh approximation, written out
        act = (
            0.5 * hidden * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (hidden + 0.044715 * hidden**3)))
        )
    want = act @ mlp.down.weight.T + mlp.down.bias
    assert torch.allclose(mlp(x), want, atol=1e-5)
    # and the two differ on these inputs: the check tells them apart
    assert (hidden < 0).any()

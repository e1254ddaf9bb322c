"""A model whose heads are wider than hidden / heads (Qwen3, Gemma) runs with its own
query and output widths: the runtime's parameters are the ones the cost model counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hetplan.model import load_model  # noqa: E402
from hetplan.runtime.model_torch import full_model  # noqa: E402


def test_runtime_parameters_are_the_counted_ones(tmp_path: Path) -> None:
    """Hidden 32, 4 heads of 16 (queries 64 wide), 2 KV heads: torch's own tensors add up
    to ``total_params``; q maps 32 -> 64 and o 64 -> 32; a forward gives one logit per
    token and vocabulary entry."""
    cfg = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
           "vocab_size": 64, "max_position_embeddings": 16}  # fmt: skip
    path = tmp_path / "wide" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    spec = load_model(str(path))
    net = full_model(spec, seed=0)
    assert sum(p.numel() for p in net.parameters()) == spec.total_params()
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert (64, 32) in shapes.values() and (32, 64) in shapes.values()
    tokens = torch.randint(0, 64, (2, 16))
    assert tuple(net(tokens).shape) == (2, 16, 64)

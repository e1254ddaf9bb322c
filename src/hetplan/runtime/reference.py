"""The single-process training run every plan must reproduce, and checkpoint readers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn import functional as F

from hetplan.model import ModelSpec
from hetplan.runtime.checkpoint import read_manifest
from hetplan.runtime.data import TokenSource
from hetplan.runtime.model_torch import full_model
from hetplan.runtime.optim_config import OptimConfig, lr_at
from hetplan.runtime.state import load_unit, make_optimizer


def reference_train(
    model: ModelSpec,
    global_batch: int,
    steps: int,
    seed: int,
    optim: OptimConfig | None = None,
    data: Path | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Returns the parameters and losses after ``steps`` full-batch fp32 steps on one device
    (gradient clipping by ``torch.nn.utils.clip_grad_norm_``)."""
    optim = optim or OptimConfig()
    net = full_model(model, seed)
    opt = make_optimizer(list(net.parameters()), optim)
    source = TokenSource(model.vocab, model.seq, seed, data)
    losses = []
    for step in range(steps):
        inputs, targets = source.batch(step * global_batch, global_batch)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), optim.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step + 1, optim)
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in net.named_parameters()}, losses


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """Returns the full parameters stored in the checkpoint at (or latest under) ``path``."""
    man = read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    for name in man.files:
        out.update(load_unit(man.path / name)["params"])
    return out


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Returns ||a - b|| / ||b|| over all parameters together (inf if the names differ).

    Per tensor would be wrong: the key bias has an exactly zero gradient (softmax ignores a
    per-query constant), so Adam turns rounding noise there into steps of size lr.
    """
    if set(a) != set(b):
        return float("inf")
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    ref = sum(float(b[k].pow(2).sum()) for k in b)
    return (diff / ref) ** 0.5

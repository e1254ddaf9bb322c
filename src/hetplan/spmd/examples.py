"""Example factories for ``hetplan spmd plan --module hetplan.spmd.examples:NAME``.

Each returns ``(module, example_inputs)``; the module's forward returns the training loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """A stack of Linear + GELU layers with a mean-squared-error loss."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(hidden if i % 2 == 0 else 4 * hidden, 4 * hidden if i % 2 == 0 else hidden)
            for i in range(layers)
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, target)


def mlp(
    batch: int = 64, hidden: int = 32, layers: int = 4
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Returns an MLP (hidden -> 4 hidden -> hidden ...) and a regression batch."""
    out_dim = hidden if layers % 2 == 0 else 4 * hidden
    return MLP(hidden, layers), (torch.randn(batch, hidden), torch.randn(batch, out_dim))


class EncoderLayer(nn.Module):
    """A post-norm transformer encoder layer (BERT), attention written out."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)
        ctx = torch.softmax(scores, dim=-1) @ v
        x = self.ln1(x + self.o(ctx.transpose(1, 2).reshape(b, n, d)))
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class BertLM(nn.Module):
    """A BERT-style encoder with a masked-LM head over the vocabulary."""

    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.tok(ids) + self.pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def bert_base(
    batch: int = 16,
    seq: int = 128,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    vocab: int = 30522,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Returns BERT-base (12 layers, hidden 768) with a masked-LM batch."""
    ids = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))
    return BertLM(vocab, seq, hidden, layers, heads), (ids, labels)


class ViT(nn.Module):
    """A vision transformer: patchify by reshapes, encoder, mean-pool, classifier."""

    def __init__(
        self,
        image: int,
        patch: int,
        channels: int,
        hidden: int,
        layers: int,
        heads: int,
        classes: int,
    ) -> None:
        super().__init__()
        self.patch = patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(channels * patch * patch, hidden)
        self.pos = nn.Parameter(torch.randn(tokens, hidden) * 0.02)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, c, hgt, wid = images.shape
        p = self.patch
        x = images.reshape(b, c, hgt // p, p, wid // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.embed(x.reshape(b, (hgt // p) * (wid // p), c * p * p)) + self.pos
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.ln(x.mean(dim=1))), labels)


def vit(
    batch: int = 32,
    image: int = 224,
    patch: int = 16,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    classes: int = 1000,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Returns ViT-Base/16 (12 layers, hidden 768) with an image-classification batch."""
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))
    return ViT(image, patch, 3, hidden, layers, heads, classes), (images, labels)


class MoE(nn.Module):
    """A mixture-of-experts layer with top-k softmax gating, inside a small regressor."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.inp = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(hidden))
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) / math.sqrt(ffn))
        self.ln = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.ln(F.gelu(self.inp(x)))
        probs = torch.softmax(self.gate(x), dim=-1)
        vals, idx = torch.topk(probs, self.top_k, dim=-1)
        chosen = F.one_hot(idx, self.experts).float()
        weights = (chosen * vals.unsqueeze(-1)).sum(1)
        h = F.gelu(torch.einsum("td,edf->tef", x, self.w1))
        y = torch.einsum("tef,efd->ted", h, self.w2)
        out = torch.einsum("ted,te->td", y, weights)
        return F.mse_loss(out + x, target)


def moe(
    tokens: int = 64, hidden: int = 32, ffn: int = 64, experts: int = 4, top_k: int = 2
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Returns a small MoE layer (dense dispatch of top-k gated experts) and a batch."""
    return MoE(hidden, ffn, experts, top_k), (
        torch.randn(tokens, hidden),
        torch.randn(tokens, hidden),
    )

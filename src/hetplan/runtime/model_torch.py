"""A GPT-2 or Llama style decoder built from a ModelSpec, in pieces a stage can hold.

Parameters are named as in the full model ("embed.tok.weight", "layers.3.attn.q.weight",
"head.out.weight") and initialised from (seed, name) at full size, then sliced to the
rank's tensor-parallel shard: any plan starts from the same weights.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hetplan.model import ModelSpec
from hetplan.runtime.layout import EMBED, HEAD, Chunk, layer_unit
from hetplan.runtime.tp import ColumnParallelLinear, RowParallelLinear

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns x normalised by its root mean square, scaled."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(spec: ModelSpec) -> nn.Module:
    return nn.LayerNorm(spec.hidden) if spec.family == "gpt" else RMSNorm(spec.hidden)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped KV heads; heads split over the TP group."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any) -> None:
        super().__init__()
        bias = spec.family == "gpt"
        self.spec, self.tp = spec, tp
        self.q = ColumnParallelLinear(spec.hidden, spec.hidden, bias, tp, group)
        self.k = ColumnParallelLinear(spec.hidden, spec.kv_dim, bias, tp, group)
        self.v = ColumnParallelLinear(spec.hidden, spec.kv_dim, bias, tp, group)
        self.o = RowParallelLinear(spec.hidden, spec.hidden, bias, tp, group)
        if spec.family == "llama":
            d = spec.head_dim
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            ang = torch.outer(torch.arange(spec.seq, dtype=torch.float64), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the attention output (full hidden width, summed over the group)."""
        b, s, _ = x.shape
        hd = self.spec.head_dim
        q = self.q(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.k(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v(x).view(b, s, -1, hd).transpose(1, 2)
        if self.spec.family == "llama":
            cos, sin = self.get_buffer("cos")[:s], self.get_buffer("sin")[:s]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(b, s, -1))
        return out


class MLP(nn.Module):
    """GeLU MLP (GPT) or SwiGLU (Llama), inner width split over the TP group."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any) -> None:
        super().__init__()
        bias = spec.family == "gpt"
        self.gated = spec.gated
        self.up = ColumnParallelLinear(spec.hidden, spec.ffn, bias, tp, group)
        if self.gated:
            self.gate = ColumnParallelLinear(spec.hidden, spec.ffn, bias, tp, group)
        self.down = RowParallelLinear(spec.ffn, spec.hidden, bias, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the MLP output."""
        if self.gated:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x), approximate="tanh")
        out: torch.Tensor = self.down(h)
        return out


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any) -> None:
        super().__init__()
        self.norm1, self.attn = _norm(spec), Attention(spec, tp, group)
        self.norm2, self.mlp = _norm(spec), MLP(spec, tp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the layer's output."""
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    """Token embedding, plus learned positions for GPT."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.seq, spec.hidden) if spec.family == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Returns the input activations of the first layer."""
        x: torch.Tensor = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        return x


class Head(nn.Module):
    """Final norm and output projection to the vocabulary."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = _norm(spec)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the logits."""
        out: torch.Tensor = self.out(self.norm(x))
        return out


class StageModel(nn.Module):
    """The part of the model one chunk holds: embedding?, layers [start, end), head?"""

    def __init__(
        self, spec: ModelSpec, chunk: Chunk, tp: int = 1, tp_index: int = 0, group: Any = None
    ) -> None:
        super().__init__()
        self.chunk = chunk
        self.embed = Embed(spec) if chunk.embed else None
        self.layers = nn.ModuleDict(
            {str(i): Block(spec, tp, group) for i in range(chunk.start, chunk.end)}
        )
        self.head = Head(spec) if chunk.head else None
        self.tied = spec.tie_embeddings
        if self.head is not None and self.embed is not None and self.tied:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns this chunk's output: activations, or logits for the last chunk."""
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(x)
        return x


def full_model(spec: ModelSpec, seed: int) -> StageModel:
    """Returns the whole model on one device, initialised from ``seed``."""
    model = StageModel(spec, Chunk(0, 0, spec.layers, True, True))
    init_params(model, seed, tp=1, tp_index=0)
    return model


TIED_HEAD = "head.out.weight"
TIED_EMBED = "embed.tok.weight"


def canonical_name(module: nn.Module, name: str) -> str:
    """Returns the name a parameter is stored and synchronised under (tied head -> embed)."""
    return TIED_EMBED if name == TIED_HEAD and getattr(module, "tied", False) else name


def unit_of(name: str) -> str:
    """Returns the checkpoint/sync unit of parameter ``name``."""
    if name.startswith("embed."):
        return EMBED
    if name.startswith("head."):
        return HEAD
    return layer_unit(int(name.split(".")[1]))


def shard_dim(module: nn.Module, name: str) -> int | None:
    """Returns the dimension along which parameter ``name`` is split by TP, or None."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    dims: dict[str, int] = getattr(sub, "shard_dims", {})
    return dims.get(leaf)


def shard(full: torch.Tensor, dim: int | None, tp: int, index: int) -> torch.Tensor:
    """Returns rank ``index``'s slice of ``full`` along ``dim`` (all of it if None)."""
    if dim is None or tp == 1:
        return full
    return full.chunk(tp, dim=dim)[index].contiguous()


def _init_full(name: str, shape: list[int], seed: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or (leaf == "weight" and ".norm" in name and len(shape) == 1):
        return torch.zeros(shape) if leaf == "bias" else torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * INIT_STD


@torch.no_grad()
def init_params(model: StageModel, seed: int, tp: int, tp_index: int) -> None:
    """Initialises every parameter from (seed, name) at full size, then keeps this shard."""
    for name, p in model.named_parameters():
        dim = shard_dim(model, name)
        full = _init_full(canonical_name(model, name), full_shape_of(p, dim, tp), seed)
        p.copy_(shard(full, dim, tp, tp_index))


def full_shape_of(p: torch.Tensor, dim: int | None, tp: int) -> list[int]:
    """Returns the unsharded shape of local tensor ``p`` split ``tp`` ways along ``dim``."""
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= tp
    return shape

"""A GPT-2 or Llama style decoder built from a ModelSpec, in pieces a stage can hold.

Parameters are named as in the full model ("embed.tok.weight", "layers.3.attn.q.weight",
"head.out.weight") and initialised from (seed, name) at full size, then sliced to the
rank's tensor-parallel shard: any plan starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from hetplan.model import ModelSpec
from hetplan.runtime.layout import EMBED, HEAD, Chunk, layer_unit
from hetplan.runtime.precision import autocast
from hetplan.runtime.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_for_tp,
    gather_from_seq,
    scatter_to_seq,
    sends_slices,
)

INIT_STD = 0.02


@dataclass(frozen=True)
class Features:
    """How the plan asks the model to run (plan fields, plus the run's dropout)."""

    precision: str = "fp32"
    recompute: str = "none"
    """none; selective: the attention core (QK^T, softmax, xV) is recomputed in the backward
    (Korthikanti et al. 2022); full: each layer is recomputed from its input."""
    flash_attention: bool = True
    """True: fused scaled_dot_product_attention (flash kernels, no math fallback); False:
    the attention matrix is materialised (softmax(QK^T / sqrt(d)) V)."""
    sequence_parallel: bool = False
    dropout: float = 0.0
    """Hidden dropout: after the embedding, the attention output and the MLP output."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm (a Hugging Face config's layer_norm_epsilon or
    rms_norm_eps under ``--init-from``)."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama), theta^(-2i/d)."""


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flash: bool) -> torch.Tensor:
    if flash:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [SDPBackend.FLASH_ATTENTION]
        if q.device.type == "cuda":
            fused += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return probs @ v


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns x normalised by its root mean square, scaled."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(spec: ModelSpec, eps: float) -> nn.Module:
    return nn.LayerNorm(spec.hidden, eps=eps) if spec.family == "gpt" else RMSNorm(spec.hidden, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped KV heads; heads split over the TP group."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any, feat: Features | None = None) -> None:
        super().__init__()
        feat = feat or Features()
        bias = spec.family == "gpt"
        self.spec, self.tp, self.group, self.feat = spec, tp, group, feat
        sp = feat.sequence_parallel
        self.q = ColumnParallelLinear(spec.hidden, spec.q_dim, bias, tp, group)
        self.k = ColumnParallelLinear(spec.hidden, spec.kv_dim, bias, tp, group)
        self.v = ColumnParallelLinear(spec.hidden, spec.kv_dim, bias, tp, group)
        self.o = RowParallelLinear(spec.q_dim, spec.hidden, bias, tp, group, sp)
        if spec.family == "llama":
            d = spec.head_dim
            inv = 1.0 / (feat.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            ang = torch.outer(torch.arange(spec.seq, dtype=torch.float64), inv)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the attention output (full hidden width, summed over the group)."""
        x = gather_for_tp(x, self.group, self.feat.sequence_parallel)
        b, s, _ = x.shape
        hd = self.spec.head_dim
        q = self.q(x, gathered=True).view(b, s, -1, hd).transpose(1, 2)
        k = self.k(x, gathered=True).view(b, s, -1, hd).transpose(1, 2)
        v = self.v(x, gathered=True).view(b, s, -1, hd).transpose(1, 2)
        if self.spec.family == "llama":
            cos, sin = self.get_buffer("cos")[:s], self.get_buffer("sin")[:s]
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        flash = self.feat.flash_attention
        if self.feat.recompute == "selective" and torch.is_grad_enabled():
            y = checkpoint(_attention_core, q, k, v, flash, use_reentrant=False)
        else:
            y = _attention_core(q, k, v, flash)
        out: torch.Tensor = self.o(y.transpose(1, 2).reshape(b, s, -1))
        return out


class MLP(nn.Module):
    """GeLU MLP (GPT) or SwiGLU (Llama), inner width split over the TP group."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any, feat: Features | None = None) -> None:
        super().__init__()
        feat = feat or Features()
        bias = spec.family == "gpt"
        self.gated, self.group, self.sp = spec.gated, group, feat.sequence_parallel
        self.relu = spec.mlp_activation == "relu"
        self.up = ColumnParallelLinear(spec.hidden, spec.ffn, bias, tp, group)
        if self.gated:
            self.gate = ColumnParallelLinear(spec.hidden, spec.ffn, bias, tp, group)
        self.down = RowParallelLinear(spec.ffn, spec.hidden, bias, tp, group, self.sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the MLP output."""
        x = gather_for_tp(x, self.group, self.sp)
        if self.gated:
            h = F.silu(self.gate(x, gathered=True)) * self.up(x, gathered=True)
        elif self.relu:
            h = F.relu(self.up(x, gathered=True))
        else:
            h = F.gelu(self.up(x, gathered=True), approximate="tanh")
        out: torch.Tensor = self.down(h)
        return out


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, spec: ModelSpec, tp: int, group: Any, feat: Features | None = None) -> None:
        super().__init__()
        feat = feat or Features()
        self.norm1, self.attn = _norm(spec, feat.norm_eps), Attention(spec, tp, group, feat)
        self.norm2, self.mlp = _norm(spec, feat.norm_eps), MLP(spec, tp, group, feat)
        self.drop = nn.Dropout(feat.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the layer's output."""
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


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

    def __init__(self, spec: ModelSpec, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = _norm(spec, eps)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the logits."""
        out: torch.Tensor = self.out(self.norm(x))
        return out


class StageModel(nn.Module):
    """The part of the model one chunk holds: embedding?, layers [start, end), head?"""

    def __init__(
        self,
        spec: ModelSpec,
        chunk: Chunk,
        tp: int = 1,
        tp_index: int = 0,
        group: Any = None,
        feat: Features | None = None,
    ) -> None:
        super().__init__()
        self.chunk, self.group = chunk, group
        self.feat = feat = feat or Features()
        self.split_io = group is not None and sends_slices(spec.seq, tp)
        self.embed = Embed(spec) if chunk.embed else None
        self.drop = nn.Dropout(feat.dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(spec, tp, group, feat) for i in range(chunk.start, chunk.end)}
        )
        self.head = Head(spec, feat.norm_eps) if chunk.head else None
        self.tied = spec.tie_embeddings
        if self.head is not None and self.embed is not None and self.tied:
            self.head.out.weight = self.embed.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns this chunk's output: activations, or logits for the last chunk. Between
        stages of TP > 1 the activations are this rank's sequence slice (``sends_slices``):
        the input arrives as one, the output leaves as one."""
        with autocast(self.feat.precision, x.device):
            sliced = self.embed is None and self.split_io
            if self.embed is not None:
                x = self.drop(self.embed(x))
            if self.layers:  # sequence parallel layers take and give slices
                seq_par = self.feat.sequence_parallel and self.group is not None
                x, sliced = self._as_slice(x, sliced, seq_par), seq_par
                full = self.feat.recompute == "full" and torch.is_grad_enabled()
                for layer in self.layers.values():
                    x = checkpoint(layer, x, use_reentrant=False) if full else layer(x)
            if self.head is not None:
                x = self.head(self._as_slice(x, sliced, False))
            else:
                x = self._as_slice(x, sliced, self.split_io)
        return x

    def _as_slice(self, x: torch.Tensor, sliced: bool, want: bool) -> torch.Tensor:
        """Returns ``x`` (this rank's sequence slice if ``sliced``, else the whole sequence)
        as a slice if ``want``, else whole: slicing a replicated tensor gathers the
        gradients' slices in backward, gathering keeps this rank's slice of them."""
        if sliced == want:
            return x
        return scatter_to_seq(x, self.group) if want else gather_from_seq(x, self.group)


def full_model(spec: ModelSpec, seed: int, feat: Features | None = None) -> StageModel:
    """Returns the whole model on one device, initialised from ``seed``."""
    model = StageModel(spec, Chunk(0, 0, spec.layers, True, True), feat=feat)
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

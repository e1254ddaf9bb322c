"""Model descriptions: the built-in catalog, Hugging Face configs, and per-layer costs.

Per-layer figures follow Narayanan et al. (SC'21) for FLOPs and Korthikanti et al.
(2022) for activation memory, generalised to grouped-query attention and gated MLPs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from hetplan.errors import InputError, shown

Family = Literal["gpt", "llama"]

LOSS_BYTES_PER_LOGIT = 14.0
"""Peak bytes per vocab-parallel logit during the loss (see ``head_activation_bytes``)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape."""

    name: str
    family: Family
    """gpt: LayerNorm, GeLU MLP, biases, learned positions, dropout; llama: RMSNorm, SwiGLU."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads (grouped-query attention); equal to heads for multi-head attention."""
    ffn: int
    """MLP inner width."""
    vocab: int
    seq: int
    """Training sequence length, tokens."""
    tie_embeddings: bool = False
    default_global_batch: int = 512
    """Sequences per iteration when the user gives none."""
    activation: str = ""
    """The MLP's activation: gelu or relu (gpt; OPT is relu), swiglu (llama); "" the family's
    (gelu, swiglu). ReLU keeps one tensor of the MLP's width for its backward, GeLU two."""
    uses_dropout: bool | None = None
    """Whether training applies dropout (keeping its masks); None: the family's (gpt yes,
    llama no). A run with dropout probability 0 keeps none."""
    attn_head_dim: int = 0
    """The width of one attention head where it is not hidden / heads (Qwen3-32B: 64 heads
    of 128 on a hidden size of 5,120; Gemma); 0: hidden / heads."""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(
                    f"model.{field}", f"must be a positive integer, got {shown(value)}"
                )
        if not isinstance(self.attn_head_dim, int) or self.attn_head_dim < 0:
            raise InputError(
                "model.attn_head_dim",
                f"must be a positive integer, got {shown(self.attn_head_dim)}",
            )
        if not self.attn_head_dim and self.hidden % self.heads:
            raise InputError(
                "model.heads", f"{self.heads} heads do not divide hidden {self.hidden}"
            )
        if self.heads % self.kv_heads:
            raise InputError("model.kv_heads", f"{self.kv_heads} do not divide heads {self.heads}")
        if self.family not in ("gpt", "llama"):
            raise InputError("model.family", f"unknown family {shown(self.family)} (gpt, llama)")
        allowed = ("gelu", "relu") if self.family == "gpt" else ("swiglu",)
        if self.activation and self.activation not in allowed:
            raise InputError("model.activation", f"{shown(self.activation)} is not one of "
                             f"{', '.join(allowed)} (family {self.family})")  # fmt: skip

    @property
    def head_dim(self) -> int:
        """Returns the width of one attention head."""
        return self.attn_head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Returns the total width of the query projection (and of the output projection's
        input): the hidden size unless the heads are of another width."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Returns the total width of the key (or value) projection."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_activation(self) -> str:
        """Returns the MLP's activation: gelu, relu or swiglu."""
        return self.activation or ("gelu" if self.family == "gpt" else "swiglu")

    @property
    def gated(self) -> bool:
        """Returns whether the MLP is gated (SwiGLU: three matrices)."""
        return self.mlp_activation == "swiglu"

    @property
    def dropout(self) -> bool:
        """Returns whether the layers apply dropout (and keep its masks)."""
        return self.family == "gpt" if self.uses_dropout is None else self.uses_dropout

    # ---- parameters -------------------------------------------------------------
    @cached_property
    def _layer_params(self) -> int:
        return self._count_layer_params()

    def layer_params(self) -> int:
        """Returns the parameters of one transformer layer."""
        return self._layer_params

    def _count_layer_params(self) -> int:
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn
        attn = h * (q + 2 * kv) + q * h
        mlp = (3 if self.gated else 2) * h * f
        if self.family == "gpt":
            biases = (q + 2 * kv) + h + f + h
            norms = 4 * h
        else:
            biases = 0
            norms = 2 * h
        return attn + mlp + biases + norms

    def embedding_params(self) -> int:
        """Returns the parameters of the input embedding (and learned positions for GPT)."""
        pos = self.seq * self.hidden if self.family == "gpt" else 0
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        """Returns the parameters of the final norm and output head (the head even if tied)."""
        norm = (2 if self.family == "gpt" else 1) * self.hidden
        return norm + self.vocab * self.hidden

    def total_params(self) -> int:
        """Returns the model's parameter count (a tied head counted once)."""
        head = self.head_params() - (self.vocab * self.hidden if self.tie_embeddings else 0)
        return self.layers * self.layer_params() + self.embedding_params() + head

    # ---- FLOPs (per sequence of self.seq tokens, forward pass) ---------------------
    def layer_matmul_flops(self) -> float:
        """Returns forward FLOPs of one layer's weight matmuls for one sequence."""
        h, q, kv, f, s = self.hidden, self.q_dim, self.kv_dim, self.ffn, self.seq
        return 2.0 * s * (h * (q + 2 * kv) + q * h + (3 if self.gated else 2) * h * f)

    def layer_attention_flops(self) -> float:
        """Returns forward FLOPs of one layer's QK^T and AV products for one sequence."""
        return 2.0 * 2.0 * self.seq * self.seq * self.q_dim

    def layer_flops(self) -> float:
        """Returns forward FLOPs of one transformer layer for one sequence."""
        return self.layer_matmul_flops() + self.layer_attention_flops()

    def head_flops(self) -> float:
        """Returns forward FLOPs of the output head (logits) for one sequence."""
        return 2.0 * self.seq * self.hidden * self.vocab

    def model_flops_per_sequence(self) -> float:
        """Returns forward+backward FLOPs per sequence without recomputation (3x forward)."""
        return 3.0 * (self.layers * self.layer_flops() + self.head_flops())

    # ---- activations (bytes per sequence; 2-byte activations unless elem_bytes says 4) -
    def layer_activation_bytes(
        self,
        tp: int,
        sequence_parallel: bool,
        recompute: str,
        flash_attention: bool,
        elem_bytes: int = 2,
    ) -> float:
        """Returns activation bytes one layer keeps for backward, per sequence, per TP rank.

        Korthikanti et al. 2022 (eq. 1-5): a replicated part (norm inputs, the inputs of the
        first matmuls, dropout masks) split only by sequence parallelism, and a part split
        by tensor parallelism; attention scores are s^2 terms absent with flash attention.
        """
        s, h, kv, f, a = self.seq, self.hidden, self.kv_dim, self.ffn, self.heads
        e = float(elem_bytes)
        if recompute == "full":
            return e * s * h / (tp if sequence_parallel else 1)
        drop = 1.0 if self.dropout else 0.0
        replicated = e * s * h * 4 + drop * 2 * s * h  # 2 norm inputs, qkv and mlp inputs; masks
        q = self.q_dim
        sharded = e * s * (q + kv)  # Q, K for QK^T
        sharded += e * s * kv  # V
        sharded += e * s * q  # output projection input
        # the activation's inputs and outputs its backward and the down projection keep:
        # SwiGLU gate, up, silu(gate) and the product; GeLU its input and output; ReLU only
        # its output (its backward reads the result, the down projection's input too)
        sharded += {"swiglu": 4, "gelu": 2, "relu": 1}[self.mlp_activation] * e * s * f
        if not flash_attention and recompute != "selective":
            sharded += (e + drop + e * drop) * a * s * s  # softmax out, dropout mask and out
        elif flash_attention:
            sharded += 4 * a * s  # log-sum-exp statistics (fp32)
        if sequence_parallel:
            return (replicated + sharded) / tp
        return replicated + sharded / tp

    def embedding_activation_bytes(
        self, tp: int, sequence_parallel: bool, elem_bytes: int = 2
    ) -> float:
        """Returns the activation bytes the embedding itself holds for its backward, per
        sequence: its dropout mask (one byte per element, as Megatron's fused dropout keeps
        it). Its output is not counted here: where layer 0 sits in the same chunk it is that
        layer's input, already in ``layer_activation_bytes`` (counting it here too held it
        twice); where the chunk holds only the embedding, the output is sent on and freed
        (Megatron's ``deallocate_output_tensor``). The lookup's backward needs only the token
        ids. (``elem_bytes`` is kept for the callers' signature: the mask is one byte.)"""
        del elem_bytes
        per = self.seq * self.hidden if self.dropout else 0
        return per / (tp if sequence_parallel else 1)

    def head_activation_bytes(self, tp: int, elem_bytes: int = 2) -> float:
        """Returns peak bytes of the final norm input and the loss's logit buffers, per sequence."""
        # Megatron/DeepSpeed GPT-2 of 2020-22 (megatron/mpu/cross_entropy.py, Megatron-LM
        # v1.1.5 as vendored by DeepSpeedExamples): the loss is computed on output.float(),
        # which _VocabParallelCrossEntropy.forward clones ("Copy so the input remains
        # unchanged") and exponentiates; at that peak the fp16 logits (2 bytes), the fp32
        # copy (4), its clone (4) and exp_logits (4) coexist: 14 bytes per vocab-parallel
        # logit. Megatron-Core works in place (6 bytes), so this is an upper bound there.
        # in fp32 training the logits themselves are fp32: 2 more bytes per logit
        logit = LOSS_BYTES_PER_LOGIT + (elem_bytes - 2)
        return elem_bytes * self.seq * self.hidden + logit * self.seq * self.vocab / tp

    def with_seq(self, seq: int | None) -> ModelSpec:
        """Returns this model with sequence length ``seq`` (unchanged if None)."""
        if seq is None:
            return self
        if seq <= 0:
            raise InputError("--seq-len", "must be positive")
        return replace(self, seq=seq)


@cache
def _catalog() -> dict[str, dict[str, Any]]:
    text = resources.files("hetplan.data").joinpath("models.yaml").read_text()
    data: dict[str, dict[str, Any]] = yaml.safe_load(text)
    return data


def catalog_models() -> list[str]:
    """Returns the names of the built-in models."""
    return list(_catalog())


def _from_catalog(name: str) -> ModelSpec:
    entry = dict(_catalog()[name])
    return ModelSpec(
        name=name,
        family=entry["family"],
        layers=entry["layers"],
        hidden=entry["hidden"],
        heads=entry["heads"],
        kv_heads=entry.get("kv_heads", entry["heads"]),
        ffn=entry["ffn"],
        vocab=entry["vocab"],
        seq=entry["seq"],
        tie_embeddings=entry.get("tie_embeddings", False),
        default_global_batch=entry["default_global_batch"],
        activation=entry.get("activation", ""),
        uses_dropout=entry.get("dropout"),
    )


def _require_int(cfg: dict[str, Any], key: str, path: str) -> int:
    if key not in cfg:
        raise InputError(f"{path}:{key}", "missing from the config")
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{path}:{key}", f"expected a positive integer, got {shown(value)}")
    return value


def model_from_hf_config(path: Path) -> ModelSpec:
    """Returns the ModelSpec of a Hugging Face ``config.json`` (Llama/Mistral or GPT-2 keys;
    GPT-NeoX, Phi and StarCoder2 read with Llama's keys as GPT's layer); refuses mixtures
    of experts, encoder-decoders and nested multimodal configs."""
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise InputError("--model", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            "--model", f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})"
        ) from None
    if not isinstance(cfg, dict):
        raise InputError("--model", f"{path} must hold a JSON object")
    name = path.parent.name or path.stem
    _refuse_unmodelled(cfg, str(path))
    if "n_embd" in cfg:
        hidden = _require_int(cfg, "n_embd", str(path))
        act = str(cfg.get("activation_function", "gelu_new"))
        if not (act.startswith("gelu") or act == "relu"):
            raise InputError(f"{path}:activation_function", f"{shown(act)} is not a GeLU or relu")
        return ModelSpec(
            name=name,
            family="gpt",
            layers=_require_int(cfg, "n_layer", str(path)),
            hidden=hidden,
            heads=_require_int(cfg, "n_head", str(path)),
            kv_heads=_require_int(cfg, "n_head", str(path)),
            ffn=cfg.get("n_inner") or 4 * hidden,
            vocab=_require_int(cfg, "vocab_size", str(path)),
            seq=_require_int(cfg, "n_positions", str(path)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            activation="relu" if act == "relu" else "gelu",
            uses_dropout=_dropout(cfg, ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
        )
    heads = _require_int(cfg, "num_attention_heads", str(path))
    shape: dict[str, Any] = {
        "name": name,
        "layers": _require_int(cfg, "num_hidden_layers", str(path)),
        "hidden": _require_int(cfg, "hidden_size", str(path)),
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "ffn": _require_int(cfg, "intermediate_size", str(path)),
        "vocab": _require_int(cfg, "vocab_size", str(path)),
        "seq": _require_int(cfg, "max_position_embeddings", str(path)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    if cfg.get("head_dim") is not None:
        head_dim = _require_int(cfg, "head_dim", str(path))
        if head_dim * heads != shape["hidden"]:
            # heads of another width than hidden / heads (Qwen3-32B, Gemma, Mistral NeMo)
            shape["attn_head_dim"] = head_dim
    if cfg.get("model_type") in PLAIN_MLP_TYPES:  # LayerNorm, biases, a GeLU MLP of two
        act = str(cfg.get("hidden_act", "gelu"))
        if not (act.startswith("gelu") or act == "relu"):
            raise InputError(f"{path}:hidden_act", f"{shown(act)} is not a GeLU or relu")
        return ModelSpec(
            family="gpt",
            activation="relu" if act == "relu" else "gelu",
            uses_dropout=_dropout(cfg, ("attention_dropout", "hidden_dropout", "resid_pdrop")),
            **shape,
        )
    return ModelSpec(
        family="llama", uses_dropout=_dropout(cfg, ("attention_dropout", "hidden_dropout")), **shape
    )


PLAIN_MLP_TYPES = ("gpt_neox", "phi", "starcoder2")
"""Hugging Face ``model_type``s with Llama's key names but GPT's layer: LayerNorm, biases and
an ungated MLP of two matrices (read as Llama's gated three, GPT-NeoX-20B would count 26.6B
parameters instead of its 20.6B)."""

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config keys that give a mixture-of-experts layer's expert count (Mixtral, Qwen-MoE and
OLMoE, DeepSeek, DBRX's ``ffn_config``)."""


def _refuse_unmodelled(cfg: dict[str, Any], path: str) -> None:
    """Raises where the config describes a model the cost model does not: experts in its
    layers (planned as a dense model they would lose most of their parameters), an encoder
    and a decoder, or a multimodal model whose language part is nested."""
    for where, block in (("", cfg), ("ffn_config.", cfg.get("ffn_config"))):
        if not isinstance(block, dict):
            continue
        for key in EXPERT_KEYS:
            value = block.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                raise InputError(
                    f"{path}:{where}{key}",
                    f"{value} experts per layer: mixture-of-experts models are not modelled "
                    f"(dense decoder-only transformers are; as dense, its experts' parameters "
                    f"would be left out)",
                )
    if cfg.get("is_encoder_decoder") or "num_decoder_layers" in cfg:
        key = "is_encoder_decoder" if "is_encoder_decoder" in cfg else "num_decoder_layers"
        raise InputError(
            f"{path}:{key}",
            "an encoder-decoder model: not modelled (decoder-only transformers are)",
        )
    if isinstance(cfg.get("text_config"), dict) and "num_attention_heads" not in cfg:
        raise InputError(
            f"{path}:text_config",
            "a multimodal model's config: save its text_config as a config.json of its own "
            "to plan the language model (its other towers are not modelled)",
        )


def _dropout(cfg: dict[str, Any], keys: tuple[str, ...]) -> bool | None:
    """Returns whether a config's dropout probabilities apply any (None: it states none)."""
    probs = [cfg[k] for k in keys if isinstance(cfg.get(k), int | float)]
    return None if not probs else any(p > 0 for p in probs)


def load_model(spec: str, seq_len: int | None = None) -> ModelSpec:
    """Returns the model named ``spec`` in the catalog, or read from a config.json path."""
    key = spec.strip().lower()
    if key in _catalog():
        return _from_catalog(key).with_seq(seq_len)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise InputError("--model", f"no such file: {spec}")
        return model_from_hf_config(path).with_seq(seq_len)
    known = ", ".join(catalog_models())
    raise InputError(
        "--model", f"unknown model {shown(spec)} (built-in: {known}; or a config.json)"
    )

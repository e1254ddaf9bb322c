"""``launch --init-from DIR``: start from a local Hugging Face checkpoint.

DIR holds ``config.json`` and ``model.safetensors``, or shards named by
``model.safetensors.index.json``. Two layouts are read:

- GPT-2 (``gpt`` family): ``[transformer.]wte``, ``wpe``, ``h.N.ln_1``, ``h.N.attn.c_attn``
  (Q, K and V fused along the output), ``h.N.attn.c_proj``, ``h.N.ln_2``, ``h.N.mlp.c_fc``,
  ``h.N.mlp.c_proj``, ``ln_f``. GPT-2's ``Conv1D`` computes ``x @ W + b`` with ``W`` stored
  (in, out): the transpose of ``nn.Linear``'s (out, in). The head is tied to ``wte``.
- Llama (``llama`` family): ``model.embed_tokens``, ``model.layers.N.input_layernorm``,
  ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``,
  ``model.norm``, ``lm_head`` (unless tied); ``nn.Linear`` layout, rotary embedding on
  half-split pairs (``rotate_half``), as the runtime's.

``check_init_from`` runs before any process starts: the config must describe the plan's
model, every tensor the runtime needs must be there with its shape, and no tensor may be
left unused. Each rank then reads only the tensors of its chunks, and of each only its
tensor-parallel slice (``get_slice``), converted to fp32 master weights.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetplan.errors import InputError, shown
from hetplan.model import ModelSpec, model_from_hf_config

FIELD = "--init-from"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# buffers some GPT-2 checkpoints carry (the causal mask), not parameters
_IGNORED = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$|rotary_emb\.inv_freq$")
_GPT_ACTS = ("gelu_new", "gelu_pytorch_tanh")  # tanh-approximated GeLU, as the runtime's


@dataclass(frozen=True)
class Source:
    """Where one runtime parameter comes from: ``key`` narrowed along ``dim`` to
    [offset, offset + length) (a slice of a fused tensor; all of it if ``dim`` is None),
    then transposed if ``transpose`` (GPT-2's Conv1D)."""

    key: str
    transpose: bool = False
    dim: int | None = None
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class HFInit:
    """A checked Hugging Face checkpoint: tensor files and the config's numerics."""

    root: Path
    files: dict[str, Path]
    """Tensor name -> safetensors file."""
    prefix: str
    """``transformer.`` for GPT2LMHeadModel checkpoints, '' for GPT2Model ones (Llama: '')."""
    positions: int
    """Positions of the checkpoint (GPT-2's n_positions rows of wpe)."""
    norm_eps: float
    rope_theta: float


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise InputError(
            FIELD, "needs the 'safetensors' package: pip install 'hetplan[torch]'"
        ) from None
    return safe_open


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise InputError(FIELD, f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            FIELD, f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})"
        ) from None


def _tensor_files(root: Path) -> dict[str, Path]:
    safe_open = _safe_open()

    if (root / INDEX).is_file():
        index = _read_json(root / INDEX)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise InputError(FIELD, f"{root / INDEX}: no weight_map")
        files = {str(k): root / str(v) for k, v in wmap.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise InputError(FIELD, f"{INDEX} names {f.name}, which is not in {root}")
        return files
    single = root / SINGLE
    if not single.is_file():
        raise InputError(FIELD, f"{root} has neither {SINGLE} nor {INDEX}")
    try:
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except Exception as exc:  # safetensors raises its own error types
        raise InputError(FIELD, f"{single} is not a safetensors file: {exc}") from None


def _config_numerics(cfg: dict[str, Any], spec: ModelSpec) -> tuple[float, float]:
    """Returns (norm epsilon, rotary base) of the config; refuses what the runtime lacks."""

    def refuse(key: str, why: str) -> InputError:
        return InputError(f"{FIELD} config.json:{key}", why)

    if spec.family == "gpt":
        act = cfg.get("activation_function", "gelu_new")
        if act not in _GPT_ACTS:
            raise refuse("activation_function", f"{shown(act)}: the runtime runs gelu_new")
        if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_weights", "the runtime scales attention by 1/sqrt(head_dim)")
        return float(cfg.get("layer_norm_epsilon", 1e-5)), 10000.0
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", f"{shown(act)}: the runtime runs SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise refuse(key, "the runtime's Llama layers have no biases")
    if cfg.get("rope_scaling"):
        raise refuse("rope_scaling", "scaled rotary embeddings are not supported")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != spec.head_dim:
        raise refuse("head_dim", f"{head_dim}, the runtime needs hidden/heads = {spec.head_dim}")
    # LlamaConfig's own defaults
    return float(cfg.get("rms_norm_eps", 1e-6)), float(cfg.get("rope_theta", 10000.0))


def _check_same_model(theirs: ModelSpec, spec: ModelSpec) -> None:
    for field in ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
        a, b = getattr(theirs, field), getattr(spec, field)
        if a != b:
            raise InputError(f"{FIELD} config.json", f"{field} is {a}, the plan's model has {b}")
    if theirs.tie_embeddings != spec.tie_embeddings:
        raise InputError(
            f"{FIELD} config.json",
            f"tie_word_embeddings is {str(theirs.tie_embeddings).lower()}, "
            f"the plan's model has {str(spec.tie_embeddings).lower()}",
        )
    if spec.seq > theirs.seq:
        raise InputError(
            "--seq-len", f"{spec.seq} is longer than the checkpoint's {theirs.seq} positions"
        )


def open_init(root: Path, spec: ModelSpec) -> HFInit:
    """Returns the checkpoint in ``root`` after checking its config against ``spec``
    (tensors not read)."""
    if not root.is_dir():
        raise InputError(FIELD, f"{root} is not a directory")
    if not (root / "config.json").is_file():
        raise InputError(FIELD, f"{root} has no config.json")
    cfg = _read_json(root / "config.json")
    if not isinstance(cfg, dict):
        raise InputError(FIELD, f"{root / 'config.json'} must hold a JSON object")
    try:
        theirs = model_from_hf_config(root / "config.json")
    except InputError as exc:
        raise InputError(f"{FIELD} config.json", exc.reason) from None
    _check_same_model(theirs, spec)
    eps, theta = _config_numerics(cfg, spec)
    files = _tensor_files(root)
    prefix = "transformer." if any(k.startswith("transformer.") for k in files) else ""
    return HFInit(root, files, prefix, theirs.seq, eps, theta)


def source_of(name: str, spec: ModelSpec, prefix: str = "") -> Source:
    """Returns the Hugging Face tensor (and slice) of runtime parameter ``name`` (its
    canonical name: a tied head is ``embed.tok.weight``)."""
    parts = name.split(".")
    leaf = parts[-1]
    h = spec.hidden
    if spec.family == "gpt":
        t = prefix
        top = {
            "embed.tok.weight": Source(f"{t}wte.weight"),
            "embed.pos.weight": Source(f"{t}wpe.weight", dim=0, offset=0, length=spec.seq),
            "head.norm.weight": Source(f"{t}ln_f.weight"),
            "head.norm.bias": Source(f"{t}ln_f.bias"),
            "head.out.weight": Source("lm_head.weight"),
        }
        if name in top:
            return top[name]
        n, mod = parts[1], ".".join(parts[2:-1])
        base = f"{t}h.{n}."
        if mod in ("attn.q", "attn.k", "attn.v"):
            off = "qkv".index(mod[-1]) * h
            # weight (in, 3h) -> columns of Q, K or V; bias (3h,) likewise
            dim = 1 if leaf == "weight" else 0
            return Source(base + "attn.c_attn." + leaf, leaf == "weight", dim, off, h)
        hf = {
            "norm1": "ln_1",
            "norm2": "ln_2",
            "attn.o": "attn.c_proj",
            "mlp.up": "mlp.c_fc",
            "mlp.down": "mlp.c_proj",
        }[mod]
        return Source(base + hf + "." + leaf, transpose=leaf == "weight" and "norm" not in mod)
    ends = {
        "embed.tok.weight": "model.embed_tokens.weight",
        "head.norm.weight": "model.norm.weight",
        "head.out.weight": "lm_head.weight",
    }
    if name in ends:
        return Source(ends[name])
    n, mod = parts[1], ".".join(parts[2:-1])
    hf = {
        "norm1": "input_layernorm",
        "norm2": "post_attention_layernorm",
        "attn.q": "self_attn.q_proj",
        "attn.k": "self_attn.k_proj",
        "attn.v": "self_attn.v_proj",
        "attn.o": "self_attn.o_proj",
        "mlp.gate": "mlp.gate_proj",
        "mlp.up": "mlp.up_proj",
        "mlp.down": "mlp.down_proj",
    }[mod]
    return Source(f"model.layers.{n}.{hf}.{leaf}")


def _hf_region(
    src: Source, hf_shape: list[int], dim: int | None, tp: int, index: int
) -> tuple[slice, ...]:
    """Returns the slices of the stored tensor that hold rank ``index``'s shard of the
    runtime parameter split ``tp`` ways along runtime dimension ``dim``."""
    region = [slice(0, n) for n in hf_shape]
    if src.dim is not None:
        region[src.dim] = slice(src.offset, src.offset + src.length)
    if dim is not None and tp > 1:
        hd = (len(hf_shape) - 1 - dim) if src.transpose else dim
        lo, hi = region[hd].start, region[hd].stop
        step = (hi - lo) // tp
        region[hd] = slice(lo + index * step, lo + (index + 1) * step)
    return tuple(region)


def _runtime_shapes(spec: ModelSpec) -> dict[str, list[int]]:
    """Returns the full shape of every parameter of the runtime's model, by canonical name
    (the model built on the meta device: no memory)."""
    import torch

    from hetplan.runtime.layout import Chunk
    from hetplan.runtime.model_torch import StageModel, canonical_name

    with torch.device("meta"):
        whole = StageModel(spec, Chunk(0, 0, spec.layers, True, True))
        # a tied head is the token table: one entry, as a stage holding only the head names it
        return {canonical_name(whole, n): list(p.shape) for n, p in whole.named_parameters()}


def check_init_from(root: Path, spec: ModelSpec) -> HFInit:
    """Returns the checked checkpoint: the config matches ``spec``; every tensor the runtime
    needs is present with its shape; none is left over. Raises InputError naming the tensor."""
    safe_open = _safe_open()

    init = open_init(root, spec)
    needed: dict[str, list[int]] = {}
    for name, shape in _runtime_shapes(spec).items():
        src = source_of(name, spec, init.prefix)
        want = list(reversed(shape)) if src.transpose else list(shape)
        if src.dim is not None:  # the whole stored axis: Q, K, V side by side, or positions
            fused = src.key.rsplit(".", 2)[-2] == "c_attn"
            want[src.dim] = 3 * spec.hidden if fused else init.positions
        needed[src.key] = want
    missing = sorted(set(needed) - set(init.files))
    if missing:
        raise InputError(FIELD, f"tensor {missing[0]} is missing from the checkpoint")
    extra = sorted(k for k in init.files if k not in needed and not _IGNORED.search(k))
    if extra and not (spec.tie_embeddings and extra == ["lm_head.weight"]):
        raise InputError(FIELD, f"tensor {extra[0]} has no place in a {spec.family} model")
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for key, want in needed.items():
            path = init.files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            got = list(handles[path].get_slice(key).get_shape())
            if got != want:
                raise InputError(
                    FIELD, f"tensor {key} has shape {_dims(got)}, the model needs {_dims(want)}"
                )
    return init


def _dims(shape: list[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def load_init(modules: list[Any], init: HFInit, spec: ModelSpec, tp: int, tp_index: int) -> int:
    """Copies this rank's parameters (its chunks, its TP shards) from the checkpoint into
    ``modules``; returns the number of elements read."""
    import torch

    safe_open = _safe_open()

    from hetplan.runtime.model_torch import canonical_name, shard_dim

    read = 0
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, Any] = {}
        for m in modules:
            for name, p in m.named_parameters():
                src = source_of(canonical_name(m, name), spec, init.prefix)
                path = init.files[src.key]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                sl = handles[path].get_slice(src.key)
                region = _hf_region(src, list(sl.get_shape()), shard_dim(m, name), tp, tp_index)
                t = sl[region].to(torch.float32)
                if src.transpose:
                    t = t.t()
                if tuple(t.shape) != tuple(p.shape):
                    raise InputError(
                        FIELD,
                        f"tensor {src.key} gives {_dims(list(t.shape))} for {name}, "
                        f"which is {_dims(list(p.shape))} on this rank",
                    )
                p.copy_(t)
                read += t.numel()
    return read

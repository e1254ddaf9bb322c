import json
from dataclasses import replace

import pytest

from hetplan.errors import InputError
from hetplan.model import ModelSpec, catalog_models, load_model


@pytest.mark.parametrize("name", ["gpt3-175b", "llama2-70b", "gpt3-6.7b"])
def test_six_n_d_rule(name):
    """Forward+backward FLOPs per token come to about 6 x parameters (attention adds a bit)."""
    m = load_model(name)
    ratio = m.model_flops_per_sequence() / (6 * m.total_params() * m.seq)
    assert 0.98 < ratio < 1.25


def test_gpt3_175b_parameter_count():
    assert load_model("gpt3-175b").total_params() == pytest.approx(175e9, rel=0.02)
    assert load_model("llama3-405b").total_params() == pytest.approx(405e9, rel=0.02)
    assert load_model("llama2-7b").total_params() == pytest.approx(6.74e9, rel=0.02)


def test_korthikanti_activation_bytes():
    """GPT layer, no recomputation: s*b*h*(34 + 5*a*s/h); with TP t: 10 + 24/t (eq. 1-2)."""
    m = load_model("gpt3-175b")
    s, h, a = m.seq, m.hidden, m.heads
    assert m.layer_activation_bytes(1, False, "none", False) == pytest.approx(
        s * h * (34 + 5 * a * s / h)
    )
    t = 8
    assert m.layer_activation_bytes(t, False, "none", False) == pytest.approx(
        s * h * (10 + 24 / t + 5 * a * s / (h * t))
    )
    # sequence parallel + selective recomputation: 34 s h / t (eq. 5)
    assert m.layer_activation_bytes(t, True, "selective", False) == pytest.approx(34 * s * h / t)
    # full recomputation keeps the layer input only
    assert m.layer_activation_bytes(t, False, "full", False) == pytest.approx(2 * s * h)


def test_embedding_and_head_are_separate_pieces():
    m = load_model("llama3-8b")
    assert m.embedding_params() == m.vocab * m.hidden
    assert m.head_params() == m.vocab * m.hidden + m.hidden
    assert m.head_flops() == 2 * m.seq * m.hidden * m.vocab


def test_catalog_names():
    names = set(catalog_models())
    for required in (
        "gpt2-xl",
        "gpt3-1.3b",
        "gpt3-6.7b",
        "gpt3-175b",
        "llama2-13b",
        "llama3-405b",
        "mistral-7b",
        "llama2-7b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "gpt3-125m",
    ):
        assert required in names


def test_hf_configs(tmp_path):
    llama = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "mistral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(llama))
    m = load_model(str(path), seq_len=4096)
    assert (m.family, m.kv_heads, m.seq, m.name) == ("llama", 8, 4096, "mistral")
    gpt2 = {
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    p2 = tmp_path / "config.json"
    p2.write_text(json.dumps(gpt2))
    m2 = load_model(str(p2))
    assert (m2.family, m2.ffn, m2.seq) == ("gpt", 3072, 1024)
    assert m2.total_params() == pytest.approx(124e6, rel=0.02)


def test_bad_models(tmp_path):
    with pytest.raises(InputError, match="unknown model"):
        load_model("gpt5")
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 64}')
    with pytest.raises(InputError, match="num_attention_heads"):
        load_model(str(bad))
    with pytest.raises(InputError, match="heads"):
        ModelSpec("x", "gpt", 2, 100, 3, 3, 400, 100, 16)


def test_activation_and_dropout_change_the_kept_activations():
    """Per layer and sequence, TP 1, bf16, flash attention (Korthikanti et al. 2022's terms
    by hand, s = 2048, h = 1024, f = 4096): norms and matmul inputs 2 x 4sh, Q K V and the
    projection input 2 x 4sh, the MLP 2 x sf per tensor it keeps (GeLU two, ReLU one), the
    softmax statistics 4as; with dropout, the masks of its two residual dropouts, sh bytes
    each (the attention probabilities' is an s^2 term, absent with flash attention)."""
    base = load_model("gpt3-350m")
    s, h, f, a = base.seq, base.hidden, base.ffn, base.heads
    common = 2 * 4 * s * h + 2 * 4 * s * h + 4 * a * s
    cases = [("gelu", True, 2, 2), ("gelu", False, 2, 0), ("relu", False, 1, 0)]
    for act, drop, mlp, masks in cases:
        m = replace(base, activation=act, uses_dropout=drop)
        want = common + mlp * 2 * s * f + masks * s * h
        assert m.layer_activation_bytes(1, False, "none", True) == want, (act, drop)
    # OPT's MLP is ReLU (its released configs): one tensor of the MLP's width less than GeLU
    assert load_model("opt-350m").mlp_activation == "relu"
    assert load_model("gpt3-350m").mlp_activation == "gelu"
    assert load_model("llama2-7b").mlp_activation == "swiglu"
    assert (load_model("gpt2").dropout, load_model("llama2-7b").dropout) == (True, False)
    with pytest.raises(InputError) as exc:
        replace(base, activation="swiglu")
    assert exc.value.field == "model.activation"


def test_hf_config_activation_and_dropout(tmp_path):
    """A GPT-2-style config states its activation and dropout probabilities; a Llama-style one
    its attention dropout. Unstated: the family's."""
    cfg = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 100}
    cases = [({}, "gelu", True), ({"activation_function": "relu"}, "relu", True),
             ({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, "gelu", False),
             ({"resid_pdrop": 0.1, "attn_pdrop": 0.0}, "gelu", True)]  # fmt: skip
    for i, (extra, act, drop) in enumerate(cases):
        path = tmp_path / f"g{i}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg | extra))
        m = load_model(str(path))
        assert (m.mlp_activation, m.dropout) == (act, drop), extra
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps(cfg | {"activation_function": "swish"}))
    with pytest.raises(InputError, match="activation_function"):
        load_model(str(bad))
    llama = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100,
             "max_position_embeddings": 32}  # fmt: skip
    for extra, drop in (({}, False), ({"attention_dropout": 0.1}, True)):
        path = tmp_path / f"l{int(drop)}" / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(llama | extra))
        assert load_model(str(path)).dropout is drop


def test_gpt_neox_counts_its_published_parameters(tmp_path):
    """EleutherAI/gpt-neox-20b's config.json (Llama's key names, an ungated GeLU MLP):
    Black et al. (2022) give 20,554,567,680 parameters. Read as a gated MLP it counted
    26.6B (a third matrix of 6144 x 24576 in each of 44 layers)."""
    cfg = {
        "model_type": "gpt_neox",
        "hidden_size": 6144,
        "intermediate_size": 24576,
        "num_attention_heads": 64,
        "num_hidden_layers": 44,
        "vocab_size": 50432,
        "max_position_embeddings": 2048,
        "hidden_act": "gelu_fast",
        "tie_word_embeddings": False,
    }
    path = tmp_path / "gpt-neox-20b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert (m.family, m.mlp_activation, m.ffn) == ("gpt", "gelu", 24576)
    assert m.total_params() == pytest.approx(20_554_567_680, rel=0.002)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),  # Mixtral
        ({"n_routed_experts": 256, "num_experts_per_tok": 8}, "n_routed_experts"),  # DeepSeek
        ({"num_experts": 60}, "num_experts"),  # Qwen1.5-MoE
        ({"ffn_config": {"moe_num_experts": 16}}, "ffn_config.moe_num_experts"),  # DBRX
        ({"is_encoder_decoder": True}, "is_encoder_decoder"),  # T5, BART
    ],
)
def test_models_the_cost_model_does_not_describe_are_refused(tmp_path, extra, field):
    """Mixtral 8x7B has 46.7B parameters; read as the dense model its keys also describe
    it was planned as 7B, memory and all. Such configs end in one message naming the key."""
    cfg = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(InputError) as err:
        load_model(str(path))
    assert err.value.field == f"{path}:{field}", err.value
    cfg.pop(next(iter(extra)))
    path.write_text(json.dumps(cfg))
    assert load_model(str(path)).family == "llama"  # the same shape without them reads


def test_a_nested_multimodal_config_points_to_its_text_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llava", "text_config": {"hidden_size": 4096}}))
    with pytest.raises(InputError) as err:
        load_model(str(path))
    assert err.value.field == f"{path}:text_config" and "config.json" in err.value.reason


def test_attention_wider_than_the_hidden_size_counts_its_published_parameters(tmp_path):
    """Qwen3-32B: hidden 5120, 64 heads of head_dim 128, so its queries are 8,192 wide (read
    with heads of hidden / heads = 80 its attention lost a third of its parameters and
    FLOPs). The Qwen3 report gives 32.8B parameters, 31.2B of them outside the embeddings;
    by hand per layer: Q 5120 x 8192, K and V 5120 x 1024 each, O 8192 x 5120, SwiGLU
    3 x 5120 x 25600, two norms. A head_dim that agrees (Llama 3 8B: 4096 = 32 x 128) is
    the default width."""
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    }
    path = tmp_path / "qwen3-32b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    m = load_model(str(path))
    assert (m.head_dim, m.q_dim, m.kv_dim) == (128, 8192, 1024)
    by_hand = 5120 * 8192 + 2 * 5120 * 1024 + 8192 * 5120 + 3 * 5120 * 25600 + 2 * 5120
    assert m.layer_params() == by_hand
    assert m.layers * m.layer_params() == pytest.approx(31.2e9, rel=0.005)
    assert m.total_params() == pytest.approx(32.8e9, rel=0.005)
    # attention scores and values over the 8,192-wide queries: 2 x 2 x s^2 x 8192
    assert m.layer_attention_flops() == 4.0 * m.seq**2 * 8192
    path.write_text(json.dumps({**cfg, "hidden_size": 4096, "num_attention_heads": 32}))
    plain = load_model(str(path))
    assert (plain.attn_head_dim, plain.head_dim, plain.q_dim) == (0, 128, 4096)
    path.write_text(json.dumps({**cfg, "head_dim": "wide"}))
    with pytest.raises(InputError) as err:
        load_model(str(path))
    assert err.value.field == f"{path}:head_dim"

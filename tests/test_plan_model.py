"""A plan file states the model it was made for: commands that read it take its sequence
length unless --seq-len is given, and refuse a model of another shape (exit 2, one line)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.plan import load_plan, plan_from_dict


def run(*args):
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """gpt2 planned on four T4 at sequence length 512 (the catalog's is 1024)."""
    root = tmp_path_factory.mktemp("made")
    path = root / "plan.json"
    res = run("plan", "--model", "gpt2", "--cluster", "T4:1x4", "--seq-len", "512",
              "--json", "--out", str(path))  # fmt: skip
    assert res.returncode == 0, res.stderr
    return path, json.loads(res.stdout)["plans"][0]


def test_the_file_states_the_model_it_was_made_for(made):
    path, _ = made
    stated = json.loads(path.read_text())["model"]
    # gpt2 as the catalog gives it (models.yaml), at the --seq-len the plan was made with
    assert stated == {"name": "gpt2", "family": "gpt", "layers": 12, "hidden": 768,
                      "heads": 12, "kv_heads": 12, "ffn": 3072, "vocab": 50257,
                      "tie_embeddings": False, "seq_len": 512}  # fmt: skip
    # and it reads back the same, and writes again the same
    again = load_plan(path)
    assert again.model is not None and again.model.seq == 512
    assert again.to_dict(compact=True) == json.loads(path.read_text())


def test_predict_takes_the_plans_sequence_length(made):
    path, best = made
    res = run("predict", "--plan", str(path), "--model", "gpt2", "--cluster", "T4:1x4",
              "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    # the plan command's own estimate of that plan at 512 tokens
    assert json.loads(res.stdout)["iteration_time_s"] == pytest.approx(
        best["iteration_time_s"], rel=1e-9
    )
    # given explicitly, another length wins: twice the tokens take longer, and the plan
    # made for 512 no longer fits a T4 (printed, then refused: exit 2)
    res = run("predict", "--plan", str(path), "--model", "gpt2", "--cluster", "T4:1x4",
              "--seq-len", "1024", "--json")  # fmt: skip
    assert res.returncode == 2 and "does not fit in memory" in res.stderr, res.stderr
    assert json.loads(res.stdout)["iteration_time_s"] > 1.5 * best["iteration_time_s"]


def test_a_model_of_the_same_shape_is_accepted_under_another_name(made):
    path, best = made
    # gpt3-125m has gpt2's shape (models.yaml) with sequences of 2048; the plan's 512 holds
    res = run("predict", "--plan", str(path), "--model", "gpt3-125m", "--cluster", "T4:1x4",
              "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["iteration_time_s"] == pytest.approx(
        best["iteration_time_s"], rel=1e-9
    )


def test_export_and_explain_take_the_plans_sequence_length(made):
    path, _ = made
    res = run("export", str(path), "--model", "gpt2")
    assert res.returncode == 0, res.stderr
    assert "--seq-length=512" in res.stdout
    res = run("explain", str(path), "--model", "gpt2", "--cluster", "T4:1x4", "--json")
    assert res.returncode == 0, res.stderr


def test_a_model_of_another_shape_is_refused(made, tmp_path):
    path, _ = made
    data = json.loads(path.read_text())
    data["model"]["hidden"] = 1536
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    for cmd in (["predict", "--plan", str(edited), "--cluster", "T4:1x4"],
                ["export", str(edited)],
                ["explain", str(edited), "--cluster", "T4:1x4"]):  # fmt: skip
        res = run(*cmd, "--model", "gpt2")
        assert res.returncode == 2, (cmd, res.stderr)
        assert "Traceback" not in res.stderr
        assert "--model" in res.stderr
        assert "the plan was made for gpt2, whose hidden is 1536; gpt2's is 768" in res.stderr


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"seq_len": 0}, "model.seq_len", "must be a positive integer"),
        ({"hidden": "768"}, "model.hidden", "must be a positive integer"),
        ({"family": "bert"}, "model.family", "must be gpt or llama"),
        ({"vocab": None}, "model.vocab", "must be a positive integer"),
    ],
)
def test_a_malformed_model_block_names_the_field(made, change, field, reason):
    data = json.loads(made[0].read_text())
    data["model"].update(change)
    with pytest.raises(InputError) as exc:
        plan_from_dict(data)
    assert exc.value.field == field
    assert reason in exc.value.reason


def test_a_model_block_missing_a_field_names_it(made):
    data = json.loads(made[0].read_text())
    del data["model"]["kv_heads"]
    with pytest.raises(InputError) as exc:
        plan_from_dict(data)
    assert (exc.value.field, exc.value.reason) == ("model.kv_heads", "required")


def test_a_file_without_a_model_takes_the_model_as_given(made, tmp_path):
    """Files written before the block (and by hand) keep working as before."""
    data = json.loads(made[0].read_text())
    del data["model"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    assert load_plan(bare).model is None
    res = run("predict", "--plan", str(bare), "--model", "gpt2", "--cluster", "T4:1x4",
              "--seq-len", "512", "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["iteration_time_s"] == pytest.approx(
        made[1]["iteration_time_s"], rel=1e-9
    )
    assert load_model("gpt2").seq == 1024  # so without --seq-len it would cost 1024 tokens


def test_replan_states_the_model_of_the_plan_it_replaces(tmp_path):
    plan = tmp_path / "p.json"
    res = run("plan", "--model", "gpt2", "--cluster", "T4:2x4", "--seq-len", "256",
              "--out", str(plan))  # fmt: skip
    assert res.returncode == 0, res.stderr
    new = tmp_path / "new.json"
    res = run("replan", "--plan", str(plan), "--model", "gpt2", "--cluster", "T4:2x4",
              "--lost", "t4-1", "--out", str(new), "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(new.read_text())["model"]["seq_len"] == 256
    assert json.loads(res.stdout)["plan"]["model"]["seq_len"] == 256


def test_the_plan_file_format_page_documents_the_block():
    page = (Path(__file__).parent.parent / "docs" / "plan-format.md").read_text()
    assert "`model`" in page and "`seq_len`" in page


def test_heads_of_another_width_travel_in_the_model_block(tmp_path):
    """A model whose heads are wider than hidden / heads writes ``head_dim`` in the plan's
    model block, reads it back, and a --model of the default width is refused naming it
    (the file without it stays as before: the test of the whole block above)."""
    from hetplan.plan import check_model_shape, model_dict

    cfg = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 2816,
           "vocab_size": 32000, "max_position_embeddings": 2048}  # fmt: skip
    path = tmp_path / "wide" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    out = tmp_path / "plan.json"
    res = subprocess.run([sys.executable, "-m", "hetplan", "plan", "-m", str(path), "-c",
                          "A100-80GB:1x8", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    block = json.loads(out.read_text())["model"]
    assert block["head_dim"] == 128
    plan = load_plan(out)
    assert plan.model is not None and plan.model.q_dim == 2048
    assert model_dict(plan.model) == block
    narrow = {**cfg, "head_dim": 64}  # 64 x 16 = 1024: the default width
    path.write_text(json.dumps(narrow))
    with pytest.raises(InputError) as err:
        check_model_shape(plan, load_model(str(path)))
    assert "head_dim is 128" in str(err.value)

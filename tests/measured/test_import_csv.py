"""The profile CSV: every part, bindings to a catalog model and to a config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetplan.hardware import get_gpu
from hetplan.measured.csv_import import read_profile_csv
from hetplan.measured.importers import parse_bindings, write_db
from hetplan.model import load_model

PROFILE = """\
# measured on one node; times in seconds per micro-batch
gpu,model,tp,micro_batch,precision,part,forward_s,backward_s,recompute_s,step_s
A100-40,mine,2,2,bf16,layer,0.010,0.020,0.003,
A100-40,mine,2,4,bf16,layer,0.018,0.036,,0.0025
A100-40,mine,2,2,bf16,embed,0.001,0.0005,,
A100-40,mine,2,2,bf16,head,0.004,0.008,,0.004
A100-40,mine,2,2,bf16,tp_comm,0,0,,
V100-16,gpt3-1.3b,1,1,fp16,layer,0.05,0.1,,
V100-16,gpt3-1.3b,1,,fp16,optimizer,,,,0.002
"""


def test_csv_rows_land_where_the_cost_model_reads_them(tmp_path: Path) -> None:
    src = tmp_path / "profile.csv"
    src.write_text(PROFILE)
    bindings = parse_bindings(["mine=gpt3-1.3b"])
    db = write_db(tmp_path / "p.sqlite", read_profile_csv(src, bindings))
    a100, v100, model = get_gpu("A100-40GB"), get_gpu("V100-16GB"), load_model("gpt3-1.3b")
    exact = db.layer_lookup(a100, model, 2, 2, "bf16")
    assert exact is not None and exact[1] == "measured"
    assert (exact[0].forward_s, exact[0].backward_s, exact[0].selective_recompute_s) == (
        0.010,
        0.020,
        0.003,
    )
    mid = db.layer_lookup(a100, model, 2, 3, "bf16")
    assert mid is not None and mid[1] == "interpolated"
    assert mid[0].forward_s == pytest.approx(0.014) and mid[0].backward_s == pytest.approx(0.028)
    assert mid[0].selective_recompute_s < 0  # one end unknown: unknown
    embed = db.part_times(a100, model, "embed", 2, 2, "bf16")
    assert embed is not None and embed.backward_s == 0.0005
    tp_comm = db.part_times(a100, model, "tp_comm", 2, 2, "bf16")
    assert tp_comm is not None and tp_comm.forward_s == 0  # collectives inside the layer times
    assert db.optimizer_step_s(a100, model, "layer", 2, "bf16") == 0.0025
    assert db.optimizer_step_s(a100, model, "head", 2, "bf16") == 0.004
    assert db.optimizer_step_s(v100, model, "layer", 1, "fp16") == 0.002
    assert db.layer_times(v100, model, 1, 1, "fp16") is not None


def test_binding_to_a_config_json(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(
        json.dumps({"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32})
    )
    src = tmp_path / "p.csv"
    src.write_text("gpu,model,tp,micro_batch,precision,part,forward_s,backward_s\n")
    with src.open("a") as fh:
        fh.write("RTX-3090,tiny,1,8,fp16,layer,1e-4,2e-4\n")
    db = write_db(tmp_path / "p.sqlite", read_profile_csv(src, parse_bindings([f"tiny={cfg}"])))
    t = db.layer_times(get_gpu("RTX 3090"), load_model(str(cfg)), 1, 8, "fp16")
    assert t is not None and t.forward_s == 1e-4

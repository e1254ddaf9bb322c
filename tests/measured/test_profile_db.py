"""The profile database: Sailor round trip, interpolation, layer points, 10k rows, writes."""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.cost.compute import LayerTimes
from hetplan.hardware import get_gpu
from hetplan.measured.profile_db import LayerRecord, ProfileDB, shape_from_key, shape_key
from hetplan.model import load_model

from .conftest import PROFILE_JSON

GH200 = get_gpu("GH200-96GB")
OPT = load_model("opt-350m")


def raw(mbs: int, tp: int) -> dict[int, list[float]]:
    """Returns the Sailor file's [forward, backward, update] per layer id (the raw numbers)."""
    data = json.loads(PROFILE_JSON.read_text())["OPT-350"]["GH-96"][str(mbs)][str(tp)]
    return {int(k): v for k, v in data.items()}


def layer_mean(mbs: int, tp: int, col: int) -> float:
    rows = raw(mbs, tp)
    body = [rows[i][col] for i in range(1, 25)]  # ids 1..24: the transformer layers
    return sum(body) / len(body)


def test_exact_rows_are_the_mean_of_the_transformer_layers(sailor_db: ProfileDB) -> None:
    for mbs, tp in ((1, 1), (8, 2), (128, 4)):
        found = sailor_db.layer_lookup(GH200, OPT, tp, mbs, "tf32")
        assert found is not None and found[1] == "measured"
        t = found[0]
        assert t.forward_s == pytest.approx(layer_mean(mbs, tp, 0), rel=1e-12)
        assert t.backward_s == pytest.approx(layer_mean(mbs, tp, 1), rel=1e-12)
        assert t.selective_recompute_s < 0  # not in Sailor's data: unknown
    # mbs 1, tp 4: every transformer layer took 0.0015 s forward in the file
    t = sailor_db.layer_times(GH200, OPT, 4, 1, "tf32")
    assert t is not None and t.forward_s == pytest.approx(0.0015)


def test_interpolation_between_micro_batch_8_and_16(sailor_db: ProfileDB) -> None:
    f8, f16 = layer_mean(8, 1, 0), layer_mean(16, 1, 0)
    b8, b16 = layer_mean(8, 1, 1), layer_mean(16, 1, 1)
    found = sailor_db.layer_lookup(GH200, OPT, 1, 12, "tf32")
    assert found is not None and found[1] == "interpolated"
    assert found[0].forward_s == pytest.approx((f8 + f16) / 2, rel=1e-12)
    assert found[0].backward_s == pytest.approx((b8 + b16) / 2, rel=1e-12)
    assert found[0].selective_recompute_s < 0
    ten = sailor_db.layer_times(GH200, OPT, 1, 10, "tf32")
    assert ten is not None and ten.forward_s == pytest.approx(f8 + (f16 - f8) * 2 / 8)
    # the embedding (layer id 0) and head (last id) interpolate alike
    e8, e16 = raw(8, 1)[0], raw(16, 1)[0]
    emb = sailor_db.part_times(GH200, OPT, "embed", 1, 12, "tf32")
    assert emb is not None and emb.forward_s == pytest.approx((e8[0] + e16[0]) / 2)
    head = sailor_db.part_times(GH200, OPT, "head", 1, 16, "tf32")
    assert head is not None and head.forward_s == raw(16, 1)[25][0]


def test_no_answer_outside_the_profile(sailor_db: ProfileDB) -> None:
    assert sailor_db.layer_lookup(GH200, OPT, 1, 64, "tf32") is None  # above tp 1's largest (32)
    assert sailor_db.layer_times(GH200, OPT, 3, 8, "tf32") is None  # tp 3 never profiled
    assert sailor_db.layer_times(GH200, OPT, 1, 8, "bf16") is None  # another precision
    assert sailor_db.layer_times(get_gpu("A100-40GB"), OPT, 1, 8, "tf32") is None
    other = replace(OPT, seq=1024)  # another shape
    assert sailor_db.layer_times(GH200, other, 1, 8, "tf32") is None
    assert sailor_db.lookup("GH200-96GB", OPT, 1, 12, "tf32") is None  # lookup: exact only


def test_optimizer_rows_are_the_median_update_over_micro_batches(sailor_db: ProfileDB) -> None:
    mbs = (1, 2, 4, 8, 16, 32)  # tp 1's micro-batches
    layer = sorted(layer_mean(m, 1, 2) for m in mbs)
    assert sailor_db.optimizer_step_s(GH200, OPT, "layer", 1, "tf32") == pytest.approx(
        (layer[2] + layer[3]) / 2
    )
    heads = sorted(raw(m, 4)[25][2] for m in (1, 2, 4, 8, 16, 32, 64, 128))
    assert sailor_db.optimizer_step_s(GH200, OPT, "head", 4, "tf32") == pytest.approx(
        (heads[3] + heads[4]) / 2
    )


def test_layer_points_give_back_the_shape(sailor_db: ProfileDB) -> None:
    points = sailor_db.layer_points()
    assert len(points) == 21  # 6 + 7 + 8 (micro-batch, tp) pairs in the file
    assert {p.device for p in points} == {"GH200-96GB"}
    p = next(p for p in points if (p.tp, p.micro_batch) == (2, 8))
    assert (p.shape.family, p.shape.hidden, p.shape.heads, p.shape.kv_heads) == (
        "gpt",
        1024,
        16,
        16,
    )
    assert (p.shape.ffn, p.shape.seq, p.precision) == (4096, 2048, "tf32")
    assert p.times.forward_s == pytest.approx(layer_mean(8, 2, 0))
    assert shape_key(p.shape) == shape_key(OPT)


def test_shape_key_round_trip() -> None:
    llama = load_model("llama3-8b")
    back = shape_from_key(shape_key(llama))
    assert shape_key(back) == shape_key(llama) and back.kv_heads == llama.kv_heads == 8
    with pytest.raises(ValueError):
        shape_from_key("gpt:h1024:a16")


def test_cost_model_reads_interpolated_times(sailor_db: ProfileDB) -> None:
    from hetplan.cost.params import CostParams
    from hetplan.cost.sources import ComputeSource

    # CostParams(): no profiler-synchronisation correction, the rows as stored
    got = ComputeSource(sailor_db).layer(OPT, GH200, CostParams(), 1, 12, "tf32", True)
    assert got.source == "interpolated"
    assert got.times.forward_s == pytest.approx((layer_mean(8, 1, 0) + layer_mean(16, 1, 0)) / 2)
    assert got.times.selective_recompute_s > 0  # unknown in the data: the model fills it in


def _times(i: int) -> LayerTimes:
    return LayerTimes(1e-3 + i * 1e-7, 2e-3 + i * 1e-7, 5e-4 + i * 1e-7)


def test_ten_thousand_rows_load_back(tmp_path: Path) -> None:
    path = tmp_path / "big.sqlite"
    db = ProfileDB(path)
    keys = []
    with db.transaction():
        for i in range(10_000):
            # i = 1000 a + 40 b + 10 c + d: a distinct (shape, mb, tp, device) per row
            device, seq = f"gpu{i % 10}", 128 * (1 + i // 1000)
            tp, mb = 1 << ((i // 10) % 4), 1 + (i // 40) % 25
            model = replace(OPT, seq=seq)
            keys.append((device, model, tp, mb, i))
            db.put(LayerRecord(device, shape_key(model), tp, mb, "bf16", _times(i), 1.0, 1))
    again = ProfileDB(path)
    assert again.counts()["layer_times"] == len(again.records()) == len(again.layer_points())
    assert again.counts()["layer_times"] == 10_000
    for device, model, tp, mb, i in random.Random(0).sample(keys, 300):
        assert again.lookup(device, model, tp, mb, "bf16") == _times(i)


def test_writes_reach_memory_and_disk_and_failed_transactions_leave_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "w.sqlite"
    db = ProfileDB(path)
    db.put(LayerRecord("GH200-96GB", shape_key(OPT), 1, 4, "bf16", _times(1), 0.0, 0))
    assert db.layer_times(GH200, OPT, 1, 4, "bf16") == _times(1)  # no reopen needed
    db.put_link("GH200-96GB", "p2p", 1e-5, 2e10)
    assert db.link_figures(GH200, "p2p") == (1e-5, 2e10)
    with pytest.raises(RuntimeError), db.transaction():
        db.put(LayerRecord("GH200-96GB", shape_key(OPT), 1, 8, "bf16", _times(2), 0.0, 0))
        raise RuntimeError("abort")
    assert db.layer_times(GH200, OPT, 1, 8, "bf16") is None
    reopened = ProfileDB(path)
    assert reopened.layer_times(GH200, OPT, 1, 4, "bf16") == _times(1)
    assert reopened.layer_times(GH200, OPT, 1, 8, "bf16") is None
    assert reopened.link_figures(GH200, "p2p") == (1e-5, 2e10)
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT COUNT(*) FROM layer_times").fetchone() == (1,)


def test_measured_package_is_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, hetplan.measured.cli, hetplan.measured.sailor, hetplan.measured.csv_import;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0

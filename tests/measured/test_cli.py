"""``hetplan profile import/show`` and the bare ``hetplan profile`` (measure this device):
outputs, and bad input ending with one line naming the field, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetplan.hardware import get_gpu
from hetplan.measured.profile_db import ProfileDB
from hetplan.model import load_model

from .conftest import NETWORK_JSON, PROFILE_JSON, Runner

CSV_HEADER = "gpu,model,tp,micro_batch,precision,part,forward_s,backward_s\n"


def test_import_and_show(tmp_path: Path, cli: Runner) -> None:
    out = tmp_path / "gh200.sqlite"
    code, stdout, err = cli(
        "profile", "import", PROFILE_JSON, "--format", "sailor", "--model", "OPT-350=opt-350m",
        "--network", NETWORK_JSON, "--out", out, "--json",
    )  # fmt: skip
    assert code == 0, err
    added = json.loads(stdout)["added"]
    assert added == {
        "layer_times": 21,
        "part_times": 42 + 15,  # embed + head of 21 entries; zero tp_comm for the 15 with TP > 1
        "optimizer_times": 9,
        "network_fits": 5,
        "network_points": 0,
    }
    db = ProfileDB(out)
    assert db.layer_times(get_gpu("GH-96"), load_model("opt-350m"), 4, 128, "tf32") is not None
    code, stdout, err = cli("profile", "show", out, "--json")
    assert code == 0, err
    shown = json.loads(stdout)
    assert [(r["tp"], r["micro_batches"][-1], r["layer_rows"]) for r in shown["layers"]] == [
        (1, 32, 6),
        (2, 64, 7),
        (4, 128, 8),
    ]
    assert {(n["scope"], n["gpus"]) for n in shown["network"]} == {
        ("intra", 2),
        ("intra", 4),
        ("inter", 1),
        ("inter", 2),
        ("inter", 4),
    }
    code, stdout, _ = cli("profile", "show", out)
    assert code == 0
    row = next(ln for ln in stdout.splitlines() if "1,2,4,8,16,32,64,128" in ln)
    assert "GH200-96GB" in row and "tf32" in row


def _sailor(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads(PROFILE_JSON.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _set(value: object) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d["OPT-350"]["GH-96"]["1"]["4"]["3"][0] = value

    return edit


def _rename_gpu(d: dict[str, Any]) -> None:
    d["OPT-350"]["H999"] = d["OPT-350"].pop("GH-96")


def _tp3(d: dict[str, Any]) -> None:
    d["OPT-350"]["GH-96"]["1"]["3"] = d["OPT-350"]["GH-96"]["1"]["4"]


def _no_gpu(d: dict[str, Any]) -> None:
    d["OPT-350"] = {}


def _csv(tmp_path: Path, body: str, header: str = CSV_HEADER, name: str = "p.csv") -> Path:
    path = tmp_path / name
    path.write_text(header + body)
    return path


BIND = ("--model", "OPT-350=opt-350m")
SAILOR_CASES = [
    ("unbound model", None, (), "profile.OPT-350"),
    ("unknown catalog model", None, ("--model", "OPT-350=nope-7b"), "--model"),
    ("malformed binding", None, ("--model", "OPT-350"), "--model"),
    ("negative time", _set(-0.001), BIND, "profile.OPT-350.GH-96.1.4.3"),
    ("zero time", _set(0.0), BIND, "profile.OPT-350.GH-96.1.4.3"),
    ("time not a number", _set("fast"), BIND, "profile.OPT-350.GH-96.1.4.3"),
    ("unknown GPU", _rename_gpu, BIND, "profile.OPT-350.H999"),
    ("TP not dividing heads", _tp3, BIND, "profile.OPT-350.GH-96.1.3"),
    ("model without GPUs", _no_gpu, BIND, "profile.OPT-350"),
    ("bad precision", None, (*BIND, "--precision", "int8"), "--precision"),
]


@pytest.mark.parametrize(("case", "edit", "extra", "field"), SAILOR_CASES)
def test_bad_sailor_input(
    tmp_path: Path, cli: Runner, case: str, edit: object, extra: tuple[str, ...], field: str
) -> None:
    src = PROFILE_JSON if edit is None else _sailor(tmp_path, edit)
    _fails(cli, tmp_path, ["profile", "import", str(src), "--format", "sailor", *extra], field)


CSV_CASES = [
    ("missing GPU", ",gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n", "p.csv:2:gpu"),
    ("unknown GPU", "B300,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n", "p.csv:2:gpu"),
    ("unknown model", "A100-40,mystery,1,1,bf16,layer,0.1,0.2\n", "p.csv:2:model"),
    ("zero forward", "A100-40,gpt3-1.3b,1,1,bf16,layer,0,0.2\n", "p.csv:2:forward_s"),
    ("negative backward", "A100-40,gpt3-1.3b,1,1,bf16,head,0.1,-2\n", "p.csv:2:backward_s"),
    ("unknown part", "A100-40,gpt3-1.3b,1,1,bf16,mlp,0.1,0.2\n", "p.csv:2:part"),
    ("bad tp", "A100-40,gpt3-1.3b,0,1,bf16,layer,0.1,0.2\n", "p.csv:2:tp"),
    ("bad precision", "A100-40,gpt3-1.3b,1,1,fp8,layer,0.1,0.2\n", "p.csv:2:precision"),
    ("no bf16 on V100", "V100-16,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n", "p.csv:2:gpu"),
    (
        "repeated row",
        "A100-40,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\nA100-40,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n",
        "p.csv:3",
    ),
]


@pytest.mark.parametrize(("case", "body", "field"), CSV_CASES)
def test_bad_csv_input(tmp_path: Path, cli: Runner, case: str, body: str, field: str) -> None:
    src = _csv(tmp_path, body)
    _fails(cli, tmp_path, ["profile", "import", str(src), "--format", "csv"], field)


def test_bad_files_and_options(tmp_path: Path, cli: Runner) -> None:
    src = _csv(tmp_path, "A100-40,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n")
    header = "gpu,tp,micro_batch,precision,part,forward_s\n"
    missing_col = _csv(tmp_path, "A100-40,1,1,bf16,layer,0.1\n", header, "cols.csv")
    _fails(cli, tmp_path, ["profile", "import", str(missing_col)], "cols.csv:1")
    _fails(cli, tmp_path, ["profile", "import", str(tmp_path / "none.json")], "FILE")
    net = tmp_path / "net.csv"
    net.write_text("gpu,scope,gpus,size_bytes,bytes_per_s\nA100-40,rack,2,1e6,1e10\n")
    _fails(cli, tmp_path, ["profile", "import", "--network", str(net)], "net.csv:2:scope")
    _fails(cli, tmp_path, ["profile", "import", str(src), "--format", "xml"], "--format")
    code, _, err = cli("profile", "import", src)
    assert code == 2 and err.strip() == "error: --out: required: the database to write"
    code, _, err = cli("profile", "show", tmp_path / "nothing.sqlite")
    assert code == 2 and err.strip().startswith("error: DB: no such file")
    not_db = tmp_path / "notes.txt"
    not_db.write_text("hello")
    _fails(cli, tmp_path, ["profile", "import", str(src)], "--out", out=not_db)


def test_failed_import_leaves_an_existing_database_as_it_was(tmp_path: Path, cli: Runner) -> None:
    out = tmp_path / "kept.sqlite"
    good = _csv(tmp_path, "A100-40,gpt3-1.3b,1,1,bf16,layer,0.1,0.2\n")
    assert cli("profile", "import", good, "--out", out)[0] == 0
    before = out.read_bytes()
    bad = tmp_path / "bad.csv"
    bad.write_text(
        CSV_HEADER + "A100-40,gpt3-1.3b,1,2,bf16,layer,0.1,0.2\nA100-40,x,1,1,bf16,layer,1,1\n"
    )
    code, _, err = cli("profile", "import", bad, "--out", out)
    assert code == 2 and err.startswith("error: bad.csv:3:model: ")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv", "kept.sqlite", "p.csv"]


def _fails(
    cli: Runner, tmp_path: Path, args: list[str], field: str, out: Path | None = None
) -> None:
    out = out or tmp_path / "out.sqlite"
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, err = cli(*args, "--out", out)
    lines = err.strip().splitlines()
    assert code == 2, (stdout, err)
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no database, no temp file


def test_entry_point_one_line_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "profile", "import", str(PROFILE_JSON), "--out",
         str(tmp_path / "x.sqlite")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: profile.OPT-350: model 'OPT-350' is not bound: add --model "
        "OPT-350=<catalog name or config.json>"
    ]
    assert not (tmp_path / "x.sqlite").exists()


def test_bare_profile_still_measures_this_device(tmp_path: Path, cli: Runner) -> None:
    pytest.importorskip("torch")
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(
        json.dumps({"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 16})
    )
    db = tmp_path / "cpu.sqlite"
    code, stdout, err = cli(
        "profile", "--device", "cpu", "--model", cfg, "--micro-batch-sizes", "1,2", "--reps",
        "1", "--db", db, "--json",
    )  # fmt: skip
    assert code == 0, err
    rows = json.loads(stdout)["layers"]
    assert [(r["tp"], r["micro_batch"]) for r in rows] == [(1, 1), (1, 2)]
    measured = ProfileDB(db).lookup("cpu", load_model(str(cfg)), 1, 2, "fp32")
    assert measured is not None and measured.forward_s == rows[1]["forward_s"]
    code, _, err = cli("profile", "--device", "cpu")
    assert code == 2 and err.strip().startswith("error: --model: required")

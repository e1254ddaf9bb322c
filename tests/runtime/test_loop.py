"""The training loop a user keeps: pruned checkpoints, measured figures, a killed run that
says why on one line and resumes, refused batch changes and bad options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hetplan.errors import InputError
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import _env, preflight, run_local

ASYM = [(2, [(4, [0])]), (6, [(1, [1]), (3, [2])])]
# tiny GPT (hidden 32, 4 layers, vocab 64, 16 positions, tied head): parameters by hand
LAYER = 12 * 32 * 32 + 13 * 32  # QKV/out/MLP weights and biases, two LayerNorms
GPT_PARAMS = 4 * LAYER + 64 * 32 + 16 * 32 + 2 * 32  # + tokens, positions, final norm


def _cfg(plan: Path, inputs: dict[str, Path], root: Path, **kw: Any) -> RunConfig:
    return RunConfig(
        plan=str(plan),
        model=str(inputs["gpt"]),
        cluster=str(inputs["cluster"]),
        checkpoint_dir=str(root),
        **kw,
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "hetplan", *args]
    return subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=300)


@pytest.mark.distributed
def test_keep_two_and_measured_figures(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", ASYM)
    root = tmp_path / "ckpt"
    record = run_local(_cfg(plan, inputs, root, steps=4, checkpoint_every=1, keep=2))
    assert [s for s, _ in ckpt.step_dirs(root)] == [3, 4]
    assert ckpt.read_manifest(root).global_batch == 8
    for s in record["steps"]:
        assert s["tokens_per_s"] == pytest.approx(8 * 16 / s["time_s"])
    peaks = record["peak_memory_bytes"]
    assert set(peaks) == {"host:0", "host:1", "host:2"}
    # host:0 holds the whole model: fp32 weights, gradients and two AdamW moments, plus
    # the activations its 1F1B schedule keeps
    assert peaks["host:0"] > 16 * GPT_PARAMS
    # host:1 holds one layer and the embedding: far less
    assert peaks["host:1"] < peaks["host:0"] / 2
    # resuming under a plan with another global batch: exit 2, one line naming the field
    bigger = write_plan(tmp_path / "b.json", [(4, [(4, [0])]), (8, [(1, [1]), (3, [2])])])
    args = ["launch", str(bigger), "--model", str(inputs["gpt"]), "--cluster"]
    res = _cli(*args, str(inputs["cluster"]), "--checkpoint-dir", str(root), "--resume")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "global_batch_size" in res.stderr
    assert "trained with 8" in res.stderr and "Traceback" not in res.stderr
    # refused before any process starts, the folder left as it was: a new run into it
    # (its steps would mix with these, 'latest' moving back), a resume with nothing left to
    # train, a resume with another seed (another data order and dropout)
    for kw, field in (({}, "--checkpoint-dir"), ({"resume": True, "steps": 4}, "--steps"),
                      ({"resume": True, "steps": 6, "seed": 5}, "--seed")):  # fmt: skip
        with pytest.raises(InputError) as info:
            preflight(_cfg(plan, inputs, root, **kw))
        assert info.value.field == field, info.value
    assert [s for s, _ in ckpt.step_dirs(root)] == [3, 4]


def test_resume_with_another_global_batch_exits_2(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step_00000002").mkdir()
    manifest = {
        "format": 1,
        "step": 2,
        "data_position": 16,
        "seed": 0,
        "global_batch": 8,
        "model": {},
        "files": {},
    }
    (root / "step_00000002" / ckpt.MANIFEST).write_text(json.dumps(manifest))
    (root / ckpt.LATEST).write_text("step_00000002\n")
    man = ckpt.read_manifest(root)
    with pytest.raises(InputError, match="global_batch_size: the plan has 12"):
        ckpt.check_batch(man, 12, allow_change=False)
    ckpt.check_batch(man, 12, allow_change=True)
    ckpt.check_batch(man, 8, allow_change=False)


def test_option_and_plan_refusals_name_the_field(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", ASYM)
    with pytest.raises(InputError, match="--dropout"):
        preflight(_cfg(plan, inputs, tmp_path / "c", dropout=1.5))
    for kw, field in (({"lr": -1.0}, "--lr"), ({"lr": float("nan")}, "--lr"),
                      ({"lr_warmup_steps": -3}, "--lr-warmup-steps"),
                      ({"min_lr_ratio": -1.0}, "--min-lr-ratio"), ({"threads": -1}, "--threads"),
                      ({"checkpoint_every": -2}, "--checkpoint-every")):  # fmt: skip
        with pytest.raises(InputError) as info:
            preflight(_cfg(plan, inputs, tmp_path / "c", **kw))
        assert info.value.field == field
    # ZeRO-3 on unequal replicas runs (deferred sync, runtime/fsdp.py); unequal TP does not
    preflight(_cfg(write_plan(tmp_path / "z.json", ASYM, zero_stage=3), inputs, tmp_path / "c"))
    for zero in (1, 3):
        mixed = write_plan(
            tmp_path / "m.json", [(4, [(4, [0, 1])]), (4, [(4, [2])])], zero_stage=zero
        )
        with pytest.raises(InputError, match=rf"zero_stage: {zero} .* degrees \[1, 2\]"):
            preflight(_cfg(mixed, inputs, tmp_path / "c"))
    sp = write_plan(tmp_path / "s.json", [(8, [(4, [0, 1, 2])])], sequence_parallel=True)
    with pytest.raises(InputError):  # tp 3 divides neither the heads nor the sequence
        preflight(_cfg(sp, inputs, tmp_path / "c"))


def _workers(parent: int) -> list[int]:
    """Returns the pids of the ranks under ``parent`` (the CLI): the processes that
    ``forkrun``'s fork server forked (their parent's command line names the server)."""
    procs: dict[int, tuple[int, bytes]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            procs[int(d.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    below = {parent}
    for _ in range(3):  # the CLI, its launcher, the launcher's fork server
        below |= {pid for pid, (ppid, _) in procs.items() if ppid in below}
    server = [pid for pid in below if b"multiprocessing.forkserver" in procs.get(pid, (0, b""))[1]]
    return [pid for pid, (ppid, _) in procs.items() if ppid in server]


@pytest.mark.distributed
@pytest.mark.slow
def test_worker_killed_mid_save_exits_with_cause_and_resumes(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", [(4, [(2, [0]), (2, [1])])])
    root = tmp_path / "ckpt"
    base = [
        "launch", str(plan), "--model", str(inputs["gpt"]), "--cluster", str(inputs["cluster"]),
        "--checkpoint-dir", str(root), "--checkpoint-every", "1",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "hetplan", *base, "--steps", "100000", "--json"]
    proc = subprocess.Popen(cmd, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600  # generous: a loaded 2-core machine starts slowly
    stopped: list[int] = []
    while not stopped:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
        if any(root.glob(".staging-*")) and ckpt.step_dirs(root):
            pids = [p for p in _workers(proc.pid)]
            for p in pids:  # freeze the ranks mid-save
                os.kill(p, signal.SIGSTOP)
            if any(root.glob(".staging-*")) and len(pids) == 2:
                stopped = pids
            else:
                for p in pids:
                    os.kill(p, signal.SIGCONT)
        time.sleep(0.001)
    os.kill(stopped[0], signal.SIGKILL)
    for p in stopped[1:]:
        os.kill(p, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    lines = [ln for ln in err.decode().splitlines() if ln.startswith("training failed")]
    assert len(lines) == 1 and "killed by SIGKILL" in lines[0], err.decode()[-2000:]
    assert out == b""
    staged = list(root.glob(".staging-*"))
    assert staged
    done = ckpt.read_manifest(root).step
    # the next start resumes from the last complete step and cleans the staging folder
    res = _cli(*base, "--steps", str(done + 2), "--resume", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    record = json.loads(res.stdout)
    assert [s["step"] for s in record["steps"]] == [done + 1, done + 2]
    # --json: measured figures per step and per rank next to the prediction for the plan
    assert all(s["tokens_per_s"] == pytest.approx(4 * 16 / s["time_s"]) for s in record["steps"])
    assert record["measured_step_time_s"] > 0 and record["predicted_step_time_s"] > 0
    assert record["tokens_per_s"] == pytest.approx(4 * 16 / record["measured_step_time_s"])
    devices = {"host:0", "host:1"}
    assert set(record["peak_memory_bytes"]) == set(record["predicted_peak_memory_bytes"]) == devices
    assert record["compute_source"] in ("analytical", "measured", "interpolated", "scaled")
    # what ran, said beside the figures: one pipeline of two stages, one device each
    assert record["ran"]["plan"].startswith("tp 1, pp 2, dp 1, micro-batch ")
    assert record["ran"]["precision"] in ("fp32", "bf16", "fp16", "tf32")
    assert not any(p.exists() for p in staged if p.name != f".staging-step_{done + 1:08d}")
    assert not any(root.glob(".staging-*"))


def test_token_files_checked_and_read(tmp_path: Path) -> None:
    import numpy as np

    from hetplan.runtime.config import check_data_file
    from hetplan.runtime.data import TokenSource

    vocab, seq, batch = 64, 16, 8
    ids = (np.arange(batch * seq + 1) * 7 % vocab).astype(np.uint16)
    good = tmp_path / "train.bin"
    ids.tofile(good)
    check_data_file(good, vocab, seq, batch)
    first = TokenSource(vocab, seq, 0, good).sequence(0)
    assert first.tolist() == [i * 7 % vocab for i in range(seq + 1)]
    odd = tmp_path / "odd.bin"
    odd.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(InputError, match="not a whole number of uint16 token ids"):
        check_data_file(odd, vocab, seq, batch)
    big = tmp_path / "big.bin"
    np.concatenate([ids, np.array([vocab], dtype=np.uint16)]).tofile(big)
    with pytest.raises(InputError, match="token id 64, beyond the vocabulary of 64"):
        check_data_file(big, vocab, seq, batch)
    short = tmp_path / "short.bin"
    ids[: batch * seq].tofile(short)
    with pytest.raises(InputError, match=r"fewer than one global batch \(8 x 16 \+ 1 = 129\)"):
        check_data_file(short, vocab, seq, batch)


def test_bad_data_files_exit_2_with_one_line(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    import numpy as np

    # tiny GPT: vocabulary 64, sequence 16; the plan's global batch 8 needs 8 x 16 + 1 ids
    plan = write_plan(tmp_path / "p.json", ASYM)
    ids = (np.arange(129) * 7 % 64).astype(np.uint16)
    npy = tmp_path / "ids.npy"
    np.save(npy, ids.astype(np.int32))  # a .npy of integer ids is read as it is
    from hetplan.runtime.data import TokenSource

    assert TokenSource(64, 16, 0, npy).sequence(0).tolist() == ids[:17].tolist()
    bad = {
        "odd.bin": (ids.tobytes()[:-1], "odd.bin is 257 bytes, not a whole number of uint16"),
        "big.bin": (np.append(ids, 64).astype(np.uint16).tobytes(), "token id 64, beyond"),
        "short.bin": (ids[:128].tobytes(), r"holds 128 tokens, fewer than one global batch"),
        "short.txt": (b"x" * 300, "byte-level tokens need a vocabulary >= 256, model has 64"),
        "empty.bin": (b"", "holds 0 tokens, fewer than one global batch"),
    }
    for name, (data, _) in bad.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "floats.npy", ids.astype(np.float32))
    np.save(tmp_path / "negative.npy", np.append(ids.astype(np.int64), -1))
    bad["floats.npy"] = (b"", "floats.npy holds float32 values, not integer token ids")
    bad["negative.npy"] = (b"", "negative.npy holds token id -1, below 0")
    for name, (_, want) in bad.items():
        root = tmp_path / f"ckpt-{name}"
        res = _cli(
            "launch", str(plan), "--model", str(inputs["gpt"]), "--cluster",
            str(inputs["cluster"]), "--data", str(tmp_path / name),
            "--checkpoint-dir", str(root),
        )  # fmt: skip
        assert res.returncode == 2, (name, res.stderr)
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
        assert "--data" in res.stderr and want in res.stderr, res.stderr
        assert not root.exists()  # refused before any process started


def test_bad_input_is_refused_before_torch_is_imported(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    """Every check of launch's inputs needs no torch; only the device (--device auto asks
    torch for CUDA) does, so a refusal takes well under a second, not torch's import."""
    plan = write_plan(tmp_path / "p.json", ASYM)
    (tmp_path / "odd.bin").write_bytes(b"x")
    argv = ["hetplan", "launch", str(plan), "--model", str(inputs["gpt"]), "--cluster",
            str(inputs["cluster"]), "--data", str(tmp_path / "odd.bin")]  # fmt: skip
    code = (
        "import sys\nfrom hetplan.cli import main\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    main()\nexcept SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(1), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert "--data" in res.stderr and res.stdout.split() == ["2", "False"], res.stderr


@pytest.mark.distributed
def test_dropout_option_reaches_the_model(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    # one device: without dropout the run is the one-device reference to 1e-5 (as every
    # equivalence test shows); --dropout 0.5 must move the first step's loss well beyond
    # that (measured: 3.4e-4; a tiny model's first logits are small, so the loss stays
    # near ln 64 either way)
    from hetplan.model import load_model
    from hetplan.runtime.reference import reference_train

    plan = write_plan(tmp_path / "p.json", [(8, [(4, [0])])])
    record = run_local(_cfg(plan, inputs, tmp_path / "c", steps=1, dropout=0.5, threads=1))
    _, losses = reference_train(load_model(str(inputs["gpt"])), 8, 1, 0)
    assert abs(record["steps"][0]["loss"] / losses[0] - 1) > 1e-4


@pytest.mark.distributed
def test_a_resumed_run_draws_the_same_dropout_masks(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    """Masks come from (seed, replica, stage, step): 2 steps and a resume to 4 give the
    uninterrupted run's losses (the generator was seeded once, so a resumed run drew the
    first steps' masks again: 5.1789 for 5.1808 in a 6-step run)."""
    plan = write_plan(tmp_path / "p.json", [(4, [(4, [0])]), (4, [(4, [1])])])
    whole = run_local(_cfg(plan, inputs, tmp_path / "a", steps=4, dropout=0.3))
    run_local(_cfg(plan, inputs, tmp_path / "b", steps=2, dropout=0.3))
    resumed = run_local(_cfg(plan, inputs, tmp_path / "b", steps=4, dropout=0.3, resume=True))
    want = [s["loss"] for s in whole["steps"]][2:]
    got = [s["loss"] for s in resumed["steps"]]
    assert [s["step"] for s in resumed["steps"]] == [3, 4]
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_learning_rate_schedule_by_hand() -> None:
    from hetplan.runtime.optim_config import OptimConfig, clip_coefficient, lr_at

    cfg = OptimConfig(lr=1.0, warmup_steps=4, decay_steps=8, min_lr_ratio=0.0)
    # warm-up 1/4 .. 4/4, then cos: step 6 is halfway (0.5), step 8 the end (0), then 0
    got = [lr_at(s, cfg) for s in (1, 2, 4, 6, 8, 9)]
    assert got == pytest.approx([0.25, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-12)
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0


def test_data_convert_bytes_and_refusals(tmp_path: Path) -> None:
    import importlib.util

    import numpy as np

    text = tmp_path / "t.txt"
    # the file's bytes, every one: CR LF and a byte that is not UTF-8 too (launch --data
    # reads a text file so; they were once decoded, dropping the CR and writing U+FFFD)
    raw = "héllo\r\nworld\n".encode() + b"\xe9\n"
    text.write_bytes(raw)
    res = _cli("data", "convert", str(text), "--out", str(tmp_path / "t.bin"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokens"] == len(raw)
    ids = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    assert bytes(ids.astype(np.uint8)) == raw
    bad = _cli("data", "convert", str(text), "--out", str(tmp_path / "t.txt2"))
    assert bad.returncode == 2 and "--out" in bad.stderr and bad.stderr.count("\n") == 1
    if importlib.util.find_spec("tokenizers") is None:
        res = _cli("data", "convert", str(text), "--out", str(tmp_path / "u.bin"),
                   "--tokenizer", str(text))  # fmt: skip
        assert res.returncode == 2 and "'tokenizers' package" in res.stderr
        assert not (tmp_path / "u.bin").exists()


def test_overlaps_the_runtime_does_not_run_are_named() -> None:
    from dataclasses import replace

    from hetplan.plan import Pipeline, Plan, Stage
    from hetplan.runtime.cli import overlap_notes

    def plan(pipes: list[list[tuple[str, ...]]], **fields: Any) -> Plan:
        pipelines = tuple(Pipeline(4, tuple(Stage(2, d) for d in st)) for st in pipes)
        return Plan(8 * len(pipes) // 2, 2, pipelines, **fields)

    dp2 = plan([[("h:0",)], [("h:1",)]], overlap_grad_reduce=True)
    assert [n.split(":")[0] for n in overlap_notes(dp2)] == ["overlap_grad_reduce"]
    assert overlap_notes(replace(dp2, overlap_grad_reduce=False)) == []
    # one replica reduces nothing; TP 2 with the TP overlap asked for
    tp2 = plan([[("h:0", "h:1")]], overlap_grad_reduce=True, overlap_tp_comm=True)
    assert [n.split(":")[0] for n in overlap_notes(tp2)] == ["overlap_tp_comm"]

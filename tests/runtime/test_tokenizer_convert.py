"""``hetplan data convert --tokenizer``: a byte-level BPE tokenizer trained here with the
``tokenizers`` package; the token file must hold exactly ``Tokenizer.encode(text).ids``, as
little-endian uint16, whether the text is encoded in one block or many, and read back by
the runtime's data source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

TEXT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "  indented line, then a blank one\n"
    "\n"
    "\n"
    "Pack my box with five dozen liquor jugs; héllo wörld 123.\n"
    "\tA tab-led line: the lazy dog sleeps.\n"
) * 40


def _train(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_tokenizer_ids_in_the_layout_the_reader_expects(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from hetplan.runtime.launch import _env

    folder = _train(tmp_path / "tok")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = tok.encode(TEXT).ids
    assert len(want) < len(TEXT.encode()) / 2  # merges learnt: not bytes
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "train.bin"
    cmd = [sys.executable, "-m", "hetplan", "data", "convert", str(text), "--out", str(out),
           "--tokenizer", str(folder), "--json"]  # fmt: skip
    res = subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary == {"out": str(out), "tokens": len(want), "dtype": "uint16", "vocab": 320}
    assert out.stat().st_size == 2 * len(want)
    assert np.fromfile(out, dtype="<u2").tolist() == want
    # the runtime's reader: sequence 0 of seed 0 is the first seq + 1 ids
    from hetplan.runtime.data import TokenSource

    src = TokenSource(vocab=320, seq=8, seed=0, path=out)
    assert src.sequence(0).tolist() == want[:9]


def test_blocks_encode_as_the_whole_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import Tokenizer

    from hetplan.runtime import data_convert

    folder = _train(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    with text.open(encoding="utf-8") as f:
        blocks = list(data_convert._blocks(f, 100))
    assert len(blocks) > 20 and "".join(blocks) == TEXT
    assert all(not b[:1].isspace() for b in blocks)
    monkeypatch.setattr(data_convert, "CHUNK_BYTES", 100)
    out = tmp_path / "t.u16"
    summary = data_convert.convert_text(text, out, folder / "tokenizer.json")
    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids
    assert summary["tokens"] == len(want)
    assert np.fromfile(out, dtype="<u2").tolist() == want


def test_byte_ids_in_32_bits_read_back_the_same(tmp_path: Path) -> None:
    """A .u32 name writes uint32 ids whatever the vocabulary (it was refused for 256 byte
    ids: 'needs uint16'); the reader takes the name's width and reads the same bytes."""
    from hetplan.runtime.data import TokenSource
    from hetplan.runtime.data_convert import convert_text

    text = tmp_path / "t.txt"
    text.write_text("hello world, hello tokens\n" * 4, encoding="utf-8")
    out = tmp_path / "t.u32"
    summary = convert_text(text, out)
    want = list(text.read_bytes())
    assert summary["dtype"] == "uint32" and summary["tokens"] == len(want)
    assert np.fromfile(out, dtype="<u4").tolist() == want
    src = TokenSource(vocab=256, seq=8, seed=0, path=out)
    assert src.sequence(0).tolist() == want[:9]

"""``hetplan data convert``: text to a token file ``launch --data`` reads.

The output is a flat array of little-endian token ids, as nanoGPT's ``train.bin``:
uint16 (``.bin`` or ``.u16``) when the vocabulary fits, else uint32 (``.u32``). Without
``--tokenizer`` the ids are the text's bytes (vocabulary 256). With ``--tokenizer
tokenizer.json`` (a Hugging Face tokenizer file, or a model folder holding one, read
locally) the text is encoded by the ``tokenizers`` package (the ``torch`` extra), without
special tokens: the file holds the text's ids only.

Large files are encoded in blocks of about 1 MB, each cut just before a line that starts
with a non-space character: a byte-level BPE (GPT-2) or whitespace pre-tokenizer never joins
a token across such a cut, so the ids equal those of the whole text encoded at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from hetplan.errors import InputError
from hetplan.outputs import output_file

CHUNK_BYTES = 1 << 20


def _encoder(tokenizer: Path | None) -> tuple[Any, int]:
    """Returns (encode function, vocabulary size); no function for the file's bytes."""
    if tokenizer is None:
        return None, 256
    if tokenizer.is_dir():
        tokenizer = tokenizer / "tokenizer.json"
    if not tokenizer.is_file():
        raise InputError("--tokenizer", f"no such file: {tokenizer}")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError(
            "--tokenizer", "needs the 'tokenizers' package: pip install 'hetplan[torch]'"
        ) from None
    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as exc:  # the package raises its own exception types
        raise InputError("--tokenizer", f"{tokenizer} is not a tokenizer file: {exc}") from None
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), int(tok.get_vocab_size())


def _blocks(f: TextIO, size: int) -> Iterator[str]:
    """Yields the text in blocks of at least ``size`` characters (the last may be shorter),
    each cut just before a line that starts with a non-space character."""
    block: list[str] = []
    held = 0
    for line in f:
        if held >= size and line[:1] and not line[:1].isspace():
            yield "".join(block)
            block, held = [], 0
        block.append(line)
        held += len(line)
    if block:
        yield "".join(block)


def _id_blocks(src: Path, encode: Any, dtype: str) -> Iterator[np.ndarray]:
    """Yields the token ids of ``src`` block by block: without ``encode`` the file's bytes,
    every one (as ``launch --data`` reads a text file); else its text's ids."""
    if encode is None:
        with src.open("rb") as f:
            for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
                yield np.frombuffer(chunk, dtype=np.uint8).astype(dtype)
        return
    with src.open("r", encoding="utf-8", errors="replace") as f:
        for text in _blocks(f, CHUNK_BYTES):
            yield np.asarray(encode(text), dtype=dtype)


def convert_text(src: Path, out: Path, tokenizer: Path | None = None) -> dict[str, Any]:
    """Writes the token ids of text file ``src`` to ``out`` (atomically); returns a summary."""
    if not src.is_file():
        raise InputError("TEXT", f"no such file: {src}")
    encode, vocab = _encoder(tokenizer)
    suffix = out.suffix.lower()
    if suffix not in (".bin", ".u16", ".u32"):
        raise InputError("--out", f"{out.name}: name it .bin (uint16), .u16 or .u32")
    dtype = "uint32" if suffix == ".u32" else "uint16"  # as the reader takes the name
    if dtype == "uint16" and vocab > 65536:
        raise InputError(
            "--out", f"{out.name}: a vocabulary of {vocab} needs uint32 ids: name it .u32"
        )
    count = 0
    with output_file(out, "--out", fsync=True) as tmp, tmp.open("wb") as w:
        for ids in _id_blocks(src, encode, dtype):
            ids.astype(ids.dtype.newbyteorder("<"), copy=False).tofile(w)
            count += len(ids)
    return {"out": str(out), "tokens": count, "dtype": dtype, "vocab": vocab}

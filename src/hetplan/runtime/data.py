"""Training data: synthetic tokens, a token file (a flat NumPy memmap of ids, uint16 as
nanoGPT's ``train.bin``, uint32 for vocabularies over 65536, or a ``.npy`` array of integer
ids) or a text file as bytes, addressed by sequence index.

Sequence ``i`` of the stream is a fixed function of (seed, i), so a replica that takes
rows [offset, offset + share) of a global batch reads exactly its share, and a run
resumed at a data position reads what the uninterrupted run would have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hetplan.runtime.config import check_data_file, open_tokens


class TokenSource:
    """Sequences of ``seq + 1`` tokens (inputs and shifted targets) by index."""

    def __init__(self, vocab: int, seq: int, seed: int, path: Path | None = None) -> None:
        self.vocab, self.seq, self.seed = vocab, seq, seed
        self._bytes: np.memmap | None = None
        if path is not None:
            check_data_file(path, vocab, seq)
            ids = open_tokens(path, vocab)
            self._bytes = np.memmap(path, dtype="uint8", mode="r") if ids is None else ids

    def sequence(self, index: int) -> torch.Tensor:
        """Returns sequence ``index`` as int64 tokens of length seq + 1."""
        n = self.seq + 1
        if self._bytes is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            return torch.randint(0, self.vocab, (n,), generator=gen)
        span = len(self._bytes) - n
        # a seed-dependent start, then stride by seq: a streaming pass over the file
        start = (self.seed * 7919 + index * self.seq) % (span + 1)
        return torch.from_numpy(np.asarray(self._bytes[start : start + n], dtype=np.int64))

    def batch(self, position: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (inputs, targets) of sequences [position, position + rows)."""
        seqs = torch.stack([self.sequence(position + i) for i in range(rows)])
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

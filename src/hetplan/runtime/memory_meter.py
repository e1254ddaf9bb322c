"""Peak memory of one rank during training.

CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``). CPU has no
allocator statistics, so the bytes of tensors held are counted instead: parameters,
gradients and optimizer state (after a step, when all exist), plus the peak of the
activations autograd keeps for the backward, counted by ``saved_tensors_hooks`` when
saved and released when the graph frees them (one count per storage; parameters,
which layers save for their backward, excluded: ZeRO-3's gathered weights count as the
layer's weights, not as activations). The hooks cost a Python call per saved tensor (about
4 ms a step of the bench's 4-layer model on one CPU thread, 3% of its step), so they run in
the first ``hooked_steps`` steps only: every step of a schedule keeps the same activations,
and the steps timed after the warm-up run as a run without a meter would.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch


class _Saved:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class MemoryMeter:
    """Measures one rank's peak memory over the steps run inside ``step()``."""

    def __init__(
        self, device: torch.device, params: list[torch.Tensor], hooked_steps: int = 0
    ) -> None:
        """``hooked_steps``: count saved activations in this many first steps (0: all)."""
        self.device = device
        self.params = params
        self.hooked_steps = hooked_steps
        self.steps = 0
        self.skip = {self._local(p).untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.current = 0
        self.peak_saved = 0
        self.static = 0

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter):
            return t  # a weight (FSDP's gathered ones too: freed after the layer runs)
        local = self._local(t)
        ptr = local.untyped_storage().data_ptr()
        if ptr in self.skip or local.device.type == "meta":
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [0, local.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak_saved = max(self.peak_saved, self.current)
        entry[0] += 1
        holder = _Saved(t)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    @staticmethod
    def _unpack(x: Any) -> torch.Tensor:
        out: torch.Tensor = x.t if isinstance(x, _Saved) else x
        return out

    @contextlib.contextmanager
    def step(self, optimizer_state: Iterator[torch.Tensor] | None = None) -> Iterator[None]:
        """Counts the activations saved inside the block (CPU; in the first
        ``hooked_steps`` blocks only, where that is set)."""
        if self.device.type == "cuda":
            yield
            return
        self.steps += 1
        if self.hooked_steps and self.steps > self.hooked_steps:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def note_static(self, tensors: list[torch.Tensor]) -> None:
        """Records the bytes of parameters, gradients and optimizer state held now."""
        seen: set[int] = set()
        total = 0
        for t in tensors:
            local = self._local(t)
            ptr = local.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += local.untyped_storage().nbytes()
        self.static = max(self.static, total)

    def peak_bytes(self) -> int:
        """Returns the peak: the allocator's on CUDA, else static plus saved activations."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.static + self.peak_saved

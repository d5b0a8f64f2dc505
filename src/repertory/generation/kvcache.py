"""The key/value cache of a left-padded batch whose rows join and leave between decode steps (the hf engine's
:class:`~repertory.generation.hf.DecodeStream`)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW_TOKENS = 128


class BatchLayer(DynamicLayer):
    """A KV-cache layer of a left-padded batch that writes new tokens into spare room instead of concatenating
    (transformers' dynamic layer copies the whole cache at every decoded token), and that rows can leave
    (:meth:`select`), join (:meth:`join`) and drop all-padding columns on the left (:meth:`trim`)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            self._store(self._k, self._v, key_states.shape[0], end, key_states)
        self._k[..., self._length : end, :] = key_states
        self._v[..., self._length : end, :] = value_states
        self._length = end
        self._expose()
        return self.keys, self.values

    def _store(self, k: torch.Tensor | None, v: torch.Tensor | None, rows: int, end: int, like: torch.Tensor) -> None:
        """Room for ``end`` tokens and more; the kept ``_length`` columns of ``k``/``v`` (if any) copied in. The room
        is not cleared (zeroing it cost 12% of a long rollout): every column is written before it is exposed."""
        room = end + max(GROW_TOKENS, end // 4)
        self._k = like.new_empty((rows, like.shape[1], room, like.shape[-1]))
        self._v = like.new_empty((rows, like.shape[1], room, like.shape[-1]))
        if k is not None:
            self._k[..., : self._length, :] = k[..., : self._length, :]
            self._v[..., : self._length, :] = v[..., : self._length, :]

    def _expose(self) -> None:
        self.keys, self.values = self._k[..., : self._length, :], self._v[..., : self._length, :]

    def select(self, rows: torch.Tensor) -> None:
        self._k, self._v = self._k[rows], self._v[rows]
        self._expose()

    def trim(self, start: int) -> None:
        """Forget the first ``start`` columns (padding in every row): a view, no copy."""
        self._k, self._v = self._k[..., start:, :], self._v[..., start:, :]
        self._length -= start
        self._expose()

    def join(self, other: BatchLayer) -> None:
        """Append ``other``'s rows below these, both left-padded to the longer of the two."""
        width = max(self._length, other._length)
        ka, va = self._k[..., : self._length, :], self._v[..., : self._length, :]
        kb, vb = other._k[..., : other._length, :], other._v[..., : other._length, :]
        rows = ka.shape[0] + kb.shape[0]
        self._length = 0
        self._store(None, None, rows, width, ka)
        for part, (k, v) in zip((slice(0, ka.shape[0]), slice(ka.shape[0], rows)), ((ka, va), (kb, vb))):
            pad = width - k.shape[2]
            # padding is masked out, but a masked score still multiplies its value: it must be finite
            self._k[part, :, :pad] = 0
            self._v[part, :, :pad] = 0
            self._k[part, :, pad:width] = k
            self._v[part, :, pad:width] = v
        self._length = width
        self._expose()


def batch_cache() -> DynamicCache:
    """An empty cache whose layers are :class:`BatchLayer`."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = BatchLayer
    return cache


def left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    """``mask`` padded with zero columns on the left to ``width``."""
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))

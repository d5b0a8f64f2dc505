"""The key/value cache of a left-padded batch whose rows join and leave between decode steps (the hf engine's
:class:`~repertory.generation.hf.DecodeStream`), and the prefixes kept between turns (:class:`KeptPrefixes`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW_TOKENS = 128
MIN_REUSE = 8  # prompt tokens a kept prefix must cover to be worth reusing


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


@dataclass
class Prefix:
    """Keys and values of some tokens, per layer ``[heads, tokens, head_dim]``."""

    token_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


Hit = tuple[list[int], Prefix]
"""The tokens of a prompt that a prefix covers, and the prefix."""


class KeptPrefixes:
    """Keys and values kept after rows finish, under their cache keys: the least recently used are evicted first
    beyond the room a caller gives (what the rows in flight leave of the memory budget), and never more than
    ``cap`` tokens (0: keep none)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tokens = 0
        self._kept: OrderedDict[object, Prefix] = OrderedDict()

    def values(self) -> list[Prefix]:
        return list(self._kept.values())

    def longest(self, key: object, prompt: Sequence[int]) -> Hit | None:
        """The longest prefix of ``prompt`` kept under ``key`` (leaving one token to encode), if worth it."""
        if key is None or key not in self._kept:
            return None
        prefix = self._kept[key]
        common = common_length([prefix.token_ids, prompt], min(len(prefix.token_ids), len(prompt) - 1))
        if common < MIN_REUSE:
            return None
        self._kept.move_to_end(key)
        return prefix.token_ids[:common], prefix

    def keep(self, key: object, prefix: Prefix, room: int) -> None:
        """Keep ``prefix`` under ``key`` (replacing what was there), then evict down to ``room`` tokens."""
        old = self._kept.pop(key, None)
        self.tokens += len(prefix.token_ids) - (len(old.token_ids) if old else 0)
        self._kept[key] = prefix
        self.evict(room)

    def forget(self, key: object) -> None:
        forgotten = self._kept.pop(key, None)
        if forgotten is not None:
            self.tokens -= len(forgotten.token_ids)

    def clear(self) -> None:
        self._kept.clear()
        self.tokens = 0

    def evict(self, room: int) -> None:
        """Drop the least recently used prefixes until the kept tokens fit ``room`` and the cap."""
        while self._kept and self.tokens > min(self.cap, room):
            _, evicted = self._kept.popitem(last=False)
            self.tokens -= len(evicted.token_ids)


def common_length(sequences: Sequence[Sequence[int]], limit: int) -> int:
    """The length of the sequences' common prefix, at most ``limit``. The common prefix of all is that of the
    lexicographically first and last, so only those two are walked."""
    first, last = min(sequences), max(sequences)
    common = 0
    while common < limit and first[common] == last[common]:
        common += 1
    return common


def assemble_past(hits: Sequence[Hit | None], device: torch.device) -> tuple[DynamicCache, torch.Tensor]:
    """A left-padded batch cache of each row's prefix (empty when none has one), and its attention mask."""
    n = len(hits)
    longest = max((len(h[0]) for h in hits if h), default=0)
    mask = torch.zeros((n, longest), dtype=torch.long)
    cache = batch_cache()
    if longest == 0:
        return cache, mask
    sample = next(h[1].kv for h in hits if h)
    for layer, (k0, v0) in enumerate(sample):
        keys = k0.new_zeros((n, k0.shape[0], longest, k0.shape[2]))
        values = v0.new_zeros((n, v0.shape[0], longest, v0.shape[2]))
        for i, h in enumerate(hits):
            if h:
                length = len(h[0])
                k, v = h[1].kv[layer]
                keys[i, :, longest - length :] = k[:, :length]
                values[i, :, longest - length :] = v[:, :length]
        cache.update(keys.to(device), values.to(device), layer)
    for i, h in enumerate(hits):
        if h:
            mask[i, longest - len(h[0]) :] = 1
    return cache, mask


def row_kv(cache: DynamicCache, row: int, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's keys and values at its unpadded positions (``mask``: that row's), per layer."""
    valid = mask.nonzero().squeeze(1)
    return [
        (layer.keys[row][:, valid].contiguous(), layer.values[row][:, valid].contiguous()) for layer in cache.layers
    ]


def left_padded(sequences: Sequence[Sequence[int]], pad: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids left-padded to the longest (with ``pad``, 0 if None) and their mask."""
    width = max(len(x) for x in sequences)
    input_ids = torch.full((len(sequences), width), pad if pad is not None else 0, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, tokens in enumerate(sequences):
        input_ids[i, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
        mask[i, width - len(tokens) :] = 1
    return input_ids, mask

"""The hf engine's key/value caches: a left-padded batch whose rows join and leave between decode steps (the
:class:`~repertory.generation.stream.DecodeStream`), pages that rows of any length hold without padding (the
:class:`~repertory.generation.stream.PagedStream`), and the prefixes kept between turns (:class:`KeptPrefixes`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from repertory.models.decode import paged_decode_attention

GROW_TOKENS = 128
MIN_REUSE = 8  # prompt tokens a kept prefix must cover to be worth reusing
PAGE = 128  # tokens a page holds: the decode kernel's block of columns, so that it scores a page in one step


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

    @property
    def size(self) -> int:
        """Tokens of the memory budget it takes."""
        return len(self.token_ids)

    def release(self) -> None:
        """Nothing to give back: the tensors go with the object."""


class Pages:
    """Keys and values of every layer in pages of :data:`PAGE` tokens (``[pages, kv_heads, PAGE, head_dim]`` a
    layer), shared by the rows of every stream and the kept prefixes. A whole page may have several holders (rows
    that start with the same tokens), and it is free again when the last gives it back; a page still being
    written has one. The tensors are allocated once and never cleared: memory is touched only where pages are
    written, and freed pages are taken again most recent first, so what a run touches stays what it needs at its
    busiest."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, count: int, dtype: torch.dtype):
        shape = (count, kv_heads, PAGE, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.count = count
        self._free = list(range(count - 1, -1, -1))
        self._holders = [0] * count
        self.reclaim: Callable[[], bool] = lambda: False
        """Frees some page when none is free (the backend evicts a kept prefix); False when it cannot."""

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages, now held by the caller."""
        taken: list[int] = []
        while len(taken) < n:
            if not self._free and not self.reclaim():
                self.drop(taken)
                # admission reserves every row's pages up front, so this is a bug in the accounting
                raise RuntimeError(f"no free page of {self.count} left for {n} more")
            if self._free:
                taken.append(self._free.pop())
                self._holders[taken[-1]] = 1
        return taken

    def hold(self, pages: Sequence[int]) -> list[int]:
        """``pages`` (whole ones, never written again), now held by the caller too."""
        for page in pages:
            self._holders[page] += 1
        return list(pages)

    def drop(self, pages: Sequence[int]) -> None:
        """Give ``pages`` back: each is free once its last holder has."""
        for page in reversed(pages):
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free.append(page)

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor):
        """Write ``keys``/``values`` [n, kv_heads, head_dim] at ``slots`` (page and offset of each, [n] each)."""
        page, offset = slots
        self.keys[layer][page, :, offset] = keys.to(self.keys[layer].dtype)
        self.values[layer][page, :, offset] = values.to(self.values[layer].dtype)

    def gather(self, pages: Sequence[int], length: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``length`` tokens held in ``pages``, per layer ``[kv_heads, length, head_dim]`` (a copy)."""
        index = torch.tensor(list(pages), dtype=torch.long)

        def flat(pool: torch.Tensor) -> torch.Tensor:
            part = pool[index].transpose(0, 1)  # [kv_heads, pages, PAGE, head_dim]
            return part.reshape(part.shape[0], -1, part.shape[-1])[:, :length].to(dtype)

        return [(flat(k), flat(v)) for k, v in zip(self.keys, self.values)]


class PagedPrefix:
    """A kept prefix that holds its pages; its keys and values are copied out only if a prompt reuses it."""

    def __init__(self, token_ids: list[int], pages: list[int], pool: Pages, dtype: torch.dtype):
        self.token_ids, self.pages, self._pool, self._dtype = token_ids, pages, pool, dtype

    @property
    def size(self) -> int:
        return len(self.pages) * PAGE

    @cached_property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._pool.gather(self.pages, len(self.token_ids), self._dtype)

    def release(self) -> None:
        self._pool.drop(self.pages)
        self.pages = []


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


class PagedPass:
    """One forward pass of a :class:`~repertory.generation.stream.PagedStream`: the model's cache for the pass
    (``update`` writes each row's new keys and values into its pages and hands the layer's pages on) and its
    attention (``attend``, reached through the ``paged`` keyword the model passes down to
    :func:`repertory.models.attention.gqa_sdpa_attention`).

    Row b feeds ``fed[b]`` tokens after its ``cached[b]``, padded to the longest; its j-th query attends to its
    first ``cached[b] + min(j, fed[b] - 1) + 1`` columns, so each query token is a row of the decode kernel."""

    def __init__(self, pool: Pages, tables: Sequence[Sequence[int]], cached: Sequence[int], fed: Sequence[int]):
        self.pool = pool
        width = max(fed)
        table = torch.zeros((len(tables), max(len(t) for t in tables)), dtype=torch.long)
        for b, pages in enumerate(tables):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        self.table = table.repeat_interleave(width, dim=0)
        self.lengths = torch.tensor([c + min(j, f - 1) + 1 for c, f in zip(cached, fed) for j in range(width)])
        self.source = torch.tensor([b * width + j for b, f in enumerate(fed) for j in range(f)], dtype=torch.long)
        positions = torch.tensor([c + j for c, f in zip(cached, fed) for j in range(f)], dtype=torch.long)
        self.slots = (table[self.source // width, positions // PAGE], positions % PAGE)
        self.mask = torch.ones((len(tables), 1, width, 1), dtype=torch.bool)
        """What the model is given as its attention mask: already 4-D, so it builds none; ``attend`` ignores it."""

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's real tokens of ``keys``/``values`` [rows, kv_heads, width, head_dim]; the layer's pages."""
        flat = [x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])[self.source] for x in (keys, values)]
        self.pool.write(layer, self.slots, *flat)
        return self.pool.keys[layer], self.pool.values[layer]

    def attend(self, query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor, scale: float | None):
        """Attention of ``query`` [rows, heads, width, head_dim] over the rows' pages: [rows, width, heads,
        head_dim]."""
        rows, heads, width, dim = query.shape
        flat = query.transpose(1, 2).reshape(rows * width, heads, 1, dim)
        return paged_decode_attention(flat, key_pages, value_pages, self.table, self.lengths, scale).view(
            rows, width, heads, dim
        )


Hit = tuple[list[int], Prefix | PagedPrefix]
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

    def keep(self, key: object, prefix: Prefix | PagedPrefix, room: int) -> None:
        """Keep ``prefix`` under ``key`` (replacing what was there), then evict down to ``room`` tokens."""
        old = self._kept.pop(key, None)
        if old is not None:
            self.tokens -= old.size
            old.release()
        self.tokens += prefix.size
        self._kept[key] = prefix
        self.evict(room)

    def forget(self, key: object) -> None:
        """Stop keeping what ``key`` names, without releasing it: the caller holds it now."""
        forgotten = self._kept.pop(key, None)
        if forgotten is not None:
            self.tokens -= forgotten.size

    def clear(self) -> None:
        self.evict(-1)

    def evict(self, room: int) -> None:
        """Drop the least recently used prefixes until the kept tokens fit ``room`` and the cap."""
        while self._kept and self.tokens > min(self.cap, room):
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used prefix; False when none is kept."""
        if not self._kept:
            return False
        _, evicted = self._kept.popitem(last=False)
        self.tokens -= evicted.size
        evicted.release()
        return True


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

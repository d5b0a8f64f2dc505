"""Generation backend ``hf``: batched sampling with exact per-token log-probs and constrained actions.

One call samples continuations for many prompts of different lengths at once: prompts are
left-padded into one batch, encoded in one forward pass, then decoded token by token with a KV
cache; rows that finish are dropped from the batch so the rest run on. For every sampled token it
records ``log softmax(logits / T)[token]`` over the full vocabulary — the quantity the learner
recomputes (docs/algorithms.md 1.2) — also when top-p or a constraint restricted what could be drawn.

Prefix reuse: a caller may name each row with a cache key (the LM agent uses episode and seat).
After a row finishes, its keys and values are kept; when the same key comes back with a prompt
that extends the stored tokens (a role's growing chat), only the new suffix is encoded. Kept
prefixes are evicted least-recently-used beyond a token budget.

Identical prompts in one call (several samples of one state) are encoded once: the batch is
prefilled with each distinct prompt and its keys and values are copied to the rows that share it.

Each row draws its randomness from its own seed, so a row's tokens do not depend on which other
rows share its batch. Constrained rows may only produce one of a finite set of complete responses:
their logits are masked to the children of the current node of a token trie built from the
tokenised choices (each followed by the end-of-turn token).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from repertory.generation.core import (
    ENOUGH_EVERY,
    SYNCED,
    Generation,
    GenerationStats,
    SamplingParams,
    TokenizedChoices,
    TokenTrie,
    end_of_turn_id,
    stop_token_ids,
)
from repertory.models import LoadedModel


@dataclass
class _Prefix:
    token_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [heads, tokens, head_dim]


class _GrowingLayer(DynamicLayer):
    """A KV-cache layer that writes new tokens into spare room instead of concatenating: transformers'
    dynamic layer copies the whole cache at every decoded token, which dominated long, wide decodes."""

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
            room = end + max(GROW_TOKENS, end // 4)
            batch, heads, _, dim = key_states.shape
            k = key_states.new_empty((batch, heads, room, dim))
            v = value_states.new_empty((batch, value_states.shape[1], room, value_states.shape[-1]))
            if self._k is not None:
                k[..., : self._length, :] = self._k[..., : self._length, :]
                v[..., : self._length, :] = self._v[..., : self._length, :]
            self._k, self._v = k, v
        self._k[..., self._length : end, :] = key_states
        self._v[..., self._length : end, :] = value_states
        self._length = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[..., : self._length, :], self._v[..., : self._length, :]


def _growing_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = _GrowingLayer
    return cache


GROW_TOKENS = 128
MIN_REUSE = 8


class HFBackend(TokenizedChoices):
    """Batched sampling with a transformers causal LM (CPU in float32, GPU in bfloat16)."""

    def __init__(self, loaded: LoadedModel, max_batch: int = 64, prefix_cache_tokens: int = 131072):
        self.loaded = loaded
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefixes: OrderedDict[object, _Prefix] = OrderedDict()
        self.model = loaded.model
        self.peft = loaded.peft
        self.tokenizer = loaded.tokenizer
        self.max_batch = max_batch
        self.stats = GenerationStats()
        self.version = 0
        self.name = loaded.name
        self.stop_ids = stop_token_ids(loaded.tokenizer)
        self._tries: dict[tuple[str, ...], TokenTrie] = {}
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    @property
    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn (the one a constrained response ends with)."""
        return end_of_turn_id(self.tokenizer, self.stop_ids)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        constraints: Sequence[TokenTrie | None] | None = None,
        cache_keys: Sequence[object] | None = None,
        enough: Sequence[Callable[[str], bool] | None] | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt, in order; ``seeds[i]`` drives row i's randomness,
        ``constraints[i]`` restricts it to a trie, ``cache_keys[i]`` names it for prefix reuse,
        ``enough[i](text)`` ends it early (finish "length") once more text would be wasted, and
        ``adapters[i]`` picks the LoRA adapter (None: adapters off) that samples it."""
        if len(seeds) != len(prompts):
            raise ValueError("one seed per prompt is required")
        constraints = list(constraints) if constraints is not None else [None] * len(prompts)
        keys = list(cache_keys) if cache_keys is not None else [None] * len(prompts)
        enough = list(enough) if enough is not None else [None] * len(prompts)
        groups: dict[object, list[int]] = {}
        for i in range(len(prompts)):
            groups.setdefault(adapters[i] if adapters is not None else SYNCED, []).append(i)
        out: list[Generation | None] = [None] * len(prompts)
        for adapter, rows in groups.items():
            order = sorted(rows, key=lambda i: len(prompts[i]))
            with self._sampling_with(adapter):
                for start in range(0, len(order), self.max_batch):
                    chunk = order[start : start + self.max_batch]
                    results = self._generate_batch(
                        [prompts[i] for i in chunk],
                        params,
                        [seeds[i] for i in chunk],
                        [constraints[i] for i in chunk],
                        [keys[i] for i in chunk],
                        [enough[i] for i in chunk],
                    )
                    for i, result in zip(chunk, results):
                        out[i] = result
        self.stats.calls += 1
        return out  # type: ignore[return-value]

    @contextlib.contextmanager
    def _sampling_with(self, adapter: object) -> Iterator[None]:
        """The PEFT model's adapter state for one group of rows (restored afterwards)."""
        if adapter is SYNCED:
            yield
            return
        if self.peft is None:
            raise ValueError(f"adapter {adapter!r} requested from a model without LoRA adapters")
        if adapter is None:
            with self.peft.disable_adapter():
                yield
            return
        active = self.peft.active_adapter
        self.peft.set_adapter(adapter, inference_mode=True)
        try:
            yield
        finally:
            self.peft.set_adapter(active)

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[Sequence[int]],
        params: SamplingParams,
        seeds: list[int],
        constraints: list[TokenTrie | None],
        keys: list[object],
        enough: list[Callable[[str], bool] | None],
    ) -> list[Generation]:
        device = self.loaded.device
        n = len(prompts)
        reused = [self._reusable(key, prompt) for key, prompt in zip(keys, prompts)]
        distinct: dict[tuple[tuple[int, ...], int], int] = {}
        source = [
            distinct.setdefault((tuple(p), len(r[0]) if r else 0), i) for i, (p, r) in enumerate(zip(prompts, reused))
        ]
        encoded = sorted(set(source))
        cache, past_mask = self._assemble_past([reused[i] for i in encoded], device)
        suffixes = [list(prompts[i][len(reused[i][0]) if reused[i] else 0 :]) for i in encoded]
        width = max(len(x) for x in suffixes)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        suffix_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, suffix in enumerate(suffixes):
            input_ids[i, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            suffix_mask[i, width - len(suffix) :] = 1
        mask = torch.cat([past_mask, suffix_mask], dim=1).to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.reused_prompt_tokens += sum(len(r[0]) for r in reused if r)
        self.stats.shared_prompt_tokens += sum(len(prompts[i]) for i in range(n) if source[i] != i)

        rngs = [torch.Generator().manual_seed(s % 2**63) for s in seeds]
        nodes = list(constraints)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        active = list(range(n))
        temperature = params.temperature if params.temperature > 0 else 1.0
        logits, cache = self._forward(input_ids.to(device), mask, positions, cache)
        logits = logits[:, -1]
        last_pos = positions[:, -1]
        if len(encoded) < n:
            slot = {i: row for row, i in enumerate(encoded)}
            rows = torch.tensor([slot[i] for i in source], device=device)
            cache.batch_select_indices(rows)
            mask, last_pos, logits = mask[rows], last_pos[rows], logits[rows]
        while True:
            chosen, chosen_logp = self._sample(logits, params, [rngs[i] for i in active], [nodes[i] for i in active])
            still: list[int] = []
            chunks: list[list[int]] = []
            for row, i in enumerate(active):
                token = int(chosen[row])
                tokens[i].append(token)
                logps[i].append(float(chosen_logp[row]))
                if nodes[i] is not None:
                    nodes[i] = nodes[i].children.get(token)  # type: ignore[union-attr]
                if token in self.stop_ids or (params.stop and self._hit_stop(tokens[i], params.stop)):
                    finish[i] = "stop"
                elif len(tokens[i]) >= params.max_new_tokens:
                    finish[i] = "length"
                elif enough[i] is not None and len(tokens[i]) % ENOUGH_EVERY == 0 and enough[i](self.decode(tokens[i])):
                    finish[i] = "length"
                else:
                    still.append(row)
                    forced = [] if params.stop else self._forced(nodes[i], params.max_new_tokens - len(tokens[i]))
                    chunks.append([token, *forced])
            self.stats.generated_tokens += len(active)
            continuing = set(still)
            for row, i in enumerate(active):
                if row not in continuing:
                    self._keep_prefix(keys[i], list(prompts[i]) + tokens[i][:-1], cache, row, mask[row])
            if not still:
                break
            keep = torch.tensor(still, device=device)
            if len(still) < len(active):
                cache.batch_select_indices(keep)
                mask, last_pos = mask[keep], last_pos[keep]
            active = [active[row] for row in still]
            # Forced tokens (a constraint with a single continuation) are fed in the same forward pass as
            # the sampled token: one pass per real choice instead of one per token.
            width = max(len(c) for c in chunks)
            chunk_ids = torch.full((len(active), width), pad, dtype=torch.long)
            chunk_mask = torch.zeros((len(active), width), dtype=mask.dtype)
            for row, chunk in enumerate(chunks):
                chunk_ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
                chunk_mask[row, : len(chunk)] = 1
            mask = torch.cat([mask, chunk_mask.to(device)], dim=1)
            steps = torch.arange(1, width + 1, device=device).unsqueeze(0)
            logits, cache = self._forward(chunk_ids.to(device), mask, last_pos.unsqueeze(1) + steps, cache, keep=width)
            lengths = torch.tensor([len(c) for c in chunks], device=device)
            last_pos = last_pos + lengths
            next_logits = logits[torch.arange(len(active), device=device), lengths - 1]
            for row, (i, chunk) in enumerate(zip(active, chunks)):
                if len(chunk) > 1:
                    forced_logp = torch.log_softmax(logits[row, : len(chunk) - 1] / temperature, dim=-1)
                    for j, token in enumerate(chunk[1:]):
                        tokens[i].append(token)
                        logps[i].append(float(forced_logp[j, token]))
                        nodes[i] = nodes[i].children.get(token)  # type: ignore[union-attr]
                    self.stats.generated_tokens += len(chunk) - 1
            logits = next_logits
        return [Generation(tokens[i], logps[i], finish[i]) for i in range(n)]

    def _reusable(self, key: object, prompt: Sequence[int]) -> tuple[list[int], _Prefix] | None:
        """The longest kept prefix of ``prompt`` under ``key`` (leaving one token to encode), if worth it."""
        if key is None or key not in self._prefixes:
            return None
        prefix = self._prefixes[key]
        limit = min(len(prefix.token_ids), len(prompt) - 1)
        common = 0
        while common < limit and prefix.token_ids[common] == prompt[common]:
            common += 1
        if common < MIN_REUSE:
            return None
        self._prefixes.move_to_end(key)
        return prefix.token_ids[:common], prefix

    def _assemble_past(
        self, reused: list[tuple[list[int], _Prefix] | None], device: torch.device
    ) -> tuple[DynamicCache, torch.Tensor]:
        """A left-padded batch cache of the reused prefixes (empty when none), and its attention mask."""
        n = len(reused)
        longest = max((len(r[0]) for r in reused if r), default=0)
        mask = torch.zeros((n, longest), dtype=torch.long)
        cache = _growing_cache()
        if longest == 0:
            return cache, mask
        sample = next(r[1].kv for r in reused if r)
        for layer, (k0, v0) in enumerate(sample):
            keys = k0.new_zeros((n, k0.shape[0], longest, k0.shape[2]))
            values = v0.new_zeros((n, v0.shape[0], longest, v0.shape[2]))
            for i, r in enumerate(reused):
                if r:
                    length = len(r[0])
                    k, v = r[1].kv[layer]
                    keys[i, :, longest - length :] = k[:, :length]
                    values[i, :, longest - length :] = v[:, :length]
            cache.update(keys.to(device), values.to(device), layer)
        for i, r in enumerate(reused):
            if r:
                mask[i, longest - len(r[0]) :] = 1
        return cache, mask

    def _keep_prefix(
        self, key: object, token_ids: list[int], cache: DynamicCache, row: int, mask: torch.Tensor
    ) -> None:
        """Keep one row's keys and values (its unpadded positions) for the next turn under ``key``."""
        if key is None or self.prefix_cache_tokens <= 0 or len(token_ids) > self.prefix_cache_tokens:
            return
        valid = mask.nonzero().squeeze(1)
        kv = [
            (layer.keys[row][:, valid].contiguous(), layer.values[row][:, valid].contiguous()) for layer in cache.layers
        ]
        self._prefixes.pop(key, None)
        self._prefixes[key] = _Prefix(token_ids, kv)
        total = sum(len(p.token_ids) for p in self._prefixes.values())
        while total > self.prefix_cache_tokens:
            _, evicted = self._prefixes.popitem(last=False)
            total -= len(evicted.token_ids)

    def reset_cache(self) -> None:
        """Forget every kept prefix: required whenever the weights change (they would be stale)."""
        self._prefixes.clear()

    def sync(self, policy: Any) -> None:
        """The learner updated ``policy``, the very module this backend runs: nothing to copy, but every kept
        prefix was computed with the old weights."""
        if policy is not self.model:
            raise ValueError("the hf backend samples the module it was built on; build a backend for this policy")
        self.version += 1
        self.reset_cache()

    def offload(self) -> None:
        """Nothing to free: the backend runs the learner's own module."""

    def close(self) -> None:
        """Release the kept prefixes (the weights belong to the caller)."""
        self.reset_cache()

    def _forced(self, node: TokenTrie | None, budget: int) -> list[int]:
        """The tokens a constraint leaves no choice about after ``node`` (never a stop token, within budget)."""
        out: list[int] = []
        while node is not None and len(node.children) == 1 and len(out) < budget - 1:
            token, child = next(iter(node.children.items()))
            if token in self.stop_ids:
                break
            out.append(token)
            node = child
        return out

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        keep: int = 1,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Logits of the last ``keep`` positions (float32, [batch, keep, vocab]) and the updated KV cache."""
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **{self._cache_kwarg: cache},
        )
        self.stats.forward_passes += 1
        new_cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        return output.logits[:, -keep:, :].float(), new_cache

    def _hit_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        tail = self.decode(token_ids[-16:])
        return any(s in tail for s in stop)

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: SamplingParams,
        rngs: list[torch.Generator],
        nodes: list[TokenTrie | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return the tokens and their full-vocabulary log-probs.

        Sampling is Gumbel-max with per-row noise from the row's own generator, so a perturbation
        of the logits far below the gap between the best candidates (padding, a reused prefix,
        another batch) leaves the draw unchanged.
        """
        temperature = params.temperature if params.temperature > 0 else 1.0
        logp_full = torch.log_softmax(logits / temperature, dim=-1)
        scores = logp_full.clone()
        for row, node in enumerate(nodes):
            if node is not None and node.children:
                allowed = torch.tensor(list(node.children), device=scores.device)
                masked = torch.full_like(scores[row], float("-inf"))
                masked[allowed] = scores[row, allowed]
                scores[row] = masked
        if params.temperature > 0 and params.top_p < 1:
            sorted_scores, index = scores.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            outside = probs.cumsum(-1) - probs > params.top_p
            scores = scores.scatter(-1, index, sorted_scores.masked_fill(outside, float("-inf")))
        if params.temperature > 0:
            vocab = scores.shape[1]
            uniform = torch.stack([torch.rand(vocab, generator=g) for g in rngs]).clamp_(1e-12, 1 - 1e-7)
            scores = scores + (-torch.log(-torch.log(uniform))).to(scores.device)
        chosen = scores.argmax(dim=-1)
        return chosen, logp_full.gather(1, chosen.unsqueeze(1)).squeeze(1)

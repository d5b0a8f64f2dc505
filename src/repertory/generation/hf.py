"""Generation backend ``hf``: continuous batching with exact per-token log-probs and constrained actions.

Rows are decoded in a :class:`DecodeStream`: one sampling setting and one policy version, rows of different
prompt lengths left-padded into one key/value cache and decoded token by token. Rows join between two decode
steps (their prompts are prefilled in one pass and their keys and values merged into the batch in flight) and
leave as soon as they finish, so a caller that turns a finished row into its next request (the rollout engine:
an episode steps as soon as its seats have answered) never waits for the batch's slowest row. ``generate`` is
a stream that is handed every row at once and run until it is empty. For every sampled token it records
``log softmax(logits / T)[token]`` over the full vocabulary — the quantity the learner recomputes
(docs/algorithms.md 1.2) — also when top-p or a trie restricted what could be drawn; under a grammar, over the
tokens the grammar allows (the masked policy, which the learner recomputes by replaying the grammar).

Memory: keys and values in flight and kept prefixes share one budget (``kv_memory_mb``; 2 GiB on a CPU, a
quarter of the device on a GPU). A row joins only while the padded cache of the batch, each row reserving its
prompt and its whole token budget, fits; kept prefixes fill what the rows in flight leave, least recently used
evicted first. A row that could not fit even alone is a one-line error before anything runs.

Prefix reuse: a caller may name each row with a cache key (the LM agent uses episode and seat). After a row
finishes, its keys and values are kept; when the same key comes back with a prompt that extends the stored
tokens (a role's growing chat), only the new suffix is encoded, and the kept copy is dropped (the row in flight
holds those keys and values now, and its finish keeps the longer chat), so no chat is held twice.

Identical prompts joining together (several samples of one state) are encoded once: the prefill runs each
distinct prompt and its keys and values are copied to the rows that share it. Rows joining together under one
cache key with no kept prefix (a judge's questions about one episode) share their common prefix the same way:
a first pass encodes it once per key, the prefill then encodes each row's own suffix after it.

Each row draws its randomness from its own seed, so a row's tokens do not depend on which other rows share its
batch or when it joined. Constrained rows may only produce one of a finite set of complete responses: their
logits are masked to the children of the current node of a token trie built from the tokenised choices (each
followed by the end-of-turn token).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from repertory.generation.core import (
    SYNCED,
    Generation,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    TokenizedChoices,
    TokenTrie,
    end_of_turn_id,
    stop_token_ids,
)
from repertory.generation.grammar import GrammarRow
from repertory.generation.kvcache import (
    MIN_REUSE,
    PAGE,
    Hit,
    KeptPrefixes,
    Pages,
    Prefix,
    batch_cache,
    common_length,
    row_kv,
)
from repertory.generation.stream import DecodeStream, PagedStream, Row
from repertory.models import LoadedModel, attention_shape, kv_bytes_per_token
from repertory.models.adapters import BASE_ROW, per_row_adapters
from repertory.models.attention import ATTENTION
from repertory.models.decode import paged_kernel
from repertory.models.linear import PRECISIONS, free_reduced_copies, sampling_precision
from repertory.types import RepertoryError

PAGED_MODELS = ("llama",)  # architectures whose every layer attends through repertory's attention, in full
CPU_KV_MEMORY_MB = 2048  # keys and values in flight plus kept prefixes, on a CPU (docs/design.md, Memory)
GPU_KV_SHARE = 0.25  # of the device's memory, on a GPU


class HFBackend(TokenizedChoices):
    """Batched sampling with a transformers causal LM (CPU in float32, GPU in bfloat16)."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_memory_mb: float | None = None,
        max_batch: int | None = None,
        prefix_cache_tokens: int | None = None,
        precision: str = "float32",
        paged: bool = True,
        kv_dtype: str = "float32",
    ):
        """``kv_memory_mb`` bounds keys and values in flight plus kept prefixes (default: 2 GiB on a CPU, a
        quarter of a GPU); ``max_batch`` caps the rows in flight besides; ``prefix_cache_tokens`` caps the kept
        prefixes below what the budget leaves them (0: keep none); ``precision`` "bfloat16" runs the linear
        layers of a float32 CPU model through bfloat16 weight copies (faster, not exact; see
        :mod:`repertory.models.linear`); ``paged`` False keeps every stream's rows in one left-padded tensor
        (the path before pages, for comparisons); ``kv_dtype`` "bfloat16" keeps the pages in bfloat16 (half the
        bytes, twice the tokens in the budget; not exact)."""
        self.loaded = loaded
        self.model = loaded.model
        self.peft = loaded.peft
        self.tokenizer = loaded.tokenizer
        memory_mb = kv_memory_mb if kv_memory_mb is not None else _default_kv_memory_mb(loaded.device)
        if memory_mb <= 0 or (max_batch is not None and max_batch < 1):
            raise RepertoryError("rollout.engine_args: kv_memory_mb must be positive and max_batch at least 1")
        for name, value in (("precision", precision), ("kv_dtype", kv_dtype)):
            if value not in PRECISIONS:
                known = ", ".join(PRECISIONS)
                raise RepertoryError(f"rollout.engine_args: {name} must be one of {known}, not {value!r}")
        self.precision, self.paged, self.kv_dtype = precision, paged, getattr(torch, kv_dtype)
        if self.kv_dtype != torch.float32 and not self.paged_cache:
            raise RepertoryError(
                "rollout.engine_args: kv_dtype bfloat16 keeps the paged cache in bfloat16, and this engine has none "
                "(it needs a CPU, a float32 Llama-architecture model, the decode kernel and paged not false)"
            )
        self.token_bytes = kv_bytes_per_token(loaded.model.config, self.kv_dtype)
        self._pages: Pages | None = None
        self.budget_tokens = int(memory_mb * 2**20) // self.token_bytes
        self.max_batch = max_batch
        self.prefixes = KeptPrefixes(self.budget_tokens if prefix_cache_tokens is None else prefix_cache_tokens)
        self._reserved: dict[int, int] = {}  # stream id -> tokens its rows in flight may fill
        self.stats = GenerationStats()
        self.version = 0
        self.name = loaded.name
        self.stop_ids = stop_token_ids(loaded.tokenizer)
        self._tries: dict[tuple[str, ...], TokenTrie] = {}
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    @property
    def context_window(self) -> int | None:
        """The model's positions (its config's ``max_position_embeddings``)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn (the one a constrained response ends with)."""
        return end_of_turn_id(self.tokenizer, self.stop_ids)

    def stream(self, params: SamplingParams, adapter: object = SYNCED) -> DecodeStream:
        """A stream of rows sampled with ``params`` by the policy version ``adapter`` names (see ``generate``):
        paged where it can be (see :mod:`repertory.generation.stream`)."""
        return (PagedStream if self.paged_cache else DecodeStream)(self, params, adapter)

    @property
    def paged_cache(self) -> bool:
        """Whether streams hold their rows in pages: asked for, on a CPU, a float32 Llama-architecture model that
        runs repertory's attention, and the decode kernel loaded."""
        config = self.model.config
        return (
            self.paged
            and self.loaded.device.type == "cpu"
            and next(self.model.parameters()).dtype == torch.float32
            and getattr(config, "model_type", None) in PAGED_MODELS
            and getattr(config, "_attn_implementation", None) == ATTENTION
            and paged_kernel() is not None
        )

    def pages(self) -> Pages:
        """The pages every paged stream's rows and the kept prefixes hold: the whole budget, allocated once."""
        if self._pages is None:
            layers, _, kv_heads, head_dim = attention_shape(self.model.config)
            self._pages = Pages(layers, kv_heads, head_dim, self.budget_tokens // PAGE, self.kv_dtype)
            self._pages.reclaim = self.prefixes.evict_one
        return self._pages

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per request, in order (see :class:`GenerationRequest`)."""
        out: list[Generation | None] = [None] * len(requests)
        stream = self.stream(params)
        index = {stream.add(requests[i]): i for i in _join_order(requests)}
        while stream.busy:
            for ticket, generation in stream.step():
                out[index[ticket]] = generation
        return out  # type: ignore[return-value]

    def _sampling_with(self, adapters: Sequence[object]) -> contextlib.AbstractContextManager:
        """The adapter state of one forward pass whose row i is sampled by the version ``adapters[i]`` names:
        the model as synced when every row asks for that, the base when every row asks for it, else each row
        through its own adapter in the same pass (the active one for SYNCED). Adapters are never switched, so
        the learner's trainable adapters stay trainable."""
        synced = any(a is SYNCED for a in adapters)
        if synced and self.peft is not None and len(self.peft.active_adapters) > 1:
            raise ValueError(f"adapters {self.peft.active_adapters} are all active (one per role): name one per row")
        if all(a is SYNCED for a in adapters):
            return contextlib.nullcontext()
        if self.peft is None:
            named = next(a for a in adapters if a is not SYNCED)
            raise ValueError(f"adapter {named!r} requested from a model without LoRA adapters")
        if all(a is None for a in adapters):
            return self.peft.disable_adapter()
        active = self.peft.active_adapter
        names = [active if a is SYNCED else BASE_ROW if a is None else a for a in adapters]
        return per_row_adapters(self.peft, names)  # type: ignore[arg-type]

    def _reserve(self, stream: DecodeStream, tokens: int) -> None:
        """Record what ``stream``'s rows in flight may fill, and evict kept prefixes beyond what is left."""
        if tokens:
            self._reserved[id(stream)] = tokens
        else:
            self._reserved.pop(id(stream), None)
        self.prefixes.evict(self._prefix_room())

    def room(self, stream: DecodeStream) -> int:
        """Tokens of the budget that ``stream``'s rows in flight may fill (the other streams' taken out)."""
        return self.budget_tokens - sum(t for s, t in self._reserved.items() if s != id(stream))

    def _keep_prefix(
        self, key: object, token_ids: list[int], cache: DynamicCache, row: int, mask: torch.Tensor
    ) -> None:
        """Keep one row's keys and values (its unpadded positions) for the next turn under ``key``."""
        if key is not None and len(token_ids) <= self.prefixes.cap:
            self.prefixes.keep(key, Prefix(token_ids, row_kv(cache, row, mask)), self._prefix_room())

    def _prefix_room(self) -> int:
        """Tokens of the budget that the rows in flight of every stream leave to kept prefixes."""
        return self.budget_tokens - sum(self._reserved.values())

    def _encode_shared(
        self, rows: Sequence[Row], kept: Sequence[Hit | None], device: torch.device
    ) -> tuple[list[Hit | None], int]:
        """Rows joining together under one cache key and adapter, with no kept prefix (a judge's questions about
        one episode), share their common prompt prefix, encoded once, one prefix a pass (unpadded: causal). Where
        a join shares, every other row without a prefix has its prompt but the last token encoded so too, so that
        no whole prompt pads the suffix pass. Per row the prefix it starts from (None where none), and the tokens
        encoded."""
        groups: dict[tuple[object, object], list[int]] = {}
        for i, (row, hit) in enumerate(zip(rows, kept)):
            if hit is None:  # identical prompts without a key are one group: the prefill copies them anyway
                groups.setdefault((row.key if row.key is not None else tuple(row.prompt), row.adapter), []).append(i)
        heads: list[tuple[list[int], list[int]]] = []  # (tokens encoded once, the rows that start from them)
        for members in groups.values():
            prompts = [rows[i].prompt for i in members]
            common = common_length(prompts, min(len(p) for p in prompts) - 1)  # one token left to encode
            if len(members) == 1 or common >= MIN_REUSE:
                heads.append((rows[members[0]].prompt[:common], members))
            else:  # little in common: each row alone, so that no long suffix pads the pass
                heads += [(rows[i].prompt[:-1], [i]) for i in members]
        shared: list[Hit | None] = [None] * len(rows)
        if not any(len(m) > 1 and rows[m[0]].key is not None for _, m in heads):
            return shared, 0
        for tokens, members in heads:
            if not tokens:
                continue
            mask = torch.ones((1, len(tokens)), dtype=torch.long, device=device)
            positions = torch.arange(len(tokens), device=device).unsqueeze(0)
            ids = torch.tensor([tokens], dtype=torch.long, device=device)
            _, cache = self._forward(ids, mask, positions, batch_cache(), adapters=[rows[members[0]].adapter])
            prefix = Prefix(tokens, [(layer.keys[0], layer.values[0]) for layer in cache.layers])
            for i in members:
                shared[i] = (tokens, prefix)
        return shared, sum(len(tokens) for tokens, _ in heads)

    def reset_cache(self) -> None:
        """Forget every kept prefix: required whenever the weights change (they would be stale)."""
        self.prefixes.clear()

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
        """Release the kept prefixes, the pages and any reduced-precision weight copies (the weights belong to the
        caller)."""
        self.reset_cache()
        self._pages = None
        free_reduced_copies(self.model)

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
        adapters: Sequence[object] = (),
        **extra: Any,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Logits of the last ``keep`` positions (float32, [batch, keep, vocab]) and the updated KV cache; row i
        sampled by the version ``adapters[i]`` names (none given: the synced policy); ``extra`` goes to the model
        (and on to its attention). A 2-D ``mask`` is recorded as the pass's workload; a paged pass records its
        own."""
        if mask.dim() == 2:  # the pass's workload without padding, which the rollout benchmark's roofline prices
            new = mask[:, -input_ids.shape[1] :].sum(1)
            context = mask.sum(1) - new
            attended = new * context + new * (new + 1) // 2
            self.stats.record_forward(len(input_ids), *torch.stack([new.sum(), context.sum(), attended.sum()]).tolist())
        with sampling_precision(self.precision), self._sampling_with(adapters):
            output = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_kwarg: cache},
                **extra,
            )
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
        limits: list[TokenTrie | GrammarRow | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return the tokens and their log-probs: over the full vocabulary, or under a
        grammar over the tokens it allows (the masked policy; a trie's rows keep the full vocabulary's).

        Sampling is Gumbel-max with per-row noise from the row's own generator, so a perturbation
        of the logits far below the gap between the best candidates (padding, a reused prefix,
        another batch) leaves the draw unchanged.
        """
        temperature = params.temperature if params.temperature > 0 else 1.0
        logp_full = torch.log_softmax(logits / temperature, dim=-1)
        scores = logp_full.clone()
        grammar = [row for row, limit in enumerate(limits) if isinstance(limit, GrammarRow)]
        if grammar:  # one mask and one normaliser for all grammar rows: no per-row kernels or transfers
            index = torch.tensor(grammar, device=scores.device)
            allowed = torch.stack([limits[row].allowed(scores.shape[1]) for row in grammar])  # type: ignore[union-attr]
            masked = scores[index].masked_fill(~allowed.to(scores.device), float("-inf"))
            scores[index] = masked
            logp_full[index] = masked - torch.logsumexp(masked, dim=-1, keepdim=True)
        for row, limit in enumerate(limits):
            if isinstance(limit, TokenTrie) and limit.children:
                allowed = torch.tensor(list(limit.children), device=scores.device)
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


def _join_order(requests: Sequence[GenerationRequest]) -> list[int]:
    """Shortest prompts first (less padding), the rows of one cache key side by side (so that they join together
    and share their prefix): each key's rows at the place of its shortest one."""
    lengths = [len(r.prompt_ids) for r in requests]
    keys = [r.cache_key for r in requests]
    group: dict[object, tuple[int, int]] = {}  # key -> (its shortest prompt, its first row)
    for i, key in enumerate(keys):
        if key is not None:
            shortest, first = group.get(key, (lengths[i], i))
            group[key] = (min(shortest, lengths[i]), first)
    return sorted(
        range(len(requests)),
        key=lambda i: (*(group[keys[i]] if keys[i] is not None else (lengths[i], i)), lengths[i]),
    )


def _default_kv_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory * GPU_KV_SHARE / 2**20
    return CPU_KV_MEMORY_MB

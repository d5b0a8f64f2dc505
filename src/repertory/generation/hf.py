"""Generation backend ``hf``: continuous batching with exact per-token log-probs and constrained actions.

Rows are decoded in a :class:`DecodeStream`: one sampling setting and one policy version, rows of different
prompt lengths left-padded into one key/value cache and decoded token by token. Rows join between two decode
steps (their prompts are prefilled in one pass and their keys and values merged into the batch in flight) and
leave as soon as they finish, so a caller that turns a finished row into its next request (the rollout engine:
an episode steps as soon as its seats have answered) never waits for the batch's slowest row. ``generate`` is
a stream that is handed every row at once and run until it is empty. For every sampled token it records
``log softmax(logits / T)[token]`` over the full vocabulary — the quantity the learner recomputes
(docs/algorithms.md 1.2) — also when top-p or a constraint restricted what could be drawn.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

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
from repertory.generation.kvcache import (
    MIN_REUSE,
    Hit,
    KeptPrefixes,
    Prefix,
    assemble_past,
    batch_cache,
    common_length,
    left_pad,
    left_padded,
    row_kv,
)
from repertory.models import LoadedModel, kv_bytes_per_token
from repertory.models.adapters import BASE_ROW, per_row_adapters
from repertory.models.linear import PRECISIONS, free_reduced_copies, sampling_precision
from repertory.types import RepertoryError

CPU_KV_MEMORY_MB = 2048  # keys and values in flight plus kept prefixes, on a CPU (docs/design.md, Memory)
GPU_KV_SHARE = 0.25  # of the device's memory, on a GPU
REBUILD_SHARE = 0.25  # rows leaving plus joining, of the rows in flight, that make a batch rebuild worth its copy


@dataclass
class _Row:
    """One continuation being sampled: what it was asked, and what it produced so far."""

    ticket: int
    prompt: list[int]
    rng: torch.Generator
    node: TokenTrie | None
    key: object
    enough: Callable[[str], bool] | None
    budget: int
    """The most tokens it can generate: max_new_tokens, or less under a constraint whose answers are shorter."""
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str = "length"
    chunk: list[int] = field(default_factory=list)  # the tokens fed in the next forward pass (none once done)
    done: bool = False
    adapter: object = SYNCED  # the policy version that samples it (see ``HFBackend.generate``)

    def generation(self) -> Generation:
        return Generation(self.tokens, self.logps, self.finish)


class HFBackend(TokenizedChoices):
    """Batched sampling with a transformers causal LM (CPU in float32, GPU in bfloat16)."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv_memory_mb: float | None = None,
        max_batch: int | None = None,
        prefix_cache_tokens: int | None = None,
        precision: str = "float32",
    ):
        """``kv_memory_mb`` bounds keys and values in flight plus kept prefixes (default: 2 GiB on a CPU, a
        quarter of a GPU); ``max_batch`` caps the rows in flight besides; ``prefix_cache_tokens`` caps the kept
        prefixes below what the budget leaves them (0: keep none); ``precision`` "bfloat16" runs the linear
        layers of a float32 CPU model through bfloat16 weight copies (faster, not exact; see
        :mod:`repertory.models.linear`)."""
        self.loaded = loaded
        self.model = loaded.model
        self.peft = loaded.peft
        self.tokenizer = loaded.tokenizer
        self.token_bytes = kv_bytes_per_token(loaded.model.config, next(loaded.model.parameters()).dtype)
        memory_mb = kv_memory_mb if kv_memory_mb is not None else _default_kv_memory_mb(loaded.device)
        if memory_mb <= 0 or (max_batch is not None and max_batch < 1):
            raise RepertoryError("rollout.engine_args: kv_memory_mb must be positive and max_batch at least 1")
        if precision not in PRECISIONS:
            known = ", ".join(PRECISIONS)
            raise RepertoryError(f"rollout.engine_args: precision must be one of {known}, not {precision!r}")
        self.precision = precision
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
    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn (the one a constrained response ends with)."""
        return end_of_turn_id(self.tokenizer, self.stop_ids)

    def stream(self, params: SamplingParams, adapter: object = SYNCED) -> DecodeStream:
        """A stream of rows sampled with ``params`` by the policy version ``adapter`` names (see ``generate``)."""
        return DecodeStream(self, params, adapter)

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
        chosen = list(adapters) if adapters is not None else [SYNCED] * len(prompts)
        out: list[Generation | None] = [None] * len(prompts)
        stream = self.stream(params)
        index = {
            stream.add(prompts[i], seeds[i], constraints[i], keys[i], enough[i], chosen[i]): i
            for i in _join_order(prompts, keys)
        }
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
        self, rows: Sequence[_Row], kept: Sequence[Hit | None], device: torch.device
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
        """Release the kept prefixes and any reduced-precision weight copies (the weights belong to the caller)."""
        self.reset_cache()
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
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Logits of the last ``keep`` positions (float32, [batch, keep, vocab]) and the updated KV cache; row i
        sampled by the version ``adapters[i]`` names (none given: the synced policy)."""
        # the pass's workload without padding, which the rollout benchmark's roofline prices
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


def _join_order(prompts: Sequence[Sequence[int]], keys: Sequence[object]) -> list[int]:
    """Shortest prompts first (less padding), the rows of one cache key side by side (so that they join together
    and share their prefix): each key's rows at the place of its shortest one."""
    group: dict[object, tuple[int, int]] = {}  # key -> (its shortest prompt, its first row)
    for i, key in enumerate(keys):
        if key is not None:
            shortest, first = group.get(key, (len(prompts[i]), i))
            group[key] = (min(shortest, len(prompts[i])), first)
    return sorted(
        range(len(prompts)),
        key=lambda i: (*(group[keys[i]] if keys[i] is not None else (len(prompts[i]), i)), len(prompts[i])),
    )


def _default_kv_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory * GPU_KV_SHARE / 2**20
    return CPU_KV_MEMORY_MB


class DecodeStream:
    """Rows of one sampling setting and one policy version, decoded together; rows join between two steps and
    leave when they finish. ``add`` queues a row and returns its ticket; each ``step`` admits the queued rows
    that fit the memory budget, samples one token (with the tokens a constraint forces after it) for every row
    in flight and returns the rows that finished, by ticket.

    Rebuilding the batch's cache copies every row's keys and values, as much memory traffic as a decode step
    reads. So a finished row stays in the batch, masked out, and queued rows wait, until rows leaving plus
    rows joining reach a quarter of the rows in flight (:data:`REBUILD_SHARE`): then one rebuild drops the one
    and admits the other."""

    def __init__(self, backend: HFBackend, params: SamplingParams, adapter: object = SYNCED):
        self.backend, self.params, self.adapter = backend, params, adapter
        self.waiting: list[_Row] = []
        self.rows: list[_Row] = []  # the cache's batch, in order; finished rows stay until the next rebuild
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # [rows, cached columns]: 1 for a real token
        self.last_pos = torch.zeros(0, dtype=torch.long)  # each row's position of its last fed token
        self.logits = torch.zeros(0)  # each row's next-token logits
        self._tickets = 0

    @property
    def busy(self) -> bool:
        """Whether rows are queued or in flight."""
        return bool(self.waiting) or self._live

    @property
    def _live(self) -> bool:
        return any(not r.done for r in self.rows)

    def add(
        self,
        prompt: Sequence[int],
        seed: int,
        constraint: TokenTrie | None = None,
        key: object = None,
        enough: Callable[[str], bool] | None = None,
        adapter: object = SYNCED,
    ) -> int:
        """Queue a row (see ``HFBackend.generate`` for the arguments; ``adapter`` SYNCED: the stream's); its
        ticket names it in ``step``'s results."""
        budget = self.params.max_new_tokens if constraint is None else min(self.params.max_new_tokens, constraint.depth)
        need = len(prompt) + budget
        if need > self.backend.budget_tokens:
            raise RepertoryError(
                f"rollout.engine_args.kv_memory_mb: {self.backend.budget_tokens} tokens of keys and values fit "
                f"({self.backend.token_bytes} bytes a token), but one row needs {need} ({len(prompt)} of prompt and "
                f"{budget} to generate); raise kv_memory_mb or lower max_new_tokens"
            )
        self._tickets += 1
        rng = torch.Generator().manual_seed(seed % 2**63)
        chosen = self.adapter if adapter is SYNCED else adapter
        self.waiting.append(_Row(self._tickets, list(prompt), rng, constraint, key, enough, budget, adapter=chosen))
        return self._tickets

    @torch.no_grad()
    def step(self) -> list[tuple[int, Generation]]:
        """Admit what fits, sample one token per row in flight, feed it; the rows that finished."""
        self._admit()
        if not self._live:
            return []
        finished = self._sample()
        if self._live:
            self._decode()
        elif not self.waiting:  # idle: the batch's memory goes back to the budget
            self.rows, self.cache = [], None
            self.backend._reserve(self, 0)
        return finished

    def _need(self, rows: Sequence[_Row]) -> int:
        """Tokens a padded batch of ``rows`` may fill: each as long as the longest prompt plus the largest budget.
        A constrained row's budget is its longest answer, not max_new_tokens: reserving 400 tokens for a 6-token
        move would evict the kept prefixes of a large batch, and every chat would be prefilled again each turn."""
        if not rows:
            return 0
        return len(rows) * (max(len(r.prompt) for r in rows) + max(r.budget for r in rows))

    def _admit(self) -> None:
        """Rebuild the batch when enough rows leave or can join: finished rows out, the queued rows that fit in."""
        live = [i for i, r in enumerate(self.rows) if not r.done]
        kept = [self.rows[i] for i in live]
        room, cap = self.backend.room(self), self.backend.max_batch
        joining: list[_Row] = []
        while self.waiting and (cap is None or len(kept) + len(joining) < cap):
            if self._need([*kept, *joining, self.waiting[0]]) > room:
                break
            joining.append(self.waiting.pop(0))
        if len(self.rows) - len(live) + len(joining) < max(1, REBUILD_SHARE * len(live)):
            self.waiting[:0] = joining
            return
        if len(live) < len(self.rows):
            self._select(live)
        if joining:
            self._join(joining)
        self.backend._reserve(self, self._need(self.rows))

    def _join(self, joining: list[_Row]) -> None:
        self.backend.stats.calls += 1
        cache, mask, last_pos, logits = self._prefill(joining)
        if self.cache is None or not self.rows:
            self.cache, self.mask, self.last_pos, self.logits = cache, mask, last_pos, logits
        else:
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.join(theirs)
            width = max(self.mask.shape[1], mask.shape[1])
            self.mask = torch.cat([left_pad(self.mask, width), left_pad(mask, width)])
            self.last_pos = torch.cat([self.last_pos, last_pos])
            self.logits = torch.cat([self.logits, logits])
        self.rows += joining

    def _prefill(self, rows: list[_Row]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encode the joining rows' prompts (each distinct prompt once, after its kept or shared prefix): their
        cache, mask, last positions and next-token logits."""
        backend, device = self.backend, self.backend.loaded.device
        kept = [backend.prefixes.longest(r.key, r.prompt) for r in rows]
        for row, hit in zip(rows, kept):
            if hit:  # the row carries these keys and values now; its finish keeps the longer chat
                backend.prefixes.forget(row.key)
        shared, shared_encoded = backend._encode_shared(rows, kept, device)
        reused = [k or s for k, s in zip(kept, shared)]
        distinct: dict[tuple[tuple[int, ...], int, object], int] = {}
        source = [
            distinct.setdefault((tuple(r.prompt), len(u[0]) if u else 0, r.adapter), i)
            for i, (r, u) in enumerate(zip(rows, reused))
        ]
        encoded = sorted(set(source))
        cache, past_mask = assemble_past([reused[i] for i in encoded], device)
        suffixes = [rows[i].prompt[len(reused[i][0]) if reused[i] else 0 :] for i in encoded]
        input_ids, suffix_mask = left_padded(suffixes, backend.tokenizer.pad_token_id)
        width = input_ids.shape[1]
        mask = torch.cat([past_mask, suffix_mask], dim=1).to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        backend.stats.prompt_tokens += sum(len(r.prompt) for r in rows)
        backend.stats.reused_prompt_tokens += sum(len(u[0]) for u in kept if u)
        backend.stats.shared_prompt_tokens += (
            sum(len(rows[i].prompt) for i in range(len(rows)) if source[i] != i)
            + sum(len(shared[i][0]) for i in encoded if shared[i])  # type: ignore[index]
            - shared_encoded
        )
        logits, cache = backend._forward(
            input_ids.to(device), mask, positions, cache, adapters=[rows[i].adapter for i in encoded]
        )
        logits, last_pos = logits[:, -1], positions[:, -1]
        if len(encoded) < len(rows):
            slot = {i: row for row, i in enumerate(encoded)}
            copies = torch.tensor([slot[i] for i in source], device=device)
            for layer in cache.layers:
                layer.select(copies)
            mask, last_pos, logits = mask[copies], last_pos[copies], logits[copies]
        return cache, mask, last_pos, logits

    def _sample(self) -> list[tuple[int, Generation]]:
        """Draw each live row's next token; rows that end are done (their keys and values kept as a prefix)."""
        backend, params = self.backend, self.params
        live = [i for i, r in enumerate(self.rows) if not r.done]
        rows = [self.rows[i] for i in live]
        logits = self.logits[live] if len(live) < len(self.rows) else self.logits
        chosen, chosen_logp = backend._sample(logits, params, [r.rng for r in rows], [r.node for r in rows])
        finished = []
        for i, row, token, logp in zip(live, rows, chosen.tolist(), chosen_logp.tolist()):
            row.tokens.append(token)
            row.logps.append(logp)
            if row.node is not None:
                row.node = row.node.children.get(token)
            checked = row.enough is not None and len(row.tokens) % ENOUGH_EVERY == 0
            if token in backend.stop_ids or (params.stop and backend._hit_stop(row.tokens, params.stop)):
                row.finish = "stop"
            elif len(row.tokens) >= params.max_new_tokens:
                row.finish = "length"
            elif checked and row.enough(backend.decode(row.tokens)):  # type: ignore[misc]
                row.finish = "length"
            else:
                forced = [] if params.stop else backend._forced(row.node, params.max_new_tokens - len(row.tokens))
                row.chunk = [token, *forced]
                continue
            row.done, row.chunk = True, []
            backend._keep_prefix(row.key, row.prompt + row.tokens[:-1], self.cache, i, self.mask[i])
            finished.append((row.ticket, row.generation()))
        backend.stats.generated_tokens += len(rows)
        return finished

    def _select(self, still: list[int]) -> None:
        """Keep the rows at ``still``; drop the columns that became padding in every row."""
        keep = torch.tensor(still, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in still]
        self.mask, self.last_pos, self.logits = self.mask[keep], self.last_pos[keep], self.logits[keep]
        start = int(self.mask.any(0).int().argmax()) if still else self.mask.shape[1]
        for layer in self.cache.layers:
            layer.select(keep)
            if start:
                layer.trim(start)
        self.mask = self.mask[:, start:]

    def _decode(self) -> None:
        """One forward pass over every row's chunk (its sampled token and the tokens a constraint forces after
        it: one pass per real choice instead of one per token); the next-token logits."""
        device, rows = self.mask.device, self.rows
        width = max(len(r.chunk) for r in rows)
        pad = self.backend.tokenizer.pad_token_id or 0
        chunk_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        chunk_mask = torch.zeros((len(rows), width), dtype=self.mask.dtype)
        for i, row in enumerate(rows):
            chunk_ids[i, : len(row.chunk)] = torch.tensor(row.chunk, dtype=torch.long)
            chunk_mask[i, : len(row.chunk)] = 1
        self.mask = torch.cat([self.mask, chunk_mask.to(device)], dim=1)
        positions = self.last_pos.unsqueeze(1) + torch.arange(1, width + 1, device=device).unsqueeze(0)
        adapters = [r.adapter for r in rows]
        logits, self.cache = self.backend._forward(
            chunk_ids.to(device), self.mask, positions, self.cache, width, adapters
        )
        lengths = torch.tensor([len(r.chunk) for r in rows], device=device)
        self.last_pos = self.last_pos + lengths
        self.logits = logits[torch.arange(len(rows), device=device), lengths - 1]
        temperature = self.params.temperature if self.params.temperature > 0 else 1.0
        for i, row in enumerate(rows):
            if len(row.chunk) > 1:
                forced_logp = torch.log_softmax(logits[i, : len(row.chunk) - 1] / temperature, dim=-1)
                for j, token in enumerate(row.chunk[1:]):
                    row.tokens.append(token)
                    row.logps.append(float(forced_logp[j, token]))
                    row.node = row.node.children.get(token)  # type: ignore[union-attr]
                self.backend.stats.generated_tokens += len(row.chunk) - 1

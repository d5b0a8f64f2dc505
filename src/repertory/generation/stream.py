"""The hf engine's continuous batching: rows of one sampling setting and one policy version decoded together, rows
joining between two decode steps and leaving as soon as they finish.

Two ways to hold the batch's keys and values. :class:`PagedStream` (the default where the decode kernel runs: a
CPU, a float32 model, the Llama architecture) keeps each row in pages of its own (:class:`~repertory.generation.
kvcache.Pages`): a row joins by writing its prompt's pages, leaves by giving them back, and a decode step reads each
row's own length, with no padding and no copy of the other rows. :class:`DecodeStream` (every other case, and
``paged: false``) keeps one left-padded tensor, rebuilt when enough rows leave or join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from repertory.envs.grammar import TurnGrammar
from repertory.generation.core import (
    ENOUGH_EVERY,
    SYNCED,
    Generation,
    GenerationRequest,
    SamplingParams,
    TokenTrie,
    window_budget,
)
from repertory.generation.grammar import GrammarRow
from repertory.generation.kvcache import (
    PAGE,
    Hit,
    PagedPass,
    PagedPrefix,
    Pages,
    assemble_past,
    left_pad,
    left_padded,
    pages_for,
)
from repertory.types import RepertoryError

Backend = Any
"""The :class:`~repertory.generation.hf.HFBackend` a stream belongs to (hf.py imports this module, so not named)."""

REBUILD_SHARE = 0.25  # rows leaving plus joining, of the rows in flight, that make a batch rebuild worth its copy
JOIN_SHARE = 0.25  # rows joining, of the rows in flight, that make a prefill pass of their own worth running


@dataclass
class Row:
    """One continuation being sampled: what it was asked, and what it produced so far."""

    ticket: int
    prompt: list[int]
    rng: torch.Generator
    node: TokenTrie | None
    key: object
    enough: Callable[[str], bool] | None
    budget: int
    """The most tokens it can generate: max_new_tokens, or less under a constraint whose answers are shorter or
    where the model's context ends first."""
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    finish: str = "length"
    chunk: list[int] = field(default_factory=list)  # the tokens fed in the next forward pass (none once done)
    done: bool = False
    adapter: object = SYNCED  # the policy version that samples it (see ``HFBackend.generate``)
    grammar: GrammarRow | None = None  # its grammar's state, under ``rollout.constrained: grammar``

    def generation(self) -> Generation:
        return Generation(self.tokens, self.logps, self.finish)


class Prefilled(NamedTuple):
    """The joining rows' prompts, encoded: their left-padded cache, mask, last positions and next-token logits, and
    per row the earlier row whose first tokens it repeats (an identical prompt, a key's shared prefix) and how
    many, None where none."""

    cache: DynamicCache
    mask: torch.Tensor
    last_pos: torch.Tensor
    logits: torch.Tensor
    repeats: list[tuple[int, int] | None]


PREFILL_PAD_TOKENS = 512
"""Pad tokens a prefill pass may add to its suffixes before a longer one takes a pass of its own. Without the cut a
chat whose kept prefix was evicted pads every row joining with it to its whole prompt: in a 64-game IPD evaluation
one such pass was 31,104 tokens for 4,835 real ones, 95 of the evaluation's 153 s."""


def prefill_passes(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of the suffix ``lengths`` in prefill passes, shortest first: a pass grows while padding all its
    suffixes to the longest adds at most :data:`PREFILL_PAD_TOKENS`."""
    passes: list[list[int]] = []
    tokens = 0  # the last pass's real suffix tokens
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if passes and (len(passes[-1]) + 1) * lengths[i] - tokens - lengths[i] <= PREFILL_PAD_TOKENS:
            passes[-1].append(i)
            tokens += lengths[i]
        else:
            passes.append([i])
            tokens = lengths[i]
    return passes


def _repeated(rows: Sequence[Row], shared: Sequence[Hit | None], source: Sequence[int]) -> list[tuple[int, int] | None]:
    """:attr:`Prefilled.repeats` from the prefill's ``shared`` prefixes and ``source`` (the row whose encoding each
    copies)."""
    first: dict[int, int] = {}  # a shared prefix (by identity) -> the first row that starts from it
    out: list[tuple[int, int] | None] = []
    for i, (row, hit) in enumerate(zip(rows, shared)):
        if source[i] != i:
            out.append((source[i], len(row.prompt)))
        elif hit is not None and first.setdefault(id(hit[1]), i) != i:
            out.append((first[id(hit[1])], len(hit[0])))
        else:
            out.append(None)
    return out


class DecodeStream:
    """Rows of one sampling setting and one policy version, decoded together; rows join between two steps and
    leave when they finish. ``add`` queues a row and returns its ticket; each ``step`` admits the queued rows
    that fit the memory budget, samples one token (with the tokens a constraint forces after it) for every row
    in flight and returns the rows that finished, by ticket.

    Rebuilding the batch's cache copies every row's keys and values, as much memory traffic as a decode step
    reads. So a finished row stays in the batch, masked out, and queued rows wait, until rows leaving plus
    rows joining reach a quarter of the rows in flight (:data:`REBUILD_SHARE`): then one rebuild drops the one
    and admits the other."""

    def __init__(self, backend: Backend, params: SamplingParams, adapter: object = SYNCED):
        self.backend, self.params, self.adapter = backend, params, adapter
        self.waiting: list[Row] = []
        self.rows: list[Row] = []  # the cache's batch, in order; finished rows stay until the next rebuild
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

    def add(self, request: GenerationRequest) -> int:
        """Queue a row (its adapter SYNCED: the stream's); its ticket names it in ``step``'s results."""
        prompt, constraint, grammar = request.prompt_ids, request.constraint, None
        if isinstance(constraint, TurnGrammar):
            if self.params.stop:
                raise RepertoryError("a row under a grammar ends where its action does: sample it without stop strings")
            grammar = self.backend.start_grammar(constraint)
            constraint = None
        budget = window_budget(len(prompt), self.params.max_new_tokens, self.backend.context_window, request.constraint)
        need = self._need_alone(len(prompt) + budget)
        if need > self.backend.budget_tokens:
            raise RepertoryError(
                f"rollout.engine_args.kv_memory_mb: {self.backend.budget_tokens} tokens of keys and values fit "
                f"({self.backend.token_bytes} bytes a token), but one row needs {need} ({len(prompt)} of prompt and "
                f"{budget} to generate{self._rounding}); raise kv_memory_mb or lower max_new_tokens"
            )
        self._tickets += 1
        rng = torch.Generator().manual_seed(request.seed % 2**63)
        adapter = request.or_adapter(self.adapter).adapter
        self.waiting.append(
            Row(
                self._tickets,
                list(prompt),
                rng,
                constraint,
                request.cache_key,
                request.enough,
                budget,
                adapter=adapter,
                grammar=grammar,
            )
        )
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

    _rounding = ""  # how a row's tokens become what it takes of the budget, in words

    def _need_alone(self, tokens: int) -> int:
        """Tokens of the budget that a row of ``tokens`` (prompt and budget) takes."""
        return tokens

    def _need(self, rows: Sequence[Row]) -> int:
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
        joining: list[Row] = []
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

    def _join(self, joining: list[Row]) -> None:
        self.backend.stats.calls += 1
        cache, mask, last_pos, logits, _ = self._prefill(joining, self._kept_prefixes(joining))
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

    def _kept_prefixes(self, rows: Sequence[Row]) -> list[Hit | None]:
        """Each joining row's longest kept prefix (None where none), no longer kept: the row carries these keys and
        values now, and its finish keeps the longer chat."""
        kept = [self.backend.prefixes.longest(r.key, r.prompt) for r in rows]
        for row, hit in zip(rows, kept):
            if hit:
                self.backend.prefixes.forget(row.key)
        return kept

    def _prefill(self, rows: list[Row], kept: Sequence[Hit | None]) -> Prefilled:
        """Encode the joining rows' prompts (each distinct prompt once, after its ``kept`` or shared prefix), in
        passes of suffixes of like length (:func:`prefill_passes`)."""
        backend, device = self.backend, self.backend.loaded.device
        shared, shared_encoded = backend._encode_shared(rows, kept, device)
        reused = [k or s for k, s in zip(kept, shared)]
        distinct: dict[tuple[tuple[int, ...], int, object], int] = {}
        source = [
            distinct.setdefault((tuple(r.prompt), len(u[0]) if u else 0, r.adapter), i)
            for i, (r, u) in enumerate(zip(rows, reused))
        ]
        encoded = sorted(set(source))
        suffixes = {i: rows[i].prompt[len(reused[i][0]) if reused[i] else 0 :] for i in encoded}
        passes = [[encoded[j] for j in p] for p in prefill_passes([len(suffixes[i]) for i in encoded])]
        backend.stats.prompt_tokens += sum(len(r.prompt) for r in rows)
        backend.stats.reused_prompt_tokens += sum(len(u[0]) for u in kept if u)
        backend.stats.shared_prompt_tokens += (
            sum(len(rows[i].prompt) for i in range(len(rows)) if source[i] != i)
            + sum(len(shared[i][0]) for i in encoded if shared[i])  # type: ignore[index]
            - shared_encoded
        )
        cache, mask, last_pos, logits = self._encode(
            [reused[i] for i in passes[0]], [suffixes[i] for i in passes[0]], [rows[i].adapter for i in passes[0]]
        )
        for indices in passes[1:]:
            more = self._encode(
                [reused[i] for i in indices], [suffixes[i] for i in indices], [rows[i].adapter for i in indices]
            )
            for mine, theirs in zip(cache.layers, more[0].layers):
                mine.join(theirs)
            width = max(mask.shape[1], more[1].shape[1])
            mask = torch.cat([left_pad(mask, width), left_pad(more[1], width)])
            last_pos, logits = torch.cat([last_pos, more[2]]), torch.cat([logits, more[3]])
        order = [i for p in passes for i in p]
        if order != list(range(len(rows))):
            slot = {i: row for row, i in enumerate(order)}
            copies = torch.tensor([slot[i] for i in source], device=device)
            for layer in cache.layers:
                layer.select(copies)
            mask, last_pos, logits = mask[copies], last_pos[copies], logits[copies]
        return Prefilled(cache, mask, last_pos, logits, _repeated(rows, shared, source))

    def _encode(
        self, past: list[Hit | None], suffixes: list[list[int]], adapters: list[object]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prefill pass: the suffixes left-padded after their past; (cache, mask, last positions, last logits)."""
        backend, device = self.backend, self.backend.loaded.device
        cache, past_mask = assemble_past(past, device)
        input_ids, suffix_mask = left_padded(suffixes, backend.tokenizer.pad_token_id)
        width = input_ids.shape[1]
        mask = torch.cat([past_mask, suffix_mask], dim=1).to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        logits, cache = backend._forward(input_ids.to(device), mask, positions, cache, adapters=adapters)
        return cache, mask, positions[:, -1], logits[:, -1]

    def _sample(self) -> list[tuple[int, Generation]]:
        """Draw each live row's next token; rows that end are done (their keys and values kept as a prefix)."""
        backend, params = self.backend, self.params
        live = [i for i, r in enumerate(self.rows) if not r.done]
        rows = [self.rows[i] for i in live]
        logits = self.logits[live] if len(live) < len(self.rows) else self.logits
        limits = [r.node or r.grammar for r in rows]
        chosen, chosen_logp = backend._sample(logits, params, [r.rng for r in rows], limits)
        finished = []
        for i, row, token, logp in zip(live, rows, chosen.tolist(), chosen_logp.tolist()):
            row.tokens.append(token)
            row.logps.append(logp)
            if row.node is not None:
                row.node = row.node.children.get(token)
            if row.grammar is not None:
                row.grammar.advance(token)
            checked = row.enough is not None and len(row.tokens) % ENOUGH_EVERY == 0
            if token in backend.stop_ids or (params.stop and backend._hit_stop(row.tokens, params.stop)):
                row.finish = "stop"
            elif len(row.tokens) >= row.budget:
                row.finish = "length"
            elif checked and row.enough(backend.decode(row.tokens)) and row.grammar is None:  # type: ignore[misc]
                row.finish = "length"  # a grammar's row ends where its action does: its check only watches
            else:
                forced = [] if params.stop else backend._forced(row.node, params.max_new_tokens - len(row.tokens))
                row.chunk = [token, *forced]
                continue
            row.done, row.chunk = True, []
            self._keep(row, i)
            finished.append((row.ticket, row.generation()))
        backend.stats.generated_tokens += len(rows)
        return finished

    def _keep(self, row: Row, i: int) -> None:
        """Keep finished row ``i``'s keys and values (all but its last token's, never fed) for its next turn."""
        self.backend._keep_prefix(row.key, row.prompt + row.tokens[:-1], self.cache, i, self.mask[i])

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
        chunk_ids, fed = self._chunks()
        width = chunk_ids.shape[1]
        chunk_mask = (torch.arange(width).unsqueeze(0) < torch.tensor(fed).unsqueeze(1)).to(self.mask.dtype)
        self.mask = torch.cat([self.mask, chunk_mask.to(device)], dim=1)
        positions = self.last_pos.unsqueeze(1) + torch.arange(1, width + 1, device=device).unsqueeze(0)
        adapters = [r.adapter for r in rows]
        logits, self.cache = self.backend._forward(
            chunk_ids.to(device), self.mask, positions, self.cache, width, adapters
        )
        self.last_pos = self.last_pos + torch.tensor(fed, device=device)
        self._after_chunks(logits, fed)

    def _chunks(self) -> tuple[torch.Tensor, list[int]]:
        """Every row's chunk, padded on the right to the longest, and the chunks' lengths."""
        fed = [len(r.chunk) for r in self.rows]
        chunk_ids = torch.full((len(self.rows), max(fed)), self.backend.tokenizer.pad_token_id or 0, dtype=torch.long)
        for i, row in enumerate(self.rows):
            chunk_ids[i, : fed[i]] = torch.tensor(row.chunk, dtype=torch.long)
        return chunk_ids, fed

    def _after_chunks(self, logits: torch.Tensor, fed: list[int]) -> None:
        """Take each row's next-token logits from a pass over the chunks, and record the forced tokens it fed."""
        device = logits.device
        self.logits = logits[torch.arange(len(fed), device=device), torch.tensor(fed, device=device) - 1]
        temperature = self.params.temperature if self.params.temperature > 0 else 1.0
        for i, row in enumerate(self.rows):
            if fed[i] > 1:
                forced_logp = torch.log_softmax(logits[i, : fed[i] - 1] / temperature, dim=-1)
                for j, token in enumerate(row.chunk[1:]):
                    row.tokens.append(token)
                    row.logps.append(float(forced_logp[j, token]))
                    row.node = row.node.children.get(token)  # type: ignore[union-attr]
                self.backend.stats.generated_tokens += fed[i] - 1


class PagedStream(DecodeStream):
    """A :class:`DecodeStream` whose rows hold pages of their own. Joining rows are prefilled together (as
    there), and each writes its prompt's keys and values into pages, taking over the pages of the kept prefix it
    continues; no other row's keys and values move. A finished row leaves at once: its pages are kept as the
    prefix of its next turn, or given back. Joins wait, as there, until rows leaving plus rows joining reach a
    quarter of the rows in flight (:data:`JOIN_SHARE`): a prefill pass costs a pass's fixed overhead."""

    def __init__(self, backend: Backend, params: SamplingParams, adapter: object = SYNCED):
        super().__init__(backend, params, adapter)
        self.pool: Pages = backend.pages()
        self.held: list[list[int]] = []  # each row's pages, in order
        self.cached: list[int] = []  # each row's tokens in its pages
        self._left = 0  # rows that left since the last join

    _rounding = f", in whole pages of {PAGE}"

    def _need_alone(self, tokens: int) -> int:
        return pages_for(tokens) * PAGE

    def _need(self, rows: Sequence[Row]) -> int:
        """Tokens of the pages ``rows`` may fill, each its own prompt and budget: no row pads to another."""
        return sum(self._need_alone(len(r.prompt) + r.budget) for r in rows)

    def _admit(self) -> None:
        room, cap = self.backend.room(self), self.backend.max_batch
        joining: list[Row] = []
        while self.waiting and (cap is None or len(self.rows) + len(joining) < cap):
            if self._need([*self.rows, *joining, self.waiting[0]]) > room:
                break
            joining.append(self.waiting.pop(0))
        if self._left + len(joining) < max(1, JOIN_SHARE * len(self.rows)):
            self.waiting[:0] = joining
            return
        if joining:
            self._join(joining)
        self.backend._reserve(self, self._need(self.rows))

    def _join(self, joining: list[Row]) -> None:
        self.backend.stats.calls += 1
        kept = self._kept_prefixes(joining)
        cache, mask, _, logits, repeats = self._prefill(joining, kept)
        held = [self._take_over(hit) for hit in kept]
        rows, cols, pages, offsets = [], [], [], []
        for b, (row, (own, start), repeat) in enumerate(zip(joining, held, repeats)):
            total = len(row.prompt)
            if repeat is not None and not start:  # only whole pages are shared: a partial one has one writer
                whole = repeat[1] // PAGE
                own, start = self.pool.hold(held[repeat[0]][0][:whole]), whole * PAGE
                held[b] = (own, start)
            own += self.pool.take(pages_for(total) - len(own))
            valid = mask[b].nonzero().squeeze(1).tolist()  # the prompt's tokens, in order
            rows += [b] * (total - start)
            cols += valid[start:total]
            pages += [own[p // PAGE] for p in range(start, total)]
            offsets += [p % PAGE for p in range(start, total)]
        rows_t, cols_t = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
        slots = (torch.tensor(pages, dtype=torch.long), torch.tensor(offsets, dtype=torch.long))
        for index, layer in enumerate(cache.layers):
            self.pool.write(index, slots, layer.keys[rows_t, :, cols_t], layer.values[rows_t, :, cols_t])
        self.logits = torch.cat([self.logits, logits]) if self.rows else logits
        self.rows += joining
        self.held += [own for own, _ in held]
        self.cached += [len(r.prompt) for r in joining]
        self._left = 0

    def _take_over(self, hit: Hit | None) -> tuple[list[int], int]:
        """The pages of a kept prefix that a joining row continues, up to the tokens it shares (the rest given
        back), and that many tokens; none for a prefix without pages."""
        if hit is None or not isinstance(hit[1], PagedPrefix):
            return [], 0
        shared, prefix = hit
        whole = pages_for(len(shared))
        own, rest = prefix.pages[:whole], prefix.pages[whole:]
        prefix.pages = []
        self.pool.drop(rest)
        return own, len(shared)

    def _sample(self) -> list[tuple[int, Generation]]:
        finished = super()._sample()
        if finished:
            still = [i for i, r in enumerate(self.rows) if not r.done]
            self._left += len(self.rows) - len(still)
            self.rows = [self.rows[i] for i in still]
            self.held = [self.held[i] for i in still]
            self.cached = [self.cached[i] for i in still]
            self.logits = self.logits[still]
        return finished

    def _keep(self, row: Row, i: int) -> None:
        """Keep finished row ``i``'s pages as the prefix of its next turn (or give them back), once the budget no
        longer reserves its room."""
        backend = self.backend
        backend._reserve(self, self._need([r for r in self.rows if not r.done]))
        tokens, own = row.prompt + row.tokens[:-1], self.held[i]
        self.held[i] = []
        if row.key is not None and len(own) * PAGE <= backend.prefixes.cap:
            dtype = next(backend.model.parameters()).dtype
            backend.prefixes.keep(row.key, PagedPrefix(tokens, own, self.pool, dtype), backend._prefix_room())
        else:
            self.pool.drop(own)

    def _decode(self) -> None:
        """One forward pass over every row's chunk, each row's new keys and values written into its pages."""
        chunk_ids, fed = self._chunks()
        for b, n in enumerate(fed):
            self.held[b] += self.pool.take(pages_for(self.cached[b] + n) - len(self.held[b]))
        paged = PagedPass(self.pool, self.held, self.cached, fed)
        width = chunk_ids.shape[1]
        positions = torch.tensor(self.cached).unsqueeze(1) + torch.arange(width).unsqueeze(0)
        attended = sum(f * c + f * (f + 1) // 2 for f, c in zip(fed, self.cached))
        self.backend.stats.record_forward(len(fed), sum(fed), sum(self.cached), attended)
        adapters = [r.adapter for r in self.rows]
        logits, _ = self.backend._forward(chunk_ids, paged.mask, positions, paged, width, adapters, paged=paged)
        self.cached = [c + f for c, f in zip(self.cached, fed)]
        self._after_chunks(logits, fed)

"""Language-model agents: one loaded model answers a whole batch of seats in one generation call.

An :class:`LMAgent` renders each request's chat with the model's own chat template, samples all
of them in one batched call of its backend (any :class:`~repertory.generation.Backend`), and returns
the exact prompt ids, response ids and sampling log-probs with the text. The backend (the loaded
weights) is separate from the agent, so several agents share one model: a live policy, the base
model with the LoRA adapters switched off (``adapter=None``), and frozen snapshots loaded as other
adapters (``adapter="snapshot-K"``); the backend applies the choice per row.

Under continuous batching the rollout engine ``submit``s each seat's request as soon as its episode needs it
and ``poll``s one decode step at a time; every row keeps the seed of its (episode, seat, turn), so a request
gets the same answer whether it was sampled in a tick's batch or joined one in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from repertory.agents import Request, Response
from repertory.envs.grammar import GRAMMAR, TurnGrammar, turn_grammar
from repertory.envs.parsing import DEFAULT_MAX_CHARS, clean
from repertory.envs.roles import RoleAdapters
from repertory.generation import Backend, SamplingParams, make_backend
from repertory.generation.core import ENOUGH_EVERY, SYNCED, Generation, GenerationRequest, Stream, TokenTrie
from repertory.models import EMBEDDED, load_model
from repertory.models.chat import chat_prompt_ids
from repertory.types import derive

Enough = Callable[[str], bool] | None
LIVE_ADAPTER = "default"  # PEFT's name of the adapter a model is created with: the trained one

_BACKENDS: dict[tuple[str, str | None], Backend] = {}


def shared_backend(model: str = EMBEDDED, device: str | None = None) -> Backend:
    """One ``hf`` backend (one copy of the weights) per model and device for the whole process."""
    key = (model, device)
    if key not in _BACKENDS:
        _BACKENDS[key] = make_backend("hf", load_model(model, device))
    return _BACKENDS[key]


class LMAgent:
    """A language model in one or many seats; every ``act`` call is one batched generation."""

    def __init__(
        self,
        backend: Backend,
        name: str = "model",
        params: SamplingParams | None = None,
        constrained: bool | str = False,
        seed: int = 0,
        policy_id: str = "base",
        adapter: str | None = LIVE_ADAPTER,
        roles: RoleAdapters | None = None,
    ):
        """``adapter`` picks the policy version on a LoRA model: the live adapter (default; on a model without
        LoRA, the model itself), another named adapter (a frozen snapshot) or None (the base, adapters off).
        ``roles`` instead gives each seat the adapter of its role or team (``model.adapters``), all seats still in
        one batched call."""
        self.backend = backend
        self.adapter = adapter
        self.roles = roles
        self.name = name
        self.params = params or SamplingParams()
        self.constrained = constrained
        self.seed = seed
        self.policy_id = policy_id
        self.watch: Callable[[Request, str, int], None] | None = None
        """Sees each row's text and token count as they grow (every ``ENOUGH_EVERY`` tokens; live play)."""
        self._stream: Stream | None = None
        self._queued: dict[int, tuple[Request, GenerationRequest]] = {}

    def prompt_ids(self, request: Request) -> list[int]:
        """The seat's chat rendered with the model's chat template, ready for the assistant turn."""
        return chat_prompt_ids(self.backend.tokenizer, request.messages)

    def _generation_requests(self, requests: list[Request]) -> list[GenerationRequest]:
        """Each request as a backend row. The seed depends on (episode, seat, turn, guard attempt) alone, so a row
        samples the same tokens in any batch; the cache key names the seat's chat, whose prefix the next turn
        reuses."""
        rows = []
        for r in requests:
            seed = derive(self.seed, r.episode_id, r.seat, r.turn_index, "sampler", *([r.attempt] if r.attempt else []))
            constraint = self._constraint(r)
            bounded = r.max_chars is None or isinstance(constraint, TurnGrammar)  # a grammar bounds its own text
            enough = None if bounded else _visible_text_exceeds(r.max_chars)
            if self.watch is not None:
                enough = _watched(self.watch, r, enough)
            key = (self.name, r.episode_id, r.seat)
            rows.append(GenerationRequest(self.prompt_ids(r), seed, constraint, key, enough, self._adapter(r)))
        return rows

    def _constraint(self, request: Request) -> TokenTrie | TurnGrammar | None:
        """What restricts the request's answer: its action's grammar after talk (``constrained`` "grammar"), the
        trie of its finite choices (True), or nothing."""
        if self.constrained == GRAMMAR:
            if request.syntax is None:
                return None
            return turn_grammar(request.syntax, self.params.max_new_tokens, request.max_chars or DEFAULT_MAX_CHARS)
        return self.backend.constraint(request.choices) if self.constrained and request.choices is not None else None

    def _response(self, row: GenerationRequest, generation: Generation) -> Response:
        grammar = row.constraint.dumps() if isinstance(row.constraint, TurnGrammar) else None
        return Response(
            text=self.backend.decode(generation.response_ids),
            finish=generation.finish,
            prompt_ids=list(row.prompt_ids),
            response_ids=generation.response_ids,
            logp_sample=generation.logp_sample,
            policy_version=self.backend.version,
            grammar=grammar,
        )

    def act(self, requests: list[Request]) -> list[Response]:
        """Answer every request in one batched generation call."""
        rows = self._generation_requests(requests)
        generations = self.backend.generate(rows, self.params)
        return [self._response(row, g) for row, g in zip(rows, generations)]

    def submit(self, requests: list[Request]) -> None:
        """Queue requests into the batch in flight (continuous batching); ``poll`` returns them when answered."""
        if self._stream is None:
            self._stream = self.backend.stream(self.params)
        for request, row in zip(requests, self._generation_requests(requests)):
            self._queued[self._stream.add(row)] = (request, row)

    def _adapter(self, request: Request) -> object:
        """The version that samples ``request``: its seat's role or team adapter, else the agent's own (SYNCED
        for the live adapter, so that a model without LoRA samples itself)."""
        if self.roles is not None:
            return self.roles.adapter(request.label, request.team)
        return SYNCED if self.adapter == LIVE_ADAPTER else self.adapter

    @property
    def busy(self) -> bool:
        """Whether submitted requests are still unanswered."""
        return bool(self._queued)

    def poll(self) -> list[tuple[Request, Response]]:
        """One decode step of the batch in flight; the requests it finished, with their responses."""
        if self._stream is None:
            return []
        done = []
        for ticket, generation in self._stream.step():
            request, row = self._queued.pop(ticket)
            done.append((request, self._response(row, generation)))
        return done


def _visible_text_exceeds(limit: int) -> Callable[[str], bool]:
    """True once the text the environment reads (thinking removed) is past ``limit``: the
    environment cuts everything after it, so sampling more is wasted."""
    return lambda text: len(clean(text, limit + 1)) > limit


def _watched(
    watch: Callable[[Request, str, int], None], request: Request, stop: Callable[[str], bool] | None
) -> Callable[[str], bool]:
    """A row's ``enough`` check that first shows the text so far to ``watch``; backends call it every
    ``ENOUGH_EVERY`` tokens, which gives the token count."""
    calls = 0

    def check(text: str) -> bool:
        nonlocal calls
        calls += 1
        watch(request, text, calls * ENOUGH_EVERY)
        return stop is not None and stop(text)

    return check

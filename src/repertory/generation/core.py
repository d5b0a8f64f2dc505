"""What every generation engine offers, independent of the engine: the :class:`Backend` protocol and the
values it takes and returns."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

from repertory.envs.grammar import TurnGrammar
from repertory.generation.grammar import GrammarRow, grammar_masks
from repertory.types import RepertoryError

ENOUGH_EVERY = 8  # tokens between two checks of a row's ``enough`` (each check decodes the row)


def stop_token_ids(tokenizer: Any) -> set[int]:
    """The tokens that end a response: end of sequence and the chat templates' end-of-turn tokens."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return ids


def end_of_turn_id(tokenizer: Any, stop_ids: set[int]) -> int:
    """The token that closes an assistant turn (the one a constrained response ends with)."""
    token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return token_id if isinstance(token_id, int) and token_id in stop_ids else tokenizer.eos_token_id


def window_budget(
    prompt_tokens: int, max_new_tokens: int, window: int | None, constraint: TokenTrie | TurnGrammar | None
) -> int:
    """A row's token budget within the model's context of ``window`` tokens (None: unbounded). A free row's
    (``constraint`` None) is cut to what the window leaves (the row ends "length" there, as vLLM ends it); a
    constrained row's (a :class:`TokenTrie`'s longest answer, or a grammar's max_new_tokens) must fit whole, since
    a cut action would not parse. A row that cannot fit, in the window or in max_new_tokens, is refused."""
    constrained = constraint is not None
    if isinstance(constraint, TokenTrie) and constraint.depth > max_new_tokens:
        raise RepertoryError(
            f"the longest allowed answer takes {constraint.depth} tokens with its end-of-turn token, but a turn has "
            f"{max_new_tokens} (max_new_tokens), so it would be cut and not parse: raise max_new_tokens to at least "
            f"{constraint.depth}"
        )
    budget = constraint.depth if isinstance(constraint, TokenTrie) else max_new_tokens
    if window is None or prompt_tokens + budget <= window:
        return budget
    if prompt_tokens < window and not constrained:
        return window - prompt_tokens
    what = f"a prompt of {prompt_tokens} tokens " + (f"and an answer of up to {budget} do" if constrained else "does")
    raise RepertoryError(
        f"{what} not fit the model's context of {window} tokens (hf: the model's positions; vLLM: its "
        "max_model_len): shorten the conversation or lower max_new_tokens"
    )


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature (0 = greedy), nucleus top-p, token budget, extra stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 400
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")


@dataclass
class Generation:
    """One sampled continuation: its token ids, their log-probs under the sampler and why it ended ("stop" or
    "length"); named as in :class:`~repertory.agents.Response` and :class:`~repertory.types.Turn`."""

    response_ids: list[int]
    logp_sample: list[float]
    finish: str


@dataclass
class TokenTrie:
    """The token sequences of a finite set of complete responses, as a prefix tree."""

    children: dict[int, TokenTrie] = field(default_factory=dict)
    depth: int = 0
    """Tokens of the longest response below this node: the most a row constrained from here can generate."""

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]]) -> TokenTrie:
        root = cls()
        for seq in sequences:
            node = root
            for k, token in enumerate(seq):
                node.depth = max(node.depth, len(seq) - k)
                node = node.children.setdefault(token, cls())
        return root


Enough = Callable[[str], bool] | None
SYNCED = object()  # a row without an adapter choice: the synced policy as it is (under LoRA, its active adapter)


@dataclass(frozen=True)
class GenerationRequest:
    """One row of a generation call: what :class:`Backend` samples one :class:`Generation` for.

    ``seed`` alone drives the row's randomness (its tokens do not depend on the other rows of the call);
    ``constraint`` restricts it to a trie of complete responses, or to a grammar (its log-probs are then the
    masked policy's, and its ``enough`` only watches: the row ends where the grammar's action does);
    ``cache_key`` names the kept prefix it reuses and extends; ``enough(text)`` ends it early (finish "length")
    once more text would be wasted; ``adapter`` names the policy version that samples it: SYNCED the synced
    policy as it is (under LoRA, its live adapter), None the base with the adapters off, a str that LoRA adapter
    of the synced PEFT model."""

    prompt_ids: Sequence[int]
    seed: int
    constraint: TokenTrie | TurnGrammar | None = None
    cache_key: object = None
    enough: Enough = None
    adapter: object = SYNCED

    def or_adapter(self, adapter: object) -> GenerationRequest:
        """This request, sampled by ``adapter`` where it leaves the choice to the caller (SYNCED)."""
        return replace(self, adapter=adapter) if self.adapter is SYNCED and adapter is not SYNCED else self


class TokenizedChoices:
    """What both engines share over a tokenizer: text of response tokens, and cached tries of finite answer
    sets. A subclass sets ``tokenizer``, ``end_of_turn_id`` and ``_tries`` (an empty dict)."""

    tokenizer: Any
    end_of_turn_id: int
    _tries: dict[tuple[str, ...], TokenTrie]

    def constraint(self, choices: Sequence[str]) -> TokenTrie:
        """The (cached) token trie of a finite set of responses, each closed by the end-of-turn token."""
        key = tuple(choices)
        if key not in self._tries:
            encoded = [self.tokenizer.encode(c, add_special_tokens=False) + [self.end_of_turn_id] for c in key]
            self._tries[key] = TokenTrie.build(encoded)
        return self._tries[key]

    def start_grammar(self, grammar: TurnGrammar) -> GrammarRow:
        """A row's grammar state at its first token (the tokenizer's masks are built once, then cached)."""
        return grammar_masks(self.tokenizer, self.end_of_turn_id).start(grammar)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of response tokens, without special tokens such as the end-of-turn token."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self, params: SamplingParams, adapter: object = SYNCED) -> Stream:
        """Rows sampled with ``params`` by the version ``adapter`` names (as in ``generate``), queued and collected
        by ticket. This default samples every queued row in one ``generate`` call per step; an engine that can
        admit rows between decode steps (hf) overrides it."""
        return CallStream(self, params, adapter)  # type: ignore[arg-type]


class Stream(Protocol):
    """Rows that join a running batch: ``add`` queues one and returns its ticket; ``step`` advances the batch and
    returns the rows that finished, by ticket; ``busy`` while any is queued or in flight. A request's ``adapter``
    overrides the stream's; SYNCED keeps it."""

    @property
    def busy(self) -> bool: ...

    def add(self, request: GenerationRequest) -> int: ...

    def step(self) -> list[tuple[int, Generation]]: ...


class CallStream:
    """A :class:`Stream` over ``generate``: each step samples every queued row in one call."""

    def __init__(self, backend: Backend, params: SamplingParams, adapter: object = SYNCED):
        self.backend, self.params, self.adapter = backend, params, adapter
        self._queued: list[tuple[int, GenerationRequest]] = []
        self._tickets = 0

    @property
    def busy(self) -> bool:
        return bool(self._queued)

    def add(self, request: GenerationRequest) -> int:
        self._tickets += 1
        self._queued.append((self._tickets, request.or_adapter(self.adapter)))
        return self._tickets

    def step(self) -> list[tuple[int, Generation]]:
        rows, self._queued = self._queued, []
        if not rows:
            return []
        tickets, requests = zip(*rows)
        return list(zip(tickets, self.backend.generate(list(requests), self.params)))


class ForwardPass(NamedTuple):
    """One forward pass's workload: rows in the batch, new tokens fed, cached context tokens read (the rows' earlier
    tokens, the new ones excluded) and (query, key) pairs attended (each new token with its row's context and the
    new tokens up to itself); padding counts nowhere."""

    rows: int
    new_tokens: int
    context_tokens: int
    attended: int


@dataclass
class GenerationStats:
    """Counters over the backend's lifetime (for benchmarks and metrics)."""

    calls: int = 0  # batches of rows that joined the engine (hf: each admission; one generate call at least one)
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    shared_prompt_tokens: int = 0  # not encoded: a row joining with it had the same prompt, or its key's prefix
    generated_tokens: int = 0
    forward_passes: int = 0
    # every pass's ForwardPass flat, four integers a pass, so a long run's records stay small (hf only)
    workload: array = field(default_factory=lambda: array("q"), repr=False)

    def record_forward(self, rows: int, new_tokens: int, context_tokens: int, attended: int) -> None:
        """Count one forward pass and keep its workload."""
        self.forward_passes += 1
        self.workload.extend((rows, new_tokens, context_tokens, attended))

    @property
    def passes(self) -> list[ForwardPass]:
        """The recorded forward passes in order (empty for an engine that does not record them)."""
        w = self.workload
        return [ForwardPass(*w[i : i + 4]) for i in range(0, len(w), 4)]

    @property
    def cache_hit_rate(self) -> float:
        """Share of prompt tokens whose keys and values came from a kept prefix."""
        return self.reused_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Backend(Protocol):
    """A generation engine that samples a policy: what agents, trainers and benchmarks rely on.

    ``generate`` samples one continuation per :class:`GenerationRequest`, in order (token ids in, token ids out,
    never re-rendered), each as its request says; each token's log-prob is log softmax(logits / T) over the full
    vocabulary at the sampling temperature. One call may mix adapters (hf: in each forward pass, every row
    through its own adapter).
    ``stream`` is the same sampling for rows that arrive while others decode (continuous batching: the rollout
    engine sends a seat's next request as soon as its episode steps), with the same per-row guarantees. A row
    that cannot fit ``context_window`` is refused, and a free row ends where the window does (:func:`window_budget`).
    ``sync`` makes the engine sample from the learner's current weights after an update (and wakes an
    offloaded engine); ``offload`` frees the device for a learner step where the engine can (vLLM on GPU
    sleeps); ``reset_cache`` forgets kept prefixes; ``close`` releases the engine."""

    name: str  # the policy it samples, as tables print it
    tokenizer: Any
    stats: GenerationStats
    version: int  # the policy version it samples: 0 at the start, one more at each sync (turns record it)

    @property
    def context_window(self) -> int | None:
        """The most tokens a row's prompt and response may hold (None: unbounded)."""

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def constraint(self, choices: Sequence[str]) -> TokenTrie: ...

    def stream(self, params: SamplingParams, adapter: object = SYNCED) -> Stream: ...

    def sync(self, policy: Any) -> None: ...

    def offload(self) -> None: ...

    def reset_cache(self) -> None: ...

    def close(self) -> None: ...

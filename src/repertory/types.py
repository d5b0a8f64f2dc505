"""The vocabulary shared by every layer: messages, kernels, turns, episodes and results.

Nothing here imports torch or knows about any particular game. An :class:`Episode` is the one
data format from rollout to loss: for every turn it holds the acting seat, exactly what that seat
saw, what it wrote, the parsed action, the reward that landed on the turn, and (for language-model
agents) the prompt and response token ids with their sampling log-probs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

ChatRole = Literal["system", "user", "assistant"]
Split = Literal["train", "heldout", "validation"]
SPLITS: tuple[str, ...] = ("train", "heldout", "validation")
"""The kernel splits in generation order: training draws train kernels, checkpoints are selected on validation
ones, and the reported numbers are held-out ones. Validation comes last so that adding it left the train and
held-out kernels as they were."""


def derive(*parts: object) -> int:
    """Deterministic 64-bit seed from any parts (docs/environments.md 1.5)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()
    return int(digest[:16], 16)


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys: the form kernels are shipped and compared in."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


CHANNELS: tuple[str, ...] = ("public", "team", "private")
"""Who else received a referee message: every player, the author's team, or the seat alone. Games
that do not label their messages leave the channel empty."""


@dataclass(frozen=True)
class Message:
    """One chat message as a seat sees it; ``channel`` (one of :data:`CHANNELS`, or empty) says who
    else was told the same."""

    role: ChatRole
    content: str
    channel: str = ""


def message_dicts(messages: list[Message]) -> list[dict[str, str]]:
    """Messages as ``{role, content, channel}`` dicts: the rows of the store's message columns, the chats of the
    report page and of the PettingZoo wrapper."""
    return [{"role": m.role, "content": m.content, "channel": m.channel} for m in messages]


def chat_dicts(messages: list[Message]) -> list[dict[str, str]]:
    """A chat as the ``{role, content}`` messages of chat templates and chat-completion APIs (what a model is
    shown; the channel is not part of it)."""
    return [{"role": m.role, "content": m.content} for m in messages]


@dataclass(frozen=True)
class Kernel:
    """One scenario instance: everything private to every role, generated from (env, split, index).

    ``data`` holds the environment-specific fields exactly as shipped in ``kernels/<env>/*.jsonl``;
    ``seed`` is the integer given to ``random.Random`` when the kernel was generated.
    """

    id: str
    env: str
    split: str
    index: int
    seed: int
    data: dict[str, Any]

    def to_json(self) -> str:
        """The shipped line: id, seed and the data fields, canonical JSON."""
        return canonical_json({"id": self.id, "seed": self.seed, **self.data})

    @classmethod
    def from_json(cls, line: str) -> Kernel:
        """Parse a shipped line; env, split and index are read from the id ``env/split/NNN``."""
        record = json.loads(line)
        kernel_id = record.pop("id")
        seed = record.pop("seed")
        env, split, index = kernel_id.split("/")
        return cls(id=kernel_id, env=env, split=split, index=int(index), seed=seed, data=record)


@dataclass(frozen=True)
class Action:
    """A parsed action: the tag name and its validated value (None for empty tags like accept)."""

    tag: str
    value: Any = None


@dataclass(frozen=True)
class Parsed:
    """What the referee made of one raw text.

    ``action`` is the action that took effect (for a forced default move, the default);
    ``error`` says why the text was not a valid action; ``invalid`` is true exactly when the
    text adds one to ``n_invalid`` (an invalid action, or a missing one where one is required).
    """

    action: Action | None
    error: str | None = None
    invalid: bool = False


@dataclass
class StepResult:
    """What one call of ``Env.step`` did: parsed actions, public events, rewards emitted now."""

    parsed: dict[str, Parsed]
    rewards: dict[str, float] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Dimension:
    """One scale a judge scores each agent on: an integer range and what it measures."""

    name: str
    low: int
    high: int
    meaning: str


@dataclass(frozen=True)
class JudgeRequest:
    """What a finished episode asks a judge to score: ``context`` (the situation, who is who, the transcript)
    for every agent of ``agents`` (their keys in the verdict, e.g. "agent_1") on every scale of ``dimensions``."""

    kind: str
    instructions: str
    context: str
    agents: tuple[str, ...]
    dimensions: tuple[Dimension, ...]


Verdict = dict[str, dict[str, float]]
"""A judge's scores: agent key -> dimension name -> score within the dimension's range."""


class Judge(Protocol):
    """Scores finished episodes (:mod:`repertory.judges`): one verdict per request, None where it failed."""

    name: str
    fine_grained: bool

    def score(self, requests: list[JudgeRequest]) -> list[Verdict | None]: ...


@dataclass
class RoleResult:
    """One role's final score: native points, normalised outcome in [0, 1], turns, invalid actions."""

    points: float
    outcome: float
    n_turns: int
    n_invalid: int


@dataclass
class Result:
    """The end of an episode: per-role results keyed by display name, why it ended, extra info."""

    roles: dict[str, RoleResult]
    end_reason: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Seat:
    """A role filled by a player in one episode (docs/algorithms.md 1.1).

    ``seat_id`` is positional ("p0", "p1", ...); ``name`` is the display name the environment
    uses (Alice, vendor); ``role`` is the game-role label trainers group by; ``agent`` is the
    agent spec that played it; ``policy_id`` is "live", "snapshot@<iter>", "base",
    "scripted:<x>" or "api:<x>".
    """

    seat_id: str
    name: str
    role: str
    agent: str
    policy_id: str
    trainable: bool = False


@dataclass
class Turn:
    """One generation by one seat: what it saw, what it wrote, what the referee made of it.

    ``observation`` holds the messages that became visible to the seat since its previous turn
    (the full prompt is the seat's earlier observations and responses followed by this one; see
    :meth:`Episode.prompt_messages`). Token fields stay empty for scripted agents.
    """

    seat_id: str
    turn_index: int
    global_step: int
    game_round: int
    observation: list[Message]
    text: str
    action: Action | None = None
    error: str | None = None
    invalid: bool = False
    reward: float = 0.0
    finish: str = "stop"
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logp_sample: list[float] = field(default_factory=list)
    policy_version: int = 0  # the sampling policy's version: the trainer's updates before it was sampled
    grammar: str | None = None
    """The grammar it was sampled under (``TurnGrammar.dumps``): its log-probs are the masked policy's, and the
    learner replays it to score the same policy. None for unconstrained and trie-constrained turns."""


@dataclass
class Episode:
    """Every turn of every seat of one game, in the order they were taken, and its result."""

    episode_id: str
    env: str
    kernel: Kernel
    episode_seed: int
    seats: list[Seat]
    turns: list[Turn]
    result: Result
    metrics: dict[str, float]
    final_observations: dict[str, list[Message]] = field(default_factory=dict)
    group_id: str = ""
    iteration: int = 0

    @property
    def kernel_id(self) -> str:
        return self.kernel.id

    @property
    def split(self) -> str:
        return self.kernel.split

    @property
    def judge_failed(self) -> bool:
        """The judge could not score this episode: it is kept, but left out of training and of evaluation means."""
        return bool(self.result.info.get("judge_failed"))

    def seat(self, seat_id: str) -> Seat:
        """The seat with this seat_id."""
        for seat in self.seats:
            if seat.seat_id == seat_id:
                return seat
        raise KeyError(f"episode {self.episode_id} has no seat {seat_id!r}")

    def trajectory(self, seat_id: str) -> list[Turn]:
        """The seat's own turns, in order."""
        return [t for t in self.turns if t.seat_id == seat_id]

    def prompt_messages(self, seat_id: str, turn_index: int) -> list[Message]:
        """The full chat the seat saw before writing its ``turn_index``-th turn."""
        chat: list[Message] = []
        for turn in self.trajectory(seat_id)[: turn_index + 1]:
            chat.extend(turn.observation)
            if turn.turn_index == turn_index:
                return chat
            chat.append(Message("assistant", turn.text))
        raise IndexError(f"seat {seat_id} has no turn {turn_index} in episode {self.episode_id}")

    def total_reward(self, seat_id: str) -> float:
        """Sum of the rewards that landed on the seat's turns (equals its outcome)."""
        return sum(t.reward for t in self.trajectory(seat_id))

    def summary(self) -> dict[str, Any]:
        """A JSON-ready digest: env, kernel, seats (name -> agent), points, outcome, metrics."""
        names = [s.name for s in self.seats]
        return {
            "episode_id": self.episode_id,
            "env": self.env,
            "kernel": self.kernel.id,
            "episode_seed": self.episode_seed,
            "seats": {s.name: s.agent for s in self.seats},
            "rewards": {n: self.result.roles[n].points for n in names},
            "outcome": {n: self.result.roles[n].outcome for n in names},
            "n_turns": {n: self.result.roles[n].n_turns for n in names},
            "n_invalid": {n: self.result.roles[n].n_invalid for n in names},
            "response_tokens": {
                s.name: sum(len(t.response_ids) for t in self.trajectory(s.seat_id)) for s in self.seats
            },
            "end_reason": self.result.end_reason,
            "metrics": dict(self.metrics),
        }


class RepertoryError(Exception):
    """A user-facing error: bad names, bad input files, bad counts. The message says what to do."""


Entry = TypeVar("Entry")


class Registry(Mapping[str, Entry], Generic[Entry]):
    """Entries of one kind by name (methods, estimators, policy losses, generation backends, environments): a
    name is taken once, and an unknown name's error lists the known ones. Read it as a mapping."""

    def __init__(self, what: str, entries: Mapping[str, Entry] | None = None):
        self.what = what
        self._entries: dict[str, Entry] = dict(entries or {})

    def add(self, name: str, entry: Entry) -> Entry:
        """Register ``entry`` as ``name``; a name already taken is an error."""
        if name in self._entries:
            raise RepertoryError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[Entry], Entry]:
        """``@registry.decorator(name)`` registers what it decorates and returns it unchanged."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's or a notebook's entry)."""
        self[name]  # noqa: B018 - an unknown name raises the registry's error
        del self._entries[name]

    def __getitem__(self, name: str) -> Entry:
        if name not in self._entries:
            raise RepertoryError(f"unknown {self.what} {name!r}; known: {', '.join(sorted(self._entries))}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._entries.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

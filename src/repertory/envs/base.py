"""The environment interface and the bookkeeping every environment shares.

An environment is a text game with a referee (docs/environments.md 1.1): it shows each role only what
that role may see, parses the tag syntax out of free text, never raises on bad output, and scores
the game. Round-based social dilemmas share :class:`IteratedGame`, which runs simultaneous moves,
proportional splits, feedback to the next round and per-round rewards ``points / Z``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.grammar import Syntax, choices_syntax
from repertory.envs.parsing import DEFAULT_MAX_CHARS
from repertory.types import (
    Episode,
    JudgeRequest,
    Kernel,
    Message,
    Parsed,
    Result,
    RoleResult,
    StepResult,
    Verdict,
)

Bot = Callable[[dict[str, Any]], str]
"""A scripted policy: the role's structured view (see ``Env.view``) in, the raw text out."""


@dataclass(frozen=True)
class KeyMetric:
    """The episode metric (a key of ``Env.metrics()``) that shows a game's key behaviour, and what a rise or a
    fall of its held-out mean says the trained policy learned (the report leads with its change)."""

    name: str
    label: str
    rises: str
    falls: str


@dataclass
class StrategyFit:
    """How often a player's moves agree with each of a game's classic strategies given the same history."""

    agreement: dict[str, float]
    moves: int

    @property
    def closest(self) -> str:
        """The strategy with the highest agreement; ties go to the one the game lists first."""
        return max(self.agreement, key=lambda name: self.agreement[name])

    def to_json(self) -> dict[str, object]:
        return {"agreement": self.agreement, "closest": self.closest, "moves": self.moves}


class Env(ABC):
    """Base class of every environment; subclasses implement the game, this class the bookkeeping.

    Lifecycle: ``reset(kernel, episode_seed)``, then while not ``done``: ``observe(role)`` for
    each role in ``acting_roles()``, ``step({role: text})``. ``result()`` scores the episode.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    roles: tuple[str, ...]
    """Seat display names in seat order. A game whose names come from the kernel (Werewolf) sets them on
    the instance at ``reset`` (``seat_names``); the class value then holds generic names of the seats."""
    role_labels: tuple[str, ...]
    """The game-role label of each seat (trainers group by it); kernel-given games set it at ``reset``."""
    teams: ClassVar[tuple[str, ...]] = ()
    """Team names of a team game (Werewolf: village, wolves); empty where every seat plays for itself."""
    default_trained_role: ClassVar[str]
    bots: ClassVar[dict[str, Bot]] = {}
    unique_kernels: ClassVar[bool] = True
    missing_splits: ClassVar[dict[str, str]] = {}
    """Splits of :data:`~repertory.types.SPLITS` the game has no kernels of, each with the reason, which loading
    one says (social: its shipped catalogue has no validation scenarios). A user's game whose generator cannot
    fill a validation split disjoint from train and held-out names it here."""
    fixed_seat: ClassVar[bool] = False
    """True where one agent is trained and evaluated in ``default_trained_role`` against a partner
    (the negotiations); otherwise an agent facing an opponent takes every seat in turn."""
    default_partner: ClassVar[str] = "self"
    """Who sits opposite the evaluated agent by default: "self" (self-play), "base" or a bot name."""
    guarded_limit: ClassVar[str] = ""
    """The private limit the partner guard protects, in words; empty where the game has none."""
    scored_by_label: ClassVar[bool] = False
    """True where display names come from the kernel (Werewolf, social): evaluations then report scores per
    role label (seer, seller) instead of per name."""
    key_metric: ClassVar[KeyMetric | None] = None
    """The metric of the game's key behaviour (IPD: mutual cooperation); None where no one metric is it."""

    def __init__(self) -> None:
        self.kernel: Kernel | None = None
        self.episode_seed = 0
        self._inbox: dict[str, list[Message]] = {}
        self.points: dict[str, Fraction] = {}
        self.n_turns: dict[str, int] = {}
        self.n_invalid: dict[str, int] = {}
        self.end_reason = ""

    @classmethod
    @abstractmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        """The data fields of one kernel, drawn from ``rng`` in the order docs/environments.md gives."""

    @classmethod
    def draw_kernel(cls, rng: random.Random, split: str) -> dict[str, Any]:
        """Kernel data for ``split``; the same procedure for every split unless a game draws from per-split pools."""
        return cls.generate_kernel(rng)

    @classmethod
    def custom_kernels(cls, split: str, options: dict[str, Any]) -> list[Kernel] | None:
        """Kernels that the game's ``options`` define instead of the shipped ones (social: a user's scenario
        directory); None where the options leave the kernels alone."""
        return None

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        """Problems with a kernel's data (empty when valid)."""
        return []

    @classmethod
    def seat_names(cls, data: dict[str, Any]) -> tuple[str, ...]:
        """The display names of a kernel's seats; fixed by the class unless a game draws them."""
        return cls.roles

    @classmethod
    def seat_labels(cls, data: dict[str, Any]) -> tuple[str, ...]:
        """The role label of each of a kernel's seats."""
        return cls.role_labels

    @classmethod
    def seat_teams(cls, data: dict[str, Any]) -> tuple[str, ...]:
        """The team of each of a kernel's seats in a team game (one of ``teams``); empty elsewhere."""
        return ()

    @classmethod
    def strategy_fit(cls, games: list[tuple[Episode, int]]) -> StrategyFit | None:
        """How a player's moves in ``games`` (each an episode and the player's seat) agree with the game's
        classic strategies (cross-play reports it); None where the game names none."""
        return None

    @classmethod
    def turn_quality(cls, episode: Episode) -> dict[tuple[str, int], float]:
        """Each turn's local quality, by (seat id, turn index): what the turn alone did for its seat, read from
        the finished episode (IPD: the round's points of the move played minus those of the other move, against
        the partner's move). Credit estimators are compared by how their per-turn advantages correlate with it
        (docs/algorithms.md 4.8); empty where the game defines none."""
        return {}

    def reset(self, kernel: Kernel, episode_seed: int) -> None:
        """Start a fresh episode of ``kernel``; every role's inbox starts with its system prompt."""
        if kernel.env != self.name:
            raise ValueError(f"kernel {kernel.id} belongs to {kernel.env}, not {self.name}")
        problems = self.validate_kernel(kernel.data)
        if problems:
            raise ValueError(f"kernel {kernel.id} is invalid: {'; '.join(problems)}")
        self.kernel = kernel
        self.episode_seed = episode_seed
        self.roles = self.seat_names(kernel.data)
        self.role_labels = self.seat_labels(kernel.data)
        self._inbox = {r: [Message("system", self.system_prompt(r))] for r in self.roles}
        self.points = {r: Fraction(0) for r in self.roles}
        self.n_turns = {r: 0 for r in self.roles}
        self.n_invalid = {r: 0 for r in self.roles}
        self.end_reason = ""
        self._start()

    @abstractmethod
    def _start(self) -> None:
        """Set up game state after ``reset`` and queue the first prompts."""

    @abstractmethod
    def system_prompt(self, role: str) -> str:
        """Rules, the role's private information, the action syntax with examples, the limits."""

    @abstractmethod
    def acting_roles(self) -> list[str]:
        """Roles that must act now (several in simultaneous phases, none when done)."""

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether the episode has ended."""

    @abstractmethod
    def parse(self, role: str, text: str) -> Parsed:
        """What ``step`` would make of ``text`` from ``role`` now; pure."""

    @abstractmethod
    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        """Advance the game with the parsed actions of all acting roles."""

    @abstractmethod
    def outcome(self, role: str) -> float:
        """The role's normalised score in [0, 1]."""

    @abstractmethod
    def metrics(self) -> dict[str, float]:
        """Episode-level metrics (cooperation rate, collective payoff, ...)."""

    @abstractmethod
    def view(self, role: str) -> dict[str, Any]:
        """Everything the role knows, as structured data, for scripted bots."""

    @property
    def game_round(self) -> int:
        """The current round (1-based) in round-based games; 0 elsewhere."""
        return 0

    def max_chars(self, role: str) -> int:
        """How much of ``role``'s visible text counts now; the rest is cut (docs/environments.md 1.2)."""
        return DEFAULT_MAX_CHARS

    def action_choices(self, role: str) -> list[str] | None:
        """Every complete valid response of ``role`` now, when that is a finite set (for constrained
        decoding); None where the role writes free text."""
        return None

    def action_syntax(self, role: str) -> Syntax | None:
        """The grammar of ``role``'s action now (``rollout.constrained: grammar``; docs/environments.md 1.7), which
        talk may precede: by default any one of :meth:`action_choices`; None where the role only talks."""
        choices = self.action_choices(role)
        return choices_syntax(choices) if choices else None

    def guard(self, role: str, text: str) -> str | None:
        """The partner guard (docs/environments.md 1.6): None when ``text`` keeps ``role`` within its private
        limits, else the text with the offending tags deleted. Games without hard limits never object."""
        return None

    @property
    def needs_judge(self) -> bool:
        """Whether the rewards wait for a judge's verdict once the episode is done (social, reward judge or hybrid)."""
        return False

    def judge_requests(self, fine_grained: bool = False) -> list[JudgeRequest]:
        """What a judge should score now that the episode is done (none for games scored by their rules)."""
        return []

    def judged(self, verdicts: list[Verdict | None]) -> dict[str, float]:
        """Apply a judge's verdicts (None: the judge failed) to the requests of ``judge_requests``; returns the
        terminal rewards they add."""
        return {}

    def seat_index(self, role: str) -> int:
        """0-based seat index of a display name."""
        return self.roles.index(role)

    def observe(self, role: str) -> list[Message]:
        """Messages that became visible to ``role`` since it last observed."""
        messages, self._inbox[role] = self._inbox[role], []
        return messages

    def tell(self, role: str, text: str, channel: str = "") -> None:
        """Queue a user message for ``role``; consecutive notices on one channel are joined into one message."""
        append_joined(self._inbox[role], Message("user", text, channel))

    def validate(self, role: str, text: str) -> tuple[bool, str]:
        """Would ``text`` be a legal action for ``role`` now? Pure; never advances the state."""
        if self.done:
            return False, "the episode is over"
        if role not in self.acting_roles():
            return False, f"{role} is not to act now"
        parsed = self.parse(role, text)
        return (False, parsed.error or "invalid action") if parsed.invalid else (True, "")

    def step(self, actions: dict[str, str]) -> StepResult:
        """Apply the raw texts of exactly the acting roles; bad text never raises."""
        if self.done:
            raise RuntimeError(f"{self.name}: step() called after the episode ended")
        acting = self.acting_roles()
        if sorted(actions) != sorted(acting):
            raise ValueError(f"{self.name}: expected actions from {acting}, got {sorted(actions)}")
        parsed = {role: self.parse(role, actions[role]) for role in acting}
        for role in acting:
            self.n_turns[role] += 1
            self.n_invalid[role] += parsed[role].invalid
        return self._apply(parsed)

    def result(self) -> Result:
        """Per-role points, outcome, turns and invalid actions; end reason; kernel id."""
        assert self.kernel is not None, "result() before reset()"
        return Result(
            roles={
                r: RoleResult(float(self.points[r]), self.outcome(r), self.n_turns[r], self.n_invalid[r])
                for r in self.roles
            },
            end_reason=self.end_reason,
            info={"kernel_id": self.kernel.id},
        )

    def _base_view(self, role: str) -> dict[str, Any]:
        assert self.kernel is not None
        return {
            "env": self.name,
            "kernel_id": self.kernel.id,
            "episode_seed": self.episode_seed,
            "role": role,
            "seat": self.seat_index(role),
            "round": self.game_round,
        }


def append_joined(chat: list[Message], message: Message) -> None:
    """Append ``message`` to ``chat``, joined onto the last message when both are notices (user messages) on one
    channel: what a seat reads as one message, however often its inbox is drained."""
    last = chat[-1] if chat else None
    if message.role == "user" and last is not None and last.role == "user" and last.channel == message.channel:
        chat[-1] = Message("user", last.content + "\n" + message.content, message.channel)
    else:
        chat.append(message)


def other(roles: tuple[str, ...], role: str) -> str:
    """The other role of a two-role game."""
    return roles[1] if role == roles[0] else roles[0]


def proportional_split(claims: dict[str, int], quantity: int) -> dict[str, Fraction]:
    """Claims that fit are granted (the rest is lost); over-claims are scaled to ``quantity``."""
    total = sum(claims.values())
    if total <= quantity:
        return {r: Fraction(x) for r, x in claims.items()}
    return {r: Fraction(quantity * x, total) for r, x in claims.items()}


def collective_payoff(history: list[dict[str, Any]], best_total: float) -> dict[str, float]:
    """Both seats' points: per game, per round, and as a share of the best possible welfare."""
    total = float(sum(sum(h["points"].values()) for h in history))
    return {
        "collective_payoff": total,
        "collective_payoff_per_round": total / max(len(history), 1),
        "collective_payoff_normalized": total / best_total if best_total else 0.0,
    }


def fmt(x: Fraction | float) -> str:
    """A number for prompts: integers bare, others with up to 4 decimals."""
    value = float(x)
    if value.is_integer():
        return str(int(value))
    return f"{value:.4f}".rstrip("0").rstrip(".")


class IteratedGame(Env):
    """Two-player iterated game: simultaneous moves, feedback next round, reward points/Z per round.

    Subclasses define the per-round payoffs (``_resolve``), Z per role (``_z``) and the prompts.
    """

    unique_kernels: ClassVar[bool] = True

    def __init__(self, reward_at_end: bool = False) -> None:
        """``reward_at_end`` pays each seat its whole score (points / Z) after the last round and 0 after the
        others: the same game and outcome, with credit that has to reach back over the rounds that earned it."""
        super().__init__()
        if not isinstance(reward_at_end, bool):
            raise ValueError(f"reward_at_end must be true or false (got {reward_at_end!r})")
        self.reward_at_end = reward_at_end

    @property
    def n_rounds(self) -> int:
        assert self.kernel is not None
        return self._n_rounds(self.kernel.data)

    @classmethod
    @abstractmethod
    def _n_rounds(cls, data: dict[str, Any]) -> int:
        """Rounds in a kernel."""

    @staticmethod
    def _check_rounds(rounds: object, field: str, round_ok: Callable[[Any], bool], rule: str) -> list[str]:
        """Problems with a kernel's per-round list: not a non-empty list, or rounds breaking ``rule``."""
        if not isinstance(rounds, list) or not rounds:
            return [f"{field} must be a non-empty list of rounds"]
        problems = []
        for r, item in enumerate(rounds, 1):
            try:
                ok = round_ok(item)
            except (KeyError, TypeError):
                ok = False
            if not ok:
                problems.append(f"round {r}: {rule}")
        return problems

    @abstractmethod
    def _z(self, role: str) -> Fraction:
        """The normaliser: the most points the role could score over the episode."""

    def _start(self) -> None:
        self.round = 1
        self.history: list[dict[str, Any]] = []
        self._start_round()

    @abstractmethod
    def _start_round(self) -> None:
        """Queue the prompts that open ``self.round``."""

    @property
    def game_round(self) -> int:
        return self.round if not self.done else self.n_rounds

    @property
    def done(self) -> bool:
        return self.round > self.n_rounds

    def outcome(self, role: str) -> float:
        return float(self.points[role] / self._z(role))

    def result(self) -> Result:
        """The episode's result; ``info["round_points"]`` holds each role's raw points per round."""
        result = super().result()
        result.info["round_points"] = {r: [float(h["points"][r]) for h in self.history] for r in self.roles}
        return result

    def _close_round(
        self,
        parsed: dict[str, Parsed],
        record: dict[str, Any],
        round_points: dict[str, Fraction],
        feedback: Callable[[str], str],
        event: str,
    ) -> StepResult:
        """Bank the round, tell each role ``feedback(role)``, open the next round (or end), and
        emit the per-round rewards ``points / Z``."""
        self.history.append(record)
        for role, p in round_points.items():
            self.points[role] += p
        for role in self.roles:
            self.tell(role, feedback(role))
        self.round += 1
        if self.done:
            self.end_reason = "rounds_complete"
        else:
            self._start_round()
        if self.reward_at_end:
            paid = {role: self.points[role] if self.done else Fraction(0) for role in round_points}
        else:
            paid = round_points
        rewards = {role: float(p / self._z(role)) for role, p in paid.items()}
        return StepResult(parsed, rewards, [event])


RoundGame = IteratedGame  # its former name, kept so that users' games that subclass it still load

"""Alternating two-party negotiations (docs/environments.md 5-10): the machinery all six share.

A :class:`Negotiation` is a conversation of at most ``max_messages`` alternating messages, the
first seat opening. A message is free text; its last action tag (``<propose>``, ``<accept/>``,
``<reject/>``, ``<walkaway/>``) is the move. The standing proposal is the latest valid proposal by
either side; ``<accept/>`` of the other side's standing proposal closes a deal. An invalid action
turns the message into a plain one (still delivered, still counted) and only its author hears why.
One terminal reward equal to the outcome lands at the end.

A game subclass supplies only what is particular to it: the kernel, the prompts, how a proposal
payload parses (:meth:`Negotiation.parse_offer`), what a deal is worth to each side
(:meth:`Negotiation.deal_points`), its normaliser, and optionally a private limit the partner
guard protects (:meth:`Negotiation.below_limit`). The aspiration bot of docs/environments.md 1.6 is
:func:`aspiration_reply`, fed each game's enumeration of complete outcomes.
"""

from __future__ import annotations

import json
import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.base import Env, KeyMetric, fmt, other
from repertory.envs.grammar import Syntax, literal, one_of, tagged
from repertory.envs.parsing import PayloadError, TagMatch, clean, find_tags, last_tag
from repertory.types import Action, Episode, Parsed, StepResult

Offer = dict[str, Any]
"""A proposal's validated content in canonical form (JSON-ready: ints and strings only)."""

PROPOSE = frozenset({"propose"})
NEGOTIATION_TAGS = frozenset({"accept", "reject", "walkaway"})


def rnd(x: Fraction | int) -> int:
    """docs/environments.md 1.5: floor(x + 1/2), exact."""
    return math.floor(Fraction(x) + Fraction(1, 2))


def tag_text(tag: str, offer: Offer | None = None) -> str:
    """A well-formed action tag, as bots and examples write it."""
    if tag == "propose":
        return f"<propose>{json.dumps(offer or {})}</propose>"
    return f"<{tag}/>"


@dataclass(frozen=True)
class Standing:
    """The proposal on the table: who made it and what it says."""

    by: str
    offer: Offer


class Negotiation(Env):
    """Two roles, alternating messages, propose / accept / reject / walk away, one terminal reward."""

    max_messages: ClassVar[int] = 20
    fixed_seat: ClassVar[bool] = True
    key_metric = KeyMetric("deal_rate", "deals reached", "it closes more deals", "it closes fewer deals")
    default_partner: ClassVar[str] = "bot"
    empty_tags: ClassVar[frozenset[str]] = NEGOTIATION_TAGS
    reject_ends: ClassVar[bool] = False
    """Ultimatum: a reject destroys the pool instead of clearing the standing proposal."""
    walkaway_points: ClassVar[int] = 0
    """Points each side gets when either walks away (CaSiNo: 5)."""
    limit_text: ClassVar[str] = "The message limit was reached without a deal."

    # -- what each game supplies ------------------------------------------------------------------

    @abstractmethod
    def parse_offer(self, role: str, payload: str) -> Offer:
        """The canonical offer ``role`` proposes with ``payload``, or PayloadError with the reason."""

    @abstractmethod
    def deal_points(self, role: str, deal: Standing) -> Fraction | float:
        """``role``'s native points if ``deal`` is accepted."""

    @abstractmethod
    def max_points(self, role: str) -> Fraction | float:
        """The normaliser: outcome = clip(points / max_points, 0, 1) (docs/environments.md 5-10)."""

    @abstractmethod
    def describe(self, deal: Standing, viewer: str) -> str:
        """The deal in words, from ``viewer``'s side (what it gets or pays)."""

    @abstractmethod
    def private_view(self, role: str) -> dict[str, Any]:
        """The role's private information, as structured data for its bot."""

    def below_limit(self, role: str, deal: Standing) -> bool:
        """Whether ``deal`` is worse for ``role`` than the private limit the guard protects."""
        return False

    def accept_fails(self, deal: Standing) -> str | None:
        """Why accepting ``deal`` forms no agreement (Alliance's thresholds); None when it does."""
        return None

    def proposal_grid(self, role: str) -> list[Offer] | None:
        """The proposals ``role`` chooses among when its answers are constrained: a finite grid of the game's
        offers (every offer where that set is small). None where the game has no such grid; its constrained
        answers stay free text."""
        return None

    def extra_metrics(self) -> dict[str, float]:
        """Game-specific episode metrics."""
        return {}

    # -- the shared game ------------------------------------------------------------------------

    def _start(self) -> None:
        self.messages = 0
        self.standing: Standing | None = None
        self.deal: Standing | None = None
        self.ended = False
        self.log: list[tuple[str, Action | None]] = []
        opener = self.roles[0]
        self.tell(opener, f"You open the negotiation. {self.status_line(opener)}")

    @property
    def done(self) -> bool:
        return self.ended

    @property
    def messages_left(self) -> int:
        return self.max_messages - self.messages

    def speaker(self) -> str:
        """Whose message comes next: the first seat on odd messages."""
        return self.roles[self.messages % 2]

    def acting_roles(self) -> list[str]:
        return [] if self.ended else [self.speaker()]

    def is_last_turn(self, role: str) -> bool:
        """Whether ``role``'s current message is its last one before the limit."""
        return self.messages_left <= 2 and self.speaker() == role

    def action_choices(self, role: str) -> list[str] | None:
        """With a proposal grid, a constrained answer is a bare action: one of the grid's proposals, accept or
        reject of the partner's standing proposal, or a walk-away where the game has one. A small model that
        cannot write the tags from the rules still plays a graded game (the price it names, when it accepts)."""
        grid = self.proposal_grid(role)
        if grid is None:
            return None
        return [tag_text("propose", offer) for offer in grid] + [tag_text(tag) for tag in self._moves(role)]

    def action_syntax(self, role: str) -> Syntax | None:
        """Under a grammar every message ends in a move: a proposal with the game's typed fields
        (:meth:`offer_syntax`), accept or reject of the partner's standing proposal, or a walk-away."""
        offer = self.offer_syntax(role)
        if offer is None:
            return super().action_syntax(role)
        return one_of([tagged("propose", offer), *(literal(tag_text(t)) for t in self._moves(role))])

    def offer_syntax(self, role: str) -> Syntax | None:
        """The grammar of a valid proposal's payload (a JSON object of the game's fields); None where the game
        states none."""
        return None

    def _moves(self, role: str) -> list[str]:
        """The empty tags ``role`` may write now."""
        answers = ("accept", "reject") if self.standing is not None and self.standing.by != role else ()
        return [t for t in (*answers, "walkaway") if t in self.empty_tags]

    def status_line(self, role: str) -> str:
        """The line that precedes each of ``role``'s turns: the table, and messages left."""
        table = "There is no proposal on the table."
        if self.standing is not None:
            who = "Your" if self.standing.by == role else f"{self.standing.by[0].upper()}{self.standing.by[1:]}'s"
            table = f"{who} proposal stands: {self.describe(self.standing, role)}."
        return f"{table} Messages left: {self.messages_left}."

    def parse(self, role: str, text: str) -> Parsed:
        visible = clean(text, self.max_chars(role))
        plain = Action("message", visible)
        tag = last_tag(visible, content_tags=PROPOSE, empty_tags=self.empty_tags)
        if tag is None:
            return Parsed(plain)
        action = self._tag_action(role, tag)
        if isinstance(action, str):
            return Parsed(plain, action, invalid=True)
        return Parsed(action)

    def _tag_action(self, role: str, tag: TagMatch) -> Action | str:
        """The action ``tag`` makes, or the reason it is invalid now."""
        if tag.name == "propose":
            if tag.malformed or tag.payload is None:
                return "the <propose> tag is not closed with </propose>"
            try:
                return Action("propose", self.parse_offer(role, tag.payload))
            except PayloadError as exc:
                return str(exc)
        if tag.name in ("accept", "reject"):
            if self.standing is None:
                return f"there is no proposal to {tag.name}"
            if self.standing.by == role:
                return f"you cannot {tag.name} your own proposal"
        return Action(tag.name)

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        ((author, result),) = parsed.items()
        partner = other(self.roles, author)
        action = result.action
        assert action is not None
        self.messages += 1
        self.log.append((author, None if result.invalid else action))
        visible = self._visible
        events = [f"{author}: {visible}"]
        self.tell(partner, f"{author}: {visible}" if visible.strip() else f"{author} sent an empty message.")
        if result.invalid:
            self.tell(author, f"[Referee] Your action was not recorded: {result.error}.")
        elif action.tag == "propose":
            self.standing = Standing(author, action.value)
        elif action.tag == "accept":
            assert self.standing is not None
            failure = self.accept_fails(self.standing)
            if failure is None:
                self._end("deal", self.standing)
            else:
                self.standing = None
                for role in self.roles:
                    self.tell(role, f"[Referee] No agreement was formed: {failure}.")
                events.append("accept failed: " + failure)
        elif action.tag == "reject":
            if self.reject_ends:
                self._end("rejected")
            else:
                self.standing = None
        elif action.tag == "walkaway":
            self._end("walkaway")
        if not self.ended and self.messages >= self.max_messages:
            self._end("limit")
        if self.ended:
            events.append(self._closing(author))
            for role in self.roles:
                self.tell(role, f"[Referee] {self._closing(role)} Your outcome: {fmt(self.outcome(role))}.")
            return StepResult(parsed, {r: self.outcome(r) for r in self.roles}, events)
        self.tell(partner, self.status_line(partner))
        return StepResult(parsed, {}, events)

    def step(self, actions: dict[str, str]) -> StepResult:
        # The partner receives the author's text verbatim (after rules 1-2), tags included.
        self._visible = "".join(clean(text, self.max_chars(role)) for role, text in actions.items())
        return super().step(actions)

    def _end(self, reason: str, deal: Standing | None = None) -> None:
        self.ended = True
        self.end_reason = reason
        self.deal = deal
        for role in self.roles:
            if deal is not None:
                self.points[role] = Fraction(self.deal_points(role, deal))
            elif reason == "walkaway":
                self.points[role] = Fraction(self.walkaway_points)

    def _closing(self, viewer: str) -> str:
        if self.deal is not None:
            return f"Deal: {self.deal.by}'s proposal was accepted; {self.describe(self.deal, viewer)}."
        return {
            "walkaway": "A party walked away; there is no deal.",
            "rejected": "The proposal was rejected; the pool is destroyed.",
            "limit": self.limit_text,
        }[self.end_reason]

    @classmethod
    def turn_quality(cls, episode: Episode) -> dict[tuple[str, int], float]:
        """Each valid proposal of a game that closed a deal: the outcome its proposer would get were it the deal
        (Craigslist: a vendor's asking price over the list price). A deal shows what the partner would take, so
        within it asking for more was better; other turns, and games without a deal, have no quality."""
        if episode.result.end_reason != "deal":
            return {}
        env = cls()
        env.reset(episode.kernel, episode.episode_seed)
        names = {seat.seat_id: seat.name for seat in episode.seats}
        quality = {}
        for turn in episode.turns:
            if turn.action is not None and turn.action.tag == "propose" and not turn.invalid:
                role = names[turn.seat_id]
                share = Fraction(env.deal_points(role, Standing(role, turn.action.value))) / Fraction(
                    env.max_points(role)
                )
                quality[(turn.seat_id, turn.turn_index)] = float(min(1, max(0, share)))
        return quality

    def outcome(self, role: str) -> float:
        if self.deal is None and self.end_reason != "walkaway":
            return 0.0
        return float(min(1, max(0, self.points[role] / Fraction(self.max_points(role)))))

    def metrics(self) -> dict[str, float]:
        out = {
            "deal_rate": float(self.deal is not None),
            "walkaway_rate": float(self.end_reason == "walkaway"),
            "messages": float(self.messages),
            "joint_outcome": sum(self.outcome(r) for r in self.roles),
        }
        return {**out, **self.extra_metrics()}

    def view(self, role: str) -> dict[str, Any]:
        standing = None
        if self.standing is not None:
            standing = {"by": self.standing.by, "offer": dict(self.standing.offer), "own": self.standing.by == role}
        return {
            **self._base_view(role),
            "partner": other(self.roles, role),
            "own_turn": self.n_turns[role],
            "messages_left": self.messages_left,
            "last_turn": self.is_last_turn(role),
            "standing": standing,
            **self.private_view(role),
        }

    def guard(self, role: str, text: str) -> str | None:
        if not self.guarded_limit:
            return None
        deal = self._deal_of(role, self.parse(role, text).action)
        if deal is None or not self.below_limit(role, deal):
            return None
        # The rest goes out as a plain message: every action tag goes, not only the offending one
        # (an earlier <reject/> must not become the move), until cleaning and deleting change nothing
        # (deleting a tag can join fragments into a new tag or a <think> block).
        visible = text
        while True:
            cleaned = clean(visible, self.max_chars(role))
            stripped = cleaned
            for tag in reversed(find_tags(cleaned, PROPOSE, self.empty_tags)):
                stripped = stripped[: tag.start] + stripped[tag.end :]
            if stripped == visible:
                return stripped.strip()
            visible = stripped

    def _deal_of(self, role: str, action: Action | None) -> Standing | None:
        """The deal ``role`` would bind itself to with ``action``: its proposal, or what it accepts."""
        if action is None:
            return None
        if action.tag == "propose":
            return Standing(role, action.value)
        if action.tag == "accept":
            return self.standing
        return None


BotOption = tuple[Offer, Fraction | float, int, tuple[int, ...]]
"""One complete outcome from a bot's side: its own share/contract, its value to the bot, the
number of units the bot keeps (item games; 0 elsewhere) and its canonical encoding."""


def aspiration(start: Fraction, step: Fraction, floor: Fraction, k: int) -> Fraction:
    """a_k = max(floor, start - step*k)."""
    return max(floor, start - step * k)


def aspiration_reply(
    view: dict[str, Any],
    options: Sequence[BotOption],
    standing_value: Callable[[dict[str, Any]], Fraction | float],
    start: Fraction,
    step: Fraction,
    floor: Fraction,
    walkaway_value: int = 0,
) -> str:
    """The aspiration bot's message (docs/environments.md 1.6) for the turn described by ``view``."""
    a_k = aspiration(start, step, floor, view["own_turn"])
    standing = view["standing"]
    if standing is not None and not standing["own"] and standing_value(standing) >= a_k:
        return "That works for me. <accept/>"
    if walkaway_value > 0 and view["last_turn"]:
        return "I cannot agree to this, so I will take my outside option. <walkaway/>"
    good = [o for o in options if o[1] >= a_k]
    if not good:
        best = max(o[1] for o in options)
        good = [o for o in options if o[1] == best]
    choice = min(good, key=lambda o: (o[1], o[2], o[3]))
    return f"How about this? {tag_text('propose', choice[0])}"

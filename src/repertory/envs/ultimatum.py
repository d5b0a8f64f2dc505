"""Ultimatum with counter-offers (docs/environments.md 6): divide a pool; a rejection destroys it."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.base import Bot, fmt, other
from repertory.envs.grammar import Syntax, integer, json_object
from repertory.envs.negotiation import Negotiation, Offer, Standing, rnd, tag_text
from repertory.envs.parsing import PayloadError, as_integer, parse_fields

POOLS = (10, 20, 30, 50, 100, 200, 500, 1000)
UNITS = ("dollars", "euros", "gold coins", "points", "credits")
STORIES = (
    "a prize the two of you won together in a quiz",
    "a one-time bonus your team must share between two members",
    "the proceeds of a joint yard sale",
    "a small grant awarded to two co-founders",
)
MIN_SHARES = (0.2, 0.3, 0.4, 0.5)


def minimum_of(pool: int, min_share: float) -> int:
    """The responder's minimum ceil(min_share * pool), on the decimal value of min_share (0.3, not its float)."""
    return math.ceil(Fraction(str(min_share)) * pool)


def share_of(role: str, deal: Standing, pool: int) -> int:
    """What ``role`` receives under ``deal`` (a proposal states the proposer's own ``keep``)."""
    keep = deal.offer["keep"]
    return keep if deal.by == role else pool - keep


def propose(keep: int) -> str:
    """A bot's proposal message."""
    return f"I propose to keep {keep}. {tag_text('propose', {'keep': keep})}"


def bot(view: dict[str, Any]) -> str:
    """The threshold responder in the responder seat, the spec's proposer bot in the proposer seat."""
    pool = view["pool"]
    standing = view["standing"]
    offered = pool - standing["offer"]["keep"] if standing is not None and not standing["own"] else None
    if view["role"] == "responder":
        if offered is not None and offered >= view["minimum"]:
            return "That works for me. <accept/>"
        if offered is not None and view["last_turn"]:
            return "That is not enough for me. <reject/>"
        return propose(math.ceil(Fraction(pool, 2)))
    if offered is not None and offered >= rnd(Fraction(2, 5) * pool):
        return "That works for me. <accept/>"
    return propose(rnd(Fraction(3, 5) * pool) if view["own_turn"] == 0 else rnd(Fraction(1, 2) * pool))


class Ultimatum(Negotiation):
    name = "ultimatum"
    description = "Ultimatum with counter-offers: divide a pool in at most 6 messages; a rejection destroys it."
    roles = ("proposer", "responder")
    role_labels = ("proposer", "responder")
    default_trained_role = "proposer"
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}
    max_messages = 6
    empty_tags = frozenset({"accept", "reject"})
    reject_ends = True
    limit_text = "The message limit was reached without a deal; the pool is destroyed."
    guarded_limit = "the responder's minimum share"

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        pool = rng.choice(POOLS)
        unit = rng.choice(UNITS)
        story = rng.choice(STORIES)
        min_share = rng.choice(MIN_SHARES)
        return {
            "pool": pool,
            "unit": unit,
            "story": story,
            "min_share": min_share,
            "minimum": minimum_of(pool, min_share),
        }

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            pool, min_share, minimum = data["pool"], data["min_share"], data["minimum"]
            problems = []
            if type(pool) is not int or pool not in POOLS:
                problems.append(f"pool must be one of {POOLS}")
            if data["unit"] not in UNITS:
                problems.append(f"unit must be one of {', '.join(UNITS)}")
            if data["story"] not in STORIES:
                problems.append("story is not one of the four stories")
            if type(min_share) is not float or min_share not in MIN_SHARES:
                problems.append(f"min_share must be one of {MIN_SHARES}")
            if not problems and (type(minimum) is not int or minimum != minimum_of(pool, min_share)):
                problems.append(f"minimum must be ceil(min_share * pool) = {minimum_of(pool, min_share)}")
            return problems
        except (KeyError, TypeError):
            return ["a kernel needs pool, unit, story, min_share and minimum"]

    @property
    def pool(self) -> int:
        assert self.kernel is not None
        return self.kernel.data["pool"]

    @property
    def unit(self) -> str:
        assert self.kernel is not None
        return self.kernel.data["unit"]

    @property
    def minimum(self) -> int:
        assert self.kernel is not None
        return self.kernel.data["minimum"]

    def proposal_grid(self, role: str) -> list[Offer]:
        """Keeping 0%, 10%, ..., 100% of the pool (our choice: every pool is a multiple of 10)."""
        return [{"keep": self.pool * tenths // 10} for tenths in range(11)]

    def offer_syntax(self, role: str) -> Syntax:
        return json_object([("keep", integer(0, self.pool))])

    def parse_offer(self, role: str, payload: str) -> Offer:
        keep = as_integer(parse_fields(payload, ("keep",), required=True)["keep"], "keep")
        if not 0 <= keep <= self.pool:
            raise PayloadError(f"keep must be between 0 and {self.pool} (the pool)")
        return {"keep": keep}

    def deal_points(self, role: str, deal: Standing) -> int:
        return share_of(role, deal, self.pool)

    def max_points(self, role: str) -> Fraction:
        return Fraction(self.pool, 2)

    def below_limit(self, role: str, deal: Standing) -> bool:
        return role == "responder" and share_of(role, deal, self.pool) < self.minimum

    def describe(self, deal: Standing, viewer: str) -> str:
        mine = share_of(viewer, deal, self.pool)
        return f"you get {mine} {self.unit} and the {other(self.roles, viewer)} gets {self.pool - mine} {self.unit}"

    def private_view(self, role: str) -> dict[str, Any]:
        view: dict[str, Any] = {"pool": self.pool}
        if role == "responder":
            view["minimum"] = self.minimum
        return view

    def system_prompt(self, role: str) -> str:
        assert self.kernel is not None
        partner = other(self.roles, role)
        half = Fraction(self.pool, 2)
        if role == "proposer":
            private = (
                "The responder may have a private minimum share below which it will not agree; you do not know it."
            )
            example = rnd(Fraction(3, 5) * self.pool)
        else:
            private = (
                f"Your private minimum is {self.minimum} {self.unit}: never propose or accept a division that gives "
                "you less. The proposer does not know it."
            )
            example = math.ceil(half)
        return (
            f"You are the {role}. You and the {partner} must divide {self.pool} {self.unit}, "
            f"{self.kernel.data['story']}. The proposer opens.\n{private}\n"
            f"Your score is your share divided by {fmt(half)} (an equal split), at most 1. Any disagreement destroys "
            "the pool: if a proposal is rejected, or no proposal is accepted within the message limit, you both "
            "score 0.\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a division by stating how much YOU keep (a whole number from 0 to {self.pool}), e.g. "
            f"{tag_text('propose', {'keep': example})} (the {partner} gets the rest); a proposal answering the "
            f"{partner}'s is a counter-offer\n"
            f"- accept the {partner}'s standing proposal: <accept/>\n"
            f"- reject the {partner}'s standing proposal, which ends the game and destroys the pool: <reject/>\n"
            f"A deal is made when one side accepts the other's standing proposal."
        )

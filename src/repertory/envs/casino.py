"""CaSiNo campsite negotiation (docs/environments.md 8): divide food, water and firewood packages with
private high/medium/low priorities; walking away gives both sides 5 points, a timeout nothing."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction
from functools import cache
from typing import Any, ClassVar

from repertory.envs.base import Bot, other
from repertory.envs.grammar import Syntax, integer, json_object
from repertory.envs.negotiation import BotOption, Negotiation, Offer, Standing, aspiration_reply, tag_text
from repertory.envs.parsing import PayloadError, as_integer, parse_fields

ITEMS = ("food", "water", "firewood")
PACKAGES = 3
PRIORITY_VALUES = (5, 4, 3)
"""Points per package of the high, medium and low item."""
PRIORITY_NAMES = ("high", "medium", "low")
MAX_POINTS = PACKAGES * sum(PRIORITY_VALUES)
WALKAWAY_POINTS = 5

NEED = {
    "food": (
        "Two teenagers in our group eat far more than we planned for.",
        "We hike long distances each day and need extra calories.",
        "Part of our food spoiled in the cooler on the drive.",
    ),
    "water": (
        "The stream near our site has dried up this season.",
        "One of us takes medication that requires drinking a lot.",
        "We plan to cook rice and pasta, which use a lot of water.",
    ),
    "firewood": (
        "Nights here drop close to freezing.",
        "We forgot our stove, so every meal is cooked over a fire.",
        "The kids are looking forward to an evening campfire.",
    ),
}
SPARE = {
    "food": ("We packed plenty of meals.", "There is a camp store close by."),
    "water": ("We brought a filter for the lake.", "Our site has a working tap."),
    "firewood": ("Gathering fallen branches is allowed here.", "Our sleeping bags are very warm."),
}


def item_values(priorities: list[str]) -> list[int]:
    """Points per package of each item in ITEMS order, from the high/medium/low priority list."""
    return [PRIORITY_VALUES[priorities.index(item)] for item in ITEMS]


def share_of(role: str, deal: Standing) -> list[int]:
    """What ``role`` receives under ``deal`` (proposals state the proposer's own share)."""
    proposed = [deal.offer[i] for i in ITEMS]
    return proposed if deal.by == role else [PACKAGES - x for x in proposed]


def bot(view: dict[str, Any]) -> str:
    """Aspiration bot 26/2/18 in either seat; it walks away on its last turn unless it accepts."""
    values = view["values"]

    def standing_value(standing: dict[str, Any]) -> int:
        return sum(v * (PACKAGES - standing["offer"][i]) for v, i in zip(values, ITEMS))

    return aspiration_reply(
        view,
        _options(tuple(values)),
        standing_value,
        Fraction(26),
        Fraction(2),
        Fraction(18),
        walkaway_value=WALKAWAY_POINTS,
    )


SPLITS = list(itertools.product(range(PACKAGES + 1), repeat=len(ITEMS)))
"""Every division of the packages: the proposer's own count of each item, in ITEMS order (64)."""


@cache
def _options(values: tuple[int, ...]) -> list[BotOption]:
    out: list[BotOption] = []
    for share in SPLITS:
        out.append((dict(zip(ITEMS, share)), sum(v * x for v, x in zip(values, share)), sum(share), share))
    return out


class Casino(Negotiation):
    name = "casino"
    description = "CaSiNo: two campers divide food, water and firewood packages with private priorities."
    roles = ("Camper A", "Camper B")
    role_labels = ("Camper A", "Camper B")
    default_trained_role = "Camper A"
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}
    walkaway_points: ClassVar[int] = WALKAWAY_POINTS
    guarded_limit: ClassVar[str] = f"the walk-away value of {WALKAWAY_POINTS} points"

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        priorities: dict[str, list[str]] = {}
        reasons: dict[str, list[str]] = {}
        for role in cls.roles:
            order = list(ITEMS)
            rng.shuffle(order)
            high, medium, low = order
            priorities[role] = order
            reasons[role] = [rng.choice(NEED[high]), rng.choice(NEED[medium]), rng.choice(SPARE[low])]
        return {"items": list(ITEMS), "priorities": priorities, "reasons": reasons}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            if data["items"] != list(ITEMS):
                return [f"items must be {list(ITEMS)}"]
            priorities, reasons = data["priorities"], data["reasons"]
            if sorted(priorities) != sorted(cls.roles) or sorted(reasons) != sorted(cls.roles):
                return [f"priorities and reasons must be given for exactly {', '.join(cls.roles)}"]
            problems = []
            for role in cls.roles:
                order, why = priorities[role], reasons[role]
                if not isinstance(order, list) or sorted(order) != sorted(ITEMS):
                    problems.append(f"{role}'s priorities must order food, water and firewood")
                    continue
                if not isinstance(why, list) or len(why) != 3:
                    problems.append(f"{role} needs three reasons (high, medium, low)")
                    continue
                banks = (NEED[order[0]], NEED[order[1]], SPARE[order[2]])
                for rank, item, reason, bank in zip(PRIORITY_NAMES, order, why, banks):
                    if reason not in bank:
                        problems.append(f"{role}'s {rank}-priority reason is not from the bank for {item}")
            return problems
        except (KeyError, TypeError):
            return ["a kernel needs items, and priorities and reasons for both campers"]

    def priorities(self, role: str) -> list[str]:
        """``role``'s items from high to low priority."""
        assert self.kernel is not None
        return self.kernel.data["priorities"][role]

    def values(self, role: str) -> list[int]:
        """Points per package to ``role``, in ITEMS order."""
        return item_values(self.priorities(role))

    def proposal_grid(self, role: str) -> list[Offer]:
        """Every split of the packages."""
        return [dict(zip(ITEMS, share)) for share in SPLITS]

    def offer_syntax(self, role: str) -> Syntax:
        return json_object([(item, integer(0, PACKAGES)) for item in ITEMS])

    def parse_offer(self, role: str, payload: str) -> Offer:
        fields = parse_fields(payload, ITEMS, required=False)
        offer = {}
        for item in ITEMS:
            n = as_integer(fields.get(item, 0), item)
            if not 0 <= n <= PACKAGES:
                raise PayloadError(f"{item} must be between 0 and {PACKAGES} (there are {PACKAGES} packages)")
            offer[item] = n
        return offer

    def deal_points(self, role: str, deal: Standing) -> int:
        return sum(v * x for v, x in zip(self.values(role), share_of(role, deal)))

    def max_points(self, role: str) -> int:
        return MAX_POINTS

    def below_limit(self, role: str, deal: Standing) -> bool:
        return self.deal_points(role, deal) < WALKAWAY_POINTS

    def describe(self, deal: Standing, viewer: str) -> str:
        received = share_of(viewer, deal)
        items = ", ".join(f"{n} {item}" for n, item in zip(received, ITEMS))
        return f"you get {items} (worth {self.deal_points(viewer, deal)} points to you)"

    def private_view(self, role: str) -> dict[str, Any]:
        return {"priorities": list(self.priorities(role)), "values": self.values(role)}

    def system_prompt(self, role: str) -> str:
        assert self.kernel is not None
        partner = other(self.roles, role)
        reasons = self.kernel.data["reasons"][role]
        lines = "\n".join(
            f"- {rank} priority: {item}, {points} points per package. {reason}"
            for rank, item, points, reason in zip(PRIORITY_NAMES, self.priorities(role), PRIORITY_VALUES, reasons)
        )
        example = tag_text("propose", {"food": 2, "water": 1, "firewood": 0})
        return (
            f"You are {role}, going camping. You and {partner} must divide {PACKAGES} packages each of food, water "
            "and firewood; every package goes to one of you.\n"
            f"Your priorities and reasons (private; {partner} does not know them):\n{lines}\n"
            f"The most you can score is {MAX_POINTS} points (all nine packages). {partner} has its own priorities, "
            "which may differ from yours, so trading what you need less for what you need more can help both.\n"
            f"If either of you walks away, you both get {WALKAWAY_POINTS} points. If the message limit is reached "
            "without a deal, you both get 0.\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a division by stating the packages YOU take, e.g. {example} (each 0 to {PACKAGES}; missing "
            f"items mean 0; {partner} gets the rest)\n"
            f"- accept {partner}'s standing proposal: <accept/>\n"
            f"- reject {partner}'s standing proposal: <reject/>\n"
            f"- walk away ({WALKAWAY_POINTS} points each): <walkaway/>\n"
            "A deal is made when one side accepts the other's standing proposal."
        )

"""Deal or No Deal (docs/environments.md 7): divide books, hats and balls with private item values."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from fractions import Fraction
from functools import cache
from typing import Any, ClassVar

from repertory.envs.base import Bot, other
from repertory.envs.grammar import Syntax, integer, json_object
from repertory.envs.negotiation import BotOption, Negotiation, Offer, Standing, aspiration_reply, tag_text
from repertory.envs.parsing import PayloadError, as_integer, parse_fields

ITEMS = ("books", "hats", "balls")
TOTAL_VALUE = 10


@cache
def value_vectors(counts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every value vector in {0..10}^3 with sum(count * value) = 10, sorted."""
    return [v for v in itertools.product(range(11), repeat=3) if sum(c * x for c, x in zip(counts, v)) == TOTAL_VALUE]


def cross_side_ok(a: list[int], b: list[int]) -> bool:
    """No item is worthless to both sides, and some item is worth something to both."""
    return all(x or y for x, y in zip(a, b)) and any(x and y for x, y in zip(a, b))


def share_of(role: str, deal: Standing, counts: list[int]) -> list[int]:
    """What ``role`` receives under ``deal`` (proposals state the proposer's own share)."""
    proposed = [deal.offer[i] for i in ITEMS]
    return proposed if deal.by == role else [c - x for c, x in zip(counts, proposed)]


def bot(view: dict[str, Any]) -> str:
    """Aspiration bot 9/1/6 in either seat."""
    counts, values = view["counts"], view["values"]

    def standing_value(standing: dict[str, Any]) -> int:
        received = [c - standing["offer"][i] for c, i in zip(counts, ITEMS)]
        return sum(v * x for v, x in zip(values, received))

    return aspiration_reply(
        view, _options(tuple(counts), tuple(values)), standing_value, Fraction(9), Fraction(1), Fraction(6)
    )


def splits(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Every division of the items: the proposer's own count of each, in ITEMS order."""
    return list(itertools.product(*(range(c + 1) for c in counts)))


@cache
def _options(counts: tuple[int, ...], values: tuple[int, ...]) -> list[BotOption]:
    out: list[BotOption] = []
    for share in splits(counts):
        offer = dict(zip(ITEMS, share))
        out.append((offer, sum(v * x for v, x in zip(values, share)), sum(share), share))
    return out


class DealOrNoDeal(Negotiation):
    name = "deal-or-no-deal"
    description = "Deal or No Deal: divide books, hats and balls; each side knows only its own item values."
    roles = ("A", "B")
    role_labels = ("A", "B")
    default_trained_role = "A"
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        while True:
            counts = [rng.randint(1, 4) for _ in ITEMS]
            if sum(counts) in (5, 6, 7):
                break
        vectors = value_vectors(tuple(counts))
        while True:
            a, b = list(rng.choice(vectors)), list(rng.choice(vectors))
            if cross_side_ok(a, b):
                break
        return {"items": list(ITEMS), "counts": counts, "values": {"A": a, "B": b}}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            counts, values = data["counts"], data["values"]
            if data["items"] != list(ITEMS):
                return [f"items must be {list(ITEMS)}"]
            problems = []
            if len(counts) != 3 or not all(isinstance(c, int) and 1 <= c <= 4 for c in counts):
                problems.append("counts must be three integers in 1..4")
            elif sum(counts) not in (5, 6, 7):
                problems.append("the item counts must total 5, 6 or 7")
            for role in cls.roles:
                v = values[role]
                if len(v) != 3 or not all(isinstance(x, int) and x >= 0 for x in v):
                    problems.append(f"{role}'s values must be three non-negative integers")
                elif sum(c * x for c, x in zip(counts, v)) != TOTAL_VALUE:
                    problems.append(f"{role}'s items must be worth {TOTAL_VALUE} in total")
            if not problems and not cross_side_ok(values["A"], values["B"]):
                problems.append("some item is worthless to both sides, or no item is valued by both")
            return problems
        except (KeyError, TypeError):
            return ["a kernel needs items, counts and values for A and B"]

    @property
    def counts(self) -> list[int]:
        assert self.kernel is not None
        return self.kernel.data["counts"]

    def values(self, role: str) -> list[int]:
        assert self.kernel is not None
        return self.kernel.data["values"][role]

    def proposal_grid(self, role: str) -> list[Offer]:
        """Every split of the items (at most 5 x 5 x 5)."""
        return [dict(zip(ITEMS, share)) for share in splits(self.counts)]

    def offer_syntax(self, role: str) -> Syntax:
        return json_object([(item, integer(0, count)) for item, count in zip(ITEMS, self.counts)])

    def parse_offer(self, role: str, payload: str) -> Offer:
        fields = parse_fields(payload, ITEMS, required=False)
        offer = {}
        for item, count in zip(ITEMS, self.counts):
            n = as_integer(fields.get(item, 0), item)
            if not 0 <= n <= count:
                raise PayloadError(f"{item} must be between 0 and {count} (there are {count})")
            offer[item] = n
        return offer

    def deal_points(self, role: str, deal: Standing) -> int:
        return sum(v * x for v, x in zip(self.values(role), share_of(role, deal, self.counts)))

    def max_points(self, role: str) -> int:
        return TOTAL_VALUE

    def describe(self, deal: Standing, viewer: str) -> str:
        received = share_of(viewer, deal, self.counts)
        items = ", ".join(f"{n} {item if n != 1 else item[:-1]}" for n, item in zip(received, ITEMS))
        return f"you get {items} (worth {self.deal_points(viewer, deal)} points to you)"

    def private_view(self, role: str) -> dict[str, Any]:
        return {"counts": list(self.counts), "values": list(self.values(role))}

    def system_prompt(self, role: str) -> str:
        partner = other(self.roles, role)
        pool = ", ".join(f"{n} {item}" for n, item in zip(self.counts, ITEMS))
        worth = ", ".join(f"each {item[:-1]} is worth {v}" for item, v in zip(ITEMS, self.values(role)))
        example = tag_text("propose", dict(zip(ITEMS, (self.counts[0], 0, self.counts[2]))))
        return (
            f"You are {role}, negotiating with {partner} over how to divide {pool}. Every item must go to one of "
            f"you.\nTo you, {worth} points; your items are worth {TOTAL_VALUE} points in total. {partner} values "
            "the items differently, and you do not know how. Your goal is to end with as many points as you can; "
            "without a deal you both score 0.\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a division by stating the items YOU take, e.g. {example} (missing items mean 0; "
            f"{partner} gets the rest)\n"
            f"- accept {partner}'s standing proposal: <accept/>\n"
            f"- reject {partner}'s standing proposal: <reject/>\n"
            "- end the negotiation without a deal: <walkaway/>\n"
            "A deal is made when one side accepts the other's standing proposal."
        )

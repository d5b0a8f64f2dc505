"""Split No-Comm (docs/environments.md 3): divide 10 hats, books and balls per round, no messages."""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.base import Bot, IteratedGame, KeyMetric, collective_payoff, fmt, other, proportional_split
from repertory.envs.grammar import Syntax, integer, json_object, tagged
from repertory.envs.parsing import PayloadError, as_integer, clean, last_tag, parse_fields
from repertory.types import Action, Parsed, StepResult

ITEMS = ("hats", "books", "balls")
QUANTITY = 10
PROPOSE = frozenset({"propose"})


def _claim(claim: dict[str, int]) -> str:
    body = ", ".join(f'"{item}": {claim[item]}' for item in ITEMS)
    return f"<propose>{{{body}}}</propose>"


ALL_CLAIMS = [
    _claim({"hats": h, "books": b, "balls": l})
    for h in range(QUANTITY + 1)
    for b in range(QUANTITY + 1)
    for l in range(QUANTITY + 1)
]


def welfare_maximizing(view: dict[str, Any]) -> str:
    own, theirs = view["values"]["own"], view["values"]["other"]
    return _claim({i: 10 if own[i] > theirs[i] else 5 if own[i] == theirs[i] else 0 for i in ITEMS})


def _round_is_valid(a: dict[str, int], b: dict[str, int]) -> bool:
    """Values of 1 or 10, at least one item valued differently, equal totals."""
    in_range = all(v[i] in (1, 10) for v in (a, b) for i in ITEMS)
    return in_range and any(a[i] != b[i] for i in ITEMS) and sum(a[i] for i in ITEMS) == sum(b[i] for i in ITEMS)


class SplitNoComm(IteratedGame):
    name = "split-no-comm"
    description = "Split No-Comm: 10 rounds of dividing 10 hats, books and balls by simultaneous claims."
    roles = ("Alice", "Bob")
    role_labels = ("player", "player")
    default_trained_role = "Alice"
    key_metric = KeyMetric(
        "split_efficiency", "split efficiency", "the splits waste less of the best total", "the splits waste more"
    )
    bots: ClassVar[dict[str, Bot]] = {
        "greedy": lambda view: _claim({i: QUANTITY for i in ITEMS}),
        "welfare-maximizing": welfare_maximizing,
    }

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        rounds = []
        for _ in range(10):
            while True:
                draws = [rng.choice([1, 10]) for _ in range(6)]
                alice, bob = dict(zip(ITEMS, draws[:3])), dict(zip(ITEMS, draws[3:]))
                if _round_is_valid(alice, bob):
                    break
            rounds.append({"Alice": alice, "Bob": bob})
        return {"names": list(cls.roles), "items": list(ITEMS), "quantity": QUANTITY, "values": rounds}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        problems = []
        if data.get("names") != list(cls.roles) or data.get("items") != list(ITEMS) or data.get("quantity") != QUANTITY:
            problems.append(f"names, items and quantity must be {list(cls.roles)}, {list(ITEMS)}, {QUANTITY}")
        return problems + cls._check_rounds(
            data.get("values"),
            "values",
            lambda v: (
                all(v[r][i] in (1, 10) for r in cls.roles for i in ITEMS) and _round_is_valid(v["Alice"], v["Bob"])
            ),
            "values must be 1 or 10, differ on some item and have equal totals",
        )

    @classmethod
    def _n_rounds(cls, data: dict[str, Any]) -> int:
        return len(data["values"])

    def _values(self, r: int) -> dict[str, dict[str, int]]:
        assert self.kernel is not None
        return self.kernel.data["values"][r - 1]

    def _z(self, role: str) -> Fraction:
        return Fraction(sum(QUANTITY * v[role][i] for v in self.kernel.data["values"] for i in ITEMS))  # type: ignore[union-attr]

    def system_prompt(self, role: str) -> str:
        partner = other(self.roles, role)
        return (
            f"You are {role}. Over {self.n_rounds} rounds you and {partner} divide {QUANTITY} hats, "
            f"{QUANTITY} books and {QUANTITY} balls every round. Each of you values each item at 1 or 10 "
            "points per unit; values change every round and both value tables are shown to both players. "
            "There are no messages.\n"
            "Every round you both state at the same time how many units of each item you claim (0 to 10). "
            f"If the two claims for an item add up to {QUANTITY} or less, each gets its claim and the rest is lost; "
            "otherwise the item is shared in proportion to the claims. "
            "Your points are the units you receive times your own values.\n"
            "Your goal is to score as many points as you can over all rounds.\n"
            'To claim, write for example <propose>{"hats": 10, "books": 0, "balls": 5}</propose> '
            "(a missing item means 0). Only your last propose tag counts; an invalid or missing "
            "proposal claims nothing. Your answer is private: the other player only learns your claim."
        )

    def _start_round(self) -> None:
        values = self._values(self.round)
        for role in self.roles:
            partner = other(self.roles, role)
            own = ", ".join(f"{i} {values[role][i]}" for i in ITEMS)
            theirs = ", ".join(f"{i} {values[partner][i]}" for i in ITEMS)
            self.tell(
                role,
                f"Round {self.round} of {self.n_rounds}. Your values: {own}. {partner}'s values: {theirs}. "
                "State your claim.",
            )

    def acting_roles(self) -> list[str]:
        return [] if self.done else list(self.roles)

    def action_choices(self, role: str) -> list[str] | None:
        return ALL_CLAIMS

    def action_syntax(self, role: str) -> Syntax:
        return tagged("propose", json_object([(item, integer(0, QUANTITY)) for item in ITEMS]))

    def parse(self, role: str, text: str) -> Parsed:
        nothing = Action("propose", {i: 0 for i in ITEMS})
        tag = last_tag(clean(text), content_tags=PROPOSE)
        if tag is None:
            return Parsed(nothing, "no <propose> tag; you claim nothing", invalid=True)
        if tag.malformed or tag.payload is None:
            return Parsed(nothing, "the <propose> tag is not closed; you claim nothing", invalid=True)
        try:
            fields = parse_fields(tag.payload, ITEMS, required=False)
            claim = {i: as_integer(fields.get(i, 0), i) for i in ITEMS}
            for item, x in claim.items():
                if not 0 <= x <= QUANTITY:
                    raise PayloadError(f"{item} must be between 0 and {QUANTITY}")
        except PayloadError as exc:
            return Parsed(nothing, f"{exc}; you claim nothing", invalid=True)
        return Parsed(Action("propose", claim))

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        claims = {r: parsed[r].action.value for r in self.roles}  # type: ignore[union-attr]
        values = self._values(self.round)
        received: dict[str, dict[str, Fraction]] = {r: {} for r in self.roles}
        for item in ITEMS:
            for role, q in proportional_split({r: claims[r][item] for r in self.roles}, QUANTITY).items():
                received[role][item] = q
        round_points = {r: sum((received[r][i] * values[r][i] for i in ITEMS), Fraction(0)) for r in self.roles}
        best = sum(QUANTITY * max(values[r][i] for r in self.roles) for i in ITEMS)
        alice, bob = self.roles

        def feedback(role: str) -> str:
            partner = other(self.roles, role)
            return (
                f"Round {self.round}: you claimed {_counts(claims[role])}; "
                f"{partner} claimed {_counts(claims[partner])}. "
                f"You received {_counts(received[role])}, worth {fmt(round_points[role])} points; "
                f"{partner} received {_counts(received[partner])}, worth {fmt(round_points[partner])} points. "
                f"Your total is {fmt(self.points[role])}."
            )

        return self._close_round(
            parsed,
            {"claims": claims, "received": received, "points": round_points, "best": best},
            round_points,
            feedback,
            f"Round {self.round}: {alice} claims {_counts(claims[alice])}, {bob} claims {_counts(claims[bob])} "
            f"-> {fmt(round_points[alice])}/{fmt(round_points[bob])}",
        )

    def view(self, role: str) -> dict[str, Any]:
        partner = other(self.roles, role)
        values = self._values(min(self.round, self.n_rounds))
        history = [
            {"own": h["claims"][role], "other": h["claims"][partner], "points": float(h["points"][role])}
            for h in self.history
        ]
        return {**self._base_view(role), "values": {"own": values[role], "other": values[partner]}, "history": history}

    def metrics(self) -> dict[str, float]:
        best = sum(h["best"] for h in self.history)
        out = collective_payoff(self.history, best_total=best)
        out["split_efficiency"] = out["collective_payoff_normalized"]
        return out


def _counts(units: dict[str, int] | dict[str, Fraction]) -> str:
    return ", ".join(f"{i} {fmt(units[i])}" for i in ITEMS)

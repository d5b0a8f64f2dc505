"""Iterated Prisoner's Dilemma (docs/environments.md 2): 10 simultaneous rounds of A (cooperate) or B."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.base import Bot, IteratedGame, KeyMetric, StrategyFit, collective_payoff, other
from repertory.envs.parsing import clean, last_tag
from repertory.types import Action, Episode, Parsed, StepResult, derive

PAYOFF = {("A", "A"): (3, 3), ("A", "B"): (0, 5), ("B", "A"): (5, 0), ("B", "B"): (1, 1)}
Z = Fraction(50)
CHOOSE = frozenset({"choose"})


def _choice(move: str) -> str:
    return f"<choose>{move}</choose>"


def _partner_moves(view: dict[str, Any]) -> list[str]:
    return [h["other"] for h in view["history"]]


def tit_for_tat(view: dict[str, Any]) -> str:
    moves = _partner_moves(view)
    return _choice(moves[-1] if moves else "A")


def grim_trigger(view: dict[str, Any]) -> str:
    return _choice("B" if "B" in _partner_moves(view) else "A")


def random_bot(view: dict[str, Any]) -> str:
    rng = random.Random(derive(view["kernel_id"], view["episode_seed"], "bot", view["seat"]))
    draws = [rng.random() for _ in range(view["round"])]
    return _choice("A" if draws[-1] < 0.5 else "B")


STRATEGIES: dict[str, Callable[[str, str], str]] = {
    "always-cooperate": lambda own, other: "A",
    "always-defect": lambda own, other: "B",
    "tit-for-tat": lambda own, other: other[-1] if other else "A",
    "suspicious-tit-for-tat": lambda own, other: other[-1] if other else "B",
    "win-stay-lose-shift": lambda own, other: ("A" if own[-1] == other[-1] else "B") if own else "A",
    "grim-trigger": lambda own, other: "B" if "B" in other else "A",
}
"""Classic IPD strategies: the move (A cooperates, B defects) after the player's and its partner's
earlier moves. The order breaks ties in agreement: unconditional strategies first, then those that
remember one round, then grim trigger, which remembers the whole game. Win-stay-lose-shift (Pavlov)
repeats its move after the partner cooperated and switches after it defected."""


def fit_strategy(games: Iterable[tuple[str, str]]) -> StrategyFit:
    """Agreement with each of :data:`STRATEGIES` over games given as (own moves, partner's moves), strings
    of A and B in round order: every own move is compared with what the strategy would have played after the
    same rounds."""
    matches = dict.fromkeys(STRATEGIES, 0)
    moves = 0
    for own, theirs in games:
        for r, move in enumerate(own):
            moves += 1
            for name, strategy in STRATEGIES.items():
                matches[name] += strategy(own[:r], theirs[:r]) == move
    if not moves:
        raise ValueError("no IPD moves to compare with the classic strategies")
    return StrategyFit({name: m / moves for name, m in matches.items()}, moves)


def moves_of(episode: Episode, seat: int) -> tuple[str, str]:
    """The moves of a seat of an IPD episode and those of its partner, in round order."""
    own, theirs = (
        "".join(turn.action.value for turn in episode.trajectory(f"p{s}"))  # type: ignore[union-attr]
        for s in (seat, 1 - seat)
    )
    return own, theirs


class IteratedPrisonersDilemma(IteratedGame):
    name = "ipd"
    description = "Iterated Prisoner's Dilemma: 10 simultaneous rounds of A (cooperate) or B (defect)."
    roles = ("Alice", "Bob")
    role_labels = ("player", "player")
    default_trained_role = "Alice"
    unique_kernels = False
    # Against the always-cooperate bot (the default recipe's evaluation) this is the agent's own cooperation.
    key_metric = KeyMetric("mutual_cooperation_rate", "mutual cooperation", "it cooperates more", "it defects more")
    bots: ClassVar[dict[str, Bot]] = {
        "always-cooperate": lambda view: _choice("A"),
        "always-defect": lambda view: _choice("B"),
        "tit-for-tat": tit_for_tat,
        "grim-trigger": grim_trigger,
        "random": random_bot,
    }

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"names": list(cls.roles), "n_rounds": 10}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        problems = []
        if data.get("names") != list(cls.roles):
            problems.append(f"names must be {list(cls.roles)}")
        n = data.get("n_rounds")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            problems.append("n_rounds must be a positive integer")
        return problems

    @classmethod
    def _n_rounds(cls, data: dict[str, Any]) -> int:
        return data["n_rounds"]

    def _z(self, role: str) -> Fraction:
        return Fraction(5 * self.n_rounds)

    def system_prompt(self, role: str) -> str:
        partner = other(self.roles, role)
        return (
            f"You are {role}. You play a repeated game with {partner} for {self.n_rounds} rounds. "
            "In every round you both choose A or B at the same time, without seeing the other's choice.\n"
            "Points per round: both choose A: 3 each. Both choose B: 1 each. "
            "If one chooses B and the other A, the one who chose B gets 5 and the one who chose A gets 0.\n"
            "Your goal is to score as many points as you can over all rounds.\n"
            "To choose, write <choose>A</choose> or <choose>B</choose>, for example: I pick <choose>A</choose>\n"
            "Only your last choose tag counts, and an answer without a valid choice counts as B. "
            "Your answer is private: the other player only learns which letter you chose."
        )

    def _start_round(self) -> None:
        for role in self.roles:
            self.tell(role, f"Round {self.round} of {self.n_rounds}. Make your choice.")

    def acting_roles(self) -> list[str]:
        return [] if self.done else list(self.roles)

    def action_choices(self, role: str) -> list[str] | None:
        return [_choice("A"), _choice("B")]

    def parse(self, role: str, text: str) -> Parsed:
        tag = last_tag(clean(text), content_tags=CHOOSE)
        if tag is None:
            return Parsed(Action("choose", "B"), "no <choose> tag; counted as B", invalid=True)
        if tag.malformed or tag.payload is None:
            return Parsed(Action("choose", "B"), "the <choose> tag is not closed; counted as B", invalid=True)
        move = tag.payload.strip().upper()
        if move not in ("A", "B"):
            return Parsed(Action("choose", "B"), f"{tag.payload.strip()!r} is not A or B; counted as B", invalid=True)
        return Parsed(Action("choose", move))

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        alice, bob = self.roles
        moves = {r: parsed[r].action.value for r in self.roles}  # type: ignore[union-attr]
        pa, pb = PAYOFF[(moves[alice], moves[bob])]
        round_points = {alice: Fraction(pa), bob: Fraction(pb)}
        partner = {alice: bob, bob: alice}
        return self._close_round(
            parsed,
            {"moves": moves, "points": {alice: pa, bob: pb}},
            round_points,
            lambda role: (
                f"Round {self.round}: you chose {moves[role]}, the other player chose {moves[partner[role]]}. "
                f"You scored {round_points[role]}; your total is {self.points[role]}."
            ),
            f"Round {self.round}: {alice} {moves[alice]}, {bob} {moves[bob]} -> {pa}/{pb}",
        )

    @classmethod
    def strategy_fit(cls, games: list[tuple[Episode, int]]) -> StrategyFit:
        return fit_strategy(moves_of(episode, seat) for episode, seat in games)

    @classmethod
    def turn_quality(cls, episode: Episode) -> dict[tuple[str, int], float]:
        quality = {}
        for seat in (0, 1):
            own, theirs = moves_of(episode, seat)
            for turn, move, partner in zip(episode.trajectory(f"p{seat}"), own, theirs):
                other_move = "B" if move == "A" else "A"
                quality[(turn.seat_id, turn.turn_index)] = float(
                    PAYOFF[(move, partner)][0] - PAYOFF[(other_move, partner)][0]
                )
        return quality

    def view(self, role: str) -> dict[str, Any]:
        partner = other(self.roles, role)
        history = [{"own": h["moves"][role], "other": h["moves"][partner]} for h in self.history]
        return {**self._base_view(role), "history": history}

    def metrics(self) -> dict[str, float]:
        rounds = max(len(self.history), 1)
        out: dict[str, float] = {}
        for role in self.roles:
            out[f"cooperation_rate/{role}"] = sum(h["moves"][role] == "A" for h in self.history) / rounds
        out["mutual_cooperation_rate"] = sum(set(h["moves"].values()) == {"A"} for h in self.history) / rounds
        return {**out, **collective_payoff(self.history, best_total=6 * len(self.history))}

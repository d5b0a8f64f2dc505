"""A base for phased team games: ordered phases in which a subset of the living seats acts, public, team
and private channels, simultaneous votes with a seeded plurality, eliminations and team rewards.

Werewolf (:mod:`repertory.envs.werewolf`) is built on it; Avalon- or Mafia-style games would be small
subclasses. A subclass draws seat names, labels and teams from its kernel (``seat_names``,
``seat_labels``, ``seat_teams``), moves ``self.phase`` and ``self.acting`` along, and ends the game
with :meth:`PhasedGame.finish`.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping

from repertory.envs.base import Env
from repertory.envs.parsing import TagMatch, clean, last_tag
from repertory.types import Action, Parsed, Result

DRAW = "draw"


def acted(parsed: Parsed) -> Action:
    """The action that took effect; a phased game's parse always names one (a no-op is ``pass``)."""
    assert parsed.action is not None, "a phased game's parse returned no action"
    return parsed.action


class PhasedGame(Env):
    """Team game of phases: the living seats of ``self.acting`` act; dead seats never act again.

    ``tell`` takes a channel: :meth:`announce` reaches every living seat (public), :meth:`tell_team` the
    living members of one team (team), :meth:`tell_private` one seat. Each delivered message carries its
    channel, so transcripts and the stored episode show who saw what.
    """

    elimination_discount: float = 0.9
    """rho: a seat eliminated in cycle c of a game that ends in cycle C gets W * rho^(C - c + 1)."""

    def __init__(self, elimination_discount: float | None = None) -> None:
        super().__init__()
        if elimination_discount is not None:
            if not 0.0 < elimination_discount <= 1.0:
                raise ValueError(f"the elimination discount must be in (0, 1] (got {elimination_discount})")
            self.elimination_discount = elimination_discount

    def _start(self) -> None:
        self.team_of: dict[str, str] = dict(zip(self.roles, self.seat_teams(self.kernel.data)))  # type: ignore[union-attr]
        self.alive: set[str] = set(self.roles)
        self.eliminated: dict[str, int] = {}
        self.cycle = 1
        self.phase = ""
        self.acting: list[str] = []
        self.winner: str | None = None
        self._open()

    @abstractmethod
    def _open(self) -> None:
        """Open the first phase of the game."""

    @property
    def done(self) -> bool:
        return self.winner is not None

    @property
    def game_round(self) -> int:
        return self.cycle

    def acting_roles(self) -> list[str]:
        return [] if self.done else [r for r in self.acting if r in self.alive]

    def living(self, team: str | None = None) -> list[str]:
        """Living seats in seat order, of one team or all."""
        return [r for r in self.roles if r in self.alive and (team is None or self.team_of[r] == team)]

    def rotation(self, start: int) -> list[str]:
        """The living seats in seat order from the first living seat at or after seat ``start``, wrapping."""
        n = len(self.roles)
        return [self.roles[(start + k) % n] for k in range(n) if self.roles[(start + k) % n] in self.alive]

    def eliminate(self, roles: Iterable[str]) -> None:
        """Remove seats from play in the current cycle."""
        for role in roles:
            self.alive.discard(role)
            self.eliminated.setdefault(role, self.cycle)

    # -- channels ------------------------------------------------------------------------------------

    def announce(self, text: str, also: Iterable[str] = ()) -> None:
        """Tell every living seat (and ``also``, say the seats that just died) on the public channel."""
        for role in dict.fromkeys([*self.living(), *also]):
            self.tell(role, text, "public")

    def tell_team(self, team: str, text: str, exclude: str | None = None) -> None:
        """Tell the living members of ``team`` (but ``exclude``) on the team channel."""
        for role in self.living(team):
            if role != exclude:
                self.tell(role, text, "team")

    def tell_private(self, role: str, text: str) -> None:
        """Tell one seat on its private channel."""
        self.tell(role, text, "private")

    # -- actions -------------------------------------------------------------------------------------

    def parse_name(
        self,
        text: str,
        tags: frozenset[str],
        legal: Mapping[str, list[str]],
        missing: str,
        passing: bool = False,
    ) -> Parsed:
        """A name action: the last of ``tags`` (or ``<pass/>`` where ``passing``) in ``text``, its payload
        matched trimmed and case-insensitively (docs/environments.md 1.2, rule 8) against ``legal[tag]``.
        Anything else is a no-op that counts as invalid, with a reason naming the legal choices."""
        tag = last_tag(clean(text), content_tags=tags, empty_tags=frozenset({"pass"} if passing else ()))
        if tag is None:
            return self.no_op(missing)
        if tag.name == "pass":
            return Parsed(Action("pass"))
        return self._match_name(tag, legal)

    def _match_name(self, tag: TagMatch, legal: Mapping[str, list[str]]) -> Parsed:
        if tag.malformed or tag.payload is None:
            return self.no_op(f"the <{tag.name}> tag is not closed")
        choices = legal.get(tag.name, [])
        wanted = tag.payload.strip().lower()
        for name in choices:
            if name.lower() == wanted:
                return Parsed(Action(tag.name, name))
        if not choices:
            return self.no_op(f"<{tag.name}> is not possible now")
        return self.no_op(f"{tag.payload.strip()[:40]!r} is not one of {', '.join(choices)}")

    def no_op(self, reason: str) -> Parsed:
        """An invalid or missing action: nothing happens, and it counts in ``n_invalid``."""
        return Parsed(Action("pass"), f"{reason}; nothing was done", invalid=True)

    @staticmethod
    def plurality(votes: Mapping[str, str | None], rng: random.Random | None = None) -> tuple[str | None, Counter[str]]:
        """The most-voted target and the tally (None votes abstain). A tie goes to ``rng.choice`` of the
        sorted tied names, or to nobody without ``rng``; no votes at all elect nobody."""
        tally = Counter(v for v in votes.values() if v is not None)
        if not tally:
            return None, tally
        top = max(tally.values())
        tied = sorted(name for name, n in tally.items() if n == top)
        if len(tied) == 1:
            return tied[0], tally
        return (rng.choice(tied) if rng is not None else None), tally

    # -- the end -------------------------------------------------------------------------------------

    def finish(self, winner: str, reason: str) -> dict[str, float]:
        """End the game with ``winner`` (a team or :data:`DRAW`); every seat's reward is its outcome."""
        self.winner = winner
        self.end_reason = reason
        self.acting = []
        for role in self.roles:
            self.points[role] += int(self.team_of[role] == winner)
        return {role: self.outcome(role) for role in self.roles}

    def outcome(self, role: str) -> float:
        """W for a survivor, W * rho^(C - c + 1) for a seat eliminated in cycle c (0 before the end)."""
        if self.winner is None or self.team_of[role] != self.winner:
            return 0.0
        if role not in self.eliminated:
            return 1.0
        return self.elimination_discount ** (self.cycle - self.eliminated[role] + 1)

    def result(self) -> Result:
        """The result; ``info`` adds the winner, the last cycle, each seat's team and elimination cycle."""
        result = super().result()
        result.info.update(
            winner=self.winner or "",
            cycles=self.cycle,
            teams=dict(self.team_of),
            eliminated=dict(self.eliminated),
        )
        return result

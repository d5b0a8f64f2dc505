"""Which seats share a policy when a model keeps one LoRA adapter per game role or team (``model.adapters``).

:class:`RoleAdapters` names the adapters of a game and routes each seat to its own: by the seat's role label
(``per_role``: vendor and customer; werewolf, seer, witch and villager) or by its team (``per_team``: village and
wolves). The models layer runs the adapters (:mod:`repertory.models.adapters`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from repertory.envs import Env, env_class
from repertory.types import RepertoryError

ADAPTER_MODES = ("shared", "per_role", "per_team")


def adapter_name(kind: str, key: str) -> str:
    """A PEFT-safe adapter name for a role label or team (module names may not hold dots)."""
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9_-]+", "_", key.strip()).strip("_").lower()


@dataclass(frozen=True)
class RoleAdapters:
    """The adapters of one game, one per role label (``by="role"``) or team (``by="team"``), in the game's
    order; ``names[key]`` is the adapter of the seats whose label or team is ``key``."""

    env: str
    by: Literal["role", "team"]
    names: dict[str, str]

    @classmethod
    def of(cls, env: str, mode: str) -> RoleAdapters | None:
        """The adapters ``model.adapters: mode`` gives ``env``'s seats; None for ``shared``. A game whose seats
        all play one role (or that has no teams) is refused: its per-role model would be the shared one."""
        if mode == "shared":
            return None
        if mode not in ADAPTER_MODES:
            raise RepertoryError(f"model.adapters: {mode!r} is not one of {', '.join(ADAPTER_MODES)}")
        game = env_class(env)
        by: Literal["role", "team"] = "role" if mode == "per_role" else "team"
        keys = list(dict.fromkeys(game.role_labels if by == "role" else game.teams))
        if len(keys) < 2:
            what = f"roles ({', '.join(keys)})" if by == "role" else "teams"
            raise RepertoryError(
                f"model.adapters: {mode}: {env} has fewer than two {what}, so every seat would share one adapter; "
                "use model.adapters: shared"
            )
        names = {key: adapter_name(by, key) for key in keys}
        if len(set(names.values())) < len(names):
            raise RepertoryError(f"model.adapters: {mode}: {env}'s {by}s {keys} do not give distinct adapter names")
        return cls(env, by, names)

    @property
    def adapters(self) -> list[str]:
        """Every adapter name, in the game's order of roles or teams."""
        return list(self.names.values())

    def adapter(self, label: str, team: str) -> str:
        """The adapter of a seat with role label ``label`` and team ``team``."""
        key = label if self.by == "role" else team
        if key not in self.names:
            raise RepertoryError(
                f"model.adapters: a seat of {self.env} has {self.by} {key!r}, which has no adapter "
                f"(the adapters are for {', '.join(self.names)})"
            )
        return self.names[key]

    def of_seat(self, game: type[Env], kernel_data: dict[str, Any], seat: int) -> str:
        """The adapter of seat ``seat`` in an episode of ``kernel_data``."""
        teams = game.seat_teams(kernel_data)
        return self.adapter(game.seat_labels(kernel_data)[seat], teams[seat] if teams else "")

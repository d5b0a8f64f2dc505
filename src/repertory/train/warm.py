"""Warm starts (``warm_start`` in a config): before a run trains, the game's bot plays every seat on train
kernels (or each seat in turn against a partner bot), one ``mt-sft`` round imitates its turns, and the run
starts from the exported result.

A small model that never writes a game's action tags has no outcome to learn from; imitating the bot first
gives every method of a comparison the same competent starting policy. The warm start is cached under
``<output_dir>/warm-starts/<env>-<digest>``, the digest covering everything that shapes it (environment and
options, model and adapter, bots, budget, sampling) but not the run's seed or method, so every run of a
comparison reuses it. Each of its steps (demonstrations, the imitation run, the export) is skipped when its
output exists, so an interrupted warm start resumes (:func:`repertory.train.warm_started` runs them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repertory.agents import Agent, Request, Response
from repertory.agents.resolve import make_agent
from repertory.config import TrainConfig
from repertory.envs import env_class
from repertory.envs.parsing import closest_choice
from repertory.rollout import run_episodes, schedule
from repertory.store import write_episodes
from repertory.types import RepertoryError

DEMOS, RUN, MODEL = "demos.parquet", "run", "model"


@dataclass(frozen=True)
class WarmPlan:
    """A run's warm start, derived once from its config: the bot imitated (``warm_start.bot``, else the run's
    opponent if it is a bot of the game, else the game's default partner, else its first bot), the partner it
    plays when that is another bot, whether every seat is imitated, the demonstrations' seatings and the cache
    directory."""

    config: TrainConfig
    bot: str
    partner: str | None
    every_seat: bool
    line_ups: tuple[tuple[tuple[str, ...], int], ...]
    directory: Path

    @classmethod
    def of(cls, config: TrainConfig) -> WarmPlan:
        warm = config.warm_start
        assert warm is not None
        game = env_class(config.rollout.env)
        bots = list(game.bots)
        if not bots:
            raise RepertoryError(f"warm_start imitates a bot, and {config.rollout.env} has none; remove warm_start")
        bot = next((c for c in (warm.bot, config.rollout.opponent, game.default_partner) if c in bots), bots[0])
        partner = warm.partner if warm.partner not in (None, bot) else None
        # Self-play imitates every seat of a game with a trained seat: the policy plays them all.
        every_seat = game.fixed_seat and config.rollout.opponent in ("self", "pool")
        seats, n = len(game.roles), warm.episodes
        if partner is None:
            line_ups: tuple[tuple[tuple[str, ...], int], ...] = (((bot,) * seats, n),)
        else:  # the bot in each seat in turn, the games shared out as evenly as they go
            shares = [n // seats + (s < n % seats) for s in range(seats)]
            line_ups = tuple(
                (tuple(bot if i == s else partner for i in range(seats)), k) for s, k in enumerate(shares) if k
            )
        return cls(config, bot, partner, every_seat, line_ups, _directory(config, bot, partner, every_seat))

    def imitation_config(self) -> TrainConfig:
        """The warm start's own run: one mt-sft round on every demonstration (the trained seat's turns, every
        seat's for self-play) against the bot, then a held-out evaluation (the warm-started policy's score, the
        comparison's base row); with a partner, only the bot's seats."""
        config, warm = self.config, self.config.warm_start
        assert warm is not None
        data: dict[str, Any] = config.model_dump(mode="json")
        data.update(name=RUN, output_dir=str(self.directory), iterations=1, warm_start=None, seed=0, tracking=["jsonl"])
        data["method"] = {
            "kind": "mt-sft",
            "logs": str(self.directory / DEMOS),
            "quantile": 0.0,
            "epochs": warm.epochs,
            "log_seats": "every" if self.every_seat else "trained",
            "log_agent": self.bot if self.partner is not None else None,
        }
        # per-role adapters start from the imitating model; it is built in one process (warm_started)
        data["model"] = {**data["model"], "adapters": "shared", "sharding": "none"}
        data["rollout"] = {**data["rollout"], "opponent": self.bot, "workers": 0}
        data["algo"] = {**data["algo"], "lr": warm.lr, "kl_mode": "loss"}
        return TrainConfig.model_validate(data)

    def write_demonstrations(self, path: Path) -> None:
        """``warm_start.episodes`` games of the bots (:attr:`line_ups`) on train kernels (seed 0), as Parquet;
        with ``rollout.constrained`` the bots answer the nearest constrained choice."""
        rollout = self.config.rollout
        cls = env_class(rollout.env)
        episodes = []
        for index, (names, count) in enumerate(self.line_ups):
            bots: list[Agent] = [make_agent(name, cls) for name in names]
            if rollout.constrained is True:  # a grammar's talk and tags are the bots' own
                bots = [ConstrainedBot(bot) for bot in bots]
            specs = schedule(rollout.env, bots, count, 0, "train", iteration=index, env_options=rollout.env_options)
            episodes.extend(run_episodes(specs))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_episodes(path, episodes)


def _directory(config: TrainConfig, bot: str, partner: str | None, every_seat: bool) -> Path:
    """Where a warm start is cached: its digest covers everything that shapes it, not the run's seed or method."""
    assert config.warm_start is not None
    shape = {
        "env": config.rollout.env,
        "env_options": config.rollout.env_options,
        # one shared model imitates, in one process
        "model": config.model.model_dump(mode="json", exclude={"adapters", "sharding"}),
        "bot": bot,
        "budget": config.warm_start.model_dump(mode="json", exclude={"bot", "partner"}),
        "sampling": [config.rollout.temperature, config.rollout.max_new_tokens, config.rollout.constrained],
        "algo": config.algo.model_dump(mode="json", exclude={"lr"}),
    }
    # Keys only when set, so the warm starts cached before them keep their digest.
    if every_seat:
        shape["seats"] = "every"
    if partner is not None:
        shape["partner"] = partner
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return Path(config.output_dir) / "warm-starts" / f"{config.rollout.env}-{digest}"


class ConstrainedBot:
    """A bot whose every answer is projected onto the seat's constrained choices, where it has them
    (:func:`repertory.envs.parsing.closest_choice`): a constrained run's warm start then imitates answers its
    policy can give, and the bots' games still close deals at the grid's prices."""

    def __init__(self, bot: Agent):
        self.bot = bot
        self.name, self.policy_id = bot.name, bot.policy_id

    def act(self, requests: list[Request]) -> list[Response]:
        return [self._project(r, a) for r, a in zip(requests, self.bot.act(requests), strict=True)]

    def _project(self, request: Request, answer: Response) -> Response:
        if request.choices is None:
            return answer
        choice = closest_choice(answer.text, request.choices)
        if choice is None:
            raise RepertoryError(
                f"warm start: the bot {self.name!r} answered {answer.text!r}, which matches none of the "
                f"{request.role}'s constrained choices; turn rollout.constrained off for this environment"
            )
        return Response(choice)

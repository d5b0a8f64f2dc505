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


def warm_bot(config: TrainConfig) -> str:
    """The bot the warm start imitates: ``warm_start.bot``, else the run's opponent if it is a bot of the game,
    else the game's default partner, else its first bot."""
    assert config.warm_start is not None
    bots = list(env_class(config.rollout.env).bots)
    if not bots:
        raise RepertoryError(f"warm_start imitates a bot, and {config.rollout.env} has none; remove warm_start")
    partner = env_class(config.rollout.env).default_partner
    for choice in (config.warm_start.bot, config.rollout.opponent, partner):
        if choice in bots:
            return choice
    return bots[0]


def warm_partner(config: TrainConfig) -> str | None:
    """The bot the imitated one plays against when it is another (``warm_start.partner``), else None."""
    assert config.warm_start is not None
    partner = config.warm_start.partner
    return partner if partner not in (None, warm_bot(config)) else None


def imitates_every_seat(config: TrainConfig) -> bool:
    """Whether a game with a trained seat is imitated in every seat, not that seat only: for self-play, where
    the policy plays them all (games without a trained seat always imitate every seat)."""
    return env_class(config.rollout.env).fixed_seat and config.rollout.opponent in ("self", "pool")


def warm_dir(config: TrainConfig) -> Path:
    """Where the warm start of ``config`` is cached (shared by every config it would be the same for)."""
    assert config.warm_start is not None
    shape = {
        "env": config.rollout.env,
        "env_options": config.rollout.env_options,
        # one shared model imitates, in one process
        "model": config.model.model_dump(mode="json", exclude={"adapters", "sharding"}),
        "bot": warm_bot(config),
        "budget": config.warm_start.model_dump(mode="json", exclude={"bot", "partner"}),
        "sampling": [config.rollout.temperature, config.rollout.max_new_tokens, config.rollout.constrained],
        "algo": config.algo.model_dump(mode="json", exclude={"lr"}),
    }
    # Keys only when set, so the warm starts cached before them keep their digest.
    if imitates_every_seat(config):
        shape["seats"] = "every"
    if warm_partner(config) is not None:
        shape["partner"] = warm_partner(config)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    return Path(config.output_dir) / "warm-starts" / f"{config.rollout.env}-{digest}"


def imitation_config(config: TrainConfig, directory: Path) -> TrainConfig:
    """The warm start's own run: one mt-sft round on every demonstration (the trained seat's turns, every
    seat's for self-play) against the bot, then a held-out evaluation (the warm-started policy's score, the
    comparison's base row); with a partner, only the bot's seats."""
    assert config.warm_start is not None
    data: dict[str, Any] = config.model_dump(mode="json")
    data.update(name=RUN, output_dir=str(directory), iterations=1, warm_start=None, seed=0, tracking=["jsonl"])
    data["method"] = {
        "kind": "mt-sft",
        "logs": str(directory / DEMOS),
        "quantile": 0.0,
        "epochs": config.warm_start.epochs,
        "log_seats": "every" if imitates_every_seat(config) else "trained",
        "log_agent": warm_bot(config) if warm_partner(config) is not None else None,
    }
    # per-role adapters start from the imitating model; it is built in one process (warm_started)
    data["model"] = {**data["model"], "adapters": "shared", "sharding": "none"}
    data["rollout"] = {**data["rollout"], "opponent": warm_bot(config), "workers": 0}
    data["algo"] = {**data["algo"], "lr": config.warm_start.lr, "kl_mode": "loss"}
    return TrainConfig.model_validate(data)


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


def line_ups(config: TrainConfig) -> list[tuple[list[str], int]]:
    """The demonstrations' seatings and how many games each: the bot in every seat, or with a partner the bot
    in each seat in turn (the partner in the others), the games shared out as evenly as they go."""
    assert config.warm_start is not None
    bot, partner, episodes = warm_bot(config), warm_partner(config), config.warm_start.episodes
    seats = len(env_class(config.rollout.env).roles)
    if partner is None:
        return [([bot] * seats, episodes)]
    shares = [episodes // seats + (s < episodes % seats) for s in range(seats)]
    return [([bot if i == s else partner for i in range(seats)], n) for s, n in enumerate(shares) if n]


def write_demonstrations(config: TrainConfig, path: Path) -> None:
    """``warm_start.episodes`` games of the bots (:func:`line_ups`) on train kernels (seed 0), as Parquet;
    with ``rollout.constrained`` the bots answer the nearest constrained choice."""
    cls = env_class(config.rollout.env)
    episodes = []
    for index, (names, count) in enumerate(line_ups(config)):
        bots: list[Agent] = [make_agent(name, cls) for name in names]
        if config.rollout.constrained:
            bots = [ConstrainedBot(bot) for bot in bots]
        options = config.rollout.env_options
        specs = schedule(config.rollout.env, bots, count, 0, "train", iteration=index, env_options=options)
        episodes.extend(run_episodes(specs))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_episodes(path, episodes)

"""Evaluation: held-out scores of one agent, alone in every seat or against an opponent.

``evaluate`` plays one agent on held-out kernels, either in every seat (self-play) or against an
opponent with the seats balanced, and reports its normalised outcome per role and its expected
discounted return with standard errors; :func:`evaluation_lineup` builds the agent and opponent of
``repertory eval``. This module orchestrates (agents, workers, line-ups); the statistics of played episodes
are :mod:`repertory.eval.scores` (pure), cross-play tournaments :mod:`repertory.eval.crossplay`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from repertory.agents import Agent, LMOptions
from repertory.agents.lm import LMAgent
from repertory.agents.resolve import language_model, make_agent, spec_kind, trained_policy
from repertory.config import TrainConfig
from repertory.envs import Env, env_class
from repertory.eval.scores import (
    GAMMA,
    JudgedStats,
    TeamStats,
    judged_stats,
    mean_metrics,
    seat_scores,
    team_stats,
)
from repertory.rollout import EpisodeSpec, agent_seats, guarded_seats, schedule
from repertory.runs import resolve_checkpoint
from repertory.stats import mean, mean_se
from repertory.types import Episode, Judge, RepertoryError
from repertory.workers import RolloutActors, play

CONCURRENT_SEATS = 128
"""Seats playing at once in an evaluation (64 two-seat games, 21 six-seat ones): every running seat's chat
must fit the generation prefix cache, or each turn prefills its whole chat again."""


@dataclass
class Evaluation:
    """One agent's held-out scores: outcome and points per role it played, the expected discounted
    return (mean of gamma^(n-1) * outcome, n the agent's turns), invalid rate, env metrics."""

    env: str
    agent: str
    opponent: str
    episodes: int
    outcome: dict[str, tuple[float, float]]
    points: dict[str, tuple[float, float]]
    overall: tuple[float, float]
    discounted: tuple[float, float]
    invalid_rate: float
    metrics: dict[str, float]
    gamma: float = GAMMA
    games: dict[str, int] = field(default_factory=dict)
    """How many of the agent's seats each role's outcome averages."""
    teams: dict[str, TeamStats] = field(default_factory=dict)
    judged: JudgedStats | None = None
    """Judge scores and goal checks of the agent's seats (social scenarios)."""
    played: list[Episode] = field(default_factory=list, repr=False)
    seats: list[list[int]] = field(default_factory=list, repr=False)
    """The seats the agent held in each played game."""

    def game_outcomes(self) -> list[float]:
        """Per game played, the mean outcome of the agent's seats, in the order of the games (those the judge
        failed on left out): evaluations with the same seed and count pair game by game."""
        return [
            mean([episode.result.roles[episode.seats[s].name].outcome for s in own])
            for episode, own in zip(self.played, self.seats)
            if not episode.judge_failed
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "env": self.env,
            "agent": self.agent,
            "opponent": self.opponent,
            "episodes": self.episodes,
            "outcome": {r: m for r, (m, _) in self.outcome.items()},
            "outcome_se": {r: s for r, (_, s) in self.outcome.items()},
            "points": {r: m for r, (m, _) in self.points.items()},
            "points_se": {r: s for r, (_, s) in self.points.items()},
            "mean_outcome": self.overall[0],
            "mean_outcome_se": self.overall[1],
            "discounted_return": self.discounted[0],
            "discounted_return_se": self.discounted[1],
            "gamma": self.gamma,
            "games": self.games,
            "invalid_rate": self.invalid_rate,
            "metrics": self.metrics,
            **({"teams": {t: stats.to_json() for t, stats in self.teams.items()}} if self.teams else {}),
            **({"judged": self.judged.to_json()} if self.judged is not None else {}),
        }


def evaluate(
    env: str,
    agent: Agent,
    episodes: int,
    seed: int,
    split: str = "heldout",
    opponent: Agent | None = None,
    iteration: int = 0,
    gamma: float = GAMMA,
    max_concurrent: int | None = None,
    workers: RolloutActors | None = None,
    env_options: dict[str, Any] | None = None,
    judge: Judge | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> Evaluation:
    """Play ``agent`` for ``episodes`` games: in every seat, or against ``opponent``. Facing an
    opponent, the agent sits in the game's trained seat where the game fixes one (negotiations); in a
    team game it plays each team in turn on the same kernel and seed (``episodes`` rounds up to a
    multiple of the teams); else it takes each seat in turn (episode i: seat i mod seats). An opponent
    that is a model is watched by the partner guard. Scores count the agent's seats only. At most
    ``max_concurrent`` games (default: :data:`CONCURRENT_SEATS` seats' worth) run at once, so that every
    running seat's chat stays in the generation prefix cache; with ``workers`` (line-up
    :func:`evaluation_agents`) the games are sharded over Ray actors. ``env_options`` are the game's options;
    a ``judge`` scores the finished games (social scenarios), and games it failed on are counted but left out
    of every mean. ``on_progress(done, total)`` hears of every finished game."""
    if episodes < 1:
        raise RepertoryError(f"the number of evaluation episodes must be at least 1 (got {episodes})")
    cls = env_class(env)
    n_seats = len(cls.roles)
    paired = len(cls.teams) if opponent is not None and cls.teams else 1
    games = schedule(
        env, [agent] * n_seats, -(-episodes // paired), seed, split, iteration=iteration, env_options=env_options
    )
    specs: list[EpisodeSpec] = []
    seats: list[list[int]] = []
    for game in games:
        for side in range(paired):
            spec = replace(game, agents=list(game.agents), episode_id=f"{game.episode_id}/eval-{agent.name}")
            own = list(range(len(cls.seat_names(spec.kernel.data))))
            if opponent is not None:
                own = agent_seats(cls, spec.kernel, len(specs))
                spec.agents = [agent if s in own else opponent for s in range(n_seats)]
                spec.guarded = guarded_seats(cls, spec.agents, own)
            if paired > 1:
                spec.episode_id += f"/{cls.teams[side]}"
            specs.append(spec)
            seats.append(own)
    names = {"agent": agent, **({"opponent": opponent} if opponent is not None else {})}
    if judge is not None and workers is not None:
        raise RepertoryError("a judge cannot score games played by Ray workers yet; evaluate without --workers")
    on_episode = counted(on_progress, len(specs))
    played = play(specs, workers, names, max_concurrent or concurrent_games(cls), on_episode, judge)
    scores = seat_scores(played, lambda i, s: s in seats[i] and not played[i].judge_failed, gamma)
    return Evaluation(
        env=env,
        agent=agent.name,
        opponent=opponent.name if opponent is not None else "self",
        episodes=len(played),
        outcome={r: mean_se(v) for r, v in scores.outcomes.items()},
        points={r: mean_se(v) for r, v in scores.points.items()},
        overall=mean_se([x for v in scores.outcomes.values() for x in v]),
        discounted=mean_se(scores.discounted),
        gamma=gamma,
        invalid_rate=scores.invalid_rate,
        metrics=mean_metrics(played),
        games={r: len(v) for r, v in scores.outcomes.items()},
        teams=team_stats(played, seats),
        judged=judged_stats(played, seats),
        played=played,
        seats=seats,
    )


def counted(on_progress: Callable[[int, int], None] | None, total: int) -> Callable[[Episode], None] | None:
    """An ``on_episode`` callback that reports (games done, ``total``) to ``on_progress``."""
    if on_progress is None:
        return None
    done = 0

    def finished(_: Episode) -> None:
        nonlocal done
        done += 1
        on_progress(done, total)

    on_progress(0, total)
    return finished


def concurrent_games(env: type[Env]) -> int:
    """How many games of ``env`` an evaluation runs at once: :data:`CONCURRENT_SEATS` seats' worth."""
    return max(1, CONCURRENT_SEATS // len(env.roles))


def partner_outcome(result: Evaluation) -> tuple[float, float]:
    """Mean outcome (and standard error) of the opponent's seats in an evaluation against an opponent."""
    if result.opponent == "self":
        raise RepertoryError("a self-play evaluation has no partner")
    scores = seat_scores(result.played, lambda i, s: s not in result.seats[i])
    return mean_se([x for v in scores.outcomes.values() for x in v])


def evaluation_gamma(target: str) -> float:
    """gamma of the expected discounted return of ``repertory eval TARGET``: the run's method's, or 0.95 for
    ``base``."""
    return GAMMA if target == "base" else resolve_checkpoint(target)[1].method.gamma


def _target_config(target: str, env: str | None, model: str) -> TrainConfig:
    if target != "base":
        return resolve_checkpoint(target)[1]
    if env is None:
        raise RepertoryError("--env is required when evaluating 'base'")
    config = TrainConfig()
    config.model.name = model
    return config


def evaluation_env(target: str, env: str | None) -> str:
    """The game ``repertory eval TARGET`` plays: ``env``, else the run's (``base`` needs ``env``)."""
    return env or _target_config(target, env, "smollm2").rollout.env


def evaluation_lineup(
    target: str,
    env: str | None,
    vs: str | None,
    seed: int,
    model: str = "smollm2",
    max_new_tokens: int | None = None,
    constrained: bool | str | None = None,
) -> tuple[LMAgent, Agent | None, str]:
    """The agent under test, its opponent (None: self-play) and the environment of ``repertory eval TARGET``.

    ``target`` is a run or checkpoint directory (its trained policy, sampled as it was trained) or ``base``
    (``model`` untrained, which needs ``env``). ``vs`` defaults to the game's partner; ``self`` is self-play,
    ``base`` the untrained model of the run; ``max_new_tokens`` and ``constrained`` override the run's."""
    config = _target_config(target, env, model)
    env_name = evaluation_env(target, env)
    cls = env_class(env_name)
    vs = vs or cls.default_partner
    rollout = config.rollout
    options = LMOptions(
        config.model.name,
        rollout.temperature,
        1.0,
        max_new_tokens or rollout.max_new_tokens,
        rollout.constrained if constrained is None else constrained,
        seed,
    )
    if target == "base" and vs == "model":  # the same untrained model in the other seat
        vs = "base"
    if vs != "self":
        spec_kind(vs, cls, options)  # before the model under test loads
    if target == "base":
        agent = language_model(model, options, policy_id="live")
    else:
        agent = trained_policy(target, options, policy_id="live")
    opponent = None if vs == "self" else make_agent(vs, cls, replace(options, seed=seed + 1))
    return agent, opponent, env_name


def evaluation_agents(*args: Any) -> dict[str, Agent]:
    """:func:`evaluation_lineup`'s agents by the names :func:`evaluate` gives them (a worker's line-up)."""
    agent, opponent, _ = evaluation_lineup(*args)
    return {"agent": agent, **({"opponent": opponent} if opponent is not None else {})}

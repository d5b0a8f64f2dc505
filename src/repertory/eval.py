"""Evaluation: held-out scores of one agent, and cross-play tournaments among any set of agents.

``evaluate`` plays one agent on held-out kernels, either in every seat (self-play) or against an
opponent with the seats balanced, and reports its normalised outcome per role with standard
errors. In cross-play every ordered pair (row agent in the first seat, column agent in the second) plays the same
kernels with the same episode seeds, so differences between cells come from the agents alone.
All pairs run through the rollout engine together: one batched call per agent per tick.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from repertory.agents import Agent
from repertory.envs import Env, env_class
from repertory.rollout import EpisodeSpec, guarded_seats, run_episodes, schedule
from repertory.types import Episode, RepertoryError, RoleResult


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (unbiased std / sqrt(n); 0 when n < 2)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


DISCOUNT = 0.95
"""gamma per own turn of the I-GRPO metric gamma^(n-1) * outcome (environments.md 1.4)."""


def discounted(role: RoleResult, gamma: float = DISCOUNT) -> float:
    """One game's discounted return: gamma^(n-1) * outcome, n being the role's own turns."""
    return gamma ** max(role.n_turns - 1, 0) * role.outcome


@dataclass
class PairResult:
    """Aggregates of one line-up: per seat mean points and outcome with standard errors, metrics."""

    agents: list[str]
    episodes: int
    points: dict[str, tuple[float, float]]
    outcome: dict[str, tuple[float, float]]
    discounted: dict[str, tuple[float, float]]
    invalid_rate: dict[str, float]
    metrics: dict[str, float]

    def to_json(self) -> dict[str, object]:
        return {
            "agents": self.agents,
            "episodes": self.episodes,
            "points": {r: m for r, (m, _) in self.points.items()},
            "points_se": {r: s for r, (_, s) in self.points.items()},
            "outcome": {r: m for r, (m, _) in self.outcome.items()},
            "outcome_se": {r: s for r, (_, s) in self.outcome.items()},
            "discounted_return": {r: m for r, (m, _) in self.discounted.items()},
            "discounted_return_se": {r: s for r, (_, s) in self.discounted.items()},
            "invalid_rate": self.invalid_rate,
            "metrics": self.metrics,
        }


def summarize(episodes: list[Episode]) -> PairResult:
    """Aggregate episodes that share one line-up."""
    first = episodes[0]
    names = [s.name for s in first.seats]
    invalid = {}
    for n in names:
        turns = sum(ep.result.roles[n].n_turns for ep in episodes)
        invalid[n] = sum(ep.result.roles[n].n_invalid for ep in episodes) / turns if turns else 0.0
    return PairResult(
        agents=[s.agent for s in first.seats],
        episodes=len(episodes),
        points={n: mean_se([ep.result.roles[n].points for ep in episodes]) for n in names},
        outcome={n: mean_se([ep.result.roles[n].outcome for ep in episodes]) for n in names},
        discounted={n: mean_se([discounted(ep.result.roles[n]) for ep in episodes]) for n in names},
        invalid_rate=invalid,
        metrics=mean_metrics(episodes),
    )


@dataclass
class CrossPlay:
    """The cross-play matrix of one environment: ``cells[(row, col)]`` and per-agent mean outcome."""

    env: str
    agents: list[str]
    cells: dict[tuple[str, str], PairResult]
    episodes: list[Episode] = field(default_factory=list, repr=False)

    def agent_outcome(self, agent: str) -> float:
        """Mean outcome of ``agent`` over all its games, in either seat."""
        values = [
            ep.result.roles[seat.name].outcome for ep in self.episodes for seat in ep.seats if seat.agent == agent
        ]
        return sum(values) / len(values)

    def to_json(self) -> dict[str, object]:
        return {
            "env": self.env,
            "agents": self.agents,
            "pairs": [cell.to_json() for cell in self.cells.values()],
            "mean_outcome": {a: self.agent_outcome(a) for a in self.agents},
        }


def crossplay(
    env: str,
    agents: dict[str, Agent],
    episodes: int,
    seed: int,
    split: str = "heldout",
    on_episode: Callable[[Episode], None] | None = None,
) -> CrossPlay:
    """Play every ordered pair of two-seat line-ups from ``agents`` for ``episodes`` games each."""
    cls = env_class(env)
    if len(cls.roles) != 2:
        raise ValueError(f"cross-play needs a two-seat environment; {env} has {len(cls.roles)} seats")
    pairs = [(a, b) for a in agents for b in agents]
    specs = []
    trained = cls.roles.index(cls.default_trained_role)
    for a, b in pairs:
        for spec in schedule(env, [agents[a], agents[b]], episodes, seed, split):
            spec.episode_id = f"{spec.episode_id}/{a}-vs-{b}"
            spec.guarded = guarded_seats(cls, spec.agents, trained)
            specs.append(spec)
    played = run_episodes(specs, on_episode=on_episode)
    cells = {pair: summarize(played[i * episodes : (i + 1) * episodes]) for i, pair in enumerate(pairs)}
    return CrossPlay(env, list(agents), cells, played)


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
    gamma: float = DISCOUNT
    played: list[Episode] = field(default_factory=list, repr=False)

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
            "invalid_rate": self.invalid_rate,
            "metrics": self.metrics,
        }


def evaluate(
    env: str,
    agent: Agent,
    episodes: int,
    seed: int,
    split: str = "heldout",
    opponent: Agent | None = None,
    iteration: int = 0,
    gamma: float = DISCOUNT,
    max_concurrent: int = 64,
) -> Evaluation:
    """Play ``agent`` for ``episodes`` games: in every seat, or against ``opponent``. Facing an
    opponent, the agent sits in the game's trained seat where the game fixes one (negotiations),
    else takes each seat in turn (episode i: seat i mod seats); an opponent that is a model is
    watched by the partner guard. Scores count the agent's seats only. At most ``max_concurrent``
    games run at once, so that every running seat's chat stays in the generation prefix cache."""
    if episodes < 1:
        raise RepertoryError(f"the number of evaluation episodes must be at least 1 (got {episodes})")
    cls = env_class(env)
    n_seats = len(cls.roles)
    specs: list[EpisodeSpec] = []
    for i, spec in enumerate(schedule(env, [agent] * n_seats, episodes, seed, split, iteration=iteration)):
        spec.episode_id = f"{spec.episode_id}/eval-{agent.name}"
        if opponent is not None:
            live = agent_seat(cls, i)
            spec.agents = [agent if s == live else opponent for s in range(n_seats)]
            spec.guarded = guarded_seats(cls, spec.agents, live)
        specs.append(spec)
    played = run_episodes(specs, max_concurrent=max_concurrent)
    scores = seat_scores(played, lambda i, s: opponent is None or s == agent_seat(cls, i), gamma)
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
        played=played,
    )


@dataclass
class SeatScores:
    """Outcomes and points per role (display name) over the selected seats, and their invalid actions."""

    outcomes: dict[str, list[float]] = field(default_factory=dict)
    points: dict[str, list[float]] = field(default_factory=dict)
    discounted: list[float] = field(default_factory=list)
    invalid: int = 0
    turns: int = 0

    @property
    def invalid_rate(self) -> float:
        return self.invalid / self.turns if self.turns else 0.0


def agent_seat(env: type[Env], episode_index: int) -> int:
    """The seat a single agent facing an opponent takes in an episode (see ``evaluate``)."""
    if env.fixed_seat:
        return env.roles.index(env.default_trained_role)
    return episode_index % len(env.roles)


def seat_scores(episodes: list[Episode], selected: Callable[[int, int], bool], gamma: float = DISCOUNT) -> SeatScores:
    """Scores of the seats for which ``selected(episode_index, seat_index)`` holds."""
    scores = SeatScores()
    for i, ep in enumerate(episodes):
        for s, seat in enumerate(ep.seats):
            if not selected(i, s):
                continue
            role = ep.result.roles[seat.name]
            scores.outcomes.setdefault(seat.name, []).append(role.outcome)
            scores.points.setdefault(seat.name, []).append(role.points)
            scores.discounted.append(discounted(role, gamma))
            scores.invalid += role.n_invalid
            scores.turns += role.n_turns
    return scores


def mean_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Each environment metric averaged over the episodes that report it."""
    names = sorted({k for ep in episodes for k in ep.metrics})
    return {
        k: sum(ep.metrics[k] for ep in episodes if k in ep.metrics) / sum(k in ep.metrics for ep in episodes)
        for k in names
    }

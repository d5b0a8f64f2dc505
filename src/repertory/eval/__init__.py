"""Evaluation: held-out scores of one agent, alone in every seat or against an opponent.

``evaluate`` plays one agent on held-out kernels, either in every seat (self-play) or against an
opponent with the seats balanced, and reports its normalised outcome per role and its expected
discounted return with standard errors; :func:`evaluation_lineup` builds the agent and opponent of
``repertory eval``. Cross-play tournaments are :mod:`repertory.eval.crossplay`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from repertory.agents import Agent, LMOptions
from repertory.agents.lm import LMAgent
from repertory.agents.resolve import language_model, make_agent, trained_policy
from repertory.config import TrainConfig
from repertory.envs import Env, env_class
from repertory.rollout import EpisodeSpec, agent_seats, guarded_seats, schedule
from repertory.runs import resolve_checkpoint
from repertory.stats import mean_se
from repertory.types import Episode, Judge, RepertoryError, RoleResult
from repertory.workers import WorkerPool, play

CONCURRENT_SEATS = 128
"""Seats playing at once in an evaluation (64 two-seat games, 21 six-seat ones): every running seat's chat
must fit the generation prefix cache, or each turn prefills its whole chat again."""

DISCOUNT = 0.95
"""gamma per own turn of the I-GRPO metric gamma^(n-1) * outcome (docs/environments.md 1.4)."""


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
    games: dict[str, int] = field(default_factory=dict)
    """How many of the agent's seats each role's outcome averages."""
    teams: dict[str, TeamStats] = field(default_factory=dict)
    judged: JudgedStats | None = None
    """Judge scores and goal checks of the agent's seats (social scenarios)."""
    played: list[Episode] = field(default_factory=list, repr=False)
    seats: list[list[int]] = field(default_factory=list, repr=False)
    """The seats the agent held in each played game."""

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


@dataclass
class JudgedStats:
    """The agent's seats in judge-scored games: each judge scale, the overall score (mean of the seven) and the
    fine-grained metrics, mean and standard error over seats; the goal-check and secret-kept rates; and the
    episodes the judge failed on (left out of every mean)."""

    seats: int
    dimensions: dict[str, tuple[float, float]]
    overall: tuple[float, float] | None
    fine_grained: dict[str, tuple[float, float]]
    goal_verified: tuple[float, float] | None
    secret_kept: tuple[float, float] | None
    judge_failed: int

    def to_json(self) -> dict[str, object]:
        def flat(values: dict[str, tuple[float, float]]) -> dict[str, float]:
            return {k: v for name, (m, se) in values.items() for k, v in ((name, m), (f"{name}_se", se))}

        return {
            "seats": self.seats,
            "dimensions": flat(self.dimensions),
            "overall": self.overall,
            "fine_grained": flat(self.fine_grained),
            "goal_verified": self.goal_verified,
            "secret_kept": self.secret_kept,
            "judge_failed": self.judge_failed,
        }


def judged_stats(episodes: list[Episode], seats: list[list[int]]) -> JudgedStats | None:
    """:class:`JudgedStats` of ``seats[i]`` of game i; None for games without goal checks or judges."""
    if not episodes or "goal_verified" not in episodes[0].result.info:
        return None
    dims: dict[str, list[float]] = {}
    fine: dict[str, list[float]] = {}
    overall: list[float] = []
    verified: list[float] = []
    kept: list[float] = []
    n = 0
    for ep, own in zip(episodes, seats):
        if ep.judge_failed:
            continue
        info = ep.result.info
        for s in own:
            name = ep.seats[s].name
            n += 1
            if info["goal_verified"].get(name) is not None:
                verified.append(info["goal_verified"][name])
            if info["secret_kept"].get(name) is not None:
                kept.append(info["secret_kept"][name])
            scores = (info.get("judge") or {}).get(name)
            if scores:
                for k, v in scores.items():
                    dims.setdefault(k, []).append(v)
                overall.append(sum(scores.values()) / len(scores))
            for k, v in ((info.get("fine_grained") or {}).get(name) or {}).items():
                fine.setdefault(k, []).append(v)
    return JudgedStats(
        seats=n,
        dimensions={k: mean_se(v) for k, v in dims.items()},
        overall=mean_se(overall) if overall else None,
        fine_grained={k: mean_se(v) for k, v in fine.items()},
        goal_verified=mean_se(verified) if verified else None,
        secret_kept=mean_se(kept) if kept else None,
        judge_failed=sum(ep.judge_failed for ep in episodes),
    )


def judged_lines(stats: JudgedStats) -> dict[str, float]:
    """Flat metrics of :class:`JudgedStats`: ``judge/DIMENSION``, ``judge/overall``, ``fine/METRIC``,
    ``goal_verified``, ``secret_kept`` and ``judge_failed``."""
    out = {f"judge/{k}": m for k, (m, _) in stats.dimensions.items()}
    out.update({f"fine/{k}": m for k, (m, _) in stats.fine_grained.items()})
    rates = {"judge/overall": stats.overall, "goal_verified": stats.goal_verified, "secret_kept": stats.secret_kept}
    for key, value in rates.items():
        if value is not None:
            out[key] = value[0]
    out["judge_failed"] = float(stats.judge_failed)
    return out


@dataclass
class TeamStats:
    """One team's record in a team game, over the games the agent played on it: win rate and draws with
    standard errors, the agent's invalid rate on that team, and the environment's metrics of those games."""

    team: str
    episodes: int
    win_rate: tuple[float, float]
    draw_rate: tuple[float, float]
    invalid_rate: float
    metrics: dict[str, float]

    def to_json(self) -> dict[str, object]:
        return {
            "episodes": self.episodes,
            "win_rate": self.win_rate[0],
            "win_rate_se": self.win_rate[1],
            "draw_rate": self.draw_rate[0],
            "draw_rate_se": self.draw_rate[1],
            "invalid_rate": self.invalid_rate,
            "metrics": self.metrics,
        }


def team_stats(episodes: list[Episode], seats: list[list[int]]) -> dict[str, TeamStats]:
    """Per team, the record of the games in which ``seats[i]`` of game i (the agent's) played on it; a
    self-play game counts for every team. Empty for games without teams."""
    cls = env_class(episodes[0].env) if episodes else None
    if cls is None or not cls.teams:
        return {}
    out = {}
    for name in cls.teams:
        games, invalid, turns = [], 0, 0
        for ep, own in zip(episodes, seats):
            team_of = cls.seat_teams(ep.kernel.data)
            mine = [s for s in own if team_of[s] == name]
            if not mine:
                continue
            games.append(ep)
            invalid += sum(ep.result.roles[ep.seats[s].name].n_invalid for s in mine)
            turns += sum(ep.result.roles[ep.seats[s].name].n_turns for s in mine)
        if games:
            out[name] = TeamStats(
                team=name,
                episodes=len(games),
                win_rate=mean_se([float(ep.result.info.get("winner") == name) for ep in games]),
                draw_rate=mean_se([float(ep.result.info.get("winner") == "draw") for ep in games]),
                invalid_rate=invalid / turns if turns else 0.0,
                metrics=mean_metrics(games),
            )
    return out


def evaluate(
    env: str,
    agent: Agent,
    episodes: int,
    seed: int,
    split: str = "heldout",
    opponent: Agent | None = None,
    iteration: int = 0,
    gamma: float = DISCOUNT,
    max_concurrent: int | None = None,
    workers: WorkerPool | None = None,
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


@dataclass
class SeatScores:
    """Outcomes and points per role (display name; game role in team games) over the selected seats, and
    their invalid actions."""

    outcomes: dict[str, list[float]] = field(default_factory=dict)
    points: dict[str, list[float]] = field(default_factory=dict)
    discounted: list[float] = field(default_factory=list)
    invalid: int = 0
    turns: int = 0

    @property
    def invalid_rate(self) -> float:
        return self.invalid / self.turns if self.turns else 0.0


def partner_outcome(result: Evaluation) -> tuple[float, float]:
    """Mean outcome (and standard error) of the opponent's seats in an evaluation against an opponent."""
    if result.opponent == "self":
        raise RepertoryError("a self-play evaluation has no partner")
    scores = seat_scores(result.played, lambda i, s: s not in result.seats[i])
    return mean_se([x for v in scores.outcomes.values() for x in v])


def seat_scores(episodes: list[Episode], selected: Callable[[int, int], bool], gamma: float = DISCOUNT) -> SeatScores:
    """Scores of the seats for which ``selected(episode_index, seat_index)`` holds."""
    scores = SeatScores()
    for i, ep in enumerate(episodes):
        # Team games deal roles to kernel-given names: score per game role (seer, witch, ...), not per name.
        by_label = env_class(ep.env).scored_by_label
        for s, seat in enumerate(ep.seats):
            if not selected(i, s):
                continue
            role = ep.result.roles[seat.name]
            key = seat.role if by_label else seat.name
            scores.outcomes.setdefault(key, []).append(role.outcome)
            scores.points.setdefault(key, []).append(role.points)
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


def rollout_metrics(episodes: list[Episode]) -> dict[str, float]:
    """A training batch's metrics: episodes, mean outcome and points of the trained seats per role, invalid
    rate and the environment's metrics."""
    scores = seat_scores(episodes, lambda i, s: episodes[i].seats[s].trainable and not episodes[i].judge_failed)
    line: dict[str, float] = {"episodes": len(episodes)}
    all_outcomes = [x for v in scores.outcomes.values() for x in v]
    line["outcome"] = sum(all_outcomes) / len(all_outcomes) if all_outcomes else 0.0
    for name in sorted(scores.outcomes):
        line[f"outcome/{name}"] = sum(scores.outcomes[name]) / len(scores.outcomes[name])
        line[f"points/{name}"] = sum(scores.points[name]) / len(scores.points[name])
    line["invalid_rate"] = scores.invalid_rate
    trained = [[s for s, seat in enumerate(ep.seats) if seat.trainable] for ep in episodes]
    line.update(team_lines(team_stats(episodes, trained)))
    judged = judged_stats(episodes, trained)
    if judged is not None:
        line.update(judged_lines(judged))
    line.update({f"env/{k}": v for k, v in mean_metrics(episodes).items()})
    return line


def team_lines(teams: dict[str, TeamStats]) -> dict[str, float]:
    """Flat metrics of per-team records: ``team/TEAM/win_rate``, ``draw_rate`` and ``games``."""
    out = {}
    for name, stats in teams.items():
        out[f"team/{name}/win_rate"] = stats.win_rate[0]
        out[f"team/{name}/draw_rate"] = stats.draw_rate[0]
        out[f"team/{name}/games"] = float(stats.episodes)
    return out



def evaluation_lineup(
    target: str,
    env: str | None,
    vs: str | None,
    seed: int,
    model: str = "smollm2",
    max_new_tokens: int | None = None,
    constrained: bool | None = None,
) -> tuple[LMAgent, Agent | None, str]:
    """The agent under test, its opponent (None: self-play) and the environment of ``repertory eval TARGET``.

    ``target`` is a run or checkpoint directory (its trained policy, sampled as it was trained) or ``base``
    (``model`` untrained, which needs ``env``). ``vs`` defaults to the game's partner; ``self`` is self-play,
    ``base`` the untrained model of the run; ``max_new_tokens`` and ``constrained`` override the run's."""
    if target == "base":
        if env is None:
            raise RepertoryError("--env is required when evaluating 'base'")
        config = TrainConfig()
        config.model.name = model
    else:
        config = resolve_checkpoint(target)[1]
    env_name = env or config.rollout.env
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
    if target == "base":
        agent = language_model(model, options, policy_id="live")
        if vs == "model":  # the same untrained model in the other seat
            vs = "base"
    else:
        agent = trained_policy(target, options, policy_id="live")
    opponent = None if vs == "self" else make_agent(vs, cls, replace(options, seed=seed + 1))
    return agent, opponent, env_name


def evaluation_agents(*args: Any) -> dict[str, Agent]:
    """:func:`evaluation_lineup`'s agents by the names :func:`evaluate` gives them (a worker's line-up)."""
    agent, opponent, _ = evaluation_lineup(*args)
    return {"agent": agent, **({"opponent": opponent} if opponent is not None else {})}

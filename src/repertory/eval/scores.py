"""Scores of played episodes: pure statistics of :class:`~repertory.types.Episode` lists, with no agents,
workers or models. Per-seat outcomes, points and discounted returns, per-team records, judge scores, and the
metrics lines a training iteration and an evaluation write. What a game measures comes from the game
(``Env.metrics``, ``Result.info``, ``Env.teams``), never from its name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from repertory.envs import env_class
from repertory.stats import mean_se
from repertory.types import Episode, RoleResult

GAMMA = 0.95
"""gamma per own turn of the I-GRPO metric gamma^(n-1) * outcome (docs/environments.md 1.4)."""


def discounted(role: RoleResult, gamma: float = GAMMA) -> float:
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
    games: dict[str, int] = field(default_factory=dict)
    """Games per seat: fewer than ``episodes`` for a seat some kernels leave empty."""

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
    """Aggregate episodes that share one line-up, per seat. Seats are keyed by the game's seat names
    (``Env.roles``: Alice, vendor), which are the display names where they are fixed and the seat index (p0, p1,
    ...) where each kernel names its seats (Werewolf, social scenarios); a seat a kernel leaves empty (a
    two-person scenario's third) counts only the games it played."""
    seat_keys = env_class(episodes[0].env).roles
    played: dict[str, list[RoleResult]] = {}
    agents: dict[str, str] = {}
    for ep in episodes:
        for i, seat in enumerate(ep.seats):
            played.setdefault(seat_keys[i], []).append(ep.result.roles[seat.name])
            agents.setdefault(seat_keys[i], seat.agent)
    invalid = {}
    for key, results in played.items():
        turns = sum(r.n_turns for r in results)
        invalid[key] = sum(r.n_invalid for r in results) / turns if turns else 0.0
    return PairResult(
        agents=list(agents.values()),
        episodes=len(episodes),
        points={key: mean_se([r.points for r in results]) for key, results in played.items()},
        outcome={key: mean_se([r.outcome for r in results]) for key, results in played.items()},
        discounted={key: mean_se([discounted(r) for r in results]) for key, results in played.items()},
        invalid_rate=invalid,
        metrics=mean_metrics(episodes),
        games={key: len(results) for key, results in played.items()},
    )


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


def seat_scores(episodes: list[Episode], selected: Callable[[int, int], bool], gamma: float = GAMMA) -> SeatScores:
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

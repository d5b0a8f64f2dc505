"""Cross-play tournaments among any set of agents and their game-theoretic summary (docs/algorithms.md 8.2, 8.4).

Cross-play sets two sides against each other: the seats of a two-seat game, or the teams of a team game
(every seat of a team goes to one agent). Every ordered pair (row agent on the first side, column agent on the
second) plays the same kernels with the same episode seeds, so differences between cells come from the agents
alone, and cells (a, b) and (b, a) play each game with the sides swapped. All pairs run through the rollout
engine together: one batched call per agent per tick. ``crossplay_report`` turns a cross-play into the
outcome matrix M and welfare matrix W over both side assignments, Bradley-Terry ratings, metrics per agent
(cooperation, or each team's record) and, in the prisoner's dilemma, the classic strategy each agent plays
most like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from repertory.agents import Agent, LMOptions
from repertory.agents.resolve import make_agent
from repertory.envs import Env, env_class
from repertory.envs.base import StrategyFit
from repertory.eval import concurrent_games, counted
from repertory.eval.scores import PairResult, TeamStats, discounted, mean_metrics, summarize, team_stats
from repertory.rollout import agent_seats, guarded_seats, schedule
from repertory.stats import mean_se
from repertory.types import Episode, Kernel, RepertoryError, RoleResult
from repertory.workers import RolloutActors, play

Matrix = dict[str, dict[str, tuple[float, float]]]
"""``matrix[a][b]``: mean and standard error of a quantity for row agent ``a`` against column agent ``b``."""


def sides(env: type[Env]) -> tuple[str, ...]:
    """The sides cross-play sets against each other: the teams of a team game, else the seats (roles)."""
    return env.teams or env.roles


def side_seats(env: type[Env], kernel: Kernel, side: int) -> list[int]:
    """The seat indices of side ``side`` on ``kernel``: that seat, or every seat the kernel deals to that team."""
    return agent_seats(env, kernel, side) if env.teams else [side]


def check_sides(env: type[Env]) -> None:
    """Cross-play needs exactly two sides: a two-seat game or a game of two teams."""
    if len(sides(env)) != 2:
        kind = "teams" if env.teams else "seats"
        raise RepertoryError(
            f"cross-play needs a two-seat or two-team environment; {env.name} has {len(sides(env))} {kind}"
        )


@dataclass
class CrossPlay:
    """The cross-play matrix of one environment: ``cells[(row, col)]`` and per-agent mean outcome.

    ``games[(row, col)]`` holds the episodes of a cell, the row agent on the first side; in a team game a
    cell's aggregates are per team (:func:`summarize_teams`)."""

    env: str
    agents: list[str]
    cells: dict[tuple[str, str], PairResult]
    episodes: list[Episode] = field(default_factory=list, repr=False)
    games: dict[tuple[str, str], list[Episode]] = field(default_factory=dict, repr=False)

    def sides_of(self, agent: str) -> list[tuple[Episode, list[int]]]:
        """Every (episode, seats of one side) ``agent`` played, on either side of any cell; a self-play
        game once per side."""
        cls = env_class(self.env)
        return [
            (ep, side_seats(cls, ep.kernel, side))
            for pair, episodes in self.games.items()
            for side, name in enumerate(pair)
            if name == agent
            for ep in episodes
        ]

    def seats_of(self, agent: str) -> list[tuple[Episode, int]]:
        """Every (episode, seat index) ``agent`` played, on either side of any cell."""
        return [(ep, seat) for ep, seats in self.sides_of(agent) for seat in seats]

    def meetings(self, a: str, b: str) -> list[tuple[Episode, list[list[int]]]]:
        """Every game between ``a`` and ``b`` with the seats of a's sides: the first in cell (a, b), the
        second in cell (b, a), both in self-play."""
        cls = env_class(self.env)
        if a == b:
            return [(ep, [side_seats(cls, ep.kernel, side) for side in (0, 1)]) for ep in self.games[(a, a)]]
        return [(ep, [side_seats(cls, ep.kernel, 0)]) for ep in self.games[(a, b)]] + [
            (ep, [side_seats(cls, ep.kernel, 1)]) for ep in self.games[(b, a)]
        ]

    def agent_outcome(self, agent: str) -> float:
        """Mean outcome of ``agent`` over all its games, on either side; a side's outcome in a game is the
        mean over its seats, so that each team weighs the same whatever its size."""
        values = [side_outcome(ep, seats) for ep, seats in self.sides_of(agent)]
        return sum(values) / len(values)

    def team_records(self, agent: str) -> dict[str, TeamStats]:
        """Per team, ``agent``'s record over all its games on that team; empty for a two-seat game."""
        played = self.sides_of(agent)
        return team_stats([ep for ep, _ in played], [seats for _, seats in played])

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "env": self.env,
            "agents": self.agents,
            "pairs": [cell.to_json() for cell in self.cells.values()],
            "mean_outcome": {a: self.agent_outcome(a) for a in self.agents},
        }
        if env_class(self.env).teams:
            data["teams"] = {a: {t: r.to_json() for t, r in self.team_records(a).items()} for a in self.agents}
        return data


def side_outcome(ep: Episode, seats: list[int]) -> float:
    """The mean outcome of ``seats`` in ``ep``."""
    return sum(ep.result.roles[ep.seats[s].name].outcome for s in seats) / len(seats)


def summarize_teams(env: type[Env], episodes: list[Episode]) -> PairResult:
    """Aggregate episodes of a team game that share one agent per team, keyed by team (seat names change
    with the kernel): the mean over games of the team's seats' mean points (its win rate), outcome and
    discounted return, with standard errors, the team's invalid rate, and the games' metrics."""
    roles = {
        team: [[ep.result.roles[ep.seats[s].name] for s in side_seats(env, ep.kernel, side)] for ep in episodes]
        for side, team in enumerate(env.teams)
    }

    def per_game(team: str, value: Callable[[RoleResult], float]) -> tuple[float, float]:
        return mean_se([sum(map(value, game)) / len(game) for game in roles[team]])

    def invalid_rate(team: str) -> float:
        turns = sum(r.n_turns for game in roles[team] for r in game)
        return sum(r.n_invalid for game in roles[team] for r in game) / turns if turns else 0.0

    first = episodes[0]
    return PairResult(
        agents=[first.seats[side_seats(env, first.kernel, side)[0]].agent for side in range(len(env.teams))],
        episodes=len(episodes),
        points={t: per_game(t, lambda r: r.points) for t in env.teams},
        outcome={t: per_game(t, lambda r: r.outcome) for t in env.teams},
        discounted={t: per_game(t, discounted) for t in env.teams},
        invalid_rate={t: invalid_rate(t) for t in env.teams},
        metrics=mean_metrics(episodes),
        games={t: len(episodes) for t in env.teams},
    )


def crossplay(
    env: str,
    agents: dict[str, Agent],
    episodes: int,
    seed: int,
    split: str = "heldout",
    on_progress: Callable[[int, int], None] | None = None,
    max_concurrent: int | None = None,
    workers: RolloutActors | None = None,
) -> CrossPlay:
    """Play every ordered pair of ``agents``, the row agent on the first side (seat or team) and the column
    agent on the second, for ``episodes`` games each, at most ``max_concurrent`` games at once so that every
    running seat's chat stays in the prefix cache; ``on_progress(done, total)`` hears of every finished game."""
    cls = env_class(env)
    check_sides(cls)
    pairs = [(a, b) for a in agents for b in agents]
    specs = []
    trained = cls.roles.index(cls.default_trained_role)
    for a, b in pairs:
        for spec in schedule(env, [agents[a]] * len(cls.roles), episodes, seed, split):
            row = side_seats(cls, spec.kernel, 0)
            spec.agents = [agents[a] if s in row else agents[b] for s in range(len(cls.roles))]
            spec.episode_id = f"{spec.episode_id}/{a}-vs-{b}"
            spec.guarded = guarded_seats(cls, spec.agents, [trained])
            specs.append(spec)
    played = play(specs, workers, agents, max_concurrent or concurrent_games(cls), counted(on_progress, len(specs)))
    games = {pair: played[i * episodes : (i + 1) * episodes] for i, pair in enumerate(pairs)}
    cells = {pair: summarize_teams(cls, cell) if cls.teams else summarize(cell) for pair, cell in games.items()}
    return CrossPlay(env, list(agents), cells, played, games)


WELFARE = "collective_payoff_normalized"
"""The episode metric W averages: the collective payoff as a share of the best possible welfare, which
every round game reports (in Split No-Comm it is the split efficiency)."""


@dataclass
class Ratings:
    """Bradley-Terry ratings (docs/algorithms.md 8.2): ``R = 1000 + 400 log10(pi / pi_anchor)`` within each
    connected component of the played pairs; ``anchors[c]`` is the member of component c rated 1000.
    ``games`` and ``score`` count the rated games (self-play and virtual draws excluded)."""

    rating: dict[str, float]
    component: dict[str, int]
    anchors: list[str]
    games: dict[str, int]
    score: dict[str, float]
    requested_anchor: str | None = None

    @property
    def connected(self) -> bool:
        return len(self.anchors) == 1

    def notes(self) -> list[str]:
        """What a reader must know before comparing ratings: components, and an anchor other than the requested one."""
        notes = []
        if self.requested_anchor not in self.rating:
            missing = f"{self.requested_anchor} is not in the line-up" if self.requested_anchor else "no anchor given"
            notes.append(
                f"{missing}: rated 1000 is the best-connected member (most distinct opponents, then most games, "
                f"then first in the line-up): {', '.join(self.anchors)}"
            )
        if not self.connected:
            notes.append(
                f"the line-up is not connected through played pairs: ratings are fitted per component "
                f"({len(self.anchors)}), each anchored (1000) on {', '.join(self.anchors)}, and compare only within one"
            )
        return notes

    def to_json(self) -> dict[str, object]:
        return {
            "rating": self.rating,
            "component": self.component,
            "anchors": self.anchors,
            "connected": self.connected,
            "games": self.games,
            "score": self.score,
            "notes": self.notes(),
        }


MM_TOLERANCE = 1e-12


MM_MAX_ITERATIONS = 1_000_000


def bradley_terry(
    names: list[str], games: Iterable[tuple[str, str, float]], prior: bool = True, anchor: str | None = None
) -> Ratings:
    """Bradley-Terry ratings of ``names`` from games ``(a, b, score of a)``, the score 1, 0.5 or 0.

    Fitted by MM iterations ``pi_a <- W_a / sum_b n_ab / (pi_a + pi_b)``, renormalised to geometric
    mean 1, until the largest relative change is below 1e-12; ``prior`` adds one virtual drawn game
    for every pair that played. Self-play games are ignored. Each connected component of the played
    pairs is anchored on ``anchor`` if it holds it, else on its best-connected member."""
    if len(set(names)) != len(names):
        raise ValueError(f"agent names must be unique: {names}")
    played = {a: dict.fromkeys(names, 0) for a in names}
    scored = {a: dict.fromkeys(names, 0.0) for a in names}
    for a, b, score in games:
        if a not in played or b not in played:
            raise ValueError(f"game between {a!r} and {b!r}: not in the line-up {names}")
        if score not in (0, 0.5, 1):
            raise ValueError(f"a game scores 1, 0.5 or 0 (got {score})")
        if a == b:
            continue
        played[a][b] += 1
        played[b][a] += 1
        scored[a][b] += score
        scored[b][a] += 1 - score
    virtual = 1.0 if prior else 0.0
    n = {a: {b: played[a][b] + (virtual if played[a][b] else 0.0) for b in names} for a in names}
    w = {a: {b: scored[a][b] + (virtual / 2 if played[a][b] else 0.0) for b in names} for a in names}
    order = {a: i for i, a in enumerate(names)}
    rating: dict[str, float] = {}
    component: dict[str, int] = {}
    anchors = []
    for c, members in enumerate(_components(names, played)):
        pi = _mm_strengths(members, n, w)
        best = (
            anchor
            if anchor in members
            else max(
                members, key=lambda a: (sum(x > 0 for x in played[a].values()), sum(played[a].values()), -order[a])
            )
        )
        anchors.append(best)
        for a in members:
            rating[a] = 1000 + 400 * math.log10(pi[a] / pi[best])
            component[a] = c
    return Ratings(
        rating=rating,
        component=component,
        anchors=anchors,
        games={a: sum(played[a].values()) for a in names},
        score={a: sum(scored[a].values()) for a in names},
        requested_anchor=anchor,
    )


def _components(names: list[str], played: dict[str, dict[str, int]]) -> list[list[str]]:
    """Connected components of the played pairs, members in line-up order, ordered by first member."""
    seen: set[str] = set()
    components = []
    for start in names:
        if start in seen:
            continue
        reached, frontier = {start}, [start]
        while frontier:
            a = frontier.pop()
            for b, count in played[a].items():
                if count and b not in reached:
                    reached.add(b)
                    frontier.append(b)
        seen |= reached
        components.append([a for a in names if a in reached])
    return components


def _mm_strengths(
    members: list[str], n: dict[str, dict[str, float]], w: dict[str, dict[str, float]]
) -> dict[str, float]:
    """Maximum-likelihood strengths of one component, geometric mean 1."""
    if len(members) == 1:
        return {members[0]: 1.0}
    if not all(_reaches_all(members, edge) for edge in (lambda a, b: w[a][b] > 0, lambda a, b: w[b][a] > 0)):
        # Some group won (or lost) every game against the rest: its strength ratio grows without bound.
        raise ValueError(f"no finite ratings for {members}: some agents won or lost every game against the others")
    pi = dict.fromkeys(members, 1.0)
    wins = {a: sum(w[a][b] for b in members) for a in members}
    for _ in range(MM_MAX_ITERATIONS):
        new = {a: wins[a] / sum(n[a][b] / (pi[a] + pi[b]) for b in members if n[a][b]) for a in members}
        scale = math.exp(sum(math.log(v) for v in new.values()) / len(new))
        new = {a: v / scale for a, v in new.items()}
        change = max(abs(new[a] - pi[a]) / pi[a] for a in members)
        pi = new
        if change < MM_TOLERANCE:
            return pi
    raise RuntimeError(f"Bradley-Terry MM did not converge in {MM_MAX_ITERATIONS} iterations")


def _reaches_all(members: list[str], edge: Callable[[str, str], bool]) -> bool:
    reached, frontier = {members[0]}, [members[0]]
    while frontier:
        a = frontier.pop()
        for b in members:
            if b not in reached and edge(a, b):
                reached.add(b)
                frontier.append(b)
    return len(reached) == len(members)


def agent_metrics(result: CrossPlay, agent: str) -> dict[str, float]:
    """Cooperation metrics of ``agent`` (docs/algorithms.md 8.4) over all its games, in either seat: its mean
    points and its partners', each per-role metric ``key/<role>`` of the seats it played (cooperation or
    honesty rate) as ``key``, and the game metrics (mutual cooperation, collective payoff, split
    efficiency) averaged over its games, a self-play game counted once."""
    roles = env_class(result.env).roles
    own: dict[str, list[float]] = {"points": [], "partner_points": []}
    game: dict[str, list[float]] = {}
    per_role: set[str] = set()
    for pair, episodes in result.games.items():
        seats = [seat for seat, name in enumerate(pair) if name == agent]
        for ep in episodes if seats else []:
            for key, value in ep.metrics.items():
                metric, _, suffix = key.rpartition("/")
                if metric and suffix in roles:
                    per_role.add(metric)
                else:
                    game.setdefault(key, []).append(value)
            for seat in seats:
                role, partner = ep.seats[seat].name, ep.seats[1 - seat].name
                own["points"].append(ep.result.roles[role].points)
                own["partner_points"].append(ep.result.roles[partner].points)
                for key, value in ep.metrics.items():
                    metric, _, suffix = key.rpartition("/")
                    if metric and suffix == role:
                        own.setdefault(metric, []).append(value)
    # A game metric that also exists per role (Trust-and-Split's honesty rate) pools both seats, so it
    # would credit the agent with its partners' behaviour; only the agent's own seats count.
    pooled = {key: v for key, v in game.items() if key not in per_role}
    return {key: sum(v) / len(v) for key, v in {**own, **pooled}.items()}


@dataclass
class CrossPlayReport:
    """The game-theoretic summary of a cross-play (docs/algorithms.md 8.2, 8.4).

    ``outcome`` is M: a's mean normalised outcome against b over both side assignments (a on the first
    side in cell (a, b), on the second in cell (b, a); the diagonal is self-play, both sides), a side's
    outcome in a game being the mean over its seats; ``welfare`` is W, the mean normalised collective
    payoff of the same games (None where the game reports none); ``points[a][b]`` is the mean raw points
    per side of cell (a, b), a on the first side, which in a team game is each team's win rate.
    ``episodes`` counts games per cell, so off-diagonal entries of M and W pool twice as many.
    ``cooperation`` (two-seat games) or ``teams`` (team games: per agent and team, its record) holds the
    metrics per agent."""

    env: str
    agents: list[str]
    episodes: int
    outcome: Matrix
    welfare: Matrix | None
    points: dict[str, dict[str, dict[str, float]]]
    ratings: Ratings
    cooperation: dict[str, dict[str, float]]
    strategies: dict[str, StrategyFit] | None
    teams: dict[str, dict[str, TeamStats]] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        def means(matrix: Matrix) -> dict[str, dict[str, float]]:
            return {a: {b: m for b, (m, _) in row.items()} for a, row in matrix.items()}

        def errors(matrix: Matrix) -> dict[str, dict[str, float]]:
            return {a: {b: se for b, (_, se) in row.items()} for a, row in matrix.items()}

        teams = {a: {t: r.to_json() for t, r in records.items()} for a, records in self.teams.items()}
        return {
            "env": self.env,
            "agents": self.agents,
            "episodes": self.episodes,
            "M": means(self.outcome),
            "M_se": errors(self.outcome),
            "W": means(self.welfare) if self.welfare else None,
            "W_se": errors(self.welfare) if self.welfare else None,
            "points": self.points,
            "ratings": self.ratings.to_json(),
            "cooperation": self.cooperation,
            "strategies": {a: fit.to_json() for a, fit in self.strategies.items()} if self.strategies else None,
            **({"teams": teams} if teams else {}),
        }


def crossplay_report(result: CrossPlay, anchor: str = "base") -> CrossPlayReport:
    """M, W, per-side points, ratings anchored on ``anchor`` (when in the line-up), cooperation metrics (in a
    team game each agent's record per team) and, in the prisoner's dilemma, each agent's closest classic
    strategy. Ratings score a game by comparing points, or in a team game by which team won."""
    agents = result.agents
    teams = env_class(result.env).teams

    def matrix(value: Callable[[Episode, list[list[int]]], float]) -> Matrix:
        return {
            a: {b: mean_se([value(ep, seats) for ep, seats in result.meetings(a, b)]) for b in agents} for a in agents
        }

    def outcome(ep: Episode, sides: list[list[int]]) -> float:
        return sum(side_outcome(ep, seats) for seats in sides) / len(sides)

    def score(ep: Episode) -> float:
        """The row agent's score: 1 for a win, 0.5 for a draw."""
        if teams:
            winner = ep.result.info["winner"]
            return 1.0 if winner == teams[0] else 0.0 if winner == teams[1] else 0.5
        first, second = (ep.result.roles[seat.name].points for seat in ep.seats)
        return 1.0 if first > second else 0.5 if first == second else 0.0

    has_welfare = all(WELFARE in ep.metrics for ep in result.episodes)
    games = [(a, b, score(ep)) for (a, b), episodes in result.games.items() for ep in episodes]
    fits = {a: env_class(result.env).strategy_fit(list(result.seats_of(a))) for a in agents}
    strategies = {a: fit for a, fit in fits.items() if fit is not None} or None
    return CrossPlayReport(
        env=result.env,
        agents=agents,
        episodes=len(result.games[(agents[0], agents[0])]),
        outcome=matrix(outcome),
        welfare=matrix(lambda ep, seats: ep.metrics[WELFARE]) if has_welfare else None,
        points={a: {b: {r: m for r, (m, _) in result.cells[(a, b)].points.items()} for b in agents} for a in agents},
        ratings=bradley_terry(agents, games, anchor=anchor),
        cooperation={} if teams else {a: agent_metrics(result, a) for a in agents},
        strategies=strategies,
        teams={a: result.team_records(a) for a in agents} if teams else {},
    )


def lineup_agent(
    spec: str, env: type[Env], seed: int, model: str, max_new_tokens: int | None, constrained: bool | str | None
) -> Agent:
    """One agent of a cross-play line-up, named by its spec. ``base`` and ``model`` sample at temperature 1
    with 400 tokens of free text, a trained policy as its run was trained; ``max_new_tokens`` and
    ``constrained`` override both."""
    kept = ("temperature",) + (("max_new_tokens",) if max_new_tokens is None else ())
    kept += ("constrained",) if constrained is None else ()
    options = LMOptions(model, 1.0, 1.0, max_new_tokens or 400, constrained or False, seed, as_trained=kept)
    return make_agent(spec, env, options)


def lineup_agents(
    names: list[str], env: str, seed: int, model: str, max_new_tokens: int | None, constrained: bool | str | None
) -> dict[str, Agent]:
    """The agents of ``eval crossplay --agents``, by name (also a worker's line-up)."""
    cls = env_class(env)
    return {
        name: lineup_agent(name, cls, seed + 1 + i, model, max_new_tokens, constrained) for i, name in enumerate(names)
    }


def lineup(specs: str | None, env: str | None) -> tuple[type[Env], list[str]]:
    """The environment and agent names of ``--agents A,B,...``: at least two distinct names, a game of two
    seats or two teams."""
    if not specs:
        raise RepertoryError("crossplay needs --agents, the line-up, for example --agents always-cooperate,base")
    if env is None:
        raise RepertoryError("crossplay needs --env, the environment the line-up plays")
    cls = env_class(env)
    check_sides(cls)
    names = [s.strip() for s in specs.split(",")]
    if not all(names):
        raise RepertoryError(f"--agents has an empty name: {specs!r}")
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise RepertoryError(f"agent {repeated!r} appears twice in --agents; every agent of the line-up is one name")
    if len(names) < 2:
        raise RepertoryError("crossplay needs at least two agents in --agents")
    return cls, names

"""``repertory envs``, ``play`` and ``tournament``: environments, episodes with transcripts, bot tournaments."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from repertory.agents import HumanAgent, Request, agent_names
from repertory.cli.common import (
    MODEL_HELP,
    SEAT_STYLES,
    agents_for,
    check_agents,
    check_run_options,
    constrained_mode,
    count,
    games_progress,
    lm_options,
    out,
    team_table,
)
from repertory.envs import env_class, env_names, load_kernels
from repertory.rollout import EpisodeSpec, guarded_seats, run_episodes, schedule, seatable
from repertory.stats import mean_se, plus_minus
from repertory.store import EpisodeStore
from repertory.types import Episode, Message, RepertoryError, Turn

if TYPE_CHECKING:
    from repertory.eval.crossplay import CrossPlay


def envs(as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table.")) -> None:
    """List the environments with their roles, bots and a one-line description."""
    classes = [env_class(name) for name in env_names()]
    if as_json:
        rows = [
            {
                "name": c.name,
                "roles": list(c.roles),
                "role_labels": list(c.role_labels),
                "teams": list(c.teams),
                "bots": list(c.bots),
                "trained_seat": c.default_trained_role if c.fixed_seat else None,
                "default_partner": c.default_partner,
                "description": c.description,
            }
            for c in classes
        ]
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="repertory environments")
    for column in ("name", "roles", "bots", "description"):
        table.add_column(column)
    for c in classes:
        table.add_row(c.name, ", ".join(c.roles), ", ".join(c.bots), c.description)
    out.print(table)
    out.print(
        "Also every TextArena game as textarena:<EnvId>, e.g. textarena:SimpleNegotiation-v0 or textarena:TicTacToe-v0 "
        "(the optional extra repertory[textarena]; docs/guide.md, Other libraries).",
        markup=False,
    )


def _seen(name: str, message: Message, style: str) -> Text:
    """A message as the seat saw it, every line marked with the seat's name (and its channel, if any)."""
    prefix = f"  {name} sees{f' [{message.channel}]' if message.channel else ''} │ "
    content = message.content
    lines = content.split("\n") or [""]
    text = Text()
    for i, line in enumerate(lines):
        text += Text(prefix if i == 0 else " " * (len(prefix) - 2) + "│ ", style=f"dim {style}")
        text += Text(line + ("\n" if i < len(lines) - 1 else ""), style="dim")
    return text


def _turn_lines(name: str, style: str, turn: Turn, full: bool) -> list[Text]:
    """What a seat saw before a turn (system prompts only with ``full``) and what it wrote."""
    lines = []
    for m in turn.observation:
        if m.role == "system" and not full:
            lines.append(
                Text(f"  [{name} sees the rules and private information; --full shows them]", style=f"dim {style}")
            )
        else:
            lines.append(_seen(name, m, style))
    line = Text(f"{name} ▸ ", style=f"bold {style}") + Text(turn.text)
    if turn.invalid:
        line += Text(f"  ✗ {turn.error}", style="red")
    lines.append(line)
    return lines


def _header(episode_id: str, kernel_id: str, names: tuple[str, ...], agents: list[str]) -> Text:
    lineup = ", ".join(f"{name}={agent}" for name, agent in zip(names, agents))
    return Text(f"━━ {episode_id} · kernel {kernel_id} · {lineup}", style="bold")


def _end_lines(ep: Episode, styles: dict[str, str]) -> list[Text]:
    names = {s.seat_id: s.name for s in ep.seats}
    lines = [_seen(names[seat], m, styles[seat]) for seat, messages in ep.final_observations.items() for m in messages]
    result = "  ".join(f"{n}: {r.points:g} points, outcome {r.outcome:.4f}" for n, r in ep.result.roles.items())
    lines.append(Text(f"end: {ep.result.end_reason} · {result}", style="bold"))
    return lines


def _seat_styles(n_seats: int) -> dict[str, str]:
    return {f"p{i}": SEAT_STYLES[i % len(SEAT_STYLES)] for i in range(n_seats)}


class LiveTranscript:
    """Transcripts printed turn by turn as the referee applies them; on a terminal, a live area below shows each
    seat's text growing as it is sampled, and a progress line (episode, turn, tokens/s, elapsed)."""

    def __init__(self, console: Console, full: bool, episodes: int, live: bool):
        self.console = console
        self.full = full
        self.episodes = episodes
        self.started = time.perf_counter()
        self.turns = 0
        self.tokens = 0
        self.done = 0
        self.current = ""
        self.growing: dict[tuple[str, int], tuple[str, str, str, int]] = {}
        """(episode, seat) -> (seat name, channel of the message it answers, text so far, tokens so far)"""
        self.live = Live(console=console, get_renderable=self.render, refresh_per_second=8, transient=True)
        self.live_area = live

    def __enter__(self) -> LiveTranscript:
        if self.live_area:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live_area:
            self.live.stop()

    def stream(self, request: Request, text: str, tokens: int) -> None:
        """A seat's text and token count so far (called every few sampled tokens)."""
        channel = next((m.channel for m in reversed(request.messages) if m.role == "user"), "")
        self.growing[(request.episode_id, request.seat)] = (request.role, channel, text, tokens)

    def turn(self, spec: EpisodeSpec, turn: Turn) -> None:
        """Print a turn the referee has just applied (the episode's header before its first)."""
        names = env_class(spec.env).seat_names(spec.kernel.data)
        if spec.episode_id != self.current:
            self.current = spec.episode_id
            self.console.print()
            self.console.print(_header(spec.episode_id, spec.kernel.id, names, [a.name for a in spec.agents]))
        seat = int(turn.seat_id[1:])
        self.growing.pop((spec.episode_id, seat), None)
        for line in _turn_lines(names[seat], SEAT_STYLES[seat % len(SEAT_STYLES)], turn, self.full):
            self.console.print(line)
        self.turns += 1
        self.tokens += len(turn.response_ids)

    def episode(self, ep: Episode) -> None:
        """Print a finished episode's last messages and result."""
        for line in _end_lines(ep, _seat_styles(len(ep.seats))):
            self.console.print(line)
        self.done += 1

    def render(self) -> Group:
        """The live area: the text each seat is writing now, then the progress line."""
        rows = []
        streamed = 0
        for (_, seat), (name, channel, text, tokens) in list(self.growing.items()):
            style = SEAT_STYLES[seat % len(SEAT_STYLES)]
            where = f" [{channel}]" if channel else ""
            rows.append(Text(f"{name}{where} ▸ ", style=f"bold {style}") + Text(text + "▌"))
            streamed += tokens
        elapsed = time.perf_counter() - self.started
        rate = (self.tokens + streamed) / elapsed if elapsed > 0 else 0.0
        progress = (
            f"episode {min(self.done + 1, self.episodes)}/{self.episodes} · turn {self.turns + 1} · "
            f"{rate:.1f} tokens/s · {timedelta(seconds=int(elapsed))} elapsed"
        )
        return Group(*rows, Text(progress, style="dim"))


def _print_summary(episodes: list[Episode]) -> None:
    """Per seat (by position: a kernel may rename seats), then per game role and team where the game deals
    them, and the game's metrics."""
    from repertory.eval.scores import seat_scores, summarize, team_stats  # the evaluation layer loads model code

    cls = env_class(episodes[0].env)
    stats = summarize(episodes)
    table = Table(title=f"{cls.name}: {count(len(episodes), 'episode')}")
    for column in ("seat", "agent", "games", "points (mean ± se)", "outcome (mean ± se)", "invalid rate"):
        table.add_column(column)
    for (seat, games), agent in zip(stats.games.items(), stats.agents):
        p, o = stats.points[seat], stats.outcome[seat]
        table.add_row(
            seat, agent, str(games), plus_minus(*p, games), plus_minus(*o, games, 4), f"{stats.invalid_rate[seat]:.3f}"
        )
    out.print(table)
    if cls.scored_by_label:
        by_role = seat_scores(episodes, lambda i, s: True)
        roles = Table(title="per game role (every seat that played it)")
        for column in ("role", "seats", "points (mean ± se)", "outcome (mean ± se)"):
            roles.add_column(column)
        for role, outcomes in by_role.outcomes.items():
            points = by_role.points[role]
            n = len(outcomes)
            roles.add_row(role, str(n), plus_minus(*mean_se(points), n), plus_minus(*mean_se(outcomes), n, 4))
        out.print(roles)
    if cls.teams:
        every_seat = [list(range(len(ep.seats))) for ep in episodes]
        out.print(team_table("per team", team_stats(episodes, every_seat)))
    if stats.metrics:
        metrics = Table(title="metrics (mean over episodes)")
        metrics.add_column("metric")
        metrics.add_column("value", justify="right")
        for k, v in stats.metrics.items():
            metrics.add_row(k, f"{v:.4f}")
        out.print(metrics)


def play(
    env: str = typer.Argument(..., help="Environment name (see `repertory envs`)."),
    agents: str | None = typer.Option(None, "--agents", "-a", help="Comma-separated agent per seat, in seat order."),
    episodes: int = typer.Option(1, "--episodes", "-n", help="Number of episodes."),
    seed: int = typer.Option(0, "--seed", "-s", help="Master seed: kernels and episode seeds derive from it."),
    split: str = typer.Option("train", "--split", help="Kernel split: train, heldout or validation."),
    kernel: int | None = typer.Option(None, "--kernel", "-k", help="Play only this kernel index of the split."),
    out_dir: Path | None = typer.Option(None, "--out", help="Append the episodes to this Parquet episode store."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per episode on stdout instead of transcripts."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary, no transcripts."),
    full: bool = typer.Option(False, "--full", help="Show each seat's system prompt in transcripts."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature of `model` agents (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling of `model` agents."),
    max_new_tokens: int = typer.Option(400, "--max-new-tokens", help="Token budget per turn of `model` agents."),
    constrained: str = typer.Option(
        "off",
        "--constrained",
        help="Restrict `model` agents: choices (a bare --constrained) to valid actions where the action is a finite "
        "set; grammar to talk and then a valid action in every turn, whatever the game.",
    ),
    guard: bool = typer.Option(
        True,
        "--guard/--no-guard",
        help="In negotiations, hold `model` agents outside the trained seat to their private limits (partner guard).",
    ),
) -> None:
    """Run episodes with models, bots, scripts or yourself at the terminal, and print transcripts."""
    cls = env_class(env)
    check_run_options(split, seed, episodes)
    bots = list(cls.bots)
    example = [bots[i % len(bots)] for i in range(len(cls.roles))] if bots else ["model"] * len(cls.roles)
    specs = [s.strip() for s in agents.split(",")] if agents else example
    hint = f"for example --agents {','.join(example)}; choose from {', '.join(agent_names(cls))}"
    if not all(specs):
        raise RepertoryError(f"--agents has an empty name; {hint}")
    seatable(cls, load_kernels(env, split), len(specs), kernel, hint)
    store = EpisodeStore(out_dir).prepare() if out_dir else None
    built = agents_for(
        env, specs, lm_options(model, temperature, top_p, max_new_tokens, constrained_mode(constrained), seed)
    )
    lineup = schedule(env, [built[s] for s in specs], episodes, seed, split, kernel)
    trained = cls.roles.index(cls.default_trained_role)
    for spec in lineup:
        spec.guarded = guarded_seats(cls, spec.agents, [trained]) if guard else []
    if as_json or quiet:
        played = run_episodes(lineup)
    else:
        # One episode at a time, so that turns print in game order; seeds are per (episode, seat, turn), so the
        # games are the same as when they are played side by side.
        human = any(isinstance(agent, HumanAgent) for agent in built.values())
        with LiveTranscript(out, full, len(lineup), live=out.is_terminal and not human) as live:
            for agent in built.values():
                if hasattr(agent, "watch"):  # language-model agents show their text as it is sampled
                    agent.watch = live.stream
            played = run_episodes(lineup, max_concurrent=1, on_episode=live.episode, on_turn=live.turn)
    if store:  # first: nothing after play may lose the games
        path = store.append(played)
        print(f"wrote {count(len(played), 'episode')} to {path}", file=sys.stderr)
    if as_json:
        for ep in played:
            print(json.dumps(ep.summary()))
    else:
        _print_summary(played)


def _print_crossplay(result: CrossPlay) -> None:
    from repertory.eval.crossplay import sides

    cls = env_class(result.env)
    first, second = sides(cls)
    # A team's points are its seats' team wins: a win rate.
    quantity, number = ("win rate", "{:.3f}") if cls.teams else ("mean points", "{:.4g}")
    table = Table(title=f"{result.env}: {quantity}, {first} (row) / {second} (column)")
    table.add_column(f"{first} \\ {second}")
    for agent in result.agents:
        table.add_column(agent, justify="center")
    for row in result.agents:
        cells = []
        for col in result.agents:
            cell = result.cells[(row, col)]
            cells.append(f"{number.format(cell.points[first][0])} / {number.format(cell.points[second][0])}")
        table.add_row(row, *cells)
    out.print(table)
    ranking = Table(title=f"{result.env}: mean outcome over all games, either {'team' if cls.teams else 'seat'}")
    ranking.add_column("agent")
    ranking.add_column("outcome", justify="right")
    for agent in sorted(result.agents, key=result.agent_outcome, reverse=True):
        ranking.add_row(agent, f"{result.agent_outcome(agent):.4f}")
    out.print(ranking)
    if cls.teams:
        for agent in result.agents:
            title = f"{result.env}: {agent} per team (all its games on each team, self-play included)"
            out.print(team_table(title, result.team_records(agent)))


def tournament(
    env: list[str] | None = typer.Option(None, "--env", "-e", help="Environment(s); default: all."),
    agents: str | None = typer.Option(
        None, "--agents", "-a", help="Comma-separated agents; default: every bot of each environment."
    ),
    episodes: int = typer.Option(10, "--episodes", "-n", help="Episodes per ordered pair."),
    seed: int = typer.Option(0, "--seed", "-s", help="Master seed."),
    split: str = typer.Option("heldout", "--split", help="Kernel split: heldout, validation or train."),
    out_dir: Path | None = typer.Option(None, "--out", help="Append all episodes to this Parquet episode store."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per environment instead of tables."),
) -> None:
    """Cross-play tournament: every ordered pair of agents, on the same kernels and seeds (by default in every
    environment with two sides: two seats or two teams)."""
    from repertory.eval.crossplay import check_sides, crossplay, sides

    names = env or [n for n in env_names() if len(sides(env_class(n))) == 2]
    check_run_options(split, seed, episodes)
    lineups = {}
    for name in names:  # every game and line-up checked before the first is played
        cls = env_class(name)
        check_sides(cls)
        lineups[name] = [s.strip() for s in agents.split(",")] if agents else list(cls.bots)
        check_agents(name, lineups[name])
    store = EpisodeStore(out_dir).prepare() if out_dir else None
    for name, specs in lineups.items():
        with games_progress(f"tournament {name}") as on_progress:
            result = crossplay(name, agents_for(name, specs), episodes, seed, split, on_progress)
        if as_json:
            print(json.dumps(result.to_json()))
        else:
            _print_crossplay(result)
        if store:
            path = store.append(result.episodes)
            print(f"wrote {count(len(result.episodes), 'episode')} to {path}", file=sys.stderr)

"""``repertory envs``, ``play`` and ``tournament``: environments, episodes with transcripts, bot tournaments."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table
from rich.text import Text

from repertory.agents import agent_names
from repertory.cli.common import MODEL_HELP, SEAT_STYLES, agents_for, check_run_options, lm_options, out, team_table
from repertory.envs import env_class, env_names
from repertory.rollout import guarded_seats, run_episodes, schedule
from repertory.store import EpisodeStore
from repertory.types import Episode, Message, RepertoryError

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


def _print_transcript(ep: Episode, full: bool) -> None:
    styles = {s.seat_id: SEAT_STYLES[i % len(SEAT_STYLES)] for i, s in enumerate(ep.seats)}
    names = {s.seat_id: s.name for s in ep.seats}
    lineup = ", ".join(f"{s.name}={s.agent}" for s in ep.seats)
    out.print()
    out.print(Text(f"━━ {ep.episode_id} · kernel {ep.kernel.id} · {lineup}", style="bold"))
    for turn in ep.turns:
        style, name = styles[turn.seat_id], names[turn.seat_id]
        for m in turn.observation:
            if m.role == "system" and not full:
                out.print(
                    Text(f"  [{name} sees the rules and private information; --full shows them]", style=f"dim {style}")
                )
            else:
                out.print(_seen(name, m, style))
        line = Text(f"{name} ▸ ", style=f"bold {style}") + Text(turn.text)
        if turn.invalid:
            line += Text(f"  ✗ {turn.error}", style="red")
        out.print(line)
    for seat_id, messages in ep.final_observations.items():
        for m in messages:
            out.print(_seen(names[seat_id], m, styles[seat_id]))
    result = "  ".join(f"{n}: {r.points:g} points, outcome {r.outcome:.4f}" for n, r in ep.result.roles.items())
    out.print(Text(f"end: {ep.result.end_reason} · {result}", style="bold"))


def _print_summary(episodes: list[Episode]) -> None:
    from repertory.eval import summarize  # the evaluation layer loads model code; bot games need none

    stats = summarize(episodes)
    table = Table(title=f"{episodes[0].env}: {len(episodes)} episode(s)")
    for column in ("seat", "agent", "points (mean ± se)", "outcome (mean ± se)", "invalid rate"):
        table.add_column(column)
    for seat, agent in zip(episodes[0].seats, stats.agents):
        p, o = stats.points[seat.name], stats.outcome[seat.name]
        table.add_row(
            seat.name,
            agent,
            f"{p[0]:.4g} ± {p[1]:.2g}",
            f"{o[0]:.4f} ± {o[1]:.4f}",
            f"{stats.invalid_rate[seat.name]:.3f}",
        )
    out.print(table)
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
    split: str = typer.Option("train", "--split", help="Kernel split: train or heldout."),
    kernel: int | None = typer.Option(None, "--kernel", "-k", help="Play only this kernel index of the split."),
    out_dir: Path | None = typer.Option(None, "--out", help="Append the episodes to this Parquet episode store."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per episode on stdout instead of transcripts."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary, no transcripts."),
    full: bool = typer.Option(False, "--full", help="Show each seat's system prompt in transcripts."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature of `model` agents (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling of `model` agents."),
    max_new_tokens: int = typer.Option(400, "--max-new-tokens", help="Token budget per turn of `model` agents."),
    constrained: bool = typer.Option(
        False, "--constrained", help="Restrict `model` agents to valid actions where the action is a finite set."
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
    if len(specs) != len(cls.roles) or not all(specs):
        raise RepertoryError(
            f"{env} needs {len(cls.roles)} agents, one per seat ({', '.join(cls.roles)}), for example "
            f"--agents {','.join(example)}; choose from {', '.join(agent_names(cls))}"
        )
    store = EpisodeStore(out_dir) if out_dir else None
    built = agents_for(env, specs, lm_options(model, temperature, top_p, max_new_tokens, constrained, seed))
    lineup = schedule(env, [built[s] for s in specs], episodes, seed, split, kernel)
    trained = cls.roles.index(cls.default_trained_role)
    for spec in lineup:
        spec.guarded = guarded_seats(cls, spec.agents, [trained]) if guard else []
    played = run_episodes(lineup)
    if as_json:
        for ep in played:
            print(json.dumps(ep.summary()))
    else:
        if not quiet:
            for ep in played:
                _print_transcript(ep, full)
        _print_summary(played)
    if store:
        path = store.append(played)
        print(f"wrote {len(played)} episode(s) to {path}", file=sys.stderr)


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
    split: str = typer.Option("heldout", "--split", help="Kernel split: train or heldout."),
    out_dir: Path | None = typer.Option(None, "--out", help="Append all episodes to this Parquet episode store."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per environment instead of tables."),
) -> None:
    """Cross-play tournament: every ordered pair of agents, on the same kernels and seeds (by default in every
    environment with two sides: two seats or two teams)."""
    from repertory.eval.crossplay import sides

    names = env or [n for n in env_names() if len(sides(env_class(n))) == 2]
    for name in names:
        env_class(name)
    check_run_options(split, seed, episodes)
    store = EpisodeStore(out_dir) if out_dir else None
    for name in names:
        specs = [s.strip() for s in agents.split(",")] if agents else list(env_class(name).bots)
        from repertory.eval.crossplay import crossplay

        result = crossplay(name, agents_for(name, specs), episodes, seed, split)
        if as_json:
            print(json.dumps(result.to_json()))
        else:
            _print_crossplay(result)
        if store:
            path = store.append(result.episodes)
            print(f"wrote {len(result.episodes)} episode(s) to {path}", file=sys.stderr)



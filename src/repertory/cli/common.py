"""What the command modules share: the console, option checks and the agents of a line-up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from repertory.agents import Agent, LMOptions
from repertory.envs import env_class
from repertory.envs.grammar import GRAMMAR
from repertory.envs.kernels import check_split
from repertory.types import RepertoryError

if TYPE_CHECKING:
    from repertory.eval.scores import JudgedStats, TeamStats

out = Console(highlight=False, soft_wrap=True)
err = Console(highlight=False, soft_wrap=True, stderr=True)
SEAT_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


@contextmanager
def games_progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar of games done, elapsed time and ETA on standard error, drawn only on a terminal (so pipes,
    logs and ``--json`` output stay clean); yields the ``on_progress(done, total)`` callback to hand down."""
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("games ·"), TimeElapsedColumn())
    progress = Progress(*columns, TextColumn("· ETA"), TimeRemainingColumn(), console=err, disable=not err.is_terminal)
    task = progress.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    with progress:
        yield update


def count(n: int, noun: str) -> str:
    """ "1 episode", "3 episodes": a number with its noun, plural where it should be."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_run_options(split: str, seed: int, episodes: int) -> None:
    check_split(split)
    if seed < 0:
        raise RepertoryError(f"--seed must be a non-negative integer (got {seed})")
    if episodes < 1:
        raise RepertoryError(f"--episodes must be at least 1 (got {episodes})")


def agents_for(env: str, specs: list[str], lm: LMOptions | None = None) -> dict[str, Agent]:
    """One agent object per distinct spec, so a spec in several seats is served in one batch; every spec is
    checked before the first model loads."""
    from repertory.agents.resolve import make_agent  # model agents import torch; bot line-ups need none

    check_agents(env, specs, lm)
    return {spec: make_agent(spec, env_class(env), lm) for spec in dict.fromkeys(specs)}


def check_agents(env: str, specs: list[str], lm: LMOptions | None = None) -> None:
    """Every spec of a line-up names an agent of ``env`` (one line saying why not), decided without loading."""
    from repertory.agents.resolve import spec_kind

    for spec in specs:
        spec_kind(spec, env_class(env), lm)


CONSTRAINED_MODES = {"off": False, "choices": True, GRAMMAR: GRAMMAR}
OPTIONAL_VALUES = {"--constrained": "choices"}
"""Options whose value may be left out (``--constrained`` alone means ``--constrained choices``)."""
ALIASES = {"--free": ["--constrained", "off"]}


def with_optional_values(argv: list[str]) -> list[str]:
    """The command line with each option of :data:`OPTIONAL_VALUES` given its value where it was left out, and
    :data:`ALIASES` spelled out (Typer has no option whose value is optional)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out += ALIASES.get(arg, [arg])
        if arg in OPTIONAL_VALUES and (i + 1 == len(argv) or argv[i + 1] not in CONSTRAINED_MODES):
            out.append(OPTIONAL_VALUES[arg])
    return out


def constrained_mode(value: str | None) -> bool | str | None:
    """``--constrained``'s value as ``rollout.constrained`` takes it: False, True (choices) or "grammar"."""
    if value is None:
        return None
    if value not in CONSTRAINED_MODES:
        raise RepertoryError(f"--constrained must be one of {', '.join(CONSTRAINED_MODES)} (got {value!r})")
    return CONSTRAINED_MODES[value]


def lm_options(
    model: str, temperature: float, top_p: float, max_new_tokens: int, constrained: bool | str | None, seed: int
) -> LMOptions:
    if temperature < 0:
        raise RepertoryError(f"--temperature must be >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise RepertoryError(f"--top-p must be in (0, 1] (got {top_p})")
    if max_new_tokens < 1:
        raise RepertoryError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    return LMOptions(model, temperature, top_p, max_new_tokens, constrained or False, seed)


MODEL_HELP = "Model for `model` agents: the embedded SmolLM2-135M-Instruct, or a Hugging Face checkpoint directory."


TEAM_METRICS = {"vote_accuracy": "vote accuracy", "seer_found": "seer found", "wolf_survival": "wolf survival"}


def team_table(title: str, teams: dict[str, TeamStats]) -> Table:
    """Per team: games, win rate and draws with standard errors, the game's team metrics, invalid rate."""
    table = Table(title=title)
    metrics = [k for k in TEAM_METRICS if any(k in t.metrics for t in teams.values())]
    for column in ("team", "games", "win rate", "draws", *(TEAM_METRICS[k] for k in metrics), "invalid"):
        table.add_column(column, justify="left" if column == "team" else "right")
    for name, t in teams.items():
        values = [f"{t.metrics[k]:.3f}" if k in t.metrics else "-" for k in metrics]
        win, draw = t.win_rate, t.draw_rate
        row = [name, str(t.episodes), f"{win[0]:.3f} ± {win[1]:.3f}", f"{draw[0]:.3f} ± {draw[1]:.3f}"]
        table.add_row(*row, *values, f"{t.invalid_rate:.1%}")
    return table


def judged_table(title: str, stats: JudgedStats) -> Table:
    """Each judge scale, the overall score and the fine-grained metrics (mean ± SE over the agent's seats), then
    the goal-check and secret-kept rates and the episodes the judge failed on."""
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("mean ± SE", justify="right")
    rows = [*stats.dimensions.items()]
    if stats.overall is not None:
        rows.append(("overall (mean of the seven)", stats.overall))
    rows += [(f"fine: {k}", v) for k, v in stats.fine_grained.items()]
    rows += [(k, v) for k, v in (("goal verified", stats.goal_verified), ("secret kept", stats.secret_kept)) if v]
    for name, (mean, se) in rows:
        table.add_row(name, f"{mean:.3f} ± {se:.3f}")
    table.add_row("seats scored", str(stats.seats))
    table.add_row("judge failed (episodes, left out)", str(stats.judge_failed))
    return table

"""``repertory eval``: held-out evaluation of a run, cross-play matrices, and exploitability."""

from __future__ import annotations

import contextlib
import difflib
import json
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table
from typer.core import TyperGroup

from repertory.cli.common import (
    check_run_options,
    constrained_mode,
    count,
    games_progress,
    judged_table,
    out,
    team_table,
)
from repertory.envs import env_class
from repertory.stats import plus_minus
from repertory.types import RepertoryError

if TYPE_CHECKING:
    from repertory.eval import Evaluation
    from repertory.eval.crossplay import CrossPlayReport, Matrix


def _matrix_table(title: str, agents: list[str], corner: str, cell: Callable[[str, str], str]) -> Table:
    table = Table(title=title)
    table.add_column(corner)
    for agent in agents:
        table.add_column(agent, justify="center")
    for row in agents:
        table.add_row(row, *(cell(row, col) for col in agents))
    return table


def _print_crossplay_report(report: CrossPlayReport) -> None:
    from repertory.eval.crossplay import WELFARE, sides

    agents, n = report.agents, report.episodes
    cls = env_class(report.env)
    first, second = sides(cls)
    each = "on each team" if cls.teams else "in each seat"

    def with_se(matrix: Matrix) -> Callable[[str, str], str]:
        return lambda a, b: f"{matrix[a][b][0]:.3f} ± {matrix[a][b][1]:.3f}"

    out.print(
        _matrix_table(
            f"{report.env}: M, mean normalised outcome of row vs column ({2 * n} games, {n} {each}; "
            f"diagonal: self-play, {n} games)",
            agents,
            "row \\ column",
            with_se(report.outcome),
        )
    )
    if report.welfare is not None:
        out.print(
            _matrix_table(
                f"{report.env}: W, mean normalised collective payoff ({WELFARE})", agents, "", with_se(report.welfare)
            )
        )
    quantity, number = ("win rate", "{:.3f}") if cls.teams else ("mean points", "{:.4g}")
    out.print(
        _matrix_table(
            f"{report.env}: {quantity}, {first} (row) / {second} (column), {n} games per cell",
            agents,
            f"{first} \\ {second}",
            lambda a, b: f"{number.format(report.points[a][b][first])} / {number.format(report.points[a][b][second])}",
        )
    )
    ratings = report.ratings
    scored = "team wins" if cls.teams else "points"
    table = Table(title=f"{report.env}: Bradley-Terry ratings (win 1, draw 0.5 on {scored}; one virtual draw per pair)")
    for column in ("agent", "rating", "score / games", *(() if ratings.connected else ("component",))):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for agent in sorted(agents, key=lambda a: (ratings.component[a], -ratings.rating[a])):
        anchor = " (anchor)" if agent in ratings.anchors else ""
        row = [f"{agent}{anchor}", f"{ratings.rating[agent]:.1f}", f"{ratings.score[agent]:g} / {ratings.games[agent]}"]
        table.add_row(*row, *(() if ratings.connected else (str(ratings.component[agent]),)))
    out.print(table)
    for note in ratings.notes():
        out.print(f"note: {note}")
    for agent, records in report.teams.items():
        title = f"{report.env}: {agent} per team (all its games on each team, self-play included)"
        out.print(team_table(title, records))
    if report.cooperation:
        metrics = list(dict.fromkeys(key for values in report.cooperation.values() for key in values))
        table = Table(title=f"{report.env}: cooperation per agent (mean over its games, either seat)")
        table.add_column("agent")
        for key in metrics:
            table.add_column(key, justify="right")
        for agent, values in report.cooperation.items():
            table.add_row(agent, *(f"{values[k]:.3f}" if k in values else "-" for k in metrics))
        out.print(table)
    if report.strategies:
        table = Table(title=f"{report.env}: agreement of each agent's moves with classic strategies")
        table.add_column("agent")
        names = list(next(iter(report.strategies.values())).agreement)
        for name in names:
            table.add_column(name, justify="right")
        table.add_column("closest")
        for agent, fit in report.strategies.items():
            table.add_row(agent, *(f"{fit.agreement[name]:.3f}" for name in names), fit.closest)
        out.print(table)


@contextlib.contextmanager
def _workers(n: int, env: str, lineup: Callable[[], dict]) -> Iterator[Any]:
    """``--workers N``: N Ray actors with the line-up (None for 0), ended afterwards."""
    if n < 0:
        raise RepertoryError(f"--workers must be at least 0 (got {n})")
    if n == 0:
        yield None
        return
    from repertory.workers import RolloutActors

    actors = RolloutActors(n, env, lineup=lineup)
    try:
        yield actors
    finally:
        actors.close()


class _EvalGroup(TyperGroup):
    """``repertory eval RUN`` is ``repertory eval policy RUN``: arguments that name no sub-command go to
    ``policy``, so a run directory (or ``base``) needs none. Options may come before a sub-command's name
    (``eval --env ipd crossplay ...``); a first word one letter off a sub-command is refused with its name."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            named = next((a for a in args if a in self.commands), None)
            if named is not None and args[0].startswith("-"):
                rest = list(args)
                rest.remove(named)
                args = [named, *rest]
            else:
                self._refuse_typo(args[0])
                args = ["policy", *args]
        return super().parse_args(ctx, args)

    def _refuse_typo(self, word: str) -> None:
        if word.startswith("-") or Path(word).exists():
            return
        close = difflib.get_close_matches(word, [c for c in self.commands if c != "policy"], n=1, cutoff=0.8)
        if close:
            raise RepertoryError(f"no sub-command {word!r} of eval (nor a run directory); did you mean {close[0]}?")


eval_app = typer.Typer(
    cls=_EvalGroup,
    no_args_is_help=True,
    help="Evaluate policies: `eval RUN` (held-out outcome per role), `eval crossplay` (every pair of a line-up), "
    "`eval exploit` (train exploiters of a frozen policy).",
)

ENV = typer.Option(None, "--env", "-e", help="Environment (default: the run's).")
SEED = typer.Option(0, "--seed", "-s", help="Seed of kernels and sampling.")
SPLIT = typer.Option("heldout", "--split", help="Kernel split: heldout, validation or train.")
AS_JSON = typer.Option(False, "--json", help="One JSON object instead of a table.")
WORKERS = typer.Option(
    0, "--workers", help="Ray actors sharing the games, each with its own copy of the agents (0: this process)."
)
MAX_NEW_TOKENS = typer.Option(
    None, "--max-new-tokens", help="Token budget per turn (default: as the run was trained; 400 for 'base')."
)
CONSTRAINED = typer.Option(
    None,
    "--constrained",
    help="choices (finite action sets; the default of a bare --constrained), grammar (every action under its "
    "grammar) or off (--free); default: as the run was trained.",
)


def _check_budget(max_new_tokens: int | None) -> None:
    if max_new_tokens is not None and max_new_tokens < 1:
        raise RepertoryError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")


@eval_app.command("crossplay")
def eval_crossplay(
    env: str | None = ENV,
    specs: str | None = typer.Option(
        None,
        "--agents",
        "-a",
        help="The comma-separated line-up: bots, base, model, model:PATH, run or checkpoint directories.",
    ),
    episodes: int = typer.Option(
        32, "--episodes", "-n", help="Games per ordered pair, the row agent in the first seat."
    ),
    seed: int = SEED,
    split: str = SPLIT,
    model: str = typer.Option("smollm2", "--model", "-m", help="The base model of base and model agents."),
    max_new_tokens: int | None = MAX_NEW_TOKENS,
    constrained: str | None = CONSTRAINED,
    as_json: bool = AS_JSON,
    out_dir: Path | None = typer.Option(
        None, "--out", help="Also draw heat maps of M and W into DIR/crossplay-ENV.png and save DIR/crossplay-ENV.json."
    ),
    workers: int = WORKERS,
) -> None:
    """Every ordered pair of --agents on --env: outcome and welfare matrices, ratings, cooperation."""
    from repertory.eval.crossplay import crossplay, crossplay_report, lineup, lineup_agents

    cls, names = lineup(specs, env)
    check_run_options(split, seed, episodes)
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise RepertoryError(f"--out {out_dir} is not a directory")
    _check_budget(max_new_tokens)
    line_up = (names, cls.name, seed, model, max_new_tokens, constrained_mode(constrained))
    agents = lineup_agents(*line_up)
    with (
        _workers(workers, cls.name, partial(lineup_agents, *line_up)) as actors,
        games_progress(f"cross-play {cls.name}") as on_progress,
    ):
        report = crossplay_report(crossplay(cls.name, agents, episodes, seed, split, on_progress, workers=actors))
    data = report.to_json()
    if as_json:
        print(json.dumps(data))
    else:
        _print_crossplay_report(report)
    if out_dir is not None:
        from repertory.report import write_matrix_figure

        panels = {"M: mean normalised outcome of row vs column": data["M"]}
        if data["W"] is not None:
            panels["W: mean normalised collective payoff"] = data["W"]
        title = f"{cls.name} cross-play ({split}): {2 * episodes} games per pair, {episodes} in each seat order"
        path = write_matrix_figure(out_dir / f"crossplay-{cls.name}.png", title, names, panels)
        saved = out_dir / f"crossplay-{cls.name}.json"
        saved.write_text(json.dumps(data, indent=1))
        stream = sys.stderr if as_json else sys.stdout
        print(f"heat map: {path}; results: {saved} (a run directory's report page shows them)", file=stream)


@eval_app.command("exploit")
def eval_exploit(
    env: str | None = typer.Option(None, "--env", "-e", help="Environment."),
    victim: str | None = typer.Option(
        None, "--victim", help="The frozen policy to exploit: a run or checkpoint directory, base, or a bot."
    ),
    iterations: int = typer.Option(500, "--iterations", help="Training iterations of each exploiter."),
    seeds: int = typer.Option(3, "--seeds", help="Exploiter seeds (0, 1, ...)."),
    episodes: int = typer.Option(32, "--episodes", "-n", help="Held-out games of each evaluation."),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Where the exploiter runs go (default runs/exploit-ENV-<time>)."
    ),
    overrides: list[str] | None = typer.Option(
        None, "--set", help="Change the exploiter's recipe (naive-ENV), e.g. --set rollout.constrained=true."
    ),
    as_json: bool = AS_JSON,
) -> None:
    """Train naive exploiters of a frozen policy; exploiter gain and victim loss, mean +- SE over seeds."""
    from datetime import datetime

    from repertory.agents.resolve import spec_kind
    from repertory.config import load_config
    from repertory.experiments import exploitability, victim_spec

    if env is None or victim is None:
        raise RepertoryError("exploit needs --env and --victim, e.g. --env ipd --victim runs/my-run")
    if iterations < 1 or seeds < 1:
        raise RepertoryError("--iterations and --seeds must be at least 1")
    check_run_options("heldout", 0, episodes)
    try:
        spec_kind(victim, env_class(env))
    except RepertoryError as exc:
        raise RepertoryError(f"--victim {victim}: {exc}") from None
    overrides = overrides or []
    load_config(None, [*overrides, f"rollout.env={env}", f"rollout.opponent={victim_spec(victim)}"])
    root = out_dir or Path("runs") / f"exploit-{env}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if root.exists() and not root.is_dir():
        raise RepertoryError(f"--out {root} is not a directory")
    if not as_json:
        exploiters = count(seeds, "naive exploiter")
        out.print(f"training {exploiters} of {victim} on {env} for {count(iterations, 'iteration')} -> {root}")
    result = exploitability(env, victim, iterations, list(range(seeds)), episodes, root, overrides)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    budget = f"{count(iterations, 'iteration')}, {count(episodes, 'held-out game')}"
    table = Table(title=f"exploitability of {victim} on {env}: {budget}")
    for column in ("seed", "J_E before", "J_E after", "J_V before", "J_V after", "gain", "loss"):
        table.add_column(column, justify="right")
    for r in result.runs:
        values = (r.exploiter_before, r.exploiter_after, r.victim_before, r.victim_after, r.gain, r.loss)
        table.add_row(str(r.seed), *(f"{v:.3f}" for v in values))
    out.print(table)
    gain, loss, selfplay = result.gain, result.loss, result.victim_selfplay
    out.print(f"exploiter gain {gain[0]:.3f} ± {gain[1]:.3f}; victim loss {loss[0]:.3f} ± {loss[1]:.3f}")
    out.print(f"victim in self-play J_V(V vs V) {selfplay[0]:.3f} ± {selfplay[1]:.3f}")
    _, lower, p = result.gain_test
    verdict = "exploitable" if result.exploitable else "not exploitable"
    out.print(
        f"{verdict} at this budget: gain > 0 at p {p:.3g} (one-sided 95% bound {lower:+.3f}; a bootstrap over "
        "games within seeds, a lower bound on exploitability)"
    )


@eval_app.command("policy")
def eval_policy(
    target: str = typer.Argument(..., help="A run directory, a checkpoint directory, or 'base' (the untrained model)."),
    env: str | None = ENV,
    split: str = SPLIT,
    vs: str | None = typer.Option(
        None,
        "--vs",
        help="Opponent: self (self-play), base, a bot, or model:PATH (a checkpoint, a run or a HF model). "
        "Default: the game's partner (its scripted negotiator in negotiations), else self-play.",
    ),
    episodes: int = typer.Option(32, "--episodes", "-n", help="Episodes to play."),
    seed: int = SEED,
    model: str = typer.Option("smollm2", "--model", "-m", help="Base model when TARGET is 'base'."),
    max_new_tokens: int | None = MAX_NEW_TOKENS,
    constrained: str | None = CONSTRAINED,
    as_json: bool = AS_JSON,
    workers: int = WORKERS,
    judge: str | None = typer.Option(
        None,
        "--judge",
        help="Judge of social scenarios: local (the embedded model), local:PATH, openai:MODEL@BASE_URL, or none. "
        "Default: the run's judge (none for 'base').",
    ),
    judge_key_env: str | None = typer.Option(
        None, "--judge-key-env", help="The environment variable holding the openai judge's API key."
    ),
    fine_grained: bool = typer.Option(
        False, "--fine-grained", help="Also score the five fine-grained metrics (a separate judge call)."
    ),
    env_option: list[str] | None = typer.Option(
        None,
        "--option",
        help="An environment option KEY=VALUE (default: the run's rollout.env_options), e.g. reward=hybrid or "
        "scenarios=DIR.",
    ),
) -> None:
    """Held-out evaluation of one policy (`repertory eval TARGET` for short): normalised outcome per role (mean
    +- standard error), the discounted return and the environment's metrics."""
    from repertory.eval import evaluate, evaluation_agents, evaluation_env, evaluation_gamma, evaluation_lineup
    from repertory.judges import make_judge

    check_run_options(split, seed, episodes)
    _check_budget(max_new_tokens)
    line_up = (target, env, vs, seed, model, max_new_tokens, constrained_mode(constrained))
    env_name = evaluation_env(target, env)
    options, judging = _judging(target, env_name, env_option or [], judge, judge_key_env, fine_grained)
    agent, opponent, env_name = evaluation_lineup(*line_up)
    scorer = make_judge(judging)
    with (
        _workers(workers, env_name, partial(evaluation_agents, *line_up)) as actors,
        games_progress(f"eval {env_name}") as on_progress,
    ):
        result = evaluate(
            env_name,
            agent,
            episodes,
            seed,
            split,
            opponent,
            workers=actors,
            env_options=options,
            judge=scorer,
            on_progress=on_progress,
            gamma=evaluation_gamma(target),
        )
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        _print_evaluation(result, agent.name, env_name, split)


def _print_evaluation(result: Evaluation, name: str, env: str, split: str) -> None:
    table = Table(title=f"{name} on {env} ({split}, vs {result.opponent}, {result.episodes} episodes)")
    for column in ("role", "outcome", "points", "games"):
        table.add_column(column, justify="right" if column != "role" else "left")
    for role, outcome in result.outcome.items():
        games = result.games[role]
        table.add_row(role, plus_minus(*outcome, games), plus_minus(*result.points[role], games, 2), str(games))
    table.add_row("all", plus_minus(*result.overall, sum(result.games.values())), "", "")
    out.print(table)
    if result.teams:
        out.print(team_table(f"{name} per team ({env}, vs {result.opponent})", result.teams))
    out.print(
        f"expected discounted return (gamma {result.gamma} per own turn): "
        f"{result.discounted[0]:.3f} ± {result.discounted[1]:.3f}"
    )
    out.print(f"invalid actions: {result.invalid_rate:.1%}")
    if result.judged is not None:
        out.print(judged_table(f"{name}'s seats, judged ({env}, vs {result.opponent})", result.judged))
    for key, value in result.metrics.items():
        out.print(f"{key}: {value:.3f}")


def _judging(
    target: str, env: str, options: list[str], spec: str | None, key_env: str | None, fine_grained: bool
) -> tuple[dict[str, Any], Any]:
    """The environment options and the judge's config of an evaluation: the flags, else the run's own (checked
    here, before any model loads)."""
    import yaml

    from repertory.config import TrainConfig
    from repertory.envs import make
    from repertory.judges import judge_config
    from repertory.runs import resolve_checkpoint

    run = TrainConfig() if target == "base" else resolve_checkpoint(target)[1]
    env_options = dict(run.rollout.env_options) if run.rollout.env == env else {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RepertoryError(f"--option takes KEY=VALUE (got {item!r})")
        env_options[key] = yaml.safe_load(value)
    make(env, **env_options)  # bad options fail here, before any model loads
    config = run.judge.model_copy(update={"fine_grained": fine_grained or run.judge.fine_grained})
    if spec is not None:
        config = judge_config(spec, key_env, fine_grained)
    elif key_env is not None:
        config = config.model_copy(update={"api_key_env": key_env})
    return env_options, config

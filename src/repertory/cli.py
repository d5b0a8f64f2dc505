"""The ``repertory`` command line: thin wrappers that parse options and call the library.

Usage errors (unknown names, bad counts, unreadable files) print one line on stderr and exit
with status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from repertory.agents import Agent, LMOptions, agent_names, make_agent
from repertory.envs import Env, env_class, env_names
from repertory.eval import (
    IPD_STRATEGIES,
    WELFARE,
    CrossPlay,
    CrossPlayReport,
    Matrix,
    crossplay,
    crossplay_report,
    summarize,
)
from repertory.rollout import guarded_seats, run_episodes, schedule
from repertory.store import EpisodeStore
from repertory.types import SPLITS, Episode, RepertoryError

app = typer.Typer(
    help="Train one language model to play every role of multi-agent conversations.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)
SEAT_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


def _check_run_options(split: str, seed: int, episodes: int) -> None:
    if split not in SPLITS:
        raise RepertoryError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if seed < 0:
        raise RepertoryError(f"--seed must be a non-negative integer (got {seed})")
    if episodes < 1:
        raise RepertoryError(f"--episodes must be at least 1 (got {episodes})")


def _agents_for(env: str, specs: list[str], lm: LMOptions | None = None) -> dict[str, Agent]:
    """One agent object per distinct spec, so a spec in several seats is served in one batch."""
    cls = env_class(env)
    built: dict[str, Agent] = {}
    for spec in specs:
        if spec not in built:
            built[spec] = make_agent(spec, cls, lm)
    return built


def _lm_options(
    model: str, temperature: float, top_p: float, max_new_tokens: int, constrained: bool, seed: int
) -> LMOptions:
    if temperature < 0:
        raise RepertoryError(f"--temperature must be >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise RepertoryError(f"--top-p must be in (0, 1] (got {top_p})")
    if max_new_tokens < 1:
        raise RepertoryError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    return LMOptions(model, temperature, top_p, max_new_tokens, constrained, seed)


MODEL_HELP = "Model for `model` agents: the embedded SmolLM2-135M-Instruct, or a Hugging Face checkpoint directory."


@app.command()
def envs(as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table.")) -> None:
    """List the environments with their roles, bots and a one-line description."""
    classes = [env_class(name) for name in env_names()]
    if as_json:
        rows = [
            {
                "name": c.name,
                "roles": list(c.roles),
                "role_labels": list(c.role_labels),
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


def _seen(name: str, content: str, style: str) -> Text:
    """A message as the seat saw it, every line marked with the seat's name."""
    prefix = f"  {name} sees │ "
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
                out.print(_seen(name, m.content, style))
        line = Text(f"{name} ▸ ", style=f"bold {style}") + Text(turn.text)
        if turn.invalid:
            line += Text(f"  ✗ {turn.error}", style="red")
        out.print(line)
    for seat_id, messages in ep.final_observations.items():
        for m in messages:
            out.print(_seen(names[seat_id], m.content, styles[seat_id]))
    result = "  ".join(f"{n}: {r.points:g} points, outcome {r.outcome:.4f}" for n, r in ep.result.roles.items())
    out.print(Text(f"end: {ep.result.end_reason} · {result}", style="bold"))


def _print_summary(episodes: list[Episode]) -> None:
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


@app.command()
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
    _check_run_options(split, seed, episodes)
    bots = list(cls.bots)
    example = [bots[i % len(bots)] for i in range(len(cls.roles))] if bots else ["model"] * len(cls.roles)
    specs = [s.strip() for s in agents.split(",")] if agents else example
    if len(specs) != len(cls.roles) or not all(specs):
        raise RepertoryError(
            f"{env} needs {len(cls.roles)} agents, one per seat ({', '.join(cls.roles)}), for example "
            f"--agents {','.join(example)}; choose from {', '.join(agent_names(cls))}"
        )
    store = EpisodeStore(out_dir) if out_dir else None
    built = _agents_for(env, specs, _lm_options(model, temperature, top_p, max_new_tokens, constrained, seed))
    lineup = schedule(env, [built[s] for s in specs], episodes, seed, split, kernel)
    trained = cls.roles.index(cls.default_trained_role)
    for spec in lineup:
        spec.guarded = guarded_seats(cls, spec.agents, trained) if guard else []
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
    first, second = env_class(result.env).roles
    table = Table(title=f"{result.env}: mean points, {first} (row) / {second} (column)")
    table.add_column(f"{first} \\ {second}")
    for agent in result.agents:
        table.add_column(agent, justify="center")
    for row in result.agents:
        cells = []
        for col in result.agents:
            cell = result.cells[(row, col)]
            cells.append(f"{cell.points[first][0]:.4g} / {cell.points[second][0]:.4g}")
        table.add_row(row, *cells)
    out.print(table)
    ranking = Table(title=f"{result.env}: mean outcome over all games, either seat")
    ranking.add_column("agent")
    ranking.add_column("outcome", justify="right")
    for agent in sorted(result.agents, key=result.agent_outcome, reverse=True):
        ranking.add_row(agent, f"{result.agent_outcome(agent):.4f}")
    out.print(ranking)


@app.command()
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
    """Cross-play tournament: every ordered pair of agents, on the same kernels and seeds."""
    names = env or env_names()
    for name in names:
        env_class(name)
    _check_run_options(split, seed, episodes)
    store = EpisodeStore(out_dir) if out_dir else None
    for name in names:
        specs = [s.strip() for s in agents.split(",")] if agents else list(env_class(name).bots)
        result = crossplay(name, _agents_for(name, specs), episodes, seed, split)
        if as_json:
            print(json.dumps(result.to_json()))
        else:
            _print_crossplay(result)
        if store:
            path = store.append(result.episodes)
            print(f"wrote {len(result.episodes)} episode(s) to {path}", file=sys.stderr)


def _train_progress(trainer, quiet: bool):
    """A rich progress bar over iterations showing outcome, KL and time left; returns (callback, context)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=out,
        disable=quiet,
    )
    task = progress.add_task("train", total=trainer.config.iterations, completed=trainer.iteration, status="rollout...")

    def on_line(line: dict) -> None:
        parts = [f"iteration {line['iteration']}"]
        if "outcome" in line:  # a round that learns from a user's logs plays no game
            parts.append(f"outcome {line['outcome']:.3f}")
        if "eval/outcome" in line:
            parts.append(f"held-out {line['eval/outcome']:.3f}")
        if "q/val_spearman" in line:
            parts.append(f"Q rank corr. {line['q/val_spearman']:.2f}")
        parts.append(f"KL {line.get('kl', 0.0):.4f}")
        progress.update(task, advance=1, status=" | ".join(parts))
        if not quiet:
            progress.console.print("  " + " | ".join(parts), style="dim")

    return on_line, progress


@app.command()
def train(
    recipe: str | None = typer.Argument(
        None, help="Recipe: a YAML file or a shipped recipe name (default: the default recipe)."
    ),
    overrides: list[str] | None = typer.Option(None, "--set", help="Override a config key: --set algo.lr=1e-4."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue this run from its newest complete checkpoint."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Train with a recipe (no arguments: OMAR self-play with the embedded model, about ten minutes on a CPU).
    A suite recipe (top-level key ``suite``) trains its whole grid and prints the table."""
    from repertory.config import load_config, load_suite
    from repertory.train import resume_run, start_run

    suite = load_suite(recipe) if recipe is not None and resume is None else None
    if suite is not None:
        _train_suite(suite.model_copy(update={"set": [*suite.set, *(overrides or [])]}), quiet)
        return
    if resume is not None:
        if recipe is not None:
            raise RepertoryError("--resume continues a run with its own config; give no recipe (--set changes keys)")
        trainer = resume_run(resume, overrides)
        out.print(f"resuming {resume} after iteration {trainer.iteration} of {trainer.config.iterations}")
    else:
        config = load_config(recipe or "default", overrides)
        trainer = start_run(config)
        c = trainer.config
        episodes = c.rollout.kernels_per_iteration * c.rollout.episodes_per_kernel
        model = f"{c.model.name}{' + LoRA' if c.model.lora.enabled else ''}"
        if c.trainer == "rounds":
            out.print(
                f"training {c.rounds.method} on {c.rollout.env} (partner: {c.rollout.opponent}) with {model}: "
                f"{c.iterations} deployment rounds of {episodes} conversations -> {trainer.run_dir}"
            )
        else:
            out.print(
                f"training {c.algo.estimator} on {c.rollout.env} (opponent: {c.rollout.opponent}) with {model}: "
                f"{c.iterations} iterations of {episodes} episodes -> {trainer.run_dir}"
            )
    on_line, progress = _train_progress(trainer, quiet)
    with progress:
        run_dir = trainer.fit(on_line)
    out.print(f"run: {run_dir}")
    out.print(f"report: {run_dir / 'report'} (learning curves); metrics: {run_dir / 'metrics.jsonl'}")
    out.print(f"evaluate it: repertory eval {run_dir}")


def _train_suite(suite, quiet: bool) -> None:
    from repertory.rounds import run_suite, suite_runs

    names = [name for name, _ in suite_runs(suite)]
    out.print(f"suite: {len(names)} runs ({', '.join(names)}) -> {suite.output_dir}")
    if suite.warm_start is not None:
        out.print(
            f"warm start per environment: {suite.warm_start.episodes} bot-vs-bot demonstrations, "
            f"{suite.warm_start.epochs} mt-sft epochs, then every run of the environment starts from it"
        )
    current = {"name": ""}

    def on_run(name, trainer) -> None:
        current["name"] = name
        out.print(f"run {name}: {trainer.iteration} of {trainer.config.iterations} rounds done")

    def on_line(line) -> None:
        if quiet:
            return
        parts = [f"{current['name']} round {line['iteration']}"]
        for key, label in (("eval/discounted_return", "held-out J"), ("q/val_spearman", "Q rank corr.")):
            if key in line:
                parts.append(f"{label} {line[key]:.3f}")
        out.print("  " + " | ".join(parts), style="dim")

    table = run_suite(suite, on_run=on_run, on_line=on_line)
    out.print(table.markdown())
    out.print(f"wrote {suite.output_dir}/table.md and table.csv")


def _crossplay_agent(
    spec: str, env: type[Env], seed: int, model: str, max_new_tokens: int | None, constrained: bool | None
) -> Agent:
    """One agent of a cross-play line-up, named by its spec. ``base`` and ``model`` sample at temperature 1
    with 400 tokens of free text, a trained policy as its run was trained; ``max_new_tokens`` and
    ``constrained`` override both."""
    if spec in env.bots or spec.startswith("script:") or spec == "human":
        return make_agent(spec, env)
    lm = LMOptions(model, 1.0, 1.0, max_new_tokens or 400, bool(constrained), seed)
    if spec in ("base", "model"):
        agent = make_agent("model", env, lm)
        agent.name = spec
        return agent
    path = spec.removeprefix("model:")
    if Path(path).is_dir():
        from repertory.train import is_run_or_checkpoint

        if is_run_or_checkpoint(path):
            from repertory.generation import SamplingParams
            from repertory.train import frozen_policy_agent, resolve_checkpoint

            rollout = resolve_checkpoint(path)[1].rollout
            params = SamplingParams(rollout.temperature, 1.0, max_new_tokens or rollout.max_new_tokens)
            agent = frozen_policy_agent(path, params, rollout.constrained if constrained is None else constrained, seed)
            agent.name = spec
            return agent
    if spec.startswith("model:"):
        return make_agent(spec, env, lm)
    raise RepertoryError(
        f"unknown agent {spec!r} for {env.name}; choose from {', '.join(env.bots)}, base, model, model:PATH, "
        "a run or checkpoint directory, script:FILE"
    )


def _crossplay_lineup(specs: str | None, env: str | None) -> tuple[type[Env], list[str]]:
    if not specs:
        raise RepertoryError("crossplay needs --agents, the line-up, for example --agents always-cooperate,base")
    if env is None:
        raise RepertoryError("crossplay needs --env, the environment the line-up plays")
    cls = env_class(env)
    if len(cls.roles) != 2:
        raise RepertoryError(f"cross-play needs a two-seat environment; {env} has {len(cls.roles)} seats")
    names = [s.strip() for s in specs.split(",")]
    if not all(names):
        raise RepertoryError(f"--agents has an empty name: {specs!r}")
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise RepertoryError(f"agent {repeated!r} appears twice in --agents; every agent of the line-up is one name")
    if len(names) < 2:
        raise RepertoryError("crossplay needs at least two agents in --agents")
    return cls, names


def _matrix_table(title: str, agents: list[str], corner: str, cell: Callable[[str, str], str]) -> Table:
    table = Table(title=title)
    table.add_column(corner)
    for agent in agents:
        table.add_column(agent, justify="center")
    for row in agents:
        table.add_row(row, *(cell(row, col) for col in agents))
    return table


def _print_crossplay_report(report: CrossPlayReport) -> None:
    agents, n = report.agents, report.episodes
    first, second = env_class(report.env).roles

    def with_se(matrix: Matrix) -> Callable[[str, str], str]:
        return lambda a, b: f"{matrix[a][b][0]:.3f} ± {matrix[a][b][1]:.3f}"

    out.print(
        _matrix_table(
            f"{report.env}: M, mean normalised outcome of row vs column ({2 * n} games, {n} in each seat; "
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
    out.print(
        _matrix_table(
            f"{report.env}: mean points, {first} (row) / {second} (column), {n} games per cell",
            agents,
            f"{first} \\ {second}",
            lambda a, b: f"{report.points[a][b][first]:.4g} / {report.points[a][b][second]:.4g}",
        )
    )
    ratings = report.ratings
    table = Table(title=f"{report.env}: Bradley-Terry ratings (win 1, draw 0.5 on points; one virtual draw per pair)")
    for column in ("agent", "rating", "score / games", *(() if ratings.connected else ("component",))):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for agent in sorted(agents, key=lambda a: (ratings.component[a], -ratings.rating[a])):
        anchor = " (anchor)" if agent in ratings.anchors else ""
        row = [f"{agent}{anchor}", f"{ratings.rating[agent]:.1f}", f"{ratings.score[agent]:g} / {ratings.games[agent]}"]
        table.add_row(*row, *(() if ratings.connected else (str(ratings.component[agent]),)))
    out.print(table)
    for note in ratings.notes():
        out.print(f"note: {note}")
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
        for name in IPD_STRATEGIES:
            table.add_column(name, justify="right")
        table.add_column("closest")
        for agent, fit in report.strategies.items():
            table.add_row(agent, *(f"{fit.agreement[name]:.3f}" for name in IPD_STRATEGIES), fit.closest)
        out.print(table)


def _eval_crossplay(
    env: str | None,
    specs: str | None,
    episodes: int,
    seed: int,
    split: str,
    model: str,
    max_new_tokens: int | None,
    constrained: bool | None,
    as_json: bool,
    out_dir: Path | None,
) -> None:
    cls, names = _crossplay_lineup(specs, env)
    _check_run_options(split, seed, episodes)
    if out_dir is not None and out_dir.exists() and not out_dir.is_dir():
        raise RepertoryError(f"--out {out_dir} is not a directory")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise RepertoryError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    agents = {
        name: _crossplay_agent(name, cls, seed + 1 + i, model, max_new_tokens, constrained)
        for i, name in enumerate(names)
    }
    report = crossplay_report(crossplay(cls.name, agents, episodes, seed, split))
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
        print(f"heat map: {path}", file=sys.stderr if as_json else sys.stdout)


def _eval_exploit(
    env: str | None,
    victim: str | None,
    iterations: int,
    seeds: int,
    episodes: int,
    out_dir: Path | None,
    overrides: list[str],
    as_json: bool,
) -> None:
    from datetime import datetime

    from repertory.config import load_config
    from repertory.train import exploitability, victim_spec

    if env is None or victim is None:
        raise RepertoryError("exploit needs --env and --victim, e.g. --env ipd --victim runs/my-run")
    if iterations < 1 or seeds < 1:
        raise RepertoryError("--iterations and --seeds must be at least 1")
    _check_run_options("heldout", 0, episodes)
    load_config(None, [*overrides, f"rollout.env={env}", f"rollout.opponent={victim_spec(victim)}"])
    root = out_dir or Path("runs") / f"exploit-{env}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if root.exists() and not root.is_dir():
        raise RepertoryError(f"--out {root} is not a directory")
    if not as_json:
        out.print(f"training {seeds} naive exploiter(s) of {victim} on {env} for {iterations} iterations -> {root}")
    result = exploitability(env, victim, iterations, list(range(seeds)), episodes, root, overrides)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    table = Table(title=f"exploitability of {victim} on {env}: {iterations} iterations, {episodes} held-out games")
    for column in ("seed", "J_E before", "J_E after", "J_V before", "J_V after", "gain", "loss"):
        table.add_column(column, justify="right")
    for r in result.runs:
        values = (r.exploiter_before, r.exploiter_after, r.victim_before, r.victim_after, r.gain, r.loss)
        table.add_row(str(r.seed), *(f"{v:.3f}" for v in values))
    out.print(table)
    gain, loss, selfplay = result.gain, result.loss, result.victim_selfplay
    out.print(f"exploiter gain {gain[0]:.3f} ± {gain[1]:.3f}; victim loss {loss[0]:.3f} ± {loss[1]:.3f}")
    out.print(f"victim in self-play J_V(V vs V) {selfplay[0]:.3f} ± {selfplay[1]:.3f}")
    verdict = "exploitable" if result.exploitable else "not exploitable"
    out.print(f"{verdict} at this budget (gain {'>' if result.exploitable else '<='} 1.96 SE; a lower bound)")


@app.command("eval")
def eval_command(
    target: str = typer.Argument(
        ...,
        help="A run directory, a checkpoint directory, 'base' (the untrained model), "
        "'crossplay' (every ordered pair of --agents), or 'exploit' (train exploiters of --victim).",
    ),
    env: str | None = typer.Option(None, "--env", "-e", help="Environment (default: the run's)."),
    split: str = typer.Option("heldout", "--split", help="Kernel split: heldout or train."),
    vs: str | None = typer.Option(
        None,
        "--vs",
        help="Opponent: self (self-play), base, a bot, or model:PATH (a checkpoint, a run or a HF model). "
        "Default: the game's partner (its scripted negotiator in negotiations), else self-play.",
    ),
    episodes: int = typer.Option(
        32, "--episodes", "-n", help="Episodes to play (crossplay: per ordered pair, the row agent in the first seat)."
    ),
    seed: int = typer.Option(0, "--seed", "-s", help="Seed of kernels and sampling."),
    model: str = typer.Option(
        "smollm2", "--model", "-m", help="Base model when TARGET is 'base' (crossplay: of base and model agents)."
    ),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", help="Token budget per turn (default: as the run was trained; 400 for 'base')."
    ),
    constrained: bool | None = typer.Option(
        None, "--constrained/--free", help="Constrained actions (default: as the run was trained)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
    agents: str | None = typer.Option(
        None,
        "--agents",
        "-a",
        help="crossplay: the comma-separated line-up: bots, base, model, model:PATH, run or checkpoint directories.",
    ),
    out_dir: Path | None = typer.Option(
        None,
        "--out",
        help="crossplay: also draw heat maps of M and W into DIR/crossplay-ENV.png; exploit: where the exploiter "
        "runs go (default runs/exploit-ENV-<time>).",
    ),
    victim: str | None = typer.Option(
        None, "--victim", help="exploit: the frozen policy to exploit: a run or checkpoint directory, base, or a bot."
    ),
    iterations: int = typer.Option(500, "--iterations", help="exploit: training iterations of each exploiter."),
    seeds: int = typer.Option(3, "--seeds", help="exploit: exploiter seeds (0, 1, ...)."),
    overrides: list[str] | None = typer.Option(
        None, "--set", help="exploit: change the exploiter's recipe (naive-ENV), e.g. --set rollout.constrained=true."
    ),
) -> None:
    """Held-out evaluation: normalised outcome per role (mean +- standard error) and the environment's metrics.

    `eval crossplay --env ENV --agents A,B,...`: every pair; outcome and welfare matrices, ratings, cooperation.
    `eval exploit --env ENV --victim V`: train naive exploiters of a frozen policy; exploiter gain, victim loss."""
    if target == "exploit":
        _eval_exploit(env, victim, iterations, seeds, episodes, out_dir, overrides or [], as_json)
        return
    if victim is not None or overrides:
        raise RepertoryError("--victim and --set are only for `repertory eval exploit --env ENV --victim V`")
    if target == "crossplay":
        if vs is not None:
            raise RepertoryError("--vs is for one agent; crossplay plays every pair of --agents")
        _eval_crossplay(env, agents, episodes, seed, split, model, max_new_tokens, constrained, as_json, out_dir)
        return
    if agents is not None or out_dir is not None:
        option = "--agents" if agents is not None else "--out"
        raise RepertoryError(f"{option} is only for `repertory eval crossplay --env ENV --agents A,B,...`")
    from repertory.agents.lm import LMAgent
    from repertory.eval import evaluate
    from repertory.generation import HFBackend, SamplingParams
    from repertory.models import load_model
    from repertory.train import frozen_policy_agent, is_run_or_checkpoint, load_policy, resolve_checkpoint

    _check_run_options(split, seed, episodes)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise RepertoryError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if target == "base":
        from repertory.config import TrainConfig

        config = TrainConfig()
        config.model.name = model
        if env is None:
            raise RepertoryError("--env is required when evaluating 'base'")
        loaded = load_model(model)
    else:
        checkpoint, config = resolve_checkpoint(target)
        loaded = load_policy(checkpoint, config)
    env_name = env or config.rollout.env
    cls = env_class(env_name)
    vs = vs or cls.default_partner
    rollout = config.rollout
    budget = max_new_tokens or rollout.max_new_tokens
    params = SamplingParams(rollout.temperature, 1.0, budget)
    use_constraints = rollout.constrained if constrained is None else constrained
    backend = HFBackend(loaded)
    agent = LMAgent(backend, loaded.name, params, use_constraints, seed=seed, policy_id="live")
    opponent = None
    if vs == "base" and target != "base":
        base = load_model(config.model.name)
        opponent = LMAgent(HFBackend(base), "base", params, use_constraints, seed=seed + 1, policy_id="base")
    elif vs == "base" or vs == "model":
        opponent = LMAgent(backend, "base", params, use_constraints, seed=seed + 1, policy_id="base")
    elif vs.startswith("model:") and is_run_or_checkpoint(vs[6:]):
        opponent = frozen_policy_agent(vs[6:], params, use_constraints, seed + 1)
    elif vs != "self":
        options = LMOptions(config.model.name, rollout.temperature, 1.0, budget, use_constraints, seed + 1)
        opponent = make_agent(vs, cls, options)
    result = evaluate(env_name, agent, episodes, seed, split, opponent)
    if as_json:
        print(json.dumps(result.to_json()))
        return
    table = Table(title=f"{loaded.name} on {env_name} ({split}, vs {result.opponent}, {result.episodes} episodes)")
    for column in ("role", "outcome", "points", "games"):
        table.add_column(column, justify="right" if column != "role" else "left")
    for role, (mean, se) in result.outcome.items():
        points, points_se = result.points[role]
        games = sum(1 for ep in result.played for s in ep.seats if s.name == role and s.agent == agent.name)
        table.add_row(role, f"{mean:.3f} ± {se:.3f}", f"{points:.2f} ± {points_se:.2f}", str(games))
    table.add_row("all", f"{result.overall[0]:.3f} ± {result.overall[1]:.3f}", "", "")
    out.print(table)
    out.print(
        f"expected discounted return (gamma {result.gamma} per own turn): "
        f"{result.discounted[0]:.3f} ± {result.discounted[1]:.3f}"
    )
    out.print(f"invalid actions: {result.invalid_rate:.1%}")
    for key, value in result.metrics.items():
        out.print(f"{key}: {value:.3f}")


@app.command()
def report(
    runs: list[Path] = typer.Argument(..., help="Run directories."),
    table: bool = typer.Option(
        False, "--table", help="One table of methods x environments over the runs, instead of each run's figures."
    ),
    checkpoint: str = typer.Option("best", "--checkpoint", help="--table: each seed's best or last checkpoint."),
    out_dir: Path | None = typer.Option(None, "--out", help="--table: also write DIR/table.md and DIR/table.csv."),
) -> None:
    """Redraw a run's learning curves into RUN/report, or (--table) the held-out expected discounted return of
    methods x environments, mean ± standard error over seeds (algorithms.md 5.7)."""
    from repertory.report import results_table, write_report

    if not table:
        for run in runs:
            if not (run / "config.yaml").is_file():
                raise RepertoryError(f"{run} is not a run directory (no config.yaml)")
            for path in write_report(run):
                out.print(str(path))
        return
    result = results_table(runs, checkpoint)
    seeds = {n for _, _, n in result.cells.values()}
    grid = Table(title=f"held-out expected discounted return, {checkpoint} checkpoint, mean ± SE over seeds")
    grid.add_column("method")
    for env in result.envs:
        grid.add_column(env, justify="right")
    for method in result.methods:
        grid.add_row(method, *(result.text(method, env) for env in result.envs))
    out.print(grid)
    out.print(f"seeds per cell: {', '.join(map(str, sorted(seeds)))}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "table.md").write_text(result.markdown())
        (out_dir / "table.csv").write_text(result.csv())
        out.print(f"wrote {out_dir / 'table.md'} and {out_dir / 'table.csv'}")


@app.command()
def export(
    run: Path = typer.Argument(..., help="A run directory (its newest complete checkpoint) or a checkpoint."),
    out_dir: Path = typer.Option(..., "--out", help="A new directory for the Hugging Face checkpoint."),
    device: str = typer.Option("cpu", "--device", help="Where to merge the adapter: cpu (float32) or cuda (bf16)."),
) -> None:
    """Write a trained policy as a plain Hugging Face checkpoint (LoRA merged into the base): start another run
    from it (--set model.name=DIR), play it (--model DIR), or serve it with any Hugging Face tool."""
    from repertory.train import export_policy

    out.print(str(export_policy(run, out_dir, device)))


bench_app = typer.Typer(help="Benchmarks: ours against a naive baseline and the hardware limit, in one run.")
app.add_typer(bench_app, name="bench")


@bench_app.command("rollout")
def bench_rollout(
    env: list[str] | None = typer.Option(None, "--env", "-e", help="Environments (default: trust-and-split, ipd)."),
    episodes: int = typer.Option(4, "--episodes", "-n", help="Self-play episodes per environment."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Token budget per turn."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    seed: int = typer.Option(0, "--seed", "-s", help="Master seed."),
    naive: bool = typer.Option(True, "--naive/--no-naive", help="Also run the naive per-turn generate() baseline."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """Batched multi-role rollout against per-turn generate() calls and the matmul limit."""
    from repertory.agents.lm import shared_backend
    from repertory.bench import RolloutBenchConfig, rollout_benchmark

    names = tuple(env or ("trust-and-split", "ipd"))
    for name in names:
        env_class(name)
    _check_run_options("train", seed, episodes)
    _lm_options(model, 1.0, 1.0, max_new_tokens, False, seed)
    config = RolloutBenchConfig(names, episodes, max_new_tokens, seed, naive)
    result = rollout_benchmark(shared_backend(model), config)
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"rollout: {result['episodes']} self-play episodes of {', '.join(names)} ({result['model']})")
    for column in ("", "generated tok/s", "prompt tok/s", "seconds", "vs naive", "vs limit"):
        table.add_column(column, justify="right")
    table.add_row(
        "ours",
        f"{result['ours_tok_s']:.1f}",
        f"{result['ours_prompt_tok_s']:.1f}",
        f"{result['ours_seconds']:.1f}",
        f"{result['ours_over_naive']:.2f}x" if naive else "-",
        f"{result['ours_over_limit']:.1%}",
    )
    if naive:
        table.add_row(
            "naive",
            f"{result['naive_tok_s']:.1f}",
            f"{result['naive_prompt_tok_s']:.1f}",
            f"{result['naive_seconds']:.1f}",
            "1.00x",
            f"{result['naive_tok_s'] / result['limit_tok_s']:.1%}",
        )
    table.add_row("limit", f"{result['limit_tok_s']:.1f}", "", "", "", "100%")
    out.print(table)
    out.print(
        "ours: one batched generation per tick with prefix reuse; naive: one generate() call per turn; "
        "limit: the float32 matmul throughput as tokens/s (2 x parameters FLOPs per token)"
    )
    out.print(
        f"matmul {result['limit_gflops']:.1f} GFLOP/s on {result['threads']} threads; "
        f"computed tokens (encoded + generated) {result['ours_computed_tok_s']:.1f}/s = "
        f"{result['ours_computed_over_limit']:.1%} of the limit; "
        f"prefix cache hit rate {result['cache_hit_rate']:.1%}; peak RSS {result['peak_rss_mb']:.0f} MiB"
    )


def _print_step_table(title: str, result: dict, variants: tuple[str, str]) -> None:
    """A training-step benchmark's two variants and the limit: tokens computed, seconds, tok/s, share of it."""
    table = Table(title=title)
    for column in ("", "tokens computed", "seconds", "tok/s", "vs limit"):
        table.add_column(column, justify="right")
    for key in variants:
        table.add_row(
            key,
            str(result[f"{key}_tokens"]),
            f"{result[f'{key}_seconds']:.2f}",
            f"{result[f'{key}_tok_s']:.0f}",
            f"{result[f'{key}_tok_s'] / result['limit_tok_s']:.1%}",
        )
    table.add_row("limit", "", "", f"{result['limit_tok_s']:.0f}", "100%")
    out.print(table)


@bench_app.command("train")
def bench_train(
    episodes: int = typer.Option(2, "--episodes", "-n", help="Self-play episodes (2 seats each) in the batch."),
    turns: int = typer.Option(8, "--turns", help="Turns per seat."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapters (the default recipe) or full fine-tuning."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """One optimisation step with packed and unpacked turns, against the float32 limit (6 x params x tokens)."""
    from repertory.bench import TrainBenchConfig, train_benchmark
    from repertory.models import load_model

    if episodes < 1 or turns < 1:
        raise RepertoryError("--episodes and --turns must be at least 1")
    result = train_benchmark(load_model(model), TrainBenchConfig(episodes=episodes, turns=turns, lora=lora))
    if as_json:
        print(json.dumps(result))
        return
    title = f"train step: {episodes} episodes x 2 seats x {turns} turns ({result['model']}, "
    _print_step_table(title + f"{'LoRA' if lora else 'full fine-tuning'})", result, ("packed", "unpacked"))
    out.print(
        f"packing makes the step {result['packed_speedup']:.2f}x faster on the same {result['trained_tokens']} "
        f"trained tokens; matmul {result['limit_gflops']:.1f} GFLOP/s on {result['threads']} threads; "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
    )


@bench_app.command("candidates")
def bench_candidates(
    states: int = typer.Option(2, "--states", "-n", help="Logged states in the step."),
    candidates: int = typer.Option(4, "--candidates", "-c", help="Sampled candidates per state."),
    prompt_tokens: int = typer.Option(640, "--prompt-tokens", help="Tokens of each state's prompt (its history)."),
    response_tokens: int = typer.Option(48, "--response-tokens", help="Tokens of each candidate."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """Iterative GRPO's policy step with each state's prompt shared by its candidates, against one sequence
    per candidate and the float32 limit."""
    from repertory.bench import CandidatesBenchConfig, candidates_benchmark
    from repertory.models import load_model

    if min(states, candidates, prompt_tokens, response_tokens) < 1:
        raise RepertoryError("--states, --candidates, --prompt-tokens and --response-tokens must be at least 1")
    config = CandidatesBenchConfig(states, candidates, prompt_tokens, response_tokens)
    result = candidates_benchmark(load_model(model), config)
    if as_json:
        print(json.dumps(result))
        return
    title = (
        f"I-GRPO policy step: {states} states x {candidates} candidates, {prompt_tokens}-token prompts, "
        f"{response_tokens}-token candidates ({result['model']}, LoRA)"
    )
    _print_step_table(title, result, ("shared", "separate"))
    out.print(
        f"sharing each prompt makes the step {result['shared_speedup']:.2f}x faster on the same "
        f"{result['trained_tokens']} trained tokens (scoring with policy and reference, forward, backward, AdamW); "
        f"matmul {result['limit_gflops']:.1f} GFLOP/s on {result['threads']} threads; "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one line on stderr and exit status 2."""
    try:
        app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:
        if exc.format_message():
            print(f"error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except RepertoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)

"""``repertory train``: a recipe, a resumed run or a suite, with a progress display."""

from __future__ import annotations

from pathlib import Path

import typer

from repertory.cli.common import count, err, out
from repertory.types import RepertoryError


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

    from repertory.report.metrics import SPLIT_NAMES

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
    split = SPLIT_NAMES[trainer.config.eval.split]

    def on_line(line: dict) -> None:
        parts = [f"iteration {line['iteration']}"]
        if "logs/conversations" in line:  # round 0 from a served log
            skipped = int(line["logs/skipped_no_outcome"])
            parts.append(f"logged conversations {int(line['logs/conversations'])}, {skipped} skipped (no outcome)")
        if "outcome" in line:  # a round that learns from a user's logs plays no game
            parts.append(f"outcome {line['outcome']:.3f}")
        parts += _scores(line, split)
        parts.append(f"KL {line.get('kl', 0.0):.4f}")
        progress.update(task, advance=1, status=" | ".join(parts))
        if not quiet:
            progress.console.print("  " + " | ".join(parts), style="dim")

    return on_line, progress


def _scores(line: dict, split: str) -> list[str]:
    """A metrics line's scores as the progress lines show them: the evaluation before the iteration's update and
    the one after the last (on the run's kernel ``split``), and how well the Q-function ranked its validation
    turns, with how many there were (a rank correlation over four turns is mostly chance)."""
    parts = []
    for when, prefix in (("", "eval/"), ("after: ", "final/")):
        for key, label in (("outcome", "outcome"), ("discounted_return", "J")):
            if prefix + key in line:
                parts.append(f"{when}{split} {label} {line[prefix + key]:.3f}")
    if "q/val_spearman" in line:
        over = f" over {int(line['q/val_examples'])} turns" if "q/val_examples" in line else ""
        parts.append(f"Q rank corr. {line['q/val_spearman']:.2f}{over}")
    return parts


def _banner(trainer) -> str:
    """What a new run trains, from which recipe, and where it writes."""
    c = trainer.config
    episodes = c.rollout.kernels_per_iteration * c.rollout.episodes_per_kernel
    lora = {"shared": " + LoRA", "per_role": " + a LoRA per role", "per_team": " + a LoRA per team"}
    model = f"{c.model.name}{lora[c.model.adapters] if c.model.lora.enabled else ''}"
    other, steps, games = (
        ("partner", "deployment round", "conversations") if c.round_based else ("opponent", "iteration", "episodes")
    )
    return (
        f"training recipe {c.recipe}: {c.method_name} on {c.rollout.env} ({other}: {c.rollout.opponent}) with "
        f"{model}: {count(c.iterations, steps)} of {episodes} {games} -> {trainer.run_dir}"
    )


def train(
    recipe: str | None = typer.Argument(
        None, help="Recipe: a YAML file or a shipped recipe name (default: the default recipe)."
    ),
    overrides: list[str] | None = typer.Option(None, "--set", help="Override a config key: --set algo.lr=1e-4."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue this run from its newest complete checkpoint."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
    gpus: int = typer.Option(
        1,
        "--gpus",
        help="Data-parallel learner over N processes, one GPU each with model.device=cuda (on a CPU: N processes).",
    ),
) -> None:
    """Train with a recipe (no arguments: OMAR self-play with the embedded model, about two minutes on two CPU cores).
    A suite recipe (top-level key ``suite``) trains its whole grid and prints the table."""
    import os
    import sys

    from repertory.config import load_config, recipe_name
    from repertory.envs import env_class
    from repertory.experiments import load_suite
    from repertory.report.metrics import SPLIT_NAMES, behaviour_change, held_out_change, read_metrics
    from repertory.runs import RunDir
    from repertory.train import distributed, resume_run, start_run

    if gpus < 1:
        raise RepertoryError(f"--gpus must be at least 1 (got {gpus})")
    if gpus > 1 and "WORLD_SIZE" not in os.environ:
        distributed.relaunch(sys.argv[1:], gpus)
    distributed.initialise()
    quiet = quiet or not distributed.is_main()
    show = out.print if distributed.is_main() else (lambda *args, **kwargs: None)  # process 0 speaks for all

    suite = load_suite(recipe) if recipe is not None and resume is None else None
    if suite is not None:
        _train_suite(suite.model_copy(update={"set": [*suite.set, *(overrides or [])]}), quiet)
        return
    if resume is not None:
        if recipe is not None:
            raise RepertoryError("--resume continues a run with its own config; give no recipe (--set changes keys)")
        trainer = resume_run(resume, overrides)
        show(f"resuming {resume} after iteration {trainer.iteration} of {trainer.config.iterations}")
    else:
        config = load_config(recipe or "default", overrides)
        trainer = start_run(config.model_copy(update={"recipe": recipe_name(recipe or "default")}))
        show(_banner(trainer))
    on_line, progress = _train_progress(trainer, quiet)
    with progress:
        try:
            run_dir = trainer.fit(on_line)
        finally:
            discarded = trainer.rollouts.discarded_episodes
            if discarded:
                show(
                    f"{discarded} episodes played ahead (rollout.max_staleness) were never learned "
                    "from; --resume plays those iterations again with the restored policy"
                )
    if not distributed.is_main():
        return
    out.print(f"run: {run_dir}")
    run = RunDir(run_dir)
    lines = read_metrics(run)
    change, split = held_out_change(lines), SPLIT_NAMES[trainer.config.eval.split]
    if change is not None:
        out.print(f"{split} outcome against {trainer.config.evaluation_opponent}: {change.describe()}")
    key = env_class(trainer.config.rollout.env).key_metric
    behaviour = behaviour_change(lines, key) if key is not None else None
    if behaviour is not None:
        out.print(f"{split} {behaviour.describe()}")
    out.print(f"metrics: {run.metrics}; learning curves: {run.report}/*.png")
    out.print(f"evaluate it: repertory eval {run_dir}")
    out.print(f"report (open it in a browser): {run.page.resolve()}")


def _train_suite(suite, quiet: bool) -> None:
    from repertory.experiments import run_suite, suite_runs
    from repertory.report.metrics import SPLIT_NAMES

    names = [name for name, _ in suite_runs(suite)]
    out.print(f"suite: {len(names)} runs ({', '.join(names)}) -> {suite.output_dir}")
    if suite.warm_start is not None:
        out.print(
            f"warm start per environment: {suite.warm_start.episodes} bot-vs-bot demonstrations, "
            f"{suite.warm_start.epochs} mt-sft epochs, then every run of the environment starts from it"
        )
    current = {"name": "", "split": ""}

    def on_run(name, trainer) -> None:
        current["name"], current["split"] = name, SPLIT_NAMES[trainer.config.eval.split]
        unit = "round" if trainer.config.round_based else "iteration"
        out.print(f"run {name}: {trainer.iteration} of {count(trainer.config.iterations, unit)} done")

    def on_line(line) -> None:
        if quiet:
            return
        parts = [f"{current['name']} iteration {line['iteration']}", *_scores(line, current["split"])]
        out.print("  " + " | ".join(parts), style="dim")

    def warn(warning: str) -> None:
        err.print(f"warning: {warning}", markup=False)

    table = run_suite(suite, on_run=on_run, on_line=on_line, warn=warn)
    out.print(table.markdown())
    out.print(f"wrote {suite.output_dir}/table.md, table.csv and contrasts.csv")
    if suite.probes is not None:
        out.print(
            f"probes of each run: {suite.output_dir}/probes.md (records in {suite.records or suite.output_dir}/probes/)"
        )

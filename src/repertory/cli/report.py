"""``repertory report`` and ``export``: a run's figures, the results table, a plain Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from repertory.cli.common import err, out


def report(
    runs: list[Path] = typer.Argument(..., help="Run directories."),
    table: bool = typer.Option(
        False, "--table", help="One table of methods x environments over the runs, instead of each run's figures."
    ),
    checkpoint: str = typer.Option(
        "last",
        "--checkpoint",
        help="--table: each seed's last checkpoint, or its best: the trained checkpoint with the highest validation "
        "score (eval/validation/*), reported by its held-out score.",
    ),
    metric: str | None = typer.Option(
        None,
        "--metric",
        help="--table: discounted_return (J at the method's discount) or outcome; default J, or the outcome where a "
        "run's method.gamma is 0 (J is then 0 for every policy). Any other metric the runs log while they train "
        "(credit/quality_corr, kl...) tables each run's mean over its iterations.",
    ),
    effect: float | None = typer.Option(
        None,
        "--effect",
        help="--table: the smallest effect of interest; each paired contrast then says what it decides at ±EFFECT "
        "and how many seeds would decide what it leaves open.",
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="--table: also write DIR/table.md, DIR/table.csv and DIR/contrasts.csv."
    ),
    max_episodes: int = typer.Option(
        300, "--max-episodes", min=0, help="Episodes in the page's browser; more are sampled evenly across iterations."
    ),
) -> None:
    """Redraw a run's learning curves and its page RUN/report/index.html (the held-out outcome and the game's key
    behaviour before and after, curves, config, evaluations and an episode browser with the final held-out games;
    self-contained, opens from file://), or (--table) the held-out expected discounted return (or outcome) of
    methods x environments, mean ± standard error over seeds (docs/algorithms.md 5.7), or of a metric the runs log
    while they train, each run's mean over its iterations."""
    from repertory.report import results_table, write_report
    from repertory.runs import RunDir

    def warn(warning: str) -> None:
        err.print(f"warning: {warning}", markup=False)

    if not table:
        for run in runs:
            for path in write_report(RunDir.existing(run), max_episodes, warn):
                out.print(str(path))
        return
    result = results_table(runs, checkpoint, metric, effect)
    seeds = {n for _, _, n in result.cells.values()}
    grid = Table(title=result.title)
    grid.add_column("method")
    for env in result.envs:
        grid.add_column(env, justify="right")
    for method in result.methods:
        grid.add_row(method, *(result.text(method, env) for env in result.envs))
    out.print(grid)
    out.print(f"seeds per cell: {', '.join(map(str, sorted(seeds)))}")
    if result.contrasts:
        paired = Table(title="paired over seeds: difference of per-seed scores, t-test with seeds − 1 df")
        for column in ("rows", "env", "difference ± SE", "95% CI", "p", "seeds", *result.decision_columns):
            paired.add_column(column, justify="left" if column in ("rows", "env") else "right")
        for row in result.contrast_rows():
            paired.add_row(*row)
        out.print(paired)
    if result.notes:
        out.print(result.notes, markup=False)
    if result.why:
        out.print(f"{result.why} (--metric discounted_return shows J)", markup=False)
    if out_dir is not None:
        out.print("wrote " + ", ".join(map(str, result.write(out_dir))))


def export(
    run: Path = typer.Argument(..., help="A run directory (its newest complete checkpoint) or a checkpoint."),
    out_dir: Path = typer.Option(..., "--out", help="A new directory for the Hugging Face checkpoint."),
    device: str = typer.Option("cpu", "--device", help="Where to merge the adapter: cpu (float32) or cuda (bf16)."),
) -> None:
    """Write a trained policy as a plain Hugging Face checkpoint (LoRA merged into the base): start another run
    from it (--set model.name=DIR), play it (--model DIR), or serve it with any Hugging Face tool."""
    from repertory.models.checkpoints import export_policy

    out.print(str(export_policy(run, out_dir, device)))

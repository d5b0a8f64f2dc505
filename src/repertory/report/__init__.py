"""A run's report: learning curves drawn from its metrics.jsonl into ``report/``, the self-contained page
``report/index.html`` (:mod:`repertory.report.page`), cross-play heat maps and the results table of many runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from repertory.config import load_config  # noqa: E402
from repertory.report.metrics import FIGURES, metric_series, read_metrics, with_final  # noqa: E402
from repertory.runs import RunDir  # noqa: E402
from repertory.stats import finite_number, format_mean_se, seed_summary  # noqa: E402
from repertory.types import RepertoryError  # noqa: E402


def write_report(
    run_dir: str | os.PathLike[str], max_episodes: int | None = None, on_warning: Callable[[str], None] | None = None
) -> list[Path]:
    """Draw every figure that has data and write ``report/index.html`` (at most ``max_episodes`` episodes, by
    default :data:`page.MAX_EPISODES`); returns the files written, the page last. Each episode or credit file
    that cannot be read is left out of the page and named to ``on_warning``."""
    from repertory.report.page import MAX_EPISODES, write_page

    run_dir = RunDir(run_dir)
    lines = with_final(read_metrics(run_dir))
    out_dir = run_dir.report
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, prefixes) in FIGURES.items():
        series = metric_series(lines, prefixes)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (xs, ys) in series.items():
            se_key = key.replace("eval/outcome", "eval/outcome_se", 1) if key.startswith("eval/outcome") else None
            errors = None
            if se_key:
                se = {line["iteration"]: line.get(se_key) for line in lines if key in line}
                errors = [se[x] if finite_number(se[x]) else 0.0 for x in xs]
            marker = "o" if len(xs) < 30 else None
            if errors and any(errors):
                ax.errorbar(xs, ys, yerr=errors, label=key, marker=marker, capsize=3)
            else:
                ax.plot(xs, ys, label=key, marker=marker)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    page, warnings = write_page(run_dir, MAX_EPISODES if max_episodes is None else max_episodes)
    for warning in warnings if on_warning is not None else []:
        on_warning(warning)
    return [*written, page]


def write_matrix_figure(
    path: str | Path, title: str, agents: list[str], panels: dict[str, dict[str, dict[str, float]]]
) -> Path:
    """Heat maps side by side under ``title``, one per titled matrix ``panel[row][column]`` of shares in
    [0, 1] over ``agents``, values printed in the cells; returns the file written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = 1.0 + 0.9 * len(agents)
    fig, axes = plt.subplots(1, len(panels), figsize=(size * len(panels) + 1.5, size + 1.0), squeeze=False)
    for ax, (title, matrix) in zip(axes[0], panels.items()):
        values = [[matrix[a][b] for b in agents] for a in agents]
        image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0)
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
        ax.set_xticks(range(len(agents)), agents, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(agents)), agents, fontsize=8)
        ax.set_xlabel("column agent")
        ax.set_ylabel("row agent")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# The results table of batch-online runs (docs/algorithms.md 5.7)

TABLE_METRICS = {"discounted_return": "held-out expected discounted return", "outcome": "held-out outcome"}
"""The scores a results table can hold: J at the method's discount (5.7), or the mean normalised outcome."""


@dataclass
class RunScores:
    """One run's held-out score (J, or the outcome): of the initial policy (``base``, evaluated before the
    first update), of the best and of the last trained checkpoint."""

    run: Path
    method: str
    env: str
    seed: int
    base: float | None
    best: float
    last: float


def run_scores(run_dir: str | os.PathLike[str], metric: str = "discounted_return") -> RunScores:
    """Read a run's config and metrics; the score of pi_k is ``eval/METRIC`` on iteration k's line (the
    policy before that iteration's update) or ``final/METRIC`` after the last one."""
    _check_metric(metric)
    run = RunDir.existing(run_dir)
    config = load_config(str(run.config))
    curve: dict[int, float] = {}
    for line in read_metrics(run):
        if f"eval/{metric}" in line:
            curve[int(line["iteration"])] = float(line[f"eval/{metric}"])
        if f"final/{metric}" in line:
            curve[int(line["iteration"]) + 1] = float(line[f"final/{metric}"])
    trained = {k: v for k, v in curve.items() if k >= 1}
    if not trained:
        raise RepertoryError(
            f"{run}: no held-out evaluation of a trained checkpoint in metrics.jsonl (train with eval.episodes > 0)"
        )
    best, last = max(trained.values()), trained[max(trained)]
    return RunScores(run.root, config.method_name, config.rollout.env, config.seed, curve.get(0), best, last)


@dataclass
class ResultsTable:
    """Methods x environments: mean and standard error over seeds, and the number of seeds, per cell;
    the ``base`` row is the initial policy of the same runs."""

    envs: list[str]
    methods: list[str]
    cells: dict[tuple[str, str], tuple[float, float, int]]
    checkpoint: str
    metric: str = "discounted_return"

    def text(self, method: str, env: str) -> str:
        cell = self.cells.get((method, env))
        return format_mean_se(cell[0], cell[1]) if cell else "—"

    def markdown(self) -> str:
        lines = ["| method | " + " | ".join(self.envs) + " |", "|---|" + "---|" * len(self.envs)]
        lines += [f"| {m} | " + " | ".join(self.text(m, e) for e in self.envs) + " |" for m in self.methods]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        rows = ["method,env,mean,se,seeds,checkpoint,metric"]
        for (method, env), (mean, se, n) in sorted(self.cells.items()):
            rows.append(f"{method},{env},{mean:.6f},{se:.6f},{n},{self.checkpoint},{self.metric}")
        return "\n".join(rows) + "\n"


def results_table(
    runs: Sequence[str | os.PathLike[str]], checkpoint: str = "best", metric: str = "discounted_return"
) -> ResultsTable:
    """The paper's table from runs (5.7): per method and environment, the held-out J (or outcome) of each
    seed's best (or last) in-training checkpoint, mean ± SE over seeds; the base row averages the initial
    policies."""
    if checkpoint not in ("best", "last"):
        raise RepertoryError(f"checkpoint must be best or last (got {checkpoint!r})")
    _check_metric(metric)
    scores = [run_scores(r, metric) for r in runs]
    seen: dict[tuple[str, str, int], Path] = {}
    for s in scores:
        key = (s.method, s.env, s.seed)
        if key in seen:
            raise RepertoryError(f"{seen[key]} and {s.run} are both {s.method} on {s.env} with seed {s.seed}")
        seen[key] = s.run
    per_cell: dict[tuple[str, str], list[float]] = {}
    base: dict[tuple[str, int], float] = {}
    for s in sorted(scores, key=lambda s: str(s.run)):
        per_cell.setdefault((s.method, s.env), []).append(s.best if checkpoint == "best" else s.last)
        if s.base is not None:
            base.setdefault((s.env, s.seed), s.base)
    for (env, _), value in sorted(base.items()):
        per_cell.setdefault(("base", env), []).append(value)
    cells = {key: (*seed_summary(values), len(values)) for key, values in per_cell.items()}
    envs = sorted({env for _, env in cells})
    methods = sorted({m for m, _ in cells}, key=lambda m: (m != "base", m))
    return ResultsTable(envs, methods, cells, checkpoint, metric)


def _check_metric(metric: str) -> None:
    if metric not in TABLE_METRICS:
        raise RepertoryError(f"metric must be one of {', '.join(TABLE_METRICS)} (got {metric!r})")

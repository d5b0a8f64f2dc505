"""A run's report: learning curves drawn from its metrics.jsonl into ``report/``, the self-contained page
``report/index.html`` (:mod:`repertory.report.page`), cross-play heat maps and the results table of many runs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from repertory.report.metrics import (  # noqa: E402
    FIGURES,
    J_IS_ZERO,
    SPLIT_NAMES,
    Series,
    metric_series,
    read_metrics,
    scale_title,
    split_by_scale,
    with_final,
)
from repertory.runs import NOT_RECORDED, RunDir, load_run_config  # noqa: E402
from repertory.stats import (  # noqa: E402
    MOST_SEEDS,
    Decision,
    Paired,
    decide,
    finite_number,
    format_mean_se,
    mean,
    paired_t,
    seed_summary,
)
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
        if series:
            written.append(_draw_figure(out_dir / filename, title, split_by_scale(series), lines))
    page, warnings = write_page(run_dir, MAX_EPISODES if max_episodes is None else max_episodes)
    for warning in warnings if on_warning is not None else []:
        on_warning(warning)
    return [*written, page]


def _draw_figure(path: Path, title: str, groups: list[Series], lines: list[dict[str, Any]]) -> Path:
    """One figure file, a panel per scale group (one axis never mixes a 0-55 payoff with 0-1 rates)."""
    fig, axes = plt.subplots(len(groups), 1, figsize=(7, 1.0 + 3.0 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups):
        for key, (xs, ys) in group.items():
            _draw_series(ax, key, xs, ys, lines)
        ax.set_title(scale_title(title, group, len(groups)), fontsize=10)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_series(ax: Any, key: str, xs: list[float], ys: list[float], lines: list[dict[str, Any]]) -> None:
    """One series; a held-out outcome with its standard errors as error bars."""
    errors = None
    if key.startswith("eval/outcome"):
        se_key = key.replace("eval/outcome", "eval/outcome_se", 1)
        se = {line["iteration"]: line.get(se_key) for line in lines if key in line}
        errors = [se[x] if finite_number(se[x]) else 0.0 for x in xs]
    marker = "o" if len(xs) < 30 else None
    if errors and any(errors):
        ax.errorbar(xs, ys, yerr=errors, label=key, marker=marker, capsize=3)
    else:
        ax.plot(xs, ys, label=key, marker=marker)


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

TABLE_METRICS = {"discounted_return": "expected discounted return", "outcome": "outcome"}
"""The scores a results table can hold: J at the method's gamma (5.7), or the mean normalised outcome."""


ITERATIONS = "iterations"
"""The checkpoint column of a training metric's table: each run's mean over its iterations, not one policy's."""

NO_VALIDATION = (
    "--checkpoint best selects on validation evaluations (eval/validation/*), and this run lacks them beside its "
    "trained held-out ones (trained before validation kernels existed, or with eval.validation false); selecting on "
    "held-out kernels would read high, so use --checkpoint last, or train again"
)


@dataclass
class RunScores:
    """One run's held-out score (J, or the outcome; on ``split``, the run's ``eval.split``): of the initial policy
    (``base``, evaluated before the first update), of the last trained checkpoint, and of the best one: the trained
    checkpoint with the highest validation score (after ``best_iteration`` updates; None where the run has no
    validation scores to choose by)."""

    run: Path
    method: str
    env: str
    seed: int
    base: float | None
    best: float | None
    last: float
    best_iteration: int | None = None
    split: str = "heldout"
    iterations: tuple[int, int] | None = None
    """A training metric's score (the mean over iterations): how many iterations logged a finite value, of all."""

    def score(self, checkpoint: str) -> float:
        """The held-out score of the "best" or the "last" checkpoint; RepertoryError where best cannot be chosen."""
        if checkpoint == "last":
            return self.last
        if self.best is None:
            raise RepertoryError(f"{self.run}: {NO_VALIDATION}")
        return self.best


def run_scores(run_dir: str | os.PathLike[str], metric: str = "discounted_return") -> RunScores:
    """Read a run's config and metrics; the score of pi_k is ``eval/METRIC`` on iteration k's line (the
    policy before that iteration's update) or ``final/METRIC`` after the last one, and its validation score
    ``eval/validation/METRIC`` or ``final/validation/METRIC``. A metric outside :data:`TABLE_METRICS` is one
    the run logs while it trains (``credit/quality_corr``, ``kl``...): its score is the mean over the iterations
    that log it, with no base and nothing to choose."""
    run = RunDir.existing(run_dir)
    config = load_run_config(run.config)
    lines = read_metrics(run)
    method, env = config.method_name, config.rollout.env
    if metric not in TABLE_METRICS:
        values = _iteration_values(run, lines, metric)
        iterations = (len(values), len(lines))
        return RunScores(
            run.root, method, env, config.seed, None, None, mean(values), split="train", iterations=iterations
        )
    held_out, validation = _curve(lines, metric), _curve(lines, f"validation/{metric}")
    trained = {k: v for k, v in held_out.items() if k >= 1}
    if not trained:
        raise RepertoryError(
            f"{run}: no held-out evaluation of a trained checkpoint in metrics.jsonl (train with eval.episodes > 0)"
        )
    best = _best_iteration(sorted(trained), validation)
    best_score = trained[best] if best is not None else None
    base, last = held_out.get(0), trained[max(trained)]
    return RunScores(run.root, method, env, config.seed, base, best_score, last, best, config.eval.split)


def _best_iteration(trained: list[int], validation: dict[int, float]) -> int | None:
    """The trained checkpoint (by updates) with the highest validation score, ties to the earlier one: chosen on
    validation kernels alone, its held-out score stays an unbiased estimate. One trained checkpoint needs no
    choosing; None where there are more and one of them has no validation score."""
    if len(trained) == 1:
        return trained[0]
    if any(k not in validation for k in trained):
        return None
    return max(trained, key=lambda k: (validation[k], -k))


def _iteration_values(run: RunDir, lines: list[dict[str, Any]], metric: str) -> list[float]:
    """The finite values of a training metric, one per iteration that logs one."""
    if metric.startswith(("eval/", "final/")):
        raise RepertoryError(
            f"{metric} is an evaluation's score: --metric {' or '.join(TABLE_METRICS)} tables the evaluations, "
            "of each run's last (or best) checkpoint"
        )
    values = [float(line[metric]) for line in lines if finite_number(line.get(metric))]
    if not values:
        logged = "logs no finite value of" if any(metric in line for line in lines) else "logs no"
        raise RepertoryError(
            f"{run}: metrics.jsonl {logged} {metric!r}; a table holds the held-out {' or '.join(TABLE_METRICS)}, "
            "or the mean over iterations of a metric every run logs (e.g. credit/quality_corr)"
        )
    return values


def _curve(lines: list[dict[str, Any]], metric: str) -> dict[int, float]:
    """Iteration k -> the score ``metric`` of pi_k: ``eval/METRIC`` on line k, ``final/METRIC`` on the last line."""
    curve: dict[int, float] = {}
    for line in lines:
        if f"eval/{metric}" in line:
            curve[int(line["iteration"])] = float(line[f"eval/{metric}"])
        if f"final/{metric}" in line:
            curve[int(line["iteration"]) + 1] = float(line[f"final/{metric}"])
    return curve


@dataclass
class ResultsTable:
    """Methods x environments: mean and standard error over seeds, and the number of seeds, per cell;
    the ``base`` row is the initial policy of the same runs. ``contrasts`` pairs every two rows of an
    environment by seed: (later row, earlier row, env) -> the t-test of their per-seed differences."""

    envs: list[str]
    methods: list[str]
    cells: dict[tuple[str, str], tuple[float, float, int]]
    checkpoint: str
    metric: str = "discounted_return"
    why: str = ""
    """Why the table holds the outcome where none was asked for (see :func:`default_metric`); else empty."""
    contrasts: dict[tuple[str, str, str], Paired] = field(default_factory=dict)
    split: str = "heldout"
    """The kernel split its runs were evaluated on: a validation table is for choosing, a held-out one reports."""
    effect: float | None = None
    """The smallest effect of interest: where given, each contrast says what it decides at ±effect and how many
    seeds would decide what it leaves open (:func:`repertory.stats.decide`)."""
    partial: str = ""
    """A training metric's table: the runs whose mean leaves out iterations without a finite value; else empty."""
    precisions: str = ""
    """Which runs trained in which precision, where they do not all agree (:func:`_mixed_precisions`); else empty."""

    @property
    def title(self) -> str:
        """What the table holds, e.g. "held-out outcome, last checkpoint, mean ± SE over seeds"."""
        if self.checkpoint == ITERATIONS:
            return f"{self.metric}, mean over each run's iterations, mean ± SE over seeds"
        what = f"{SPLIT_NAMES[self.split]} {TABLE_METRICS[self.metric]}"
        return f"{what}, {self.checkpoint} checkpoint, mean ± SE over seeds"

    def text(self, method: str, env: str) -> str:
        cell = self.cells.get((method, env))
        if cell is None:
            return "—"
        value, se, seeds = cell
        return format_mean_se(value, se) if seeds > 1 else f"{value:.2f} (1 seed)"  # one seed has no SE to show

    @property
    def decision_columns(self) -> list[str]:
        """The headers of :meth:`contrast_rows` after "seeds": with an ``effect``, the decision and the seeds to
        decide; else none."""
        return [f"at ±{self.effect:g}", "seeds to decide"] if self.effect is not None else []

    def contrast_rows(self) -> list[list[str]]:
        """Each paired comparison as table cells: rows, environment, difference ± SE, 95% CI, p, seeds, and with
        an ``effect`` what it decides and the seeds that would decide the rest ("—" where nothing is open)."""
        rows = []
        for (a, b, env), c in self.contrasts.items():
            row = [f"{a} − {b}", env, f"{c.mean:+.3f} ± {c.se:.3f}", f"{c.low:+.3f} to {c.high:+.3f}", _p_text(c.p)]
            row.append(str(c.seeds))
            if self.effect is not None:
                decision = decide(c, self.effect)
                row += [decision.label, _seeds_text(decision)]
            rows.append(row)
        return rows

    def markdown(self) -> str:
        if self.checkpoint == ITERATIONS:
            rows = f"method ({self.metric}, mean over iterations)"
        else:
            rows = "method" if self.split == "heldout" else f"method ({SPLIT_NAMES[self.split]} kernels)"
        lines = [f"| {rows} | " + " | ".join(self.envs) + " |", "|---|" + "---|" * len(self.envs)]
        lines += [f"| {m} | " + " | ".join(self.text(m, e) for e in self.envs) + " |" for m in self.methods]
        if self.contrasts:
            columns = ["paired over seeds", "env", "difference ± SE", "95% CI", "p (t, seeds − 1 df)", "seeds"]
            columns += self.decision_columns
            lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(row) + " |" for row in self.contrast_rows()]
        lines += ["", note] if (note := self.notes) else []
        return "\n".join(lines) + "\n"

    @property
    def notes(self) -> str:
        """What a reader must know beside the numbers: partial means, mixed precisions (one per line)."""
        return "\n".join(note for note in (self.partial, self.precisions) if note)

    def csv(self) -> str:
        rows = ["method,env,mean,se,seeds,checkpoint,metric,split"]
        for (method, env), (value, se, n) in sorted(self.cells.items()):
            rows.append(f"{method},{env},{value:.6f},{se:.6f},{n},{self.checkpoint},{self.metric},{self.split}")
        return "\n".join(rows) + "\n"

    def contrasts_csv(self) -> str:
        """One line per contrast; ``effect``, ``decided`` and ``seeds_to_decide`` are empty without an effect, and
        ``seeds_to_decide`` where nothing is left open or more than :data:`~repertory.stats.MOST_SEEDS` would do."""
        rows = ["method,minus,env,difference,se,ci_low,ci_high,p,seeds,checkpoint,metric,split," + CSV_DECISION]
        for (a, b, env), c in self.contrasts.items():
            decision = decide(c, self.effect) if self.effect is not None else Decision("", True)
            effect = "" if self.effect is None else f"{self.effect:g}"
            seeds = "" if decision.seeds is None else str(decision.seeds)
            rows.append(
                f"{a},{b},{env},{c.mean:.6f},{c.se:.6f},{c.low:.6f},{c.high:.6f},{c.p:.6g},{c.seeds},"
                f"{self.checkpoint},{self.metric},{self.split},{effect},{decision.label},{seeds}"
            )
        return "\n".join(rows) + "\n"

    def write(self, directory: Path) -> list[Path]:
        """``table.md``, ``table.csv`` and ``contrasts.csv`` in ``directory``; their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        written = {"table.md": self.markdown(), "table.csv": self.csv(), "contrasts.csv": self.contrasts_csv()}
        for name, text in written.items():
            (directory / name).write_text(text)
        return [directory / name for name in written]


CSV_DECISION = "effect,decided,seeds_to_decide"


def _p_text(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def _seeds_text(decision: Decision) -> str:
    if decision.settled:
        return "—"
    return f"about {decision.seeds}" if decision.seeds is not None else f"over {MOST_SEEDS:,}"


BASE = "base"
"""The row of the initial policies, evaluated before the first update."""

POOLED = "pooled"
"""The environment of a contrast over the (environment, seed) pairs of every environment together."""


def paired_contrasts(
    per_seed: dict[tuple[str, str], dict[int, float]],
    methods: list[str],
    own_bases: dict[tuple[str, str], dict[int, float]] | None = None,
) -> dict[tuple[str, str, str], Paired]:
    """Every later row of ``methods`` against every earlier one on the same environment, paired by the seeds
    both have (at least 2): the base row first, so each method is also compared with its initial policy — its
    own runs' (``own_bases``, by method and environment) where given. Where two rows share seeds in more than
    one environment, also over all their (environment, seed) pairs (:data:`POOLED`; t with pairs − 1 degrees of
    freedom)."""
    out = {}
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (b, env), row in sorted(per_seed.items(), key=lambda item: (item[0][1], methods.index(item[0][0]))):
        for a in methods[methods.index(b) + 1 :]:
            later = per_seed.get((a, env), {})
            earlier = (own_bases or {}).get((a, env), row) if b == BASE else row
            differences = [later[s] - earlier[s] for s in sorted(set(earlier) & set(later))]
            if len(differences) >= 2:
                out[(a, b, env)] = paired_t(differences)
            if differences:
                pooled.setdefault((a, b), {})[env] = differences
    for (a, b), by_env in pooled.items():
        if len(by_env) > 1:
            out[(a, b, POOLED)] = paired_t([d for differences in by_env.values() for d in differences])
    return out


def default_metric(runs: Sequence[str | os.PathLike[str]]) -> tuple[str, str]:
    """The score of a table of ``runs`` where none is asked for, and why when it is not J: J (5.7), unless a
    run's ``method.gamma`` is 0, where J is 0 for every policy that plays more than one turn. A table holds one
    score, so then every run's cell is its outcome, which a gamma-0 run's J would otherwise read 0 beside."""
    flat = [RunDir.existing(run).name for run in runs if _gamma(run) == 0]
    if not flat:
        return "discounted_return", ""
    who = flat[0] if len(flat) == 1 else f"{len(flat)} of the {len(runs)} runs"
    return "outcome", f"the outcome, not J: method.gamma is 0 in {who}, and {J_IS_ZERO}"


def _gamma(run: str | os.PathLike[str]) -> float:
    return load_run_config(RunDir.existing(run).config).method.gamma


def results_table(
    runs: Sequence[str | os.PathLike[str]],
    checkpoint: str = "last",
    metric: str | None = None,
    effect: float | None = None,
) -> ResultsTable:
    """The paper's table from runs (5.7): per method and environment, the held-out J (or outcome) of each
    seed's last (or best) in-training checkpoint, mean ± SE over seeds, and the paired comparisons of its rows;
    the base row averages the initial policies. "best" is the checkpoint with the best validation score (see
    :func:`run_scores`); a run without validation evaluations is refused. Without a ``metric``,
    :func:`default_metric` chooses. Runs evaluated on validation kernels (``eval.split``: a suite that chooses
    a setting) make a validation table, named so; one table never mixes splits. With ``effect``, the smallest
    effect of interest, each contrast also says what it decides and the seeds that would decide the rest. A
    ``metric`` the runs log while they train (e.g. ``credit/quality_corr``) tables each run's mean over its
    iterations, paired by seed the same way (:func:`run_scores`)."""
    if checkpoint not in ("best", "last"):
        raise RepertoryError(f"checkpoint must be best or last (got {checkpoint!r})")
    if effect is not None and not (math.isfinite(effect) and effect > 0):
        raise RepertoryError(f"the smallest effect of interest must be a positive number (got {effect})")
    metric, why = default_metric(runs) if metric is None else (metric, "")
    if metric not in TABLE_METRICS and checkpoint == "best":
        raise RepertoryError(f"--checkpoint best chooses among evaluated checkpoints, and {metric} is a training "
                             "metric, averaged over each run's iterations: use --checkpoint last")  # fmt: skip
    scores = [run_scores(r, metric) for r in runs]
    splits = {s.split: s.run for s in scores}
    if len(splits) > 1:
        named = ", ".join(f"{run} on {split}" for split, run in splits.items())
        raise RepertoryError(f"one table holds one kernel split, but its runs were evaluated on several ({named})")
    seen: dict[tuple[str, str, int], Path] = {}
    for s in scores:
        key = (s.method, s.env, s.seed)
        if key in seen:
            raise RepertoryError(f"{seen[key]} and {s.run} are both {s.method} on {s.env} with seed {s.seed}")
        seen[key] = s.run
    per_seed: dict[tuple[str, str], dict[int, float]] = {}
    own_bases: dict[tuple[str, str], dict[int, float]] = {}
    for s in sorted(scores, key=lambda s: str(s.run)):
        per_seed.setdefault((s.method, s.env), {})[s.seed] = s.score(checkpoint)
        if s.base is not None:
            own_bases.setdefault((s.method, s.env), {})[s.seed] = s.base
    per_seed.update(_base_rows(own_bases))
    cells = {key: (*seed_summary(list(values.values())), len(values)) for key, values in per_seed.items()}
    envs = sorted({env for _, env in cells})
    methods = sorted({m for m, _ in cells}, key=lambda m: (m != BASE, m))
    contrasts = paired_contrasts(per_seed, methods, own_bases)
    split = next(iter(splits), "heldout")
    checkpoint = checkpoint if metric in TABLE_METRICS else ITERATIONS
    partial, precisions = _partial(scores), _mixed_precisions([s.run for s in scores])
    return ResultsTable(envs, methods, cells, checkpoint, metric, why, contrasts, split, effect, partial, precisions)


def _mixed_precisions(runs: list[Path]) -> str:
    """The precisions the runs trained in (:meth:`RunDir.precisions`), where they do not all agree: arms of a seed
    trained in float32 and in bfloat16 differ by more than their method (a suite continued on another machine,
    where ``model.precision: auto`` resolves otherwise). The most common precision by its count, the rest by
    name; empty where every run trained in the same (or none recorded any)."""
    groups: dict[str, list[str]] = {}
    for run in map(RunDir, runs):
        groups.setdefault(" then ".join(run.precisions()) or NOT_RECORDED, []).append(run.name)
    if len(groups) < 2:
        return ""
    common, *rest = sorted(groups, key=lambda precision: (-len(groups[precision]), precision))
    count = f"{len(groups[common])} run{'s' * (len(groups[common]) > 1)}"
    named = "; ".join(f"{precision}: {', '.join(groups[precision])}" for precision in rest)
    return f"trained in more than one precision (sessions.jsonl): {common}: {count}; {named}"


def _partial(scores: list[RunScores]) -> str:
    """Which runs' means of a training metric leave out iterations (it is not defined in every one: a rank
    correlation over a batch without spread), so that a reader sees what each mean is over; empty for scores of
    evaluations."""
    counts = [(s.run.name, *s.iterations) for s in scores if s.iterations is not None]
    short = [f"{name} {used} of {total}" for name, used, total in counts if used < total]
    if not short:
        return ""
    return f"iterations with a finite value, where fewer than all: {', '.join(short)}"


def _base_rows(own_bases: dict[tuple[str, str], dict[int, float]]) -> dict[tuple[str, str], dict[int, float]]:
    """The base row of each environment: per seed, the mean of its runs' initial scores. The arms of a seed
    usually share one start evaluation, so this is that score; where they do not (an arm's own evaluation
    settings, J at its own discount, runs from different machines), each arm is still paired with its own."""
    gathered: dict[tuple[str, int], list[float]] = {}
    for (_, env), by_seed in own_bases.items():
        for seed, score in by_seed.items():
            gathered.setdefault((env, seed), []).append(score)
    rows: dict[tuple[str, str], dict[int, float]] = {}
    for (env, seed), scores in sorted(gathered.items()):
        rows.setdefault((BASE, env), {})[seed] = mean(scores)
    return rows

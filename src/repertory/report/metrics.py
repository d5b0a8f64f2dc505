"""A run's metrics lines and the series the figures and the page draw from them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from repertory.envs import KeyMetric
from repertory.runs import RunDir
from repertory.stats import finite_number

FIGURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "outcome.png": ("Normalised outcome of the trained seats", ("outcome", "eval/outcome")),
    "losses.png": ("Losses", ("loss/",)),
    "kl_entropy.png": ("KL to the reference and entropy (nats per token)", ("kl", "entropy")),
    "environment.png": ("Environment metrics (rollouts)", ("env/",)),
    "throughput.png": ("Throughput (tokens/s)", ("throughput/",)),
}

SPLIT_NAMES = {"heldout": "held-out", "validation": "validation", "train": "train"}
"""A kernel split (a run's ``eval.split``) as a table's title and the progress lines name its evaluations."""


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The metrics lines of a run (a torn last line from a kill is skipped)."""
    path = RunDir(run_dir).metrics
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def with_final(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation after the last update (``final/*`` keys) as a point one iteration later."""
    out = []
    for line in lines:
        out.append(line)
        final = {f"eval/{k[6:]}": v for k, v in line.items() if k.startswith("final/")}
        if final:
            out.append({"iteration": line["iteration"] + 1, **final})
    return out


def is_standard_error(key: str) -> bool:
    """Whether a metric is the standard error of another (``eval/outcome_se``, ``eval/outcome_se/Alice``)."""
    return any(part.endswith("_se") for part in key.split("/"))


def metric_series(lines: list[dict[str, Any]], prefixes: tuple[str, ...]) -> dict[str, tuple[list[float], list[float]]]:
    """(iterations, values) of every key equal to or under one of ``prefixes`` (standard errors aside), from the
    lines where it is a finite number (elsewhere a gap)."""
    keys = sorted(
        {
            k
            for line in lines
            for k, v in line.items()
            if finite_number(v) and not is_standard_error(k) and any(k == p or k.startswith(p) for p in prefixes)
        }
    )
    out = {}
    for key in keys:
        points = [(line["iteration"], line[key]) for line in lines if finite_number(line.get(key))]
        out[key] = ([x for x, _ in points], [y for _, y in points])
    return out


J_IS_ZERO = (
    "J = gamma^(n-1) x outcome is then 0 for every game in which the agent took more than one turn, whatever it played"
)
"""Why J says nothing of a run whose discount is 0 (docs/algorithms.md 5.7): its tables show the outcome."""

SCALE_RATIO = 5.0
"""Series share an axis only where their largest magnitudes are within this factor of each other."""

Series = dict[str, tuple[list[float], list[float]]]


def _in_unit_range(ys: list[float]) -> bool:
    return all(0 <= y <= 1 for y in ys)


def _magnitude(ys: list[float]) -> float:
    return max(abs(y) for y in ys)


def split_by_scale(series: Series) -> list[Series]:
    """The series in groups that can share an axis: rates and shares (every value in [0, 1]) apart from the
    rest, and within each, magnitudes no more than :data:`SCALE_RATIO` apart, so a 0-55 payoff never flattens a
    0-1 rate; groups in order of magnitude, rates first, each keeping the series' own order."""
    order = sorted(series, key=lambda k: (not _in_unit_range(series[k][1]), -_magnitude(series[k][1])))
    groups: list[list[str]] = []
    for key in order:
        ys = series[key][1]
        top = series[groups[-1][0]][1] if groups else None
        same_kind = top is not None and _in_unit_range(ys) == _in_unit_range(top)
        # an all-zero series (nothing invalid, no draw) says nothing of scale: it joins the group before it
        if same_kind and (_magnitude(ys) == 0 or _magnitude(ys) * SCALE_RATIO >= _magnitude(top)):
            groups[-1].append(key)
        else:
            groups.append([key])
    return [{key: series[key] for key in series if key in group} for group in groups]


def scale_title(title: str, group: Series, groups: int) -> str:
    """A figure's title, naming which of its ``groups`` scales ``group`` draws where it was split."""
    if groups == 1:
        return title
    if len(group) == 1:
        return f"{title}: {next(iter(group))}"
    if all(_in_unit_range(ys) for _, ys in group.values()):
        return f"{title}: rates and shares (0-1)"
    return f"{title}: values up to {max(_magnitude(ys) for _, ys in group.values()):.3g}"


@dataclass(frozen=True)
class HeldOutChange:
    """The held-out outcome of the policy before the first update and after the last, each with its standard
    error over evaluation games: the run's headline, whether it learned."""

    first_iteration: int
    last_iteration: int
    before: float
    before_se: float
    after: float
    after_se: float

    @property
    def rise(self) -> float:
        return self.after - self.before

    @property
    def standard_errors(self) -> float | None:
        """The rise in standard errors of the difference of two independent means; None when neither evaluation
        varied (every game the same outcome), where a ratio would claim certainty the games cannot give."""
        spread = math.hypot(self.before_se, self.after_se)
        return self.rise / spread if spread > 0 else None

    def describe(self) -> str:
        """One line: "0.795 ± 0.018 -> 0.935 ± 0.020 (+0.140, 5.2 SE)"."""
        z = self.standard_errors
        size = f"{z:.1f} SE" if z is not None else "no spread"
        return (
            f"{self.before:.3f} ± {self.before_se:.3f} -> {self.after:.3f} ± {self.after_se:.3f} "
            f"({self.rise:+.3f}, {size})"
        )


def held_out_change(lines: list[dict[str, Any]]) -> HeldOutChange | None:
    """The first and the last held-out evaluation of the metrics lines (the last is normally ``final/*``), or
    None when the run has fewer than two. A missing standard error counts as 0."""
    ends = _first_and_last(lines, "eval/outcome")
    if ends is None:
        return None
    first, last = ends
    return HeldOutChange(
        first["iteration"],
        last["iteration"],
        first["eval/outcome"],
        _or_zero(first.get("eval/outcome_se")),
        last["eval/outcome"],
        _or_zero(last.get("eval/outcome_se")),
    )


def _first_and_last(lines: list[dict[str, Any]], key: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The first and the last metrics line (``final/*`` read as one iteration later) with a finite ``key``, or
    None when fewer than two have it."""
    points = [line for line in with_final(lines) if finite_number(line.get(key))]
    return (points[0], points[-1]) if len(points) >= 2 else None


def _or_zero(value: Any) -> float:
    return value if finite_number(value) else 0.0


@dataclass(frozen=True)
class BehaviourChange:
    """The game's key behaviour (its :class:`~repertory.envs.KeyMetric`) at the first and the last held-out
    evaluation: what the policy learned, next to the headline's outcome."""

    metric: KeyMetric
    first_iteration: int
    last_iteration: int
    before: float
    after: float

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def verdict(self) -> str:
        """The game's words for the change: "it defects more" (IPD, cooperation down)."""
        if self.after == self.before:
            return "unchanged"
        return self.metric.rises if self.after > self.before else self.metric.falls

    def describe(self) -> str:
        """One line: "mutual cooperation 0.750 -> 0.650 (-0.100): it defects more"."""
        return f"{self.metric.label} {self.before:.3f} -> {self.after:.3f} ({self.change:+.3f}): {self.verdict}"


def behaviour_change(lines: list[dict[str, Any]], metric: KeyMetric) -> BehaviourChange | None:
    """The held-out mean of ``metric`` (``eval/env/NAME``) at the first and the last evaluation that report it,
    or None when fewer than two do."""
    key = f"eval/env/{metric.name}"
    ends = _first_and_last(lines, key)
    if ends is None:
        return None
    first, last = ends
    return BehaviourChange(metric, first["iteration"], last["iteration"], first[key], last[key])

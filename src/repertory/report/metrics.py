"""A run's metrics lines and the series the figures and the page draw from them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from repertory.runs import RunDir
from repertory.stats import finite_number

FIGURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "outcome.png": ("Normalised outcome of the trained seats", ("outcome", "eval/outcome")),
    "losses.png": ("Losses", ("loss/",)),
    "kl_entropy.png": ("KL to the reference and entropy (nats per token)", ("kl", "entropy")),
    "environment.png": ("Environment metrics (rollouts)", ("env/",)),
    "throughput.png": ("Throughput (tokens/s)", ("throughput/",)),
}


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
    points = [
        (line["iteration"], line["eval/outcome"], line.get("eval/outcome_se"))
        for line in with_final(lines)
        if finite_number(line.get("eval/outcome"))
    ]
    if len(points) < 2:
        return None
    (first, before, before_se), (last, after, after_se) = points[0], points[-1]
    return HeldOutChange(first, last, before, _or_zero(before_se), after, _or_zero(after_se))


def _or_zero(value: Any) -> float:
    return value if finite_number(value) else 0.0

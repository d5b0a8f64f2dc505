"""A run's metrics lines and the series the figures and the page draw from them."""

from __future__ import annotations

import json
import os
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


def metric_series(
    lines: list[dict[str, Any]], prefixes: tuple[str, ...]
) -> dict[str, tuple[list[float], list[float]]]:
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

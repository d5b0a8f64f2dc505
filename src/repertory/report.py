"""Figures: learning curves of a run, drawn from its metrics.jsonl into ``report/``, and cross-play heat maps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FIGURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "outcome.png": ("Normalised outcome of the trained seats", ("outcome", "eval/outcome")),
    "losses.png": ("Losses", ("loss/",)),
    "kl_entropy.png": ("KL to the reference and entropy (nats per token)", ("kl", "entropy")),
    "environment.png": ("Environment metrics (rollouts)", ("env/",)),
    "throughput.png": ("Throughput (tokens/s)", ("throughput/",)),
}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics lines of a run (a torn last line from a kill is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _with_final(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation after the last update (``final/*`` keys) as a point one iteration later."""
    out = []
    for line in lines:
        out.append(line)
        final = {f"eval/{k[6:]}": v for k, v in line.items() if k.startswith("final/")}
        if final:
            out.append({"iteration": line["iteration"] + 1, **final})
    return out


def _series(lines: list[dict[str, Any]], prefixes: tuple[str, ...]) -> dict[str, tuple[list[float], list[float]]]:
    keys = sorted(
        {
            k
            for line in lines
            for k, v in line.items()
            if isinstance(v, (int, float)) and "_se" not in k and any(k == p or k.startswith(p) for p in prefixes)
        }
    )
    out = {}
    for key in keys:
        xs = [line["iteration"] for line in lines if key in line]
        ys = [line[key] for line in lines if key in line]
        out[key] = (xs, ys)
    return out


def write_report(run_dir: str | Path) -> list[Path]:
    """Draw every figure that has data; returns the files written."""
    run_dir = Path(run_dir)
    lines = _with_final(read_metrics(run_dir))
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, prefixes) in FIGURES.items():
        series = _series(lines, prefixes)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (xs, ys) in series.items():
            se_key = key.replace("eval/outcome", "eval/outcome_se", 1) if key.startswith("eval/outcome") else None
            errors = [line.get(se_key, 0.0) for line in lines if key in line] if se_key else None
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
    return written


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

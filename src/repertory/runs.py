"""The run directory: its name, its checkpoints, and what resuming keeps.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per iteration),
``episodes/iter-K.parquet``, ``credit/iter-K.parquet`` (each trained turn's advantage and return),
``checkpoints/NNNNNN/`` and ``report/`` (figures and the self-contained ``index.html``). A checkpoint directory
is written under a temporary name, fsynced, marked ``COMPLETE`` and renamed, so a run killed at any moment
resumes from its newest complete checkpoint; :func:`truncate_after` drops what an interrupted iteration wrote
after it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from repertory.config import TrainConfig, load_config
from repertory.types import RepertoryError

CHECKPOINT = re.compile(r"^\d{6}$")
COMPLETE = "COMPLETE"


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories that were completely written, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if CHECKPOINT.match(p.name) and (p / COMPLETE).is_file())


def new_run_dir(config: TrainConfig) -> Path:
    """A fresh run directory under ``output_dir`` (the name, or <estimator>-<env>-<timestamp>)."""
    root = Path(config.output_dir)
    if config.name:
        path = root / config.name
        if path.exists():
            raise RepertoryError(f"run directory {path} already exists; continue it with --resume {path} or rename")
        return path
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{config.algo.estimator}-{config.rollout.env}-{stamp}"
    path, n = root / base, 2
    while path.exists():
        path, n = root / f"{base}-{n}", n + 1
    return path


def _iteration_of(line: str) -> int:
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def resolve_checkpoint(path: str | Path) -> tuple[Path, TrainConfig]:
    """A run directory (its newest complete checkpoint) or a checkpoint directory, with the run's config."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        checkpoints = complete_checkpoints(path)
        if not checkpoints:
            raise RepertoryError(f"run {path} has no complete checkpoint yet")
        return checkpoints[-1], load_config(str(path / "config.yaml"))
    if (path / COMPLETE).is_file() and (path.parent.parent / "config.yaml").is_file():
        return path, load_config(str(path.parent.parent / "config.yaml"))
    raise RepertoryError(f"{path} is neither a run directory (config.yaml) nor a complete checkpoint (COMPLETE)")


def is_run_or_checkpoint(path: str | Path) -> bool:
    """True for a run directory or one of its checkpoint directories."""
    path = Path(path)
    return (path / "config.yaml").is_file() or (path / COMPLETE).is_file()


def write_checkpoint(run_dir: Path, done: int, fill: Callable[[Path], None], keep: int) -> Path:
    """Write checkpoint ``done`` (iterations completed): ``fill`` writes its files into a temporary directory,
    which is fsynced, marked complete and renamed into place; only the newest ``keep`` checkpoints stay."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{done:06d}"
    tmp = root / f".tmp-{done:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    (tmp / COMPLETE).write_text("")
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def truncate_after(run_dir: Path, done: int) -> None:
    """Discard what the run wrote after its checkpoint ``done``: half-written checkpoint directories, metrics
    lines, episode and credit files of later iterations, so the continued run equals an uninterrupted one."""
    for stale in (run_dir / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        kept = [line for line in metrics_path.read_text().splitlines() if _iteration_of(line) < done]
        tmp = metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics_path)
    for part in [*(run_dir / "episodes").glob("iter-*.parquet"), *(run_dir / "credit").glob("iter-*.parquet")]:
        if int(part.stem.split("-")[1]) >= done:
            part.unlink()
    (run_dir / "episodes").mkdir(parents=True, exist_ok=True)

"""The run directory: every path in it, its name, its checkpoints, and what resuming keeps.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per iteration),
``episodes/iter-K.parquet``, ``credit/iter-K.parquet`` (each trained turn's advantage and return),
``heldout/iter-K.parquet`` (the games of the final held-out evaluation, after K updates),
``rounds/turns-K.parquet`` (a deployment round's logged turns), ``snapshots/K.safetensors`` (the opponent pool),
``checkpoints/NNNNNN/``, ``report/`` (figures and the self-contained ``index.html``), ``served/`` (conversations
logged by ``repertory serve``) and the trackers' files (``tensorboard/``, ``wandb/``, ``wandb-run-id``).
:class:`RunDir` is the one place that spells these paths. A checkpoint directory is written under a temporary
name, fsynced, marked ``COMPLETE`` and renamed, so a run killed at any moment resumes from its newest complete
checkpoint; :meth:`RunDir.truncate_after` drops what an interrupted iteration wrote after it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from repertory.config import TrainConfig, load_config
from repertory.types import RepertoryError

CHECKPOINT = re.compile(r"^\d{6}$")
COMPLETE = "COMPLETE"
ITERATION_FOLDERS = ("episodes", "credit")  # one iter-K.parquet per iteration; resuming drops the later ones


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _numbered(folder: Path, pattern: str, prefix: str) -> dict[int, Path]:
    """The files of ``folder`` matching ``pattern`` by the number after ``prefix`` in their stem."""
    if not folder.is_dir():
        return {}
    out = {}
    for path in folder.glob(pattern):
        number = path.stem.removeprefix(prefix)
        if number.isdigit():
            out[int(number)] = path
    return dict(sorted(out.items()))


NOT_RECORDED = "not recorded"
"""The precision of training that logged no session line (before runs recorded where they trained)."""


def session_precision(line: dict[str, Any]) -> str:
    """What a ``sessions.jsonl`` line says the products ran in: on a CPU (or a line without a device, from before
    sessions named one) ``model.precision`` resolved, bfloat16 or float32; elsewhere the weights' own dtype on the
    device's kind (``bfloat16 on cuda``), which ``model.precision`` does not set there."""
    device = str(line.get("device") or "cpu")
    if device.startswith("cpu"):
        return str(line["precision"])
    return f"{line.get('weights', 'unrecorded weights')} on {device.split(':')[0]}"


@dataclass(frozen=True)
class RunDir:
    """Every path of one run directory (see the module docstring); it may not exist yet."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]):
        object.__setattr__(self, "root", Path(root))

    def __fspath__(self) -> str:
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)

    def __truediv__(self, name: str | os.PathLike[str]) -> Path:
        """A path inside the run that this class does not name (a user's own files); repertory's own paths
        come from the properties and methods below."""
        return self.root / name

    @property
    def name(self) -> str:
        return self.root.name

    @classmethod
    def existing(cls, root: str | os.PathLike[str]) -> RunDir:
        """The run directory at ``root``; a one-line error when it holds no ``config.yaml``."""
        run = cls(root)
        if not run.is_run():
            raise RepertoryError(f"{run.root} is not a run directory (no config.yaml)")
        return run

    @classmethod
    def of_checkpoint(cls, checkpoint: str | os.PathLike[str]) -> RunDir:
        """The run a checkpoint directory (``RUN/checkpoints/NNNNNN``) belongs to."""
        return cls(Path(checkpoint).parent.parent)

    def is_run(self) -> bool:
        return self.config.is_file()

    def create(self, config_yaml: str) -> None:
        """Make the directory and write the run's resolved config into it."""
        self.episodes(0).parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_yaml)

    # files and folders

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def sessions(self) -> Path:
        """One JSON line per stretch of training (a start or a resume): where and on what it ran."""
        return self.root / "sessions.jsonl"

    def precisions(self) -> list[str]:
        """What its training's products ran in (:func:`session_precision`), first seen first, from
        :attr:`sessions`; :data:`NOT_RECORDED` for training before sessions were logged (a run with metrics and no
        sessions, or whose first session resumes after iteration 0). A line a crash tore is skipped, as metrics
        lines are."""
        lines = []
        if self.sessions.is_file():
            for text in self.sessions.read_text().splitlines():
                try:
                    line = json.loads(text)
                    lines.append((int(line.get("from_iteration", 0)), session_precision(line)))
                except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
                    continue
        trained = self.metrics.is_file() and self.metrics.stat().st_size > 0
        unrecorded = lines[0][0] > 0 if lines else trained
        return list(dict.fromkeys([NOT_RECORDED] * unrecorded + [precision for _, precision in lines]))

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def page(self) -> Path:
        return self.report / "index.html"

    @property
    def served(self) -> Path:
        return self.root / "served"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_id(self) -> Path:
        return self.root / "wandb-run-id"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def snapshots_dir(self) -> Path:
        return self.root / "snapshots"

    def episodes(self, iteration: int) -> Path:
        """Iteration ``iteration``'s episodes (a deployment round's conversations)."""
        return self.root / "episodes" / f"iter-{iteration:06d}.parquet"

    def credit(self, iteration: int) -> Path:
        """Iteration ``iteration``'s per-turn advantages and returns."""
        return self.root / "credit" / f"iter-{iteration:06d}.parquet"

    def heldout(self, done: int) -> Path:
        """The games of the held-out evaluation of the policy after ``done`` updates (the trainer keeps the
        final evaluation's, so the report can show the trained policy playing)."""
        return self.root / "heldout" / f"iter-{done:06d}.parquet"

    def turns(self, round_index: int) -> Path:
        """Deployment round ``round_index``'s logged turns."""
        return self.root / "rounds" / f"turns-{round_index:06d}.parquet"

    def snapshot(self, iteration: int) -> Path:
        """The opponent pool's snapshot of the live adapter at ``iteration``."""
        return self.snapshots_dir / f"{iteration:06d}.safetensors"

    def checkpoint(self, done: int) -> Path:
        """Checkpoint ``done`` (iterations completed)."""
        return self.checkpoints_dir / f"{done:06d}"

    def iteration_files(self, folder: str) -> list[Path]:
        """The ``iter-K.parquet`` files of ``folder`` (one of :data:`ITERATION_FOLDERS`), by iteration."""
        return list(_numbered(self.root / folder, "iter-*.parquet", "iter-").values())

    def snapshots(self) -> list[int]:
        """Iterations whose snapshot is on disk, oldest first."""
        return list(_numbered(self.snapshots_dir, "*.safetensors", ""))

    def crossplay_results(self) -> list[Path]:
        """Cross-play results saved into the run (``crossplay-*.json``, in the run or its report folder)."""
        return sorted([*self.root.glob("crossplay-*.json"), *self.report.glob("crossplay-*.json")])

    # checkpoints

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoint directories that were completely written, oldest first."""
        root = self.checkpoints_dir
        if not root.is_dir():
            return []
        return sorted(p for p in root.iterdir() if CHECKPOINT.match(p.name) and (p / COMPLETE).is_file())

    def write_checkpoint(self, done: int, fill: Callable[[Path], None], keep: int) -> Path:
        """Write checkpoint ``done``: ``fill`` writes its files into a temporary directory, which is fsynced,
        marked complete and renamed into place; only the newest ``keep`` checkpoints stay."""
        tmp = self.begin_checkpoint(done)
        fill(tmp)
        return self.finish_checkpoint(done, tmp, keep)

    def begin_checkpoint(self, done: int) -> Path:
        """The empty temporary directory checkpoint ``done`` is written into (several processes may write into
        it before :meth:`finish_checkpoint`)."""
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoints_dir / f".tmp-{done:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def finish_checkpoint(self, done: int, tmp: Path, keep: int) -> Path:
        """Mark the written ``tmp`` complete, fsync it and rename it into place as checkpoint ``done``; prune."""
        final = self.checkpoint(done)
        (tmp / COMPLETE).write_text("")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.complete_checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def truncate_after(self, done: int) -> None:
        """Discard what the run wrote after its checkpoint ``done``: half-written checkpoint directories, metrics
        lines, episode and credit files of later iterations, so the continued run equals an uninterrupted one."""
        for stale in self.checkpoints_dir.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.metrics.is_file():
            kept = [line for line in self.metrics.read_text().splitlines() if _iteration_of(line) < done]
            tmp = self.metrics.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.metrics)
        for folder in ITERATION_FOLDERS:
            for iteration, path in _numbered(self.root / folder, "iter-*.parquet", "iter-").items():
                if iteration >= done:
                    path.unlink()
        self.episodes(0).parent.mkdir(parents=True, exist_ok=True)


def new_run_dir(config: TrainConfig) -> RunDir:
    """A fresh run directory under ``output_dir``: the name, or <method>-<env>-<timestamp> after
    ``<recipe>_`` when the run comes from a recipe other than the default (the recipe finds the run, the method
    and game say what it trains, an override included)."""
    root = Path(config.output_dir)
    if config.name:
        path = root / config.name
        if path.exists():
            raise RepertoryError(f"run directory {path} already exists; continue it with --resume {path} or rename")
        return RunDir(path)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{config.method_name}-{config.rollout.env}-{stamp}"
    if config.recipe not in (None, "default"):
        base = f"{config.recipe}_{base}"
    path, n = root / base, 2
    while path.exists():
        path, n = root / f"{base}-{n}", n + 1
    return RunDir(path)


def _iteration_of(line: str) -> int:
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def resolve_checkpoint(path: str | Path) -> tuple[Path, TrainConfig]:
    """A run directory (its newest complete checkpoint) or a checkpoint directory, with the run's config."""
    run = RunDir(path)
    if run.is_run():
        checkpoints = run.complete_checkpoints()
        if not checkpoints:
            raise RepertoryError(f"run {run} has no complete checkpoint yet")
        return checkpoints[-1], load_run_config(run.config)
    owner = RunDir.of_checkpoint(path)
    if (Path(path) / COMPLETE).is_file() and owner.is_run():
        return Path(path), load_run_config(owner.config)
    raise RepertoryError(f"{path} is neither a run directory (config.yaml) nor a complete checkpoint (COMPLETE)")


def is_run_or_checkpoint(path: str | Path) -> bool:
    """True for a run directory or one of its checkpoint directories."""
    return RunDir(path).is_run() or (Path(path) / COMPLETE).is_file()


def load_run_config(path: Path, overrides: list[str] | None = None) -> TrainConfig:
    """A run's saved ``config.yaml`` with ``overrides``. A run saved before ``model.precision`` existed trained in
    float32, which the key's default (auto) no longer gives on every CPU: it keeps float32, so that it resumes and
    evaluates as it trained. A run saved before ``eval.validation`` existed had no validation evaluations: it
    resumes without them (some would leave it with too few to select on anyway)."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        saved = None  # load_config says what is wrong with it
    model = saved.get("model") if isinstance(saved, dict) else None
    evaluation = saved.get("eval") if isinstance(saved, dict) else None
    legacy = [] if isinstance(model, dict) and "precision" in model else ["model.precision=float32"]
    legacy += [] if not isinstance(evaluation, dict) or "validation" in evaluation else ["eval.validation=false"]
    return load_config(str(path), [*legacy, *(overrides or [])])

"""Experiment trackers: every metrics line, the config and the report of a run, sent where ``tracking`` says.

``jsonl`` (always on) is the run directory's ``metrics.jsonl``, the record resuming and the report read.
``tensorboard`` writes event files under ``RUN/tensorboard`` with TensorBoard's ``SummaryWriter``; ``wandb``
logs to Weights & Biases, offline under ``RUN/wandb`` unless ``wandb.mode`` (or ``WANDB_MODE``) says otherwise.
A resumed run continues the same TensorBoard history (steps from the resumed iteration on are purged first)
and logs to the same W&B run id (kept in ``RUN/wandb-run-id``): online, W&B continues that run; offline, each
session is its own directory under ``RUN/wandb`` (W&B cannot resume offline runs).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from repertory.config import TrainConfig, dump_config
from repertory.runs import RunDir
from repertory.stats import finite_number
from repertory.types import RepertoryError


class Tracker(Protocol):
    """Receives a run's config once, each iteration's metrics line, and the report's files at the end."""

    def log_config(self, config: TrainConfig) -> None: ...

    def log(self, line: dict[str, Any]) -> None: ...

    def log_report(self, files: list[Path]) -> None: ...

    def close(self) -> None: ...


def numeric(line: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics of a line (the iteration aside)."""
    return {k: float(v) for k, v in line.items() if k != "iteration" and finite_number(v)}


class JsonlTracker:
    """``metrics.jsonl``: one JSON line per iteration, appended and flushed as soon as the iteration ends."""

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.metrics

    def log_config(self, config: TrainConfig) -> None:
        """The config is the run directory's ``config.yaml``, written when the run starts."""

    def log(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def log_report(self, files: list[Path]) -> None:
        """The report lives in the run directory already."""

    def close(self) -> None:
        """Every line was closed when written."""


class TensorBoardTracker:
    """Scalars per metric at step = iteration, the config as text (once, at step 0), the figures as images and
    the page's path at step = the number of iterations (so a resumed run's purge replaces them)."""

    def __init__(self, run_dir: RunDir, start: int, iterations: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RepertoryError(
                "tracking: tensorboard needs the tensorboard package: pip install 'repertory[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(str(run_dir.tensorboard), purge_step=start if start else None)
        self.start = start
        self.iterations = iterations

    def log_config(self, config: TrainConfig) -> None:
        if self.start:  # a resumed run: the first session logged it, and step 0 is not purged
            return
        text = "    " + dump_config(config).replace("\n", "\n    ")  # indented: TensorBoard renders Markdown
        self.writer.add_text("config", text, 0)

    def log(self, line: dict[str, Any]) -> None:
        for key, value in numeric(line).items():
            self.writer.add_scalar(key, value, line["iteration"])
        self.writer.flush()

    def log_report(self, files: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in files:
            if path.suffix == ".png":
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self.writer.add_image(f"report/{path.stem}", pixels, self.iterations, dataformats="HWC")
            else:
                self.writer.add_text(f"report/{path.name}", str(path.resolve()), self.iterations)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run named after the run directory: metrics at step = iteration, the config, the figures and the
    report page (``wandb.Html``) at the end."""

    def __init__(self, run_dir: RunDir, config: TrainConfig):
        try:
            import wandb
        except ImportError:
            raise RepertoryError("tracking: wandb needs the wandb package: pip install 'repertory[wandb]'") from None
        self.wandb = wandb
        id_file = run_dir.wandb_id
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        settings = config.wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=settings.mode or os.environ.get("WANDB_MODE") or "offline",
            config=config.model_dump(mode="json"),
        )

    def log_config(self, config: TrainConfig) -> None:
        """The config went to ``wandb.init``."""

    def log(self, line: dict[str, Any]) -> None:
        self.run.log(numeric(line), step=int(line["iteration"]))

    def log_report(self, files: list[Path]) -> None:
        logged: dict[str, Any] = {}
        for path in files:
            if path.suffix == ".png":
                logged[f"report/{path.stem}"] = self.wandb.Image(str(path))
            elif path.suffix == ".html":
                logged["report/page"] = self.wandb.Html(path.read_text(), inject=False)
        if logged:
            self.run.log(logged)

    def close(self) -> None:
        self.run.finish()


def make_trackers(config: TrainConfig, run_dir: RunDir, start: int) -> list[Tracker]:
    """The run's trackers, JSONL first; ``start`` is the first iteration this process runs (resume). If one
    cannot start, those already made are closed before the error propagates."""
    factories: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(run_dir, start, config.iterations),
        "wandb": lambda: WandbTracker(run_dir, config),
    }
    trackers: list[Tracker] = [JsonlTracker(run_dir)]
    try:
        for name in dict.fromkeys(config.tracking):
            if name != "jsonl":
                trackers.append(factories[name]())
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers

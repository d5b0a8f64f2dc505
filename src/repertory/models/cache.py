"""The user's cache directory, where converted checkpoints and compiled kernels live. A module of its own so that
the models package's submodules (:mod:`repertory.models.decode`) can use it without importing the package."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$REPERTORY_CACHE, else $XDG_CACHE_HOME/repertory, else ~/.cache/repertory."""
    if os.environ.get("REPERTORY_CACHE"):
        return Path(os.environ["REPERTORY_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "repertory"

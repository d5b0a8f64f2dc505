"""Training methods, one file each, registered by ``method.kind`` (docs/design.md, The method section).

Online: :mod:`~repertory.train.methods.selfplay` (OMAR and the estimator registry) and
:mod:`~repertory.train.methods.adalign` (Advantage Alignment with its opponent pool). Batch-online rounds:
:mod:`~repertory.train.methods.igrpo` (Iterative GRPO with its Q-function), and the baselines that learn from the
same logs, :mod:`~repertory.train.methods.st_grpo`, :mod:`~repertory.train.methods.mt_sft`,
:mod:`~repertory.train.methods.mt_kto`, :mod:`~repertory.train.methods.mt_ppo` and
:mod:`~repertory.train.methods.archer` (ArCHer and ArCHer-LC with their critic).
"""

from __future__ import annotations

from repertory.train.methods import adalign, archer, igrpo, mt_kto, mt_ppo, mt_sft, selfplay, st_grpo
from repertory.train.methods.base import (
    METHODS,
    Method,
    OnlineMethod,
    RoundContext,
    RoundMethod,
    build_method,
    chunks,
    register_method,
)

__all__ = [
    "METHODS",
    "Method",
    "OnlineMethod",
    "RoundContext",
    "RoundMethod",
    "adalign",
    "archer",
    "build_method",
    "chunks",
    "igrpo",
    "mt_kto",
    "mt_ppo",
    "mt_sft",
    "register_method",
    "selfplay",
    "st_grpo",
]

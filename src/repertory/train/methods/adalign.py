"""Advantage Alignment (``method.kind: adalign``; docs/algorithms.md 7): online like self-play, with round credit
from both seats' advantages (``method.estimator``: adalign, or its baselines naive and shared-reward), against
an opponent pool of past LoRA snapshots of the live policy when ``rollout.opponent`` is ``pool`` (7.5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from repertory.agents import Agent
from repertory.config import AdAlignConfig
from repertory.runs import RunDir
from repertory.train.methods.base import register_method
from repertory.train.methods.selfplay import SelfPlay
from repertory.train.pool import OpponentPool


@register_method(AdAlignConfig)
class AdvantageAlignment(SelfPlay):
    """Self-play with the Advantage Alignment family's credit and, when the line-up asks for it, its pool."""

    config: AdAlignConfig  # type: ignore[assignment]

    def __init__(self, config: Any, seed: int):
        super().__init__(config, seed)
        self.pool: OpponentPool | None = None

    def open_pool(self, peft: Any, run_dir: RunDir, live: Agent, resolve: Callable[[str], Agent]) -> OpponentPool:
        """The opponent pool of ``rollout.opponent: pool``: snapshots of ``peft``'s live adapter in ``run_dir``."""
        self.pool = OpponentPool(peft, run_dir, self.config.pool, self.seed, live, resolve)
        return self.pool

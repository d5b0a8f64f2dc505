"""Advantage Alignment (``method.kind: adalign``; docs/algorithms.md 7): online like self-play, with round credit
from both seats' advantages (``method.estimator``: adalign, or its baselines naive and shared-reward), against
an opponent pool of past LoRA snapshots of the live policy when ``rollout.opponent`` is ``pool`` (7.5)."""

from __future__ import annotations

from typing import Any

from repertory.agents.lm import LMAgent
from repertory.config import AdAlignConfig
from repertory.runs import RunDir
from repertory.train.methods.base import register_method
from repertory.train.methods.selfplay import SelfPlay
from repertory.train.pool import OpponentPool


@register_method(AdAlignConfig)
class AdvantageAlignment(SelfPlay):
    """Self-play with the Advantage Alignment family's credit and, when the line-up asks for it, its pool."""

    config: AdAlignConfig  # type: ignore[assignment]

    def opponents(self, peft: Any, run_dir: RunDir, live: LMAgent) -> OpponentPool:
        """The opponent pool (7.5): snapshots of ``peft``'s live adapter, kept in ``run_dir``."""
        return OpponentPool(peft, run_dir, self.config.pool, self.seed, live)

"""MT-PPO in batch-online mode (``method.kind: mt-ppo``; docs/algorithms.md 6.3): token-level GAE with the
learner's critic (warm across rounds) on the round's deployed conversations, reward G_0 on the agent's last
turn and nothing before, so that maximising it maximises the metric J; PPO epochs with the deployed policy as
the old one."""

from __future__ import annotations

from typing import Any

from repertory import algos
from repertory.algos import TurnParams
from repertory.config import MTPPOConfig
from repertory.models import LoadedModel
from repertory.store.turns import LoggedTurn
from repertory.train.batch import Batch, collect
from repertory.train.methods.base import RoundContext, RoundMethod, register_method
from repertory.train.methods.selfplay import assign_advantages
from repertory.types import Episode


@register_method(MTPPOConfig)
class MTPPO(RoundMethod):
    """PPO with a critic on the round's conversations."""

    config: MTPPOConfig

    def __init__(self, config: Any, seed: int, initial: LoadedModel, device: str | None):
        super().__init__(config, seed, initial, device)
        self.estimator = algos.get_estimator("gae")
        self.params = TurnParams(estimator="gae", gamma_token=config.gamma_token, lam=config.lam)

    @property
    def needs_critic(self) -> bool:
        return True

    def estimator_inputs(self, batch: Batch) -> list[algos.TrajectoryInput]:
        """The conversation's G_0 on the agent's last turn, nothing before (6.3)."""
        inputs = batch.estimator_inputs()
        for traj in inputs:
            g0 = algos.discounted_returns(traj.rewards, self.config.gamma)[0] if traj.rewards else 0.0
            traj.rewards = [0.0] * (len(traj.rewards) - 1) + [g0] if traj.rewards else []
        return inputs

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        batch = collect(list(episodes.values()), ctx.algo.packing, ctx.algo.mask_truncated)
        ctx.backend.offload()
        mismatch = ctx.learner.score(batch)
        metrics = assign_advantages(batch, self.estimator, self.params, ctx.algo, {}, self.estimator_inputs(batch))
        ctx.write_credit(round_index, batch)
        metrics.update(mismatch)
        metrics.update(ctx.learner.update(batch, f"mt-ppo/{round_index}", self.config.epochs))
        return metrics

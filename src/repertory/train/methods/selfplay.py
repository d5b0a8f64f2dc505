"""Online self-play (``method.kind: selfplay``; OMAR, docs/algorithms.md 2-4): each iteration the live policy
plays the line-up, the learner scores the batch, the registered estimator (``method.estimator``: omar, gae,
grpo, rloo, reinforce-pp, reinforce, rae) turns the rewards of the trained seats into per-token advantages, and
the learner runs PPO epochs. The EMA baselines of reinforce and rae are this method's state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from repertory import algos, stats
from repertory.algos import losses
from repertory.config import AlgoConfig, SelfPlayConfig
from repertory.train.batch import Batch
from repertory.train.methods.base import OnlineMethod, register_method

STATE_FILE = "method.json"


def assign_advantages(
    batch: Batch,
    estimator: algos.EstimatorSpec,
    params: algos.EstimatorParams,
    algo: AlgoConfig,
    state: dict[str, Any],
    inputs: list[algos.TrajectoryInput] | None = None,
) -> dict[str, float]:
    """Run ``estimator`` on the scored ``batch`` (its per-turn rewards, or ``inputs``; less the KL penalty where
    ``algo.kl_mode`` is reward), whiten as configured, and assign every trained sample its advantages and critic
    targets; returns the estimator's metrics, the mean advantage and the critic's error."""
    inputs = batch.estimator_inputs() if inputs is None else inputs
    if algo.kl_mode == "reward" and algo.beta_kl > 0:
        for traj, ref in zip(inputs, batch.trajectories):
            for k, index in enumerate(ref.samples):
                if index in batch.experience:
                    scored = batch.experience[index]
                    kl = losses.kl_penalty(scored.logp_old, scored.logp_ref, algo.kl_estimator)
                    traj.rewards[k] -= algo.beta_kl * float(kl.sum())
    estimate = estimator.fn(inputs, params, state)
    whiten = estimator.whiten if params.whiten is None else params.whiten
    adv_lists = algos.whiten(estimate.advantages) if whiten else estimate.advantages
    advantages: dict[int, torch.Tensor] = {}
    returns: dict[int, torch.Tensor] | None = {} if estimate.returns is not None else None
    raw_turns: list[list[float]] = []
    for t, ref in enumerate(batch.trajectories):
        for k, index in enumerate(ref.samples):
            if batch.samples[index].trained:
                raw_turns.append(estimate.advantages[t][k])
                advantages[index] = torch.tensor(adv_lists[t][k], dtype=torch.float32)
                if returns is not None:
                    returns[index] = torch.tensor(estimate.returns[t][k], dtype=torch.float32)  # type: ignore[index]
    batch.assign(advantages, returns)
    metrics = {f"estimator/{k}": v for k, v in estimate.metrics.items()}
    metrics["advantage/mean"] = float(torch.cat(list(advantages.values())).mean()) if advantages else 0.0
    metrics.update(raw_spread(raw_turns))
    if returns:
        errors = [
            float(((batch.experience[i].values - returns[i]) ** 2).mean())  # type: ignore[operator]
            for i in returns
            if batch.samples[i].n_tokens
        ]
        metrics["value/mse"] = sum(errors) / len(errors)
    return metrics


def raw_spread(turns: list[list[float]]) -> dict[str, float]:
    """The estimator's advantages before whitening, over the trained turns: their unbiased standard deviation over
    tokens (``advantage/raw_sd``) and the share of turns with a non-zero token (``advantage/nonzero_share``); none
    without trained turns. Whitening hides both, yet they say whether a batch carried signal: a flat-credit group
    that tied is all zeros."""
    if not turns:
        return {}
    nonzero = sum(any(not abs(a) <= 1e-8 for a in turn) for turn in turns) / len(turns)
    return {"advantage/raw_sd": stats.std([a for turn in turns for a in turn]), "advantage/nonzero_share": nonzero}


@register_method(SelfPlayConfig)
class SelfPlay(OnlineMethod):
    """Credit from a registered estimator over the trained seats' turns (see the module docstring)."""

    config: SelfPlayConfig

    def __init__(self, config: Any, seed: int):
        super().__init__(config, seed)
        self.estimator = algos.get_estimator(config.estimator)
        self.estimator_state: dict[str, Any] = {}  # the EMA baselines, carried across iterations

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    def credit(self, batch: Batch, algo: AlgoConfig) -> dict[str, float]:
        return assign_advantages(batch, self.estimator, self.config, algo, self.estimator_state)

    def save(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps({"estimator_state": self.estimator_state}, indent=1))

    def load(self, directory: Path) -> None:
        if (directory / STATE_FILE).is_file():
            self.estimator_state = json.loads((directory / STATE_FILE).read_text())["estimator_state"]
        else:  # a checkpoint written before methods held their state kept it with the trainer's counters
            self.estimator_state = json.loads((directory / "trainer_state.json").read_text())["estimator_state"]

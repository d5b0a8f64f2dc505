"""The online trainer (``method.kind`` selfplay or adalign): rollout -> advantages -> optimisation epochs ->
metrics, one iteration at a time.

Each iteration draws train kernels, plays ``episodes_per_kernel`` episodes on each (the groups of critic-free
estimators), with the live policy in every seat (self-play, all seats trained) or against an opponent (the live
policy takes each seat in turn; only its seats are trained). The learner scores the batch (log-probs, reference
log-probs, values), the method turns rewards into per-token advantages (:meth:`OnlineMethod.credit`), and the
learner runs PPO epochs.
"""

from __future__ import annotations

import time
from typing import Any

from repertory.eval.scores import rollout_metrics
from repertory.store import write_episodes
from repertory.train import distributed
from repertory.train.base import Trainer
from repertory.train.batch import collect
from repertory.train.methods import OnlineMethod
from repertory.types import RepertoryError


class OnlineTrainer(Trainer):
    """Rollout and update every iteration."""

    method: OnlineMethod

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        """Rollout, estimate, update; returns the iteration's metrics line."""
        algo = self.config.algo
        pool = self.lineup.pool
        if pool is not None:
            pool.before_rollout(iteration)
        episodes, timing = self.rollouts.of_iteration(iteration)
        if distributed.is_main():
            write_episodes(self.run_dir.episodes(iteration), episodes)
        line: dict[str, Any] = {**rollout_metrics(episodes)}
        if pool is not None:
            line.update(pool.metrics(episodes))

        start = time.perf_counter()
        roles = self.lineup.live.roles
        batch = collect([ep for ep in episodes if not ep.judge_failed], algo.packing, algo.mask_truncated, roles)
        if not batch.sequences:
            raise RepertoryError(
                f"iteration {iteration}: no trainable tokens (no live seat produced a response); "
                "check rollout.opponent and the environment"
            )
        self.backend.offload()  # the learner takes the device (a colocated vLLM engine sleeps until sync)
        mismatch = self.learner.score(batch, version=self.backend.version)
        estimate_metrics = self.method.credit(batch, algo)
        self.write_credit(iteration, batch)
        update = self.learner.update(batch, iteration)
        train_s = time.perf_counter() - start
        self.publish()

        seq_tokens = sum(len(s.input_ids) for s in batch.sequences)
        line.update(
            {
                "samples": sum(1 for s in batch.samples if s.trained),
                "tokens/trained": batch.n_tokens,
                "tokens/sequence": seq_tokens,
                **update,
                **estimate_metrics,
                **batch.credit_quality(),
                **mismatch,
                **timing,
                "time/train_s": train_s,
                "throughput/train_tok_s": seq_tokens * (1 + algo.ppo_epochs) / train_s if train_s else 0.0,
            }
        )
        return line

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
from repertory.system import peak_rss_mb
from repertory.train import distributed
from repertory.train.base import Trainer
from repertory.train.batch import collect
from repertory.train.methods import OnlineMethod
from repertory.train.pipeline import staleness_metrics
from repertory.types import Episode, RepertoryError


class OnlineTrainer(Trainer):
    """Rollout and update every iteration."""

    method: OnlineMethod

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        """Rollout, estimate, update; returns the iteration's metrics line."""
        algo = self.config.algo
        line: dict[str, Any] = {"iteration": iteration}
        if distributed.is_main():
            line.update(self.periodic_evaluation(iteration))
        if self.pool is not None and iteration % self.pool.config.snapshot_every == 0:
            if distributed.is_main():
                self.pool.take(iteration)
            distributed.barrier()  # every process loads the snapshot file
        episodes, timing = self.rollouts(iteration)
        if distributed.is_main():
            write_episodes(self.run_dir.episodes(iteration), episodes)
        line.update(rollout_metrics(episodes))
        if self.pool is not None:
            line["pool/snapshots"] = len(self.pool.snapshots())
            line["pool/snapshot_matches"] = sum(
                any(s.policy_id.startswith("snapshot@") for s in ep.seats) for ep in episodes
            ) / len(episodes)

        start = time.perf_counter()
        batch = collect([ep for ep in episodes if not ep.judge_failed], algo.packing, algo.mask_truncated, self.roles)
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
        self.sync()

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
                "memory/peak_rss_mb": peak_rss_mb(),
            }
        )
        return line

    def rollouts(self, iteration: int) -> tuple[list[Episode], dict[str, float]]:
        """The iteration's episodes and their rollout metrics: played now by the current policy, or (with
        ``rollout.max_staleness``) taken from the pipeline that played them ahead."""
        if not self.config.rollout.max_staleness:
            start = time.perf_counter()
            generated_before = self.backend.stats.generated_tokens
            episodes = self.play(self.specs(iteration))
            rollout_s = time.perf_counter() - start
            generated = self.backend.stats.generated_tokens - generated_before
            return episodes, {
                "time/rollout_s": rollout_s,
                "throughput/rollout_tok_s": generated / rollout_s if rollout_s else 0.0,
            }
        played, waited = self.played_ahead(iteration)
        generated = sum(len(turn.response_ids) for ep in played.episodes for turn in ep.turns)
        return played.episodes, {
            "time/rollout_s": played.rollout_s,
            "time/rollout_wait_s": waited,
            "throughput/rollout_tok_s": generated / played.rollout_s if played.rollout_s else 0.0,
            "async/sampled_by_version": float(played.version),
            **staleness_metrics(played.episodes, self.backend.version),
        }

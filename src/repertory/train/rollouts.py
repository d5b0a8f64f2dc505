"""How a run's episodes get played: in this process, split over data-parallel processes, on ``rollout.workers``
Ray actors, or ahead of the learner (``rollout.max_staleness``, :class:`~repertory.train.pipeline.AsyncRollouts`).
:class:`Rollouts` owns what those samplers need — copies of the live weights, sent after every update — the
played-ahead queue, and closing both."""

from __future__ import annotations

import time
from typing import Any

from repertory.agents.live import LiveSource
from repertory.config import TrainConfig
from repertory.rollout import EpisodeSpec, run_episodes
from repertory.runs import RunDir
from repertory.train import distributed
from repertory.train.lineup import LineUp
from repertory.train.pipeline import AsyncRollouts, Played, Sampler, staleness_metrics
from repertory.types import Episode, Judge
from repertory.workers import ActorSampler, LocalSampler, RolloutActors, RolloutWorker


class Rollouts:
    """Plays the line-up's episodes; ``judge`` scores them where the game's reward needs one. A sampler of its own
    builds its engine with ``engine_args``. Workers and the pipeline start at their first use and end at
    :meth:`close`."""

    def __init__(
        self, config: TrainConfig, lineup: LineUp, engine_args: dict[str, Any], judge: Judge | None, run_dir: RunDir
    ):
        self.config, self.lineup = config, lineup
        self.live = lineup.live_policy
        self.engine_args, self.judge, self.run_dir = engine_args, judge, run_dir
        self.workers: RolloutActors | None = None  # built at the first sharded rollout
        self.pipeline: AsyncRollouts | None = None  # rollout.max_staleness >= 1: built at the first iteration
        self.discarded_episodes = 0  # played ahead by the pipeline and never learned from (a stop before the end)

    def of_iteration(self, iteration: int) -> tuple[list[Episode], dict[str, float]]:
        """The iteration's episodes and their rollout metrics: played now by the current policy, or (with
        ``rollout.max_staleness``) taken from the pipeline that played them ahead."""
        backend = self.live.agent.backend
        if not self.config.rollout.max_staleness:
            start = time.perf_counter()
            generated_before = backend.stats.generated_tokens
            episodes = self.play(self.lineup.specs(iteration))
            rollout_s = time.perf_counter() - start
            generated = backend.stats.generated_tokens - generated_before
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
            **staleness_metrics(played.episodes, backend.version),
        }

    def play(self, specs: list[EpisodeSpec]) -> list[Episode]:
        """Play episodes now: in this process, each data-parallel process its share, or on the Ray workers."""
        rollout = self.config.rollout
        if distributed.world_size() > 1:  # data-parallel: each process plays its contiguous shard
            n, k = distributed.world_size(), distributed.rank()
            shard = specs[len(specs) * k // n : len(specs) * (k + 1) // n]
            mine = run_episodes(shard, rollout.max_concurrent, judge=self.judge, schedule=rollout.schedule)
            return [episode for shard in distributed.gather(mine) for episode in shard]
        if not rollout.workers:
            return run_episodes(specs, rollout.max_concurrent, judge=self.judge, schedule=rollout.schedule)
        return self._actors().play(specs, self.lineup.spec_of, rollout.max_concurrent, rollout.schedule)

    def played_ahead(self, iteration: int) -> tuple[Played, float]:
        """``iteration``'s episodes from the asynchronous pipeline (started here at the first call) and the
        seconds the learner waited for them."""
        if self.pipeline is None:
            self.pipeline = AsyncRollouts(
                self._sampler(),
                self.lineup.specs,
                self.config.rollout.max_staleness,
                start=iteration,
                stop=self.config.iterations,
                version=self.live.agent.backend.version,
                weights=self.live.weights(),
            )
        return self.pipeline.take(iteration)

    def publish(self, iteration: int) -> None:
        """After an update: the backend, and every sampler of its own, sample the learner's current weights from
        ``iteration`` on (the pipeline sends them when that iteration is due)."""
        backend = self.live.agent.backend
        backend.sync(self.live.loaded.model)
        if self.pipeline is not None:
            self.pipeline.publish(iteration, backend.version, self.live.weights())
        elif self.workers is not None:
            self.workers.publish(backend.version, self.live.weights())

    def close(self) -> None:
        """End the asynchronous pipeline and the rollout workers, if any."""
        if self.pipeline is not None:
            self.discarded_episodes += self.pipeline.close()
            self.pipeline = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def _actors(self) -> RolloutActors:
        if self.workers is None:
            rollout = self.config.rollout
            self.workers = RolloutActors(
                rollout.workers, rollout.env, self.lineup.options(), self.live_source(), address=rollout.ray_address
            )
        return self.workers

    def _sampler(self) -> Sampler:
        """What plays ahead of the learner: the Ray workers, else a worker in this process with its own copy of
        the policy (the learner's module is written while the sampler plays)."""
        rollout = self.config.rollout
        if rollout.workers:
            return ActorSampler(self._actors(), self.lineup.spec_of, rollout.max_concurrent, rollout.schedule)
        worker = RolloutWorker(rollout.env, self.lineup.options(), self.live_source())
        return LocalSampler(worker, self.lineup.spec_of, rollout.max_concurrent, rollout.schedule)

    def live_source(self) -> LiveSource:
        """The live policy as a sampler of its own rebuilds it."""
        return self.live.portable(self.engine_args, self.run_dir if self.lineup.pool is not None else None)

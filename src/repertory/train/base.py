"""What every trainer shares: the learner, the backend sampling the live policy, the line-up of the
iteration's episodes, held-out evaluation, atomic checkpoints with exact resume, and the loop.

The run directory (docs/design.md, :mod:`repertory.runs`) holds the resolved config, the episodes of every
iteration as Parquet, one metrics line per iteration, atomic checkpoints and a report folder with learning
curves. A run killed at any moment resumes from its newest complete checkpoint and redoes at most the
iteration in flight; because every random choice is derived from (seed, iteration, ...), the resumed run is
identical to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict

from repertory.agents import Agent, LMOptions
from repertory.agents.lm import LIVE_ADAPTER, LMAgent
from repertory.agents.resolve import LivePolicy, make_agent
from repertory.config import TrainConfig
from repertory.envs import env_class, load_kernels, make
from repertory.envs.roles import RoleAdapters
from repertory.eval import evaluate
from repertory.eval.scores import judged_lines, team_lines
from repertory.generation import SamplingParams, engine_options, make_backend, samples_exactly
from repertory.judges import make_judge
from repertory.models import LoadedModel, base_weights, load_model
from repertory.models.checkpoints import run_precision
from repertory.report import write_report
from repertory.rollout import EpisodeSpec, agent_seats, guarded_seats, run_episodes
from repertory.runs import RunDir
from repertory.store import write_credit, write_episodes
from repertory.tracking import make_trackers
from repertory.train import distributed
from repertory.train.batch import Batch
from repertory.train.learner import Learner
from repertory.train.learner_state import load_learner, save_learner
from repertory.train.methods import build_method
from repertory.train.methods.adalign import AdvantageAlignment
from repertory.train.pipeline import AsyncRollouts, Played, Sampler
from repertory.train.pool import OpponentPool
from repertory.train.sharding import OPTIMIZER_SHARDS, check_shards
from repertory.types import Episode, RepertoryError, derive
from repertory.workers import LIVE, LiveSource, LocalSampler, PoolSampler, RolloutWorker, WorkerPool

TIMING_PREFIXES = ("time/", "throughput/", "memory/")
VALIDATION_SCORES = ("outcome", "outcome_se", "discounted_return", "discounted_return_se")
"""What a validation evaluation keeps (``eval/validation/*``): the scores a results table selects on, with
their standard errors."""


class Trainer:
    """One training run in one run directory: the learner, the backend that samples the live policy, the
    line-up, held-out evaluation, checkpoints and the loop. A trainer kind implements :meth:`run_iteration`."""

    def __init__(self, config: TrainConfig, run_dir: RunDir, loaded: LoadedModel | None = None):
        self.config = config
        self.run_dir = run_dir
        self.env = env_class(config.rollout.env)
        self.roles = RoleAdapters.of(config.rollout.env, config.model.adapters)  # None: one shared adapter
        loaded = loaded or load_model(config.model.name, config.model.device)
        self.precision = run_precision(config, str(loaded.device))
        # The method's own modules (a critic on a copy of the initial model) are built before the learner wraps it.
        self.method = build_method(config.method, config.seed, loaded, config.model.device)
        self.learner = Learner(
            loaded,
            config.algo,
            config.model.lora,
            self.method.value_settings,
            needs_critic=self.method.value,
            temperature=config.rollout.temperature,
            seed=config.seed,
            # played ahead, samples come from an older policy: auto corrects them
            exact_sampler=samples_exactly(config.rollout.backend, config.rollout.engine_args, self.precision)
            and not config.rollout.max_staleness,
            roles=self.roles,
            sharding=config.model.sharding,
            precision=self.precision,
        )
        self.loaded = LoadedModel(self.learner.model, loaded.tokenizer, loaded.name, self.learner.peft)
        self.engine_args = engine_options(config.rollout.backend, config.rollout.engine_args, self.precision)
        self.backend = make_backend(config.rollout.backend, self.loaded, **self.engine_args)
        params = SamplingParams(config.rollout.temperature, 1.0, config.rollout.max_new_tokens)
        sampler_seed = derive(config.seed, "sampler")
        self.live = LMAgent(
            self.backend, "live", params, config.rollout.constrained, sampler_seed, policy_id="live", roles=self.roles
        )
        self.judge = make_judge(config.judge, config.model.device)
        # Rollouts are judged only where the reward needs it; evaluations report the judge's scores regardless.
        self.rollout_judge = self.judge if make(config.rollout.env, **config.rollout.env_options).needs_judge else None
        self.pool: OpponentPool | None = None
        if config.rollout.opponent == "pool":  # the config allows it with method adalign only
            assert isinstance(self.method, AdvantageAlignment)
            resolve = lambda spec: make_agent(spec, self.env, live=self.live_policy)  # noqa: E731
            self.pool = self.method.open_pool(self.learner.peft, run_dir, self.live, resolve)
        reference = self.learner.reference
        self.live_policy = LivePolicy(
            self.live,
            self.learner.peft,
            LoadedModel(reference, loaded.tokenizer, loaded.name) if reference is not None else None,
            self.pool.load if self.pool is not None else None,
            config.rollout.backend,
        )
        self.opponent = self._agent(config.rollout.opponent)
        self.eval_opponent = self._evaluation_agent() if config.eval.episodes else None
        self.kernels = load_kernels(config.rollout.env, "train", config.rollout.env_options)
        self.iteration = 0
        self.discount = self.method.discount  # gamma of the held-out expected discounted return
        self.workers: WorkerPool | None = None  # built at the first sharded rollout
        self.pipeline: AsyncRollouts | None = None  # rollout.max_staleness >= 1: built at the first iteration
        self.discarded_episodes = 0  # played ahead by the pipeline and never learned from (a stop before the end)

    def _options(self) -> LMOptions:
        """How the line-up's other language models sample."""
        return LMOptions(
            model=self.config.model.name,
            temperature=self.config.rollout.temperature,
            max_new_tokens=self.config.rollout.max_new_tokens,
            constrained=self.config.rollout.constrained,
            seed=derive(self.config.seed, "opponent"),
            device=self.config.model.device,
        )

    def _agent(self, spec: str) -> Agent | None:
        """The line-up's other agent: None for the live policy itself (``self``, ``pool``), else the resolved spec."""
        if spec in ("self", "pool"):
            return None
        return make_agent(spec, self.env, self._options(), self.live_policy)

    def _evaluation_agent(self) -> Agent | None:
        """The held-out line-up's agent, named as such when it does not resolve: a recipe's line-up may not
        exist in another game (the default recipe's always-cooperate is an IPD bot)."""
        spec = self.config.evaluation_opponent
        try:
            return self._agent(spec)
        except RepertoryError as exc:
            raise RepertoryError(f"the held-out evaluation's line-up (eval.opponent) {spec!r}: {exc}") from None

    # rollout

    def play(self, specs: list[EpisodeSpec]) -> list[Episode]:
        """Play an iteration's episodes: in this process, or sharded over ``rollout.workers`` Ray actors."""
        rollout = self.config.rollout
        if distributed.world_size() > 1:  # data-parallel: each process plays its contiguous shard
            n, k = distributed.world_size(), distributed.rank()
            shard = specs[len(specs) * k // n : len(specs) * (k + 1) // n]
            mine = run_episodes(shard, rollout.max_concurrent, judge=self.rollout_judge, schedule=rollout.schedule)
            return [episode for shard in distributed.gather(mine) for episode in shard]
        if not rollout.workers:
            return run_episodes(specs, rollout.max_concurrent, judge=self.rollout_judge, schedule=rollout.schedule)
        return self._worker_pool().play(specs, self._spec_of, rollout.max_concurrent, rollout.schedule)

    def _worker_pool(self) -> WorkerPool:
        if self.workers is None:
            rollout = self.config.rollout
            self.workers = WorkerPool(
                rollout.workers, rollout.env, self._options(), self._live_source(), address=rollout.ray_address
            )
        return self.workers

    def played_ahead(self, iteration: int) -> tuple[Played, float]:
        """``iteration``'s episodes from the asynchronous pipeline (started here at the first call) and the
        seconds the learner waited for them."""
        if self.pipeline is None:
            self.pipeline = AsyncRollouts(
                self._sampler(),
                self.specs,
                self.config.rollout.max_staleness,
                start=iteration,
                stop=self.config.iterations,
                version=self.backend.version,
                weights=self._live_weights(),
            )
        return self.pipeline.take(iteration)

    def _sampler(self) -> Sampler:
        """What plays ahead of the learner: the Ray workers, else a worker in this process with its own copy of
        the policy (the learner's module is written while the sampler plays)."""
        rollout = self.config.rollout
        if rollout.workers:
            return PoolSampler(self._worker_pool(), self._spec_of, rollout.max_concurrent, rollout.schedule)
        worker = RolloutWorker(rollout.env, self._options(), self._live_source())
        return LocalSampler(worker, self._spec_of, rollout.max_concurrent, rollout.schedule)

    def _spec_of(self, agent: Agent) -> str:
        """The spec a worker resolves to this line-up agent."""
        if agent is self.live:
            return LIVE
        if agent is self.opponent:
            return self.config.rollout.opponent
        if isinstance(agent, LMAgent) and agent.name.startswith("snapshot@"):
            return agent.name
        raise RepertoryError(f"agent {agent.name!r} cannot be sent to a rollout worker")

    def _live_weights(self) -> dict[str, torch.Tensor]:
        """What changes with an update: the live adapter under LoRA, the whole model otherwise."""
        if self.learner.peft is not None:
            return get_peft_model_state_dict(self.learner.peft, adapter_name=LIVE_ADAPTER)
        return self.learner.model.state_dict()

    def _live_source(self) -> LiveSource:
        peft = self.learner.peft
        reference = self.learner.reference
        base = base_weights(self.loaded) if peft is not None else reference.state_dict()  # type: ignore[union-attr]
        return LiveSource(
            model_config=self.learner.model.config,
            tokenizer=self.loaded.tokenizer,
            name=self.loaded.name,
            base={k: v.detach().cpu() for k, v in base.items()},
            live={k: v.detach().cpu() for k, v in self._live_weights().items()},
            lora=peft.peft_config[LIVE_ADAPTER] if peft is not None else None,
            version=self.backend.version,
            params=self.live.params,
            constrained=self.live.constrained,
            seed=self.live.seed,
            engine=self.config.rollout.backend,
            engine_args=self.engine_args,
            pool_run=self.run_dir if self.pool is not None else None,
        )

    def close(self) -> None:
        """End the asynchronous pipeline and the rollout workers, if any."""
        if self.pipeline is not None:
            self.discarded_episodes += self.pipeline.close()
            self.pipeline = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def specs(self, iteration: int) -> list[EpisodeSpec]:
        """The iteration's episodes: kernels drawn by (seed, iteration); each kernel's crn group of
        ``episodes_per_kernel`` episodes shares its environment seed."""
        rollout = self.config.rollout
        rng = random.Random(derive(self.config.seed, iteration, "kernels", rollout.env))
        n, n_kernels = rollout.kernels_per_iteration, len(self.kernels)
        picks = [rng.sample(range(n_kernels), min(n - start, n_kernels)) for start in range(0, n, n_kernels)]
        kernels = [self.kernels[k] for chunk in picks for k in chunk]
        n_seats = len(self.env.roles)
        served = []
        if self.pool is not None:
            served = self.pool.serve(iteration)
        specs = []
        for g, kernel in enumerate(kernels):
            for _ in range(rollout.episodes_per_kernel):
                i = len(specs)
                if self.opponent is None and self.pool is None:
                    agents: list[Agent] = [self.live] * n_seats
                    trainable = [True] * n_seats
                    guarded = []
                else:
                    if self.pool is not None:
                        # 7.5: the trained seat (a team, in team games) alternates between crn groups.
                        live = agent_seats(self.env, kernel, g) if self.env.teams else [g % n_seats]
                        opponent = self.pool.draw(served, iteration, i)
                    else:
                        live, opponent = agent_seats(self.env, kernel, i), self.opponent
                    agents = [self.live if s in live else opponent for s in range(n_seats)]
                    trainable = [s in live for s in range(n_seats)]
                    guarded = guarded_seats(self.env, agents, live)
                specs.append(
                    EpisodeSpec(
                        episode_id=f"{rollout.env}/s{self.config.seed}/i{iteration}/{i:05d}",
                        env=rollout.env,
                        kernel=kernel,
                        episode_seed=derive(self.config.seed, iteration, g, "env"),
                        agents=agents,
                        group_id=f"{kernel.id}/{iteration}/{g}",
                        iteration=iteration,
                        trainable=trainable,
                        guarded=guarded,
                        env_options=dict(rollout.env_options),
                    )
                )
        return specs

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        """One iteration of this trainer kind; returns its metrics line."""
        raise NotImplementedError

    def sync(self) -> None:
        """After an update: the backend (and every rollout worker) samples the learner's current weights."""
        self.backend.sync(self.learner.model)
        if self.pipeline is not None:  # the policy after this iteration; the pipeline sends it when due
            self.pipeline.publish(self.iteration + 1, self.backend.version, self._live_weights())
        elif self.workers is not None:
            self.workers.update(self.backend.version, self._live_weights())

    def write_credit(self, iteration: int, batch: Batch) -> None:
        """Persist each trained turn's advantage and return next to the iteration's episodes (``credit/``), for
        the report's episode browser."""
        if distributed.is_main():
            write_credit(self.run_dir.credit(iteration), batch.credit_rows())

    def periodic_evaluation(self, iteration: int) -> dict[str, Any]:
        """The evaluation lines due before ``iteration``'s update: ``eval/*`` at iteration 0 and every
        ``eval.every`` iterations, and ``eval/validation/*`` beside them for the trained policies of a run that
        selects; nothing at other iterations."""
        every = self.config.eval.every
        if not self.config.eval.episodes or not (iteration == 0 or (every and iteration % every == 0)):
            return {}
        line = self.evaluate(iteration)
        if iteration and self.config.selects_on_validation:
            line.update(self.validate(iteration))
        return line

    def validate(self, iteration: int) -> dict[str, Any]:
        """The validation evaluation that ``report --checkpoint best`` selects on: the live policy on validation
        kernels, with the held-out evaluation's line-up and number of games; only the scores a results table can
        hold are kept."""
        result = self.evaluate(iteration, validation=True)
        line = {f"eval/validation/{key}": result[f"eval/{key}"] for key in VALIDATION_SCORES}
        return {**line, "time/validation_s": result["time/eval_s"]}

    def evaluate(self, iteration: int, keep: Path | None = None, validation: bool = False) -> dict[str, Any]:
        """Evaluation of the live policy on ``eval.split`` (deterministic in the run's seed), or on validation
        kernels with seeds of their own: sharing the held-out games' seeds, they would replay the same games where
        a game's kernels differ in name only (IPD). Its games are written to ``keep`` where given, marked as
        played at ``iteration``."""
        start = time.perf_counter()
        config = self.config
        split, seed = (
            ("validation", derive(config.seed, "validation"))
            if validation
            else (config.eval.split, derive(config.seed, "eval"))
        )
        result = evaluate(
            config.rollout.env,
            self.live,
            config.eval.episodes,
            seed,
            split,
            self.eval_opponent,
            gamma=self.discount,
            env_options=config.rollout.env_options,
            judge=self.judge,
        )
        self.backend.reset_cache()
        if keep is not None:
            write_episodes(keep, [dataclasses.replace(ep, iteration=iteration) for ep in result.played])
        out: dict[str, Any] = {
            "eval/outcome": result.overall[0],
            "eval/outcome_se": result.overall[1],
            "eval/discounted_return": result.discounted[0],
            "eval/discounted_return_se": result.discounted[1],
        }
        for role, (mean, se) in result.outcome.items():
            out[f"eval/outcome/{role}"] = mean
            out[f"eval/outcome_se/{role}"] = se
        out["eval/invalid_rate"] = result.invalid_rate
        out.update({f"eval/{k}": v for k, v in team_lines(result.teams).items()})
        if result.judged is not None:
            out.update({f"eval/{k}": v for k, v in judged_lines(result.judged).items()})
        out.update({f"eval/env/{k}": v for k, v in result.metrics.items()})
        out["time/eval_s"] = time.perf_counter() - start
        return out

    # checkpoints

    def save_checkpoint(self, done: int) -> Path | None:
        """Write checkpoint ``done`` (iterations completed) atomically; prune old ones. Data-parallel, process 0
        writes it; with a sharded learner every process writes its shards into process 0's temporary directory
        (a run directory all of them reach). Returns the checkpoint's path (None in the other processes)."""
        main = distributed.is_main()
        if self.learner.sharded is None:
            return (
                self.run_dir.write_checkpoint(done, lambda tmp: self._fill(tmp, done), self.config.keep_checkpoints)
                if main
                else None
            )
        tmp = distributed.broadcast(self.run_dir.begin_checkpoint(done) if main else None)
        save_learner(self.learner, tmp)
        distributed.barrier()
        final = None
        if main:
            check_shards(tmp / OPTIMIZER_SHARDS)
            self.method.save(tmp)
            self._fill_counters(tmp, done)
            final = self.run_dir.finish_checkpoint(done, tmp, self.config.keep_checkpoints)
        distributed.barrier()
        return final

    def _fill(self, directory: Path, done: int) -> None:
        self.save_state(directory)
        self._fill_counters(directory, done)

    def _fill_counters(self, directory: Path, done: int) -> None:
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, directory / "rng.pt")
        state = {"iterations_done": done, "policy_version": self.backend.version}
        (directory / "trainer_state.json").write_text(json.dumps(state, indent=1))

    def save_state(self, directory: Path) -> None:
        """Write the trainable state (what a checkpoint holds besides RNG and counters) into ``directory``: the
        learner's and the method's."""
        save_learner(self.learner, directory)
        self.method.save(directory)

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        load_learner(self.learner, directory)
        self.method.load(directory)

    def load_checkpoint(self, path: Path) -> None:
        self.load_state(path)
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        state = json.loads((path / "trainer_state.json").read_text())
        self.iteration = state["iterations_done"]
        self.sync()  # an engine with its own copy of the weights (vllm) samples the restored ones
        self.backend.version = state.get("policy_version", 0)  # checkpoints written before versions: 0

    # the loop

    def fit(self, on_line: Callable[[dict[str, Any]], None] | None = None) -> Path:
        """Run the remaining iterations, each metrics line to every tracker; returns the run directory."""
        config = self.config
        main = distributed.is_main()  # in data-parallel training, process 0 writes the run directory
        trackers = make_trackers(config, self.run_dir, self.iteration) if main else []
        try:
            for tracker in trackers:
                tracker.log_config(config)
            for iteration in range(self.iteration, config.iterations):
                judged = self.judge.stats.as_metrics() if self.judge is not None else {}
                line = self.run_iteration(iteration)
                if self.judge is not None:  # this iteration's requests, failures, retries, clipped scores, cache hits
                    line.update({k: v - judged[k] for k, v in self.judge.stats.as_metrics().items()})
                done = iteration + 1
                if done == config.iterations and config.eval.episodes and main:
                    final = self.evaluate(done, keep=self.run_dir.heldout(done))
                    if config.selects_on_validation:
                        final.update(self.validate(done))
                    line.update(
                        {f"final/{k.removeprefix('eval/')}": v for k, v in final.items() if k.startswith("eval/")}
                    )
                for tracker in trackers:
                    tracker.log(line)
                self.iteration = done
                if done % config.checkpoint_every == 0 or done == config.iterations:
                    self.save_checkpoint(done)
                if on_line is not None:
                    on_line(line)
            self.close()
            if main:
                files = write_report(self.run_dir.root)
                for tracker in trackers:
                    tracker.log_report(files)
        finally:
            self.close()
            for tracker in trackers:
                tracker.close()
        distributed.barrier()
        return self.run_dir.root

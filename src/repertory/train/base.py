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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from repertory.config import TrainConfig
from repertory.envs import make
from repertory.envs.roles import RoleAdapters
from repertory.eval import evaluate
from repertory.eval.scores import judged_lines, team_lines
from repertory.generation import engine_options, make_backend, samples_exactly
from repertory.judges import make_judge
from repertory.models import LoadedModel, load_model
from repertory.models.checkpoints import run_precision
from repertory.report import write_report
from repertory.runs import RunDir, session_precision
from repertory.store import write_credit, write_episodes
from repertory.system import machine, peak_rss_mb
from repertory.tracking import make_trackers
from repertory.train import distributed
from repertory.train.batch import Batch
from repertory.train.learner import Learner
from repertory.train.learner_state import load_learner, save_learner
from repertory.train.lineup import LineUp
from repertory.train.methods import build_method
from repertory.train.rollouts import Rollouts
from repertory.train.sharding import OPTIMIZER_SHARDS, check_shards
from repertory.types import derive

TIMING_PREFIXES = ("time/", "throughput/", "memory/")
VALIDATION_SCORES = ("outcome", "outcome_se", "discounted_return", "discounted_return_se")
"""What a validation evaluation keeps (``eval/validation/*``): the scores a results table selects on, with
their standard errors."""


class Trainer:
    """One training run in one run directory: the method, the learner, the backend that samples the live policy,
    who plays (:class:`LineUp`), how the episodes get played (:class:`Rollouts`), held-out evaluation,
    checkpoints and the loop. A trainer kind implements :meth:`run_iteration`."""

    start_evaluation: dict[str, Any] | None = None
    """The ``eval/*`` line of iteration 0, when a run with the same start played it already (a suite's arms of one
    seed: :func:`repertory.experiments.start_key`); taken instead of playing the same games again."""

    def __init__(self, config: TrainConfig, run_dir: RunDir, loaded: LoadedModel | None = None):
        self.config = config
        self.run_dir = run_dir
        loaded = loaded or load_model(config.model.name, config.model.device)
        precision = self.precision = run_precision(config, str(loaded.device))
        weights = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        self.placement = {"device": str(loaded.device), "weights": weights}
        # The method's own modules (a critic on a copy of the initial model) are built before the learner wraps it.
        self.method = build_method(config.method, config.seed, loaded, config.model.device)
        self.learner = Learner(
            loaded,
            config.algo,
            config.model.lora,
            self.method.critic_settings,
            needs_critic=self.method.needs_critic,
            temperature=config.rollout.temperature,
            seed=config.seed,
            # played ahead, samples come from an older policy: auto corrects them
            exact_sampler=samples_exactly(config.rollout.backend, config.rollout.engine_args, precision)
            and not config.rollout.max_staleness,
            roles=RoleAdapters.of(config.rollout.env, config.model.adapters),  # None: one shared adapter
            sharding=config.model.sharding,
            precision=precision,
        )
        model = LoadedModel(self.learner.model, loaded.tokenizer, loaded.name, self.learner.peft)
        engine_args = engine_options(config.rollout.backend, config.rollout.engine_args, precision)
        self.backend = make_backend(config.rollout.backend, model, **engine_args)
        self.judge = make_judge(config.judge, config.model.device)
        self.lineup = LineUp.build(config, self.learner, self.backend, self.method, run_dir)
        # Rollouts are judged only where the reward needs it; evaluations report the judge's scores regardless.
        needs_judge = make(config.rollout.env, **config.rollout.env_options).needs_judge
        self.rollouts = Rollouts(config, self.lineup, engine_args, self.judge if needs_judge else None, run_dir)
        self.iteration = 0

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        """One iteration of this trainer kind, after its due evaluations; returns its metrics."""
        raise NotImplementedError

    def close(self) -> None:
        """End the rollout pipeline and workers, if any."""
        self.rollouts.close()

    def publish(self) -> None:
        """After an update: the backend (and every sampler of its own) samples the learner's current weights."""
        self.rollouts.publish(self.iteration + 1)

    def write_credit(self, iteration: int, batch: Batch) -> None:
        """Persist each trained turn's advantage and return next to the iteration's episodes (``credit/``), for
        the report's episode browser."""
        if distributed.is_main():
            write_credit(self.run_dir.credit(iteration), batch.credit_rows())

    def due_evaluations(self, iteration: int, final: bool = False) -> dict[str, Any]:
        """The evaluation lines due at ``iteration``: before its update, ``eval/*`` at iteration 0 and every
        ``eval.every`` iterations; with ``final``, after the last update, ``final/*`` (its games kept in the run).
        Beside each of a trained policy, ``eval/validation/*`` in a run that selects."""
        config = self.config
        every = config.eval.every
        due = final or iteration == 0 or (every and iteration % every == 0)
        if not config.eval.episodes or not due:
            return {}
        if iteration == 0 and not final and self.start_evaluation is not None:
            return dict(self.start_evaluation)
        line = self.evaluate(iteration, keep=self.run_dir.heldout(iteration) if final else None)
        if iteration and config.selects_on_validation:
            line.update(self.validate(iteration))
        if final:
            return {f"final/{k.removeprefix('eval/')}": v for k, v in line.items() if k.startswith("eval/")}
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
            self.lineup.live,
            config.eval.episodes,
            seed,
            split,
            self.lineup.eval_opponent,
            gamma=self.method.gamma,
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
        if not self.learner.sharded.active:
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
        self.publish()  # an engine with its own copy of the weights (vllm) samples the restored ones
        self.backend.version = state.get("policy_version", 0)  # checkpoints written before versions: 0

    # the loop

    @property
    def trained_in(self) -> str:
        """What this trainer's products run in, as its ``sessions.jsonl`` line says (:func:`session_precision`)."""
        return session_precision({"precision": self.precision, **self.placement})

    def log_session(self) -> None:
        """Append where this stretch of training runs to ``sessions.jsonl``: the iteration it starts from, the
        precision ``model.precision`` resolved to, the device and the weights' dtype, the engine and
        :func:`machine`. A line a crash left unfinished is ended first, so it costs only itself."""
        line = {
            "from_iteration": self.iteration,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "precision": self.precision,
            **self.placement,
            "engine": self.config.rollout.backend,
            **machine(),
        }
        sessions = self.run_dir.sessions
        torn = sessions.is_file() and not sessions.read_bytes().endswith(b"\n") and sessions.stat().st_size > 0
        with sessions.open("a") as f:
            f.write("\n" * torn + json.dumps(line) + "\n")

    def fit(self, on_line: Callable[[dict[str, Any]], None] | None = None) -> Path:
        """Run the remaining iterations, each metrics line to every tracker; returns the run directory."""
        config = self.config
        main = distributed.is_main()  # in data-parallel training, process 0 writes the run directory
        trackers = make_trackers(config, self.run_dir, self.iteration) if main else []
        if main and self.iteration < config.iterations:
            self.log_session()
        try:
            for tracker in trackers:
                tracker.log_config(config)
            for iteration in range(self.iteration, config.iterations):
                judged = self.judge.stats.as_metrics() if self.judge is not None else {}
                line: dict[str, Any] = {"iteration": iteration, **(self.due_evaluations(iteration) if main else {})}
                line.update(self.run_iteration(iteration))
                if self.judge is not None:  # this iteration's requests, failures, retries, clipped scores, cache hits
                    line.update({k: v - judged[k] for k, v in self.judge.stats.as_metrics().items()})
                done = iteration + 1
                if done == config.iterations and main:
                    line.update(self.due_evaluations(done, final=True))
                line["memory/peak_rss_mb"] = peak_rss_mb()  # this process's peak so far, evaluations included
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

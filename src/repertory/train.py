"""The online trainer: rollout -> advantages -> optimisation epochs -> metrics, one iteration at a time.

Each iteration draws train kernels, plays ``episodes_per_kernel`` episodes on each (the groups of
critic-free estimators), with the live policy in every seat (self-play, all seats trained) or
against an opponent (the live policy takes each seat in turn; only its seats are trained). The
learner scores the batch (log-probs, reference log-probs, values), the registered estimator turns
rewards into per-token advantages, and the learner runs PPO epochs.

The run directory (design.md) holds the resolved config, the episodes of every iteration as
Parquet, one metrics line per iteration, atomic checkpoints, and a report folder with learning
curves. A checkpoint directory is written under a temporary name and renamed when complete, so a
run killed at any moment resumes from the newest complete checkpoint and redoes at most the
iteration in flight; because every random choice is derived from (seed, iteration, ...), the
resumed run is identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from repertory import algos
from repertory.agents import Agent, LMOptions, make_agent
from repertory.agents.lm import LMAgent
from repertory.bench import peak_rss_mb
from repertory.config import TrainConfig, dump_config, load_config
from repertory.envs import env_class, load_kernels
from repertory.eval import DISCOUNT, agent_seat, evaluate, mean_metrics, partner_outcome, seat_scores
from repertory.generation import HFBackend, SamplingParams
from repertory.learner import LIVE_ADAPTER, Batch, Learner, collect
from repertory.models import LoadedModel, load_model, save_checkpoint
from repertory.report import write_report
from repertory.rollout import EpisodeSpec, guarded_seats, run_episodes
from repertory.store import write_episodes
from repertory.types import Episode, RepertoryError, derive

CHECKPOINT = re.compile(r"^\d{6}$")
COMPLETE = "COMPLETE"
TIMING_PREFIXES = ("time/", "throughput/", "memory/")


class _AdaptersOff:
    """The frozen base model as an agent: the live LM agent with the LoRA adapters switched off."""

    def __init__(self, agent: LMAgent, peft: Any):
        self.agent, self.peft = agent, peft
        self.name, self.policy_id = agent.name, "base"

    def act(self, requests):
        with self.peft.disable_adapter():
            return self.agent.act(requests)


class _AdapterAgent:
    """A frozen snapshot as an agent: the live model with another LoRA adapter active while it answers."""

    def __init__(self, agent: LMAgent, peft: Any, adapter: str):
        self.agent, self.peft, self.adapter = agent, peft, adapter
        self.name, self.policy_id = agent.name, agent.policy_id

    def act(self, requests):
        self.peft.set_adapter(self.adapter, inference_mode=True)
        try:
            return self.agent.act(requests)
        finally:
            self.peft.set_adapter(LIVE_ADAPTER)


class OpponentPool:
    """Snapshots of the live adapter (algorithms.md 7.5), kept as files in the run directory and loaded
    as named adapters into the policy model for the iterations that serve them."""

    def __init__(self, trainer: Trainer):
        if trainer.learner.peft is None:
            raise RepertoryError("rollout.opponent 'pool' serves LoRA snapshots; set model.lora.enabled: true")
        self.trainer = trainer
        self.config = trainer.config.pool
        self.directory = trainer.run_dir / "snapshots"
        self.loaded: dict[int, _AdapterAgent] = {}

    def snapshots(self) -> list[int]:
        """Iterations whose snapshot is on disk, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(f.stem) for f in self.directory.glob("*.safetensors") if f.stem.isdigit())

    def take(self, iteration: int) -> None:
        """Save the live adapter as snapshot ``iteration`` (atomically; rewriting it is harmless)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        tensors = get_peft_model_state_dict(self.trainer.learner.peft, adapter_name=LIVE_ADAPTER)
        tmp = self.directory / f".tmp-{iteration:06d}-{os.getpid()}"
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, self.directory / f"{iteration:06d}.safetensors")

    def serve(self, iteration: int) -> list[_AdapterAgent]:
        """The snapshots served this iteration (a random subset of at most ``max_served``), loaded as adapters."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        available = [i for i in self.snapshots() if i <= iteration]
        rng = random.Random(derive(self.trainer.config.seed, iteration, "opponent", "served"))
        served = sorted(rng.sample(available, min(self.config.max_served, len(available))))
        peft = self.trainer.learner.peft
        for old in [i for i in self.loaded if i not in served]:
            peft.delete_adapter(self.loaded.pop(old).adapter)
        for snap in served:
            if snap in self.loaded:
                continue
            name = f"snapshot-{snap}"
            # A new adapter draws its initial weights (overwritten below) from the global RNG; forking keeps
            # a resumed run, which loads every snapshot at once, on the same random stream as a straight one.
            with torch.random.fork_rng(devices=[]):
                peft.add_adapter(name, peft.peft_config[LIVE_ADAPTER])
            set_peft_model_state_dict(
                peft, load_file(str(self.directory / f"{snap:06d}.safetensors")), adapter_name=name
            )
            peft.set_adapter(LIVE_ADAPTER)
            live = self.trainer.live
            agent = LMAgent(
                live.backend, f"snapshot@{snap}", live.params, live.constrained, live.seed, f"snapshot@{snap}"
            )
            self.loaded[snap] = _AdapterAgent(agent, peft, name)
        return [self.loaded[i] for i in served]

    def draw(self, served: list[_AdapterAgent], iteration: int, match: int) -> Agent:
        """Match ``match``'s opponent: a random served snapshot with probability p_snapshot, else the live policy."""
        rng = random.Random(derive(self.trainer.config.seed, iteration, match, "opponent"))
        if served and rng.random() < self.config.p_snapshot:
            return served[rng.randrange(len(served))]
        return self.trainer.live


class Trainer:
    """One training run in one run directory."""

    def __init__(self, config: TrainConfig, run_dir: Path, loaded: LoadedModel | None = None):
        self.config = config
        self.run_dir = run_dir
        self.env = env_class(config.rollout.env)
        self.estimator = algos.get_estimator(config.algo.estimator)
        loaded = loaded or load_model(config.model.name, config.model.device)
        self.learner = Learner(
            loaded,
            config.algo,
            config.model.lora,
            config.critic,
            needs_critic=self.needs_critic(),
            temperature=config.rollout.temperature,
            seed=config.seed,
        )
        self.loaded = LoadedModel(self.learner.model, loaded.tokenizer, loaded.name)
        self.backend = HFBackend(self.loaded)
        params = SamplingParams(config.rollout.temperature, 1.0, config.rollout.max_new_tokens)
        sampler_seed = derive(config.seed, "sampler")
        self.live = LMAgent(self.backend, "live", params, config.rollout.constrained, sampler_seed, policy_id="live")
        self.opponent = self._agent(config.rollout.opponent)
        self.pool = OpponentPool(self) if config.rollout.opponent == "pool" else None
        eval_spec = config.eval.opponent or config.rollout.opponent
        if eval_spec == "pool":
            eval_spec = "self"
        if eval_spec == "self" and config.eval.opponent is None and self.env.fixed_seat:
            eval_spec = self.env.default_partner  # negotiations are measured against their partner
        self.eval_opponent = self._agent(eval_spec)
        self.kernels = load_kernels(config.rollout.env, "train")
        self.iteration = 0
        self.estimator_state: dict[str, Any] = {}
        self.discount = DISCOUNT  # gamma of the held-out expected discounted return

    def needs_critic(self) -> bool:
        """Whether the learner carries a value model (read from the config alone: called while building)."""
        return self.estimator.needs_critic

    def estimator_inputs(self, batch: Batch) -> list[algos.TrajectoryInput]:
        """What the estimator sees of a batch (the per-turn rewards as the environment gave them)."""
        return batch.estimator_inputs()

    def _agent(self, spec: str) -> Agent | None:
        if spec in ("self", "pool"):
            return None
        if spec == "base":
            if self.learner.peft is not None:
                base = LMAgent(self.backend, "base", self.live.params, self.live.constrained, self.live.seed, "base")
                return _AdaptersOff(base, self.learner.peft)
            frozen = HFBackend(LoadedModel(self.learner.reference, self.loaded.tokenizer, self.loaded.name))
            return LMAgent(frozen, "base", self.live.params, self.live.constrained, self.live.seed, "base")
        options = LMOptions(
            model=self.config.model.name,
            temperature=self.config.rollout.temperature,
            max_new_tokens=self.config.rollout.max_new_tokens,
            constrained=self.config.rollout.constrained,
            seed=derive(self.config.seed, "opponent"),
            device=self.config.model.device,
        )
        if spec == "model":
            raise RepertoryError("opponent 'model' is ambiguous in training; use 'base' or 'model:PATH'")
        if spec.startswith("model:") and is_run_or_checkpoint(spec[6:]):
            return frozen_policy_agent(spec[6:], self.live.params, self.live.constrained, options.seed, options.device)
        return make_agent(spec, env_class(self.config.rollout.env), options)

    # rollout

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
                if self.pool is not None:
                    live_seat = g % n_seats  # 7.5: the trained seat alternates between crn groups
                    opponent = self.pool.draw(served, iteration, i)
                    agents: list[Agent] = [self.live if s == live_seat else opponent for s in range(n_seats)]
                    trainable = [s == live_seat for s in range(n_seats)]
                    guarded = guarded_seats(self.env, agents, live_seat)
                elif self.opponent is None:
                    agents = [self.live] * n_seats
                    trainable = [True] * n_seats
                    guarded = []
                else:
                    live_seat = agent_seat(self.env, i)
                    agents = [self.live if s == live_seat else self.opponent for s in range(n_seats)]
                    trainable = [s == live_seat for s in range(n_seats)]
                    guarded = guarded_seats(self.env, agents, live_seat)
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
                    )
                )
        return specs

    # one iteration

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        """Rollout, estimate, update; returns the iteration's metrics line."""
        config, algo = self.config, self.config.algo
        line: dict[str, Any] = {"iteration": iteration}
        if config.eval.episodes and (iteration == 0 or (config.eval.every and iteration % config.eval.every == 0)):
            line.update(self.evaluate(iteration))
        if self.pool is not None and iteration % config.pool.snapshot_every == 0:
            self.pool.take(iteration)
        start = time.perf_counter()
        generated_before = self.backend.stats.generated_tokens
        episodes = run_episodes(self.specs(iteration), config.rollout.max_concurrent)
        rollout_s = time.perf_counter() - start
        generated = self.backend.stats.generated_tokens - generated_before
        write_episodes(self.run_dir / "episodes" / f"iter-{iteration:06d}.parquet", episodes)
        line.update(rollout_metrics(episodes))
        if self.pool is not None:
            line["pool/snapshots"] = len(self.pool.snapshots())
            line["pool/snapshot_matches"] = sum(
                any(s.policy_id.startswith("snapshot@") for s in ep.seats) for ep in episodes
            ) / len(episodes)

        start = time.perf_counter()
        batch = collect(episodes, algo.packing, algo.mask_truncated)
        if not batch.sequences:
            raise RepertoryError(
                f"iteration {iteration}: no trainable tokens (no live seat produced a response); "
                "check rollout.opponent and the environment"
            )
        self.learner.score(batch)
        advantages, returns, estimate_metrics = self.advantages(batch)
        update = self.learner.update(batch, advantages, returns, iteration)
        train_s = time.perf_counter() - start
        self.backend.clear_prefixes()

        seq_tokens = sum(len(s.input_ids) for s in batch.sequences)
        line.update(
            {
                "samples": sum(1 for s in batch.samples if s.trained),
                "tokens/trained": batch.n_tokens,
                "tokens/sequence": seq_tokens,
                **update,
                **estimate_metrics,
                "time/rollout_s": rollout_s,
                "time/train_s": train_s,
                "throughput/rollout_tok_s": generated / rollout_s if rollout_s else 0.0,
                "throughput/train_tok_s": seq_tokens * (1 + algo.ppo_epochs) / train_s if train_s else 0.0,
                "memory/peak_rss_mb": peak_rss_mb(),
            }
        )
        return line

    def advantages(self, batch: Batch) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor] | None, dict]:
        """Per-sample advantage (and critic target) tensors from the configured estimator."""
        algo = self.config.algo
        inputs = self.estimator_inputs(batch)
        if algo.kl_mode == "reward" and algo.beta_kl > 0:
            for traj, ref in zip(inputs, batch.trajectories):
                for k, index in enumerate(ref.samples):
                    if index in batch.logp_old:
                        kl = algos.kl_penalty(batch.logp_old[index], batch.logp_ref[index], algo.kl_estimator)
                        traj.rewards[k] -= algo.beta_kl * float(kl.sum())
        params = algos.EstimatorParams(
            **{f.name: getattr(algo, f.name) for f in fields(algos.EstimatorParams) if hasattr(algo, f.name)}
        )
        estimate = self.estimator.fn(inputs, params, self.estimator_state)
        whiten = self.estimator.whiten if algo.whiten is None else algo.whiten
        adv_lists = algos.whiten(estimate.advantages) if whiten else estimate.advantages
        advantages: dict[int, torch.Tensor] = {}
        returns: dict[int, torch.Tensor] | None = {} if estimate.returns is not None else None
        for t, ref in enumerate(batch.trajectories):
            for k, index in enumerate(ref.samples):
                if batch.samples[index].trained:
                    advantages[index] = torch.tensor(adv_lists[t][k], dtype=torch.float32)
                    if returns is not None:
                        returns[index] = torch.tensor(estimate.returns[t][k], dtype=torch.float32)
        metrics = {f"estimator/{k}": v for k, v in estimate.metrics.items()}
        metrics["advantage/mean"] = float(torch.cat(list(advantages.values())).mean()) if advantages else 0.0
        if returns:
            errors = [float(((batch.values[i] - returns[i]) ** 2).mean()) for i in returns if batch.samples[i].n_tokens]
            metrics["value/mse"] = sum(errors) / len(errors)
        return advantages, returns, metrics

    def evaluate(self, iteration: int) -> dict[str, Any]:
        """Held-out evaluation of the live policy (deterministic in seed and iteration)."""
        start = time.perf_counter()
        config = self.config
        result = evaluate(
            config.rollout.env,
            self.live,
            config.eval.episodes,
            derive(config.seed, "eval"),
            config.eval.split,
            self.eval_opponent,
            gamma=self.discount,
        )
        self.backend.clear_prefixes()
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
        out.update({f"eval/env/{k}": v for k, v in result.metrics.items()})
        out["time/eval_s"] = time.perf_counter() - start
        return out

    # checkpoints

    def save_checkpoint(self, done: int) -> Path:
        """Write checkpoint ``done`` (iterations completed) atomically; prune old ones."""
        root = self.run_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"{done:06d}"
        tmp = root / f".tmp-{done:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_state(tmp)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        state = {"iterations_done": done, "estimator_state": self.estimator_state}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / COMPLETE).write_text("")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(self.run_dir)[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def save_state(self, directory: Path) -> None:
        """Write the trainable state (what a checkpoint holds besides RNG and counters) into ``directory``."""
        self.learner.save(directory)

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        self.learner.load(directory)

    def load_checkpoint(self, path: Path) -> None:
        self.load_state(path)
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        state = json.loads((path / "trainer_state.json").read_text())
        self.iteration = state["iterations_done"]
        self.estimator_state = state["estimator_state"]

    # the loop

    def fit(self, on_line: Callable[[dict[str, Any]], None] | None = None) -> Path:
        """Run the remaining iterations; returns the run directory."""
        config = self.config
        metrics_path = self.run_dir / "metrics.jsonl"
        for iteration in range(self.iteration, config.iterations):
            line = self.run_iteration(iteration)
            done = iteration + 1
            if done == config.iterations and config.eval.episodes:
                final = self.evaluate(done)
                line.update({f"final/{k.removeprefix('eval/')}": v for k, v in final.items() if k.startswith("eval/")})
            with metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            self.iteration = done
            if done % config.checkpoint_every == 0 or done == config.iterations:
                self.save_checkpoint(done)
            if on_line is not None:
                on_line(line)
        write_report(self.run_dir)
        return self.run_dir


def rollout_metrics(episodes: list[Episode]) -> dict[str, float]:
    scores = seat_scores(episodes, lambda i, s: episodes[i].seats[s].trainable)
    line: dict[str, float] = {"episodes": len(episodes)}
    all_outcomes = [x for v in scores.outcomes.values() for x in v]
    line["outcome"] = sum(all_outcomes) / len(all_outcomes) if all_outcomes else 0.0
    for name in sorted(scores.outcomes):
        line[f"outcome/{name}"] = sum(scores.outcomes[name]) / len(scores.outcomes[name])
        line[f"points/{name}"] = sum(scores.points[name]) / len(scores.points[name])
    line["invalid_rate"] = scores.invalid_rate
    line.update({f"env/{k}": v for k, v in mean_metrics(episodes).items()})
    return line


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories that were completely written, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if CHECKPOINT.match(p.name) and (p / COMPLETE).is_file())


def new_run_dir(config: TrainConfig) -> Path:
    """A fresh run directory under ``output_dir`` (the name, or <estimator>-<env>-<timestamp>)."""
    root = Path(config.output_dir)
    if config.name:
        path = root / config.name
        if path.exists():
            raise RepertoryError(f"run directory {path} already exists; continue it with --resume {path} or rename")
        return path
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{config.algo.estimator}-{config.rollout.env}-{stamp}"
    path, n = root / base, 2
    while path.exists():
        path, n = root / f"{base}-{n}", n + 1
    return path


def trainer_class(config: TrainConfig) -> type[Trainer]:
    """The trainer of ``config.trainer``: online iterations or batch-online rounds."""
    if config.trainer == "rounds":
        from repertory.rounds import RoundsTrainer

        return RoundsTrainer
    return Trainer


def start_run(config: TrainConfig, loaded: LoadedModel | None = None) -> Trainer:
    """Create the run directory, write the resolved config, build the trainer."""
    run_dir = new_run_dir(config)
    trainer_obj = trainer_class(config)(config, run_dir, loaded)
    (run_dir / "episodes").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    return trainer_obj


def resume_run(run_dir: Path, overrides: list[str] | None = None, loaded: LoadedModel | None = None) -> Trainer:
    """Rebuild the trainer of ``run_dir`` from its config and newest complete checkpoint.

    Work after that checkpoint (a metrics line, an episodes file of the iteration in flight) is
    discarded so that the continued run equals an uninterrupted one.
    """
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise RepertoryError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(str(config_path), overrides)
    if overrides:
        config_path.write_text(dump_config(config))
    trainer_obj = trainer_class(config)(config, run_dir, loaded)
    checkpoints = complete_checkpoints(run_dir)
    for stale in (run_dir / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if checkpoints:
        trainer_obj.load_checkpoint(checkpoints[-1])
    done = trainer_obj.iteration
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        kept = [line for line in metrics_path.read_text().splitlines() if _iteration_of(line) < done]
        tmp = metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, metrics_path)
    for part in (run_dir / "episodes").glob("iter-*.parquet"):
        if int(part.stem.split("-")[1]) >= done:
            part.unlink()
    (run_dir / "episodes").mkdir(parents=True, exist_ok=True)
    return trainer_obj


def _iteration_of(line: str) -> int:
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def resolve_checkpoint(path: str | Path) -> tuple[Path, TrainConfig]:
    """A run directory (its newest complete checkpoint) or a checkpoint directory, with the run's config."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        checkpoints = complete_checkpoints(path)
        if not checkpoints:
            raise RepertoryError(f"run {path} has no complete checkpoint yet")
        return checkpoints[-1], load_config(str(path / "config.yaml"))
    if (path / COMPLETE).is_file() and (path.parent.parent / "config.yaml").is_file():
        return path, load_config(str(path.parent.parent / "config.yaml"))
    raise RepertoryError(f"{path} is neither a run directory (config.yaml) nor a complete checkpoint (COMPLETE)")


def load_policy(checkpoint: Path, config: TrainConfig, device: str | None = None) -> LoadedModel:
    """The trained policy of a checkpoint as one plain model (LoRA adapters merged into the base)."""
    policy = checkpoint / "policy"
    if (policy / "adapter_config.json").is_file():
        from peft import PeftModel

        loaded = load_model(config.model.name, device or config.model.device)
        merged = PeftModel.from_pretrained(loaded.model, str(policy)).merge_and_unload()
        merged.eval()
        return LoadedModel(merged, loaded.tokenizer, f"{checkpoint.parent.parent.name}@{int(checkpoint.name)}")
    loaded = load_model(str(policy), device or config.model.device)
    return LoadedModel(loaded.model, loaded.tokenizer, f"{checkpoint.parent.parent.name}@{int(checkpoint.name)}")


def export_policy(path: str | Path, out_dir: str | Path, device: str = "cpu") -> Path:
    """Write a run's newest (or a given checkpoint's) policy as a plain Hugging Face checkpoint, LoRA merged into
    the base, usable as ``model.name``, ``--model`` or by any Hugging Face tool. The directory appears whole or
    not at all; an existing non-empty one is refused."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RepertoryError(f"{out_dir} already exists and is not an empty directory; choose a new one")
    checkpoint, config = resolve_checkpoint(path)
    loaded = load_policy(checkpoint, config, device)
    return save_checkpoint(loaded.model, loaded.tokenizer, out_dir)


def is_run_or_checkpoint(path: str | Path) -> bool:
    """True for a run directory or one of its checkpoint directories."""
    path = Path(path)
    return (path / "config.yaml").is_file() or (path / COMPLETE).is_file()


def frozen_policy_agent(
    path: str | Path, params: SamplingParams, constrained: bool, seed: int, device: str | None = None
) -> LMAgent:
    """A trained policy (a run's newest checkpoint, or a checkpoint) as a frozen agent with its own weights."""
    checkpoint, config = resolve_checkpoint(path)
    loaded = load_policy(checkpoint, config, device)
    return LMAgent(HFBackend(loaded), f"model:{path}", params, constrained, seed, f"snapshot@{int(checkpoint.name)}")


# Exploitability (algorithms.md 8.3)


def exploit_gain_loss(
    exploiter_before: float, exploiter_after: float, victim_before: float, victim_after: float
) -> tuple[float, float]:
    """(exploiter gain, victim loss) of one exploiter: J_E(E_N vs V) - J_E(E_0 vs V), J_V(V vs E_0) - J_V(V vs E_N)."""
    return exploiter_after - exploiter_before, victim_before - victim_after


@dataclass
class ExploitRun:
    """One exploiter seed: held-out outcomes of exploiter and victim before and after training."""

    seed: int
    run_dir: str
    exploiter_before: float
    exploiter_after: float
    victim_before: float
    victim_after: float

    @property
    def gain(self) -> float:
        return exploit_gain_loss(self.exploiter_before, self.exploiter_after, self.victim_before, self.victim_after)[0]

    @property
    def loss(self) -> float:
        return exploit_gain_loss(self.exploiter_before, self.exploiter_after, self.victim_before, self.victim_after)[1]


@dataclass
class Exploitability:
    """Approximate exploitability of a frozen victim at a training budget: gain and loss over exploiter seeds."""

    env: str
    victim: str
    iterations: int
    episodes: int
    runs: list[ExploitRun]
    victim_selfplay: tuple[float, float]

    @property
    def gain(self) -> tuple[float, float]:
        return algos.mean_se([r.gain for r in self.runs])

    @property
    def loss(self) -> tuple[float, float]:
        return algos.mean_se([r.loss for r in self.runs])

    @property
    def exploitable(self) -> bool:
        """Whether the gain is significantly positive (mean above 1.96 standard errors)."""
        mean, se = self.gain
        return mean > 1.96 * se if len(self.runs) > 1 else mean > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "victim": self.victim,
            "iterations": self.iterations,
            "episodes": self.episodes,
            "runs": [{**asdict(r), "gain": r.gain, "loss": r.loss} for r in self.runs],
            "gain": self.gain[0],
            "gain_se": self.gain[1],
            "loss": self.loss[0],
            "loss_se": self.loss[1],
            "victim_selfplay": self.victim_selfplay[0],
            "victim_selfplay_se": self.victim_selfplay[1],
            "exploitable": self.exploitable,
        }


def victim_spec(victim: str) -> str:
    """The rollout.opponent naming a victim: a run or checkpoint directory becomes model:PATH."""
    return f"model:{victim}" if is_run_or_checkpoint(victim) else victim


def exploitability(
    env: str,
    victim: str,
    iterations: int,
    seeds: list[int],
    episodes: int,
    output_dir: Path,
    overrides: list[str] | None = None,
    loaded: Callable[[], LoadedModel] | None = None,
    on_line: Callable[[dict[str, Any]], None] | None = None,
) -> Exploitability:
    """Train a fresh naive exploiter (new LoRA on the base model) against the frozen ``victim`` for
    ``iterations`` per seed and evaluate both on held-out kernels before and after (8.3). The recipe is
    ``naive-ENV`` where one is shipped; ``overrides`` (key=value) shrink or change it, but the estimator,
    the opponent, the budget and the seed are the exploit's."""
    from repertory.config import recipe_names

    if iterations < 1 or episodes < 1 or not seeds:
        raise RepertoryError("exploitability needs at least 1 iteration, 1 evaluation episode and 1 seed")
    recipe = f"naive-{env}" if f"naive-{env}" in recipe_names() else None
    runs, trainer = [], None
    for seed in seeds:
        config = load_config(
            recipe,
            [
                *(overrides or []),
                f"rollout.env={env}",
                f"rollout.opponent={victim_spec(victim)}",
                "algo.estimator=naive",
                f"iterations={iterations}",
                f"seed={seed}",
                "eval.episodes=0",
                f"output_dir={output_dir}",
                f"name=exploiter-seed{seed}",
            ],
        )
        trainer = start_run(config, loaded() if loaded is not None else None)
        if trainer.opponent is None:
            raise RepertoryError(f"victim {victim!r} is not a frozen policy or bot")
        eval_seed = derive(0, "exploit", "eval")
        before = evaluate(env, trainer.live, episodes, eval_seed, "heldout", trainer.opponent)
        trainer.backend.clear_prefixes()
        trainer.fit(on_line)
        after = evaluate(env, trainer.live, episodes, eval_seed, "heldout", trainer.opponent)
        runs.append(
            ExploitRun(
                seed,
                str(trainer.run_dir),
                before.overall[0],
                after.overall[0],
                partner_outcome(before)[0],
                partner_outcome(after)[0],
            )
        )
    assert trainer is not None and trainer.opponent is not None
    selfplay = evaluate(env, trainer.opponent, episodes, derive(0, "exploit", "eval"), "heldout")
    return Exploitability(env, victim, iterations, episodes, runs, selfplay.overall)

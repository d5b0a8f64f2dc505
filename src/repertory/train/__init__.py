"""Training runs: the loop a method runs in, and starting or resuming a run.

An online method (``method.kind`` selfplay, adalign) runs in :class:`~repertory.train.online.OnlineTrainer`,
which rolls out and updates every iteration; a round method (igrpo, st-grpo, mt-sft, mt-kto, mt-ppo, archer,
archer-lc) in :class:`~repertory.train.rounds.RoundsTrainer`, which runs batch-online deployment rounds. The
methods themselves are :mod:`repertory.train.methods`. Every name a config gives a registry (method, estimator,
policy loss, generation backend) is checked before any model loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from repertory.agents.resolve import spec_kind
from repertory.algos.losses import POLICY_LOSSES
from repertory.config import TrainConfig, broken_rule, dump_config
from repertory.envs import env_class, load_kernels
from repertory.generation import BACKENDS
from repertory.models import LoadedModel
from repertory.models.checkpoints import export_policy
from repertory.runs import RunDir, load_run_config, new_run_dir
from repertory.train import distributed, warm
from repertory.train.base import TIMING_PREFIXES, Trainer
from repertory.train.methods import METHODS
from repertory.train.online import OnlineTrainer
from repertory.train.rounds import RoundsTrainer
from repertory.types import RepertoryError


def check_names(config: TrainConfig) -> None:
    """Every registry name in ``config`` is registered and every line-up agent resolves (one line naming the known
    ones otherwise), before any model loads."""
    for key, registry, name in [
        ("method.kind", METHODS, config.method.kind),
        ("rollout.backend", BACKENDS, config.rollout.backend),
        ("algo.policy_loss", POLICY_LOSSES, config.algo.policy_loss),
    ]:
        try:
            registry[name]
        except RepertoryError as exc:
            raise RepertoryError(f"{key}: {exc}") from None
    if config.selects_on_validation:  # before training, not at the first validation evaluation
        try:
            load_kernels(config.rollout.env, "validation", config.rollout.env_options)
        except RepertoryError as exc:
            raise RepertoryError(f"eval.validation: {exc}; or set eval.validation: false") from None
    line_ups = [("rollout.opponent", config.rollout.opponent)]
    if config.eval.episodes:  # a recipe's evaluation line-up may not exist in another game: named only when used
        line_ups.append(("the evaluations' line-up (eval.opponent)", config.evaluation_opponent))
    for key, spec in line_ups:
        if spec in ("self", "pool"):
            continue
        try:
            if spec_kind(spec, env_class(config.rollout.env)) == "model":
                raise RepertoryError("'model' is ambiguous in training; use 'base' or 'model:PATH'")
        except RepertoryError as exc:
            raise RepertoryError(f"{key} {spec!r}: {exc}") from None


def build(config: TrainConfig, run_dir: RunDir, loaded: LoadedModel | None = None) -> Trainer:
    """The trainer ``config`` names, on ``run_dir``; registry names are checked before any model loads."""
    check_names(config)
    broken = broken_rule(config, distributed.world_size())  # the config checked them on one process
    if broken is not None:
        raise RepertoryError(broken)
    loop = RoundsTrainer if config.round_based else OnlineTrainer
    return loop(config, run_dir, loaded)


def warm_started(
    config: TrainConfig, loaded: LoadedModel | None = None, on_line: Callable[[dict[str, Any]], None] | None = None
) -> Path:
    """The exported warm-started policy of ``config`` (:class:`~repertory.train.warm.WarmPlan`): found in its
    cache, or built there from ``loaded`` (else ``model.name``) — demonstrations, one mt-sft round, the export."""
    plan = warm.WarmPlan.of(config)
    model = plan.directory / warm.MODEL
    if (model / "config.json").is_file():
        if not any(model.glob("*.safetensors")):  # the export is atomic: these files went missing afterwards
            raise RepertoryError(
                f"the cached warm start {model} has lost its weights; delete {plan.directory} to rebuild it"
            )
        return model
    if distributed.world_size() > 1:
        raise RepertoryError(f"the warm start {plan.directory} is not built yet; build it with one process first")
    if not (plan.directory / warm.DEMOS).is_file():
        plan.write_demonstrations(plan.directory / warm.DEMOS)
    run = RunDir(plan.directory / warm.RUN)
    trainer = resume_run(run.root, loaded=loaded) if run.is_run() else start_run(plan.imitation_config(), loaded)
    if trainer.iteration < trainer.config.iterations:
        trainer.fit(on_line)
    return export_policy(run.root, model, config.model.device or "cpu")


def from_warm_start(config: TrainConfig, model: Path | None = None) -> TrainConfig:
    """``config`` as its run saves it: starting from its warm start's export (``model``; default where
    :func:`warm_started` puts it)."""
    path = model if model is not None else warm.WarmPlan.of(config).directory / warm.MODEL
    return config.model_copy(update={"model": config.model.model_copy(update={"name": str(path)})})


def start_run(config: TrainConfig, loaded: LoadedModel | None = None) -> Trainer:
    """Create the run directory (process 0 of data-parallel training), write the resolved config, build the
    trainer. Under a launcher (``WORLD_SIZE`` > 1) it joins the process group first. With ``warm_start`` the run
    starts from the warm-started policy (its ``model.name`` in the run's config)."""
    distributed.initialise()
    check_names(config)
    if config.warm_start is not None:
        config = from_warm_start(config, warm_started(config, loaded))
        loaded = None
    run_dir = distributed.broadcast(new_run_dir(config) if distributed.is_main() else None)
    trainer = build(config, run_dir, loaded)
    if distributed.is_main():
        run_dir.create(dump_config(config))
    distributed.barrier()
    return trainer


def resume_run(
    run_dir: str | os.PathLike[str], overrides: list[str] | None = None, loaded: LoadedModel | None = None
) -> Trainer:
    """Rebuild the trainer of ``run_dir`` from its config and newest complete checkpoint.

    Work after that checkpoint (a metrics line, an episodes file of the iteration in flight) is
    discarded so that the continued run equals an uninterrupted one.
    """
    distributed.initialise()
    run = RunDir.existing(run_dir)
    config = load_run_config(run.config, overrides)
    trainer = build(config, run, loaded)
    checkpoints = run.complete_checkpoints()
    if checkpoints:
        trainer.load_checkpoint(checkpoints[-1])
    distributed.barrier()  # every process read the config before process 0 rewrites it
    if overrides and distributed.is_main():  # once the checkpoint took them: a refused resume changes nothing
        run.config.write_text(dump_config(config))
    if distributed.is_main():
        run.truncate_after(trainer.iteration)
    distributed.barrier()
    return trainer


__all__ = [
    "TIMING_PREFIXES",
    "OnlineTrainer",
    "RoundsTrainer",
    "Trainer",
    "build",
    "check_names",
    "from_warm_start",
    "resume_run",
    "start_run",
    "warm_started",
]

"""Experiments made of several runs: a grid of batch-online runs with its table (docs/algorithms.md 5.7), the
suite's warm start, and the approximate exploitability of a frozen policy (8.3)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from repertory.config import SuiteConfig, SuiteFile, describe_error, load_config, recipe_names, recipe_text
from repertory.eval import evaluate, partner_outcome
from repertory.models import LoadedModel
from repertory.report import ResultsTable, results_table
from repertory.runs import RunDir, is_run_or_checkpoint
from repertory.stats import bootstrap_gain, mean_se
from repertory.train import Trainer, check_names, resume_run, start_run
from repertory.types import RepertoryError, derive


def load_suite(recipe: str) -> SuiteConfig | None:
    """The suite a recipe describes, or None when it is an ordinary recipe. Every run's config is validated
    here, before any work starts."""
    text, source = recipe_text(recipe)
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RepertoryError(f"{source} is not valid YAML: {err}") from None
    if not isinstance(loaded, dict) or "suite" not in loaded:
        return None
    try:
        suite = SuiteFile.model_validate(loaded).suite
    except ValidationError as err:
        raise RepertoryError(describe_error(err, source, SuiteFile)) from None
    for _, overrides in suite_runs(suite):
        check_names(load_config(suite.recipe, overrides))
    return suite


def suite_runs(suite: SuiteConfig) -> list[tuple[str, list[str]]]:
    """(run name, overrides) of every cell of the grid, environment-major, then seed: each seed's arms run back to
    back, so that a suite continued in a later session (on other code, or another machine) still compares arms
    paired by seed under the same conditions."""
    out = []
    for env in suite.envs:
        for seed in suite.seeds:
            for entry in suite.methods:
                method, selected = suite.method_overrides(entry)
                name = f"{method}-{env}-s{seed}"
                overrides = [*suite.set, *selected, f"rollout.env={env}", f"seed={seed}"]
                if suite.warm_start is not None:
                    overrides += [f"warm_start.{k}={json.dumps(v)}" for k, v in suite.warm_start.model_dump().items()]
                out.append((name, [*overrides, f"output_dir={suite.output_dir}", f"name={name}"]))
    return out


def run_suite(
    suite: SuiteConfig,
    loaded: Callable[[], LoadedModel] | None = None,
    on_run: Callable[[str, Trainer], None] | None = None,
    on_line: Callable[[dict[str, Any]], None] | None = None,
) -> ResultsTable:
    """Train every run of the grid one after the other — a finished run is skipped, an interrupted one resumed,
    so rerunning the suite continues it — then write ``table.md``, ``table.csv`` and ``contrasts.csv`` into the
    output directory."""
    runs = []
    for name, overrides in suite_runs(suite):
        run_dir = RunDir(Path(suite.output_dir) / name)
        model = loaded() if loaded is not None else None
        if run_dir.is_run():  # a warm-started run resumes from its exported policy, not the caller's model
            trainer = resume_run(run_dir, loaded=model if suite.warm_start is None else None)
        else:
            trainer = start_run(load_config(suite.recipe, overrides), model)
        if on_run is not None:
            on_run(name, trainer)
        if trainer.iteration < trainer.config.iterations:
            trainer.fit(on_line)
        runs.append(run_dir)
    table = results_table(runs, metric=suite.metric)
    table.write(Path(suite.output_dir))
    return table


def exploit_gain_loss(
    exploiter_before: float, exploiter_after: float, victim_before: float, victim_after: float
) -> tuple[float, float]:
    """(exploiter gain, victim loss) of one exploiter: J_E(E_N vs V) - J_E(E_0 vs V), J_V(V vs E_0) - J_V(V vs E_N)."""
    return exploiter_after - exploiter_before, victim_before - victim_after


EXPLOIT_ALPHA = 0.05
"""A victim is exploitable at a budget when its exploiters' gain is above 0 at this one-sided level."""


@dataclass
class ExploitRun:
    """One exploiter seed: held-out outcomes of exploiter and victim before and after training, and the
    exploiter's gain in each game (the games before and after share kernels and episode seeds)."""

    seed: int
    run_dir: str
    exploiter_before: float
    exploiter_after: float
    victim_before: float
    victim_after: float
    game_gains: list[float] = field(default_factory=list)

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
        return mean_se([r.gain for r in self.runs])

    @property
    def loss(self) -> tuple[float, float]:
        return mean_se([r.loss for r in self.runs])

    @cached_property
    def gain_test(self) -> tuple[float, float, float]:
        """The mean gain, its one-sided 95% lower bound and p, by a bootstrap over games within each seed
        (:func:`repertory.stats.bootstrap_gain`): valid for any number of exploiter seeds, one included."""
        return bootstrap_gain([r.game_gains for r in self.runs])

    @property
    def exploitable(self) -> bool:
        """Whether these exploiters gained: the bootstrap's p below 0.05."""
        return self.gain_test[2] < EXPLOIT_ALPHA

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
            "gain_lower_bound": self.gain_test[1],
            "gain_p": self.gain_test[2],
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
                "method.kind=adalign",
                "method.estimator=naive",
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
        trainer.backend.reset_cache()
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
                [a - b for a, b in zip(after.game_outcomes(), before.game_outcomes(), strict=True)],
            )
        )
    assert trainer is not None and trainer.opponent is not None
    selfplay = evaluate(env, trainer.opponent, episodes, derive(0, "exploit", "eval"), "heldout")
    return Exploitability(env, victim, iterations, episodes, runs, selfplay.overall)

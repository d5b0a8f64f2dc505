"""Experiments made of several runs: a grid of batch-online runs with its table (docs/algorithms.md 5.7), the
suite's warm start, and the approximate exploitability of a frozen policy (8.3)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from repertory.config import (
    ProbesConfig,
    SuiteConfig,
    SuiteFile,
    TrainConfig,
    describe_error,
    leaves,
    load_config,
    recipe_names,
    recipe_text,
)
from repertory.envs import env_class
from repertory.eval import evaluate, evaluation_lineup, partner_outcome
from repertory.models import LoadedModel
from repertory.report import ResultsTable, paired_contrasts, results_table
from repertory.report.metrics import read_metrics
from repertory.runs import NOT_RECORDED, RunDir, is_run_or_checkpoint, load_run_config
from repertory.stats import bootstrap_gain, mean_se, seed_summary
from repertory.train import Trainer, check_names, distributed, from_warm_start, resume_run, start_run
from repertory.types import Episode, RepertoryError, derive


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
                overrides = [*suite.set, *suite.env_set.get(env, []), *selected, f"rollout.env={env}", f"seed={seed}"]
                if suite.warm_start is not None:
                    overrides += [f"warm_start.{k}={json.dumps(v)}" for k, v in suite.warm_start.model_dump().items()]
                out.append((name, [*overrides, f"output_dir={suite.output_dir}", f"name={name}"]))
    return out


def run_suite(
    suite: SuiteConfig,
    loaded: Callable[[], LoadedModel] | None = None,
    on_run: Callable[[str, Trainer], None] | None = None,
    on_line: Callable[[dict[str, Any]], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> ResultsTable:
    """Train every run of the grid one after the other — a finished run is skipped (here, or in
    ``suite.records``), an interrupted one resumed, so rerunning the suite continues it, on this machine or
    another — then write ``table.md``, ``table.csv`` and ``contrasts.csv`` (and with probes ``probes.md``) into
    the output directory. ``warn`` hears of each existing run whose settings the suite now gives differently
    (:func:`drift`): it is kept, and its table compares it with runs trained as the suite says now; and of each
    run about to train in another precision than its seed's arms recorded (:func:`precision_conflict`)."""
    warn = warn if distributed.is_main() else None  # in data-parallel training every process runs the suite
    runs: list[RunDir] = []
    probed: list[dict[str, Any]] = []
    starts: dict[str, dict[str, Any]] = {}  # start_key -> an iteration-0 evaluation played in this process
    kept = Path(suite.records or suite.output_dir)
    planned = [(name, load_config(suite.recipe, overrides)) for name, overrides in suite_runs(suite)]
    seeds: dict[tuple[str, int], list[str]] = {}  # (env, seed) -> its arms' run names
    for name, config in planned:
        seeds.setdefault((config.rollout.env, config.seed), []).append(name)
    for name, config in planned:
        existing, trained_here = _counted_copy(suite, name)
        changed = drift(existing, config) if existing.is_run() else []
        if changed and warn is not None:
            warn(f"{name} was trained with other settings than the suite now gives it ({', '.join(changed)})")
        if trained_here:
            arms = [_counted_copy(suite, arm)[0] for arm in seeds[(config.rollout.env, config.seed)] if arm != name]
            heard = _checking_precision(arms, warn, on_run)
            _train(existing, config, suite.warm_start is not None, loaded, heard, on_line, starts)
        runs.append(existing)
        if suite.probes is not None:
            exploiters = Path(suite.output_dir) / "exploiters" / name
            probed.append(probe_run(existing, suite.probes, kept / "probes" / f"{name}.json", exploiters, loaded))
        if suite.records is not None and trained_here:  # after its probes: records mean a run needs nothing more
            keep_records(existing, kept)
    table = results_table(runs, metric=suite.metric, effect=suite.effect)
    table.write(Path(suite.output_dir))
    if probed:
        methods = list(dict.fromkeys(record["method"] for record in probed))  # the runs' own names, suite order
        (Path(suite.output_dir) / "probes.md").write_text(probes_markdown(probed, methods))
    return table


def _counted_copy(suite: SuiteConfig, name: str) -> tuple[RunDir, bool]:
    """The copy of run ``name`` that the suite counts, and whether it trains (or resumes, or is finished) in the
    output directory: finished records win over a run stopped there, which another machine may have finished
    since."""
    here = RunDir(Path(suite.output_dir) / name)
    if suite.records is None:
        return here, True
    recorded = RunDir(Path(suite.records) / name)
    trained_here = not finished(recorded) or finished(here)
    return (here if trained_here else recorded), trained_here


def _checking_precision(
    arms: list[RunDir], warn: Callable[[str], None] | None, on_run: Callable[[str, Trainer], None] | None
) -> Callable[[str, Trainer], None]:
    """``on_run``, after a warning where the trainer is about to train in another precision than its seed's
    ``arms`` (the suite's other runs of its environment and seed, wherever they are counted) or its own earlier
    stretches recorded."""

    def heard(name: str, trainer: Trainer) -> None:
        if warn is not None and trainer.iteration < trainer.config.iterations:
            if conflict := precision_conflict(trainer.run_dir, trainer.trained_in, arms):
                warn(conflict)
        if on_run is not None:
            on_run(name, trainer)

    return heard


def precision_conflict(run: RunDir, here: str, arms: list[RunDir]) -> str:
    """Why training ``run`` in ``here`` (:func:`~repertory.runs.session_precision` of this machine) would leave
    the arms of one seed in different precisions, so that they differ by more than their method: its own earlier
    stretches, or ``arms``, recorded another (:meth:`RunDir.precisions`); empty where none did."""
    own = [precision for precision in run.precisions() if precision != here]
    other = {arm.name: [precision for precision in arm.precisions() if precision != here] for arm in arms}

    def said(precisions: list[str]) -> str:
        return " and ".join("an unrecorded precision" if p == NOT_RECORDED else p for p in precisions)

    named = [f"its own earlier training in {said(own)}"] if own else []
    named += [f"{arm} in {said(precisions)}" for arm, precisions in other.items() if precisions]
    if not named:
        return ""
    return (
        f"{run.name} trains in {here} on this machine, beside {', '.join(named)}: its seed's arms would differ by "
        "more than their method (train the odd ones again on one machine, or pin model.precision in the suite's "
        "set before any of them trains)"
    )


def _train(
    run_dir: RunDir,
    config: TrainConfig,
    warm_started: bool,
    loaded: Callable[[], LoadedModel] | None,
    on_run: Callable[[str, Trainer], None] | None,
    on_line: Callable[[dict[str, Any]], None] | None,
    starts: dict[str, dict[str, Any]],
) -> None:
    """Start, resume or leave one run of a suite; it is finished on return. ``starts`` holds the iteration-0
    evaluations played in this process, by :func:`start_key` of the run's own config (its warm start's path
    included): a run that starts here takes its own from there, else files the one it plays. Runs trained
    elsewhere (records, another machine's precision) neither give nor take one."""
    model = loaded() if loaded is not None else None
    if run_dir.is_run():  # a warm-started run resumes from its exported policy, not the caller's model
        trainer = resume_run(run_dir, loaded=None if warm_started else model)
    else:
        trainer = start_run(config, model)
    key, fresh = start_key(trainer.config), trainer.iteration == 0
    if fresh:
        trainer.start_evaluation = starts.get(key)
    if on_run is not None:
        on_run(run_dir.name, trainer)
    if trainer.iteration < trainer.config.iterations:
        trainer.fit(on_line)
    if distributed.is_main() and not finished(run_dir):  # its checkpoint outlived the metrics lines after it
        raise RepertoryError(
            f"{run_dir} has a checkpoint after all {trainer.config.iterations} iterations, but its metrics.jsonl "
            "lacks the last lines or the final evaluation (lost in a crash?); delete its last checkpoint "
            "under checkpoints/ to train that iteration again"
        )
    played = start_evaluation(run_dir)
    if fresh and played:
        starts.setdefault(key, played)


def drift(run: RunDir, config: TrainConfig) -> list[str]:
    """The settings (dotted keys) in which ``run``'s saved config differs from ``config``, what the suite gives
    it now (a warm-started run starts from its warm start's export, as its config says)."""
    if config.warm_start is not None:
        config = from_warm_start(config)
    saved, wanted = (
        _settings(load_run_config(run.config).model_dump(mode="json")),
        _settings(config.model_dump(mode="json")),
    )
    return sorted(key for key in saved.keys() | wanted.keys() if saved.get(key) != wanted.get(key))


def _settings(node: dict[str, Any]) -> dict[str, Any]:
    return {".".join(path): value for path, value in leaves(node)}


def start_key(config: TrainConfig) -> str:
    """What a run's iteration-0 evaluation depends on: its whole config but its name, its arm and its method's and
    learner's settings, save the discount its J is taken at. Before the first update every method's policy is
    the model (or the suite's warm start; LoRA starts at zero), evaluated on the same games, so the arms of one
    seed play the same evaluation."""
    kept = config.model_dump(mode="json", exclude={"name", "arm", "method", "algo"})
    return json.dumps({**kept, "gamma": config.method.gamma}, sort_keys=True)


def start_evaluation(run: RunDir) -> dict[str, Any]:
    """The ``eval/*`` scores of ``run``'s iteration-0 evaluation (empty where it has none yet)."""
    if not run.metrics.is_file():
        return {}
    first = next((line for line in read_metrics(run) if line.get("iteration") == 0), {})
    return {key: value for key, value in first.items() if key.startswith("eval/")}


RECORDS = ("config.yaml", "metrics.jsonl", "sessions.jsonl")
"""A finished run's small records: enough for a results table on any machine, and where it trained (checkpoints and
episodes stay)."""


def finished(run: RunDir) -> bool:
    """Whether ``run`` (a run, or a run's records) holds the metrics of every iteration its config asks for, and
    of its final evaluation."""
    if not run.is_run() or not run.metrics.is_file():
        return False
    config, lines = load_run_config(run.config), read_metrics(run)
    trained = max((int(line["iteration"]) for line in lines), default=-1) + 1 >= config.iterations
    evaluated = config.eval.episodes == 0 or any(key.startswith("final/") for line in lines for key in line)
    return trained and evaluated


def keep_records(run: RunDir, records: Path) -> None:
    """Copy a finished run's :data:`RECORDS` into ``records/<run>/``."""
    target = records / run.name
    target.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:  # each file whole or not at all: a torn metrics.jsonl would read as finished
        if not (run / name).is_file():  # sessions.jsonl: runs from before it have none
            continue
        shutil.copyfile(run / name, target / f"{name}.tmp")
        (target / f"{name}.tmp").replace(target / name)


def probe_run(
    run_dir: RunDir,
    probes: ProbesConfig,
    path: Path,
    exploiters: Path,
    loaded: Callable[[], LoadedModel] | None = None,
) -> dict[str, Any]:
    """Probe a finished run's last policy (see :class:`ProbesConfig`) on held-out games that every arm of its seed
    shares; the record, kept at ``path`` so that a continued suite probes each run once. The exploiters train
    in ``exploiters`` (a working directory: their checkpoints stay out of the records, which keep their numbers
    in the probe record)."""
    if path.is_file():
        return json.loads(path.read_text())
    if not (run_dir / "checkpoints").is_dir():
        raise RepertoryError(f"{run_dir} has no checkpoint to probe (only its records) and no probe record at {path}")
    config = load_run_config(run_dir.config)
    env, seed = config.rollout.env, derive(config.seed, "probe")
    record: dict[str, Any] = {"run": run_dir.name, "method": config.method_name, "env": env, "seed": config.seed}
    games: list[tuple[Episode, int]] = []
    for partner in ["self", *probes.partners]:
        agent, opponent, _ = evaluation_lineup(str(run_dir.root), env, partner, config.seed)
        result = evaluate(
            env, agent, probes.episodes, seed, "heldout", opponent, env_options=config.rollout.env_options
        )
        games += [(episode, s) for episode, own in zip(result.played, result.seats) for s in own]
        if opponent is None:
            record["selfplay"] = {"outcome": result.overall[0], "se": result.overall[1]}
        else:
            taken = partner_outcome(result)
            record.setdefault("partners", {})[partner] = {
                "outcome": result.overall[0],
                "se": result.overall[1],
                "partner": taken[0],
                "partner_se": taken[1],
            }
    fit = env_class(env).strategy_fit(games)
    record["strategy"] = fit.to_json() if fit is not None else None
    if probes.exploiters:
        shutil.rmtree(exploiters, ignore_errors=True)  # a probe stopped before its record: its exploiters start again
        record["exploit"] = exploitability(
            env, str(run_dir.root), probes.exploiter_iterations, probes.exploiters, probes.episodes, exploiters,
            probes.exploiter_set, loaded,
        ).to_json()  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1))
    temporary.replace(path)
    return record


def probe_scores(record: dict[str, Any]) -> dict[str, float]:
    """A probe record's numbers, by the label of their table."""
    scores = {"self-play outcome": record["selfplay"]["outcome"]}
    for partner, result in record.get("partners", {}).items():
        scores[f"outcome against {partner}"] = result["outcome"]
        scores[f"{partner}'s outcome against it"] = result["partner"]
    if "exploit" in record:  # a gain with no loss is an exploiter that learned to cooperate, not to take
        scores["exploiter gain"] = record["exploit"]["gain"]
        scores["victim loss"] = record["exploit"]["loss"]
    return scores


def probes_markdown(records: list[dict[str, Any]], methods: list[str]) -> str:
    """``probes.md``: a table per probe (arms × environments, mean ± SE over seeds, arms paired by seed), then
    each run's closest classic strategy and, with exploiters, the bootstrap test of each victim's exploitability
    beside what the victim lost."""
    per_probe: dict[str, dict[tuple[str, str], dict[int, float]]] = {}
    for record in records:
        for label, value in probe_scores(record).items():
            per_probe.setdefault(label, {}).setdefault((record["method"], record["env"]), {})[record["seed"]] = value
    parts = []
    for label, per_seed in per_probe.items():
        cells = {key: (*seed_summary(list(scores.values())), len(scores)) for key, scores in per_seed.items()}
        arms = [m for m in methods if any(m == method for method, _ in cells)]
        envs = sorted({env for _, env in cells})
        table = ResultsTable(envs, arms, cells, "last", label, contrasts=paired_contrasts(per_seed, arms))
        parts.append(f"## {label}, mean ± SE over seeds\n\n{table.markdown()}")
    lines = ["| run | closest strategy (agreement) | exploiter gain (one-sided 95% bound, p) | victim loss |"]
    lines.append("|---|---|---|---|")
    for record in records:
        fit, exploit = record.get("strategy"), record.get("exploit")
        closest = f"{fit['closest']} ({fit['agreement'][fit['closest']]:.3f})" if fit else "—"
        gain = (
            f"{exploit['gain']:+.3f} ({exploit['gain_lower_bound']:+.3f}, p {exploit['gain_p']:.3f})"
            if exploit
            else "—"
        )
        loss = f"{exploit['loss']:+.3f}" if exploit else "—"
        lines.append(f"| {record['run']} | {closest} | {gain} | {loss} |")
    parts.append("## each run\n\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


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
        if trainer.lineup.opponent is None:
            raise RepertoryError(f"victim {victim!r} is not a frozen policy or bot")
        eval_seed = derive(0, "exploit", "eval")
        before = evaluate(env, trainer.lineup.live, episodes, eval_seed, "heldout", trainer.lineup.opponent)
        trainer.backend.reset_cache()
        trainer.fit(on_line)
        after = evaluate(env, trainer.lineup.live, episodes, eval_seed, "heldout", trainer.lineup.opponent)
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
    assert trainer is not None and trainer.lineup.opponent is not None
    selfplay = evaluate(env, trainer.lineup.opponent, episodes, derive(0, "exploit", "eval"), "heldout")
    return Exploitability(env, victim, iterations, episodes, runs, selfplay.overall)

"""Selection on validation kernels: a run that evaluates several trained policies also plays each of them on
validation kernels, and ``--checkpoint best`` picks by those scores while the table reports held-out ones."""

from __future__ import annotations

import json

import pytest
import yaml

import repertory.train.base
from repertory.config import dump_config, load_config
from repertory.report import results_table, run_scores
from repertory.runs import RunDir, load_run_config
from repertory.train import check_names
from repertory.train.base import Trainer
from repertory.types import RepertoryError

HELD_OUT = {0: 0.1, 1: 0.9, 2: 0.3, 3: 0.5, 4: 0.4}
"""The held-out score of the policy after k updates: the best held-out score (pi_1) is not the selected one."""
VALIDATION = {1: 0.2, 2: 0.8, 3: 0.5, 4: 0.6}


class ScriptedTrainer(Trainer):
    """A trainer without a model: each evaluation scores the policy by the tables above and is recorded."""

    def __init__(self, tmp_path, *overrides: str):
        self.config = load_config(None, ["iterations=4", "eval.episodes=2", *overrides])
        self.run_dir = RunDir(tmp_path / "run")
        self.run_dir.root.mkdir()
        self.run_dir.config.write_text(dump_config(self.config))
        self.judge, self.iteration, self.precision = None, 0, "float32"
        self.placement = {"device": "cpu", "weights": "float32"}
        self.evaluations: list[tuple[int, bool]] = []

    def evaluate(self, iteration, keep=None, validation=False):
        self.evaluations.append((iteration, validation))
        score = (VALIDATION if validation else HELD_OUT)[iteration]
        scores = {"outcome": score, "outcome_se": 0.01, "discounted_return": score, "discounted_return_se": 0.01}
        return {**{f"eval/{k}": v for k, v in scores.items()}, "eval/invalid_rate": 0.0, "time/eval_s": 0.5}

    def run_iteration(self, iteration):
        return {}  # the loop runs the due evaluations itself

    def close(self):
        pass

    def save_checkpoint(self, done):
        return None


@pytest.fixture(autouse=True)
def no_figures(monkeypatch):
    monkeypatch.setattr(repertory.train.base, "write_report", lambda root: [])


def test_each_trained_evaluation_has_a_validation_one_and_best_picks_by_it(tmp_path):
    trainer = ScriptedTrainer(tmp_path, "eval.every=1")
    trainer.fit()
    assert trainer.evaluations == [(0, False), *[(k, v) for k in range(1, 5) for v in (False, True)]]
    lines = [json.loads(line) for line in trainer.run_dir.metrics.read_text().splitlines()]
    assert "eval/validation/outcome" not in lines[0]  # the initial policy is no candidate
    assert [line["eval/validation/outcome"] for line in lines[1:]] == [0.2, 0.8, 0.5]
    assert lines[3]["final/validation/discounted_return"] == 0.6 and lines[3]["final/outcome"] == 0.4
    assert set(lines[1]) >= {"eval/validation/outcome_se", "eval/validation/discounted_return_se"}
    assert "eval/validation/invalid_rate" not in lines[1] and lines[1]["time/validation_s"] == 0.5
    scores = run_scores(trainer.run_dir.root)
    assert (scores.best_iteration, scores.best, scores.last, scores.base) == (2, 0.3, 0.4, 0.1)
    assert results_table([trainer.run_dir.root], "best").cells[("omar", "ipd")] == (pytest.approx(0.3), 0.0, 1)


@pytest.mark.parametrize(
    "overrides",
    [
        ["eval.every=0"],  # one trained evaluation, after the last update: nothing to choose among
        ["eval.every=4"],  # the same
        ["eval.every=1", "eval.validation=false"],  # turned off: --checkpoint best is then refused
    ],
)
def test_no_validation_evaluation_where_nothing_is_selected(tmp_path, overrides):
    trainer = ScriptedTrainer(tmp_path, *overrides)
    trainer.fit()
    assert not any(validation for _, validation in trainer.evaluations)
    assert "validation" not in trainer.run_dir.metrics.read_text()


def test_a_run_saved_before_validation_evaluations_resumes_without_them(tmp_path):
    saved = yaml.safe_load(dump_config(load_config(None, ["eval.every=1"])))
    assert saved["eval"]["validation"] is True and load_run_config(_saved(tmp_path, saved)).selects_on_validation
    del saved["eval"]["validation"]
    assert not load_run_config(_saved(tmp_path, saved)).selects_on_validation


def _saved(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_game_without_validation_kernels_is_refused_before_training_where_the_run_selects():
    social = ["rollout.env=social", "rollout.opponent=agreeable", "iterations=4"]
    check_names(load_config(None, social))  # evaluated once trained: nothing to select, no validation needed
    with pytest.raises(
        RepertoryError, match="eval.validation: social has no validation kernels.*eval.validation: false"
    ):
        check_names(load_config(None, [*social, "eval.every=2"]))
    check_names(load_config(None, [*social, "eval.every=2", "eval.validation=false"]))

"""Asynchronous rollouts (``rollout.max_staleness``): the fixed schedule under random speeds, errors and
stops, and a tiny-model run whose episodes carry the versions the schedule names."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

from repertory.config import load_config
from repertory.models import load_tokenizer, tiny_model
from repertory.store import read_episodes
from repertory.train import TIMING_PREFIXES, resume_run, start_run
from repertory.train.pipeline import AsyncRollouts, sampled_by


class _Sampler:
    """Plays an iteration as one fake episode naming the iteration and the weights it was played with; sleeps
    a random while (its own generator: the thread must not share the test's)."""

    def __init__(self, seed: int, fail_at: int | None = None):
        self.rng = random.Random(seed)
        self.fail_at = fail_at
        self.version: int | None = None
        self.weights: float | None = None
        self.updates: list[int] = []
        self.played = 0

    def publish(self, version, tensors):
        self.version, self.weights = version, tensors["w"].item()
        self.updates.append(version)

    def play(self, specs):
        (iteration,) = specs
        if iteration == self.fail_at:
            raise RuntimeError(f"sampler broke at {iteration}")
        time.sleep(self.rng.random() * 0.005)
        self.played += 1
        return [(iteration, self.version, self.weights)]


@pytest.mark.parametrize("seed", range(8))
def test_every_iteration_is_sampled_by_the_version_the_schedule_names_whatever_the_speeds(seed):
    rng = random.Random(seed)
    staleness, start, stop = rng.choice([1, 2, 3]), rng.choice([0, 2]), 9
    sampler = _Sampler(seed + 100)
    weights = {"w": torch.tensor(float(start))}
    pipeline = AsyncRollouts(sampler, lambda j: [j], staleness, start, stop, version=100 + start, weights=weights)
    weights["w"].add_(1000.0)  # the learner updates in place: the pipeline holds its own copy
    for iteration in range(start, stop):
        played, waited = pipeline.take(iteration)
        ((played_iteration, version, w),) = played.episodes
        done = sampled_by(iteration, start, staleness)
        assert played_iteration == iteration and w == done and version == played.version == 100 + done
        assert 0 <= iteration - done <= staleness and waited >= 0
        time.sleep(rng.random() * 0.005)
        pipeline.publish(iteration + 1, 100 + iteration + 1, {"w": torch.tensor(float(iteration + 1))})
    assert pipeline.close() == 0
    # each version is sent once, in order, and only the versions the schedule uses
    assert sampler.updates == sorted({100 + sampled_by(j, start, staleness) for j in range(start, stop)})


def test_the_schedule_by_hand():
    assert [sampled_by(j, 0, 1) for j in range(5)] == [0, 0, 1, 2, 3]
    assert [sampled_by(j, 3, 2) for j in range(3, 8)] == [3, 3, 3, 4, 5]


def test_a_sampler_error_reaches_the_learner_at_the_iteration_it_broke():
    pipeline = AsyncRollouts(_Sampler(0, fail_at=1), lambda j: [j], 1, 0, 4, version=0, weights={"w": torch.ones(1)})
    assert pipeline.take(0)[0].episodes[0][0] == 0
    with pytest.raises(RuntimeError, match="sampler broke at 1"):
        pipeline.take(1)
    assert pipeline.close() == 0


def test_a_stop_counts_the_iterations_played_ahead_and_never_learned():
    sampler = _Sampler(0)
    pipeline = AsyncRollouts(sampler, lambda j: [j], 2, 0, 6, version=0, weights={"w": torch.zeros(1)})
    pipeline.take(0)
    pipeline.publish(1, 1, {"w": torch.ones(1)})
    deadline = time.monotonic() + 10
    while sampler.played < 4 and time.monotonic() < deadline:  # 0, then 1 to 3 (all sampled by version <= 1)
        time.sleep(0.01)
    time.sleep(0.05)
    assert sampler.played == 4  # iteration 4 needs the policy after 2 iterations: the sampler waits
    assert pipeline.close() == 3
    assert not any(t.name == "repertory-rollouts" for t in threading.enumerate())


def test_a_staleness_below_one_is_the_synchronous_loop_not_a_pipeline():
    with pytest.raises(ValueError, match="at least 1"):
        AsyncRollouts(_Sampler(0), lambda j: [j], 0, 0, 2, version=0, weights={})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.kind=mt-sft", "does not support method kind mt-sft"),
        ("rollout.opponent=pool", "does not support rollout.opponent pool"),
    ],
)
def test_unsupported_combinations_are_refused_by_the_config(override, message):
    extra = ["method.kind=adalign"] if override.endswith("pool") else []
    with pytest.raises(Exception, match=message):
        load_config(None, ["rollout.max_staleness=1", *extra, override])


# a tiny model, end to end


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=3",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=2",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=2",
            "algo.lr=1e-2",
            *extra,
        ],
    )


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _episodes(run_dir, iteration):
    return read_episodes(run_dir / "episodes" / f"iter-{iteration:06d}.parquet")


def _versions(run_dir, iteration):
    return {t.policy_version for ep in _episodes(run_dir, iteration) for t in ep.turns}


class _Stop(Exception):
    pass


def test_a_run_one_version_stale_plays_the_schedule_reproducibly_and_resumes_within_the_bound(tmp_path, tokenizer):
    synchronous = start_run(_config(tmp_path, "sync"), tiny_model(tokenizer, seed=2)).fit()
    trainer = start_run(_config(tmp_path, "async", "rollout.max_staleness=1"), tiny_model(tokenizer, seed=2))
    assert trainer.learner.correction == "tis"  # auto: stale samples are corrected
    run_dir = trainer.fit()
    assert [_versions(run_dir, i) for i in range(3)] == [{0}, {0}, {1}]
    lines = _lines(run_dir)
    assert [line["async/sampled_by_version"] for line in lines] == [0.0, 0.0, 1.0]
    assert [line["async/staleness"] for line in lines] == [0.0, 1.0, 1.0]
    assert lines[1]["async/turns_at_gap/1"] == 1.0 and lines[1]["async/staleness_max"] == 1.0
    assert lines[1]["offpolicy/weight_mean"] != 1.0  # a version old: the learner reweights its tokens
    assert trainer.rollouts.discarded_episodes == 0
    # iteration 0 is sampled by the initial policy either way, by a copy in the sampler thread here
    for x, y in zip(_episodes(synchronous, 0), _episodes(run_dir, 0)):
        assert [t.response_ids for t in x.turns] == [t.response_ids for t in y.turns]
    # the schedule is fixed, so a second run plays the same episodes and learns the same
    again = start_run(_config(tmp_path, "again", "rollout.max_staleness=1"), tiny_model(tokenizer, seed=2)).fit()
    same = [{k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)} for line in _lines(again)]
    assert same == [{k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)} for line in lines]
    assert [t.text for ep in _episodes(again, 2) for t in ep.turns] == [
        t.text for ep in _episodes(run_dir, 2) for t in ep.turns
    ]

    stopped = start_run(_config(tmp_path, "stopped", "rollout.max_staleness=1"), tiny_model(tokenizer, seed=2))

    def stop_after_two(line):
        if line["iteration"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        stopped.fit(stop_after_two)
    assert stopped.rollouts.discarded_episodes in (0, 4)  # iteration 2 played ahead, or not yet begun
    resumed = resume_run(stopped.run_dir, loaded=tiny_model(tokenizer, seed=2))
    resumed.fit()
    # the resumed run samples its first iteration with the restored policy: within the bound, not the same
    assert _versions(stopped.run_dir, 2) == {2}
    assert [line["iteration"] for line in _lines(stopped.run_dir)] == [0, 1, 2]

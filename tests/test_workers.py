"""Ray rollout workers (``rollout.workers``) on a local two-CPU cluster: the same episodes as in-process, the
policy versions they were sampled with, and a dead worker that fails the iteration cleanly."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import run_cli, tiny_checkpoint

from repertory.config import load_config
from repertory.models import load_tokenizer, tiny_model
from repertory.store import read_episodes
from repertory.train import TIMING_PREFIXES, resume_run, start_run
from repertory.types import RepertoryError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (make test installs it)"),
]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=2",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=2",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=0",
            "algo.lr=1e-2",
            "model.precision=float32",  # the exact path: bfloat16 rounds differently in another batch
            *extra,
        ],
    )


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same(line):
    return {k: v for k, v in line.items() if not k.startswith((*TIMING_PREFIXES, "offpolicy/"))}


def test_two_workers_play_the_episodes_of_the_in_process_run(ray_cluster, tmp_path, tokenizer):
    local = start_run(_config(tmp_path, "local"), tiny_model(tokenizer, seed=2)).fit()
    sharded = start_run(_config(tmp_path, "sharded", "rollout.workers=2"), tiny_model(tokenizer, seed=2)).fit()
    for iteration in range(2):
        a = read_episodes(local / "episodes" / f"iter-{iteration:06d}.parquet")
        b = read_episodes(sharded / "episodes" / f"iter-{iteration:06d}.parquet")
        assert [ep.episode_id for ep in a] == [ep.episode_id for ep in b] and len(a) == 4
        for x, y in zip(a, b):
            assert [t.response_ids for t in x.turns] == [t.response_ids for t in y.turns]
            assert [t.reward for t in x.turns] == [t.reward for t in y.turns]
            assert x.result == y.result
            gaps = [abs(p - q) for s, t in zip(x.turns, y.turns) for p, q in zip(s.logp_sample, t.logp_sample)]
            assert max(gaps) < 1e-4
            assert {t.policy_version for t in y.turns} == {iteration}  # one update per iteration
    assert [_same(line) for line in _lines(local)] == [_same(line) for line in _lines(sharded)]


def test_a_dead_worker_fails_the_iteration_and_the_run_resumes(ray_cluster, tmp_path, tokenizer):
    trainer = start_run(_config(tmp_path, "dies", "rollout.workers=2"), tiny_model(tokenizer, seed=2))

    def kill_a_worker(line):
        ray_cluster.kill(trainer.rollouts.workers.actors[1])

    shard = r"worker 1 of 2 failed playing episodes ipd/s0/i1/00002 to ipd/s0/i1/00003"
    with pytest.raises(RepertoryError, match=shard):
        trainer.fit(kill_a_worker)
    run_dir = trainer.run_dir
    assert not (run_dir / "episodes" / "iter-000001.parquet").exists()
    assert [line["iteration"] for line in _lines(run_dir)] == [0]
    trainer.close()
    resumed = resume_run(run_dir, loaded=tiny_model(tokenizer, seed=2))
    assert resumed.iteration == 1
    resumed.fit()
    assert [line["iteration"] for line in _lines(run_dir)] == [0, 1]
    episodes = read_episodes(run_dir / "episodes" / "iter-000001.parquet")
    assert {t.policy_version for ep in episodes for t in ep.turns} == {1}


def test_eval_and_crossplay_with_workers_report_what_one_process_reports(ray_cluster, tmp_path, tokenizer, capsys):
    model = str(tiny_checkpoint(tmp_path / "m", tokenizer, seed=3))
    line_up = ["eval", "crossplay", "--env", "ipd", "--agents", "tit-for-tat,always-defect,base", "-n", "2"]
    line_up += ["--model", model, "--max-new-tokens", "8", "--constrained", "--json"]
    base = ["eval", "base", "--env", "ipd", "--vs", "tit-for-tat", "-n", "4", "--model", model, "--json"]
    base += ["--max-new-tokens", "8", "--constrained"]
    for argv in (line_up, base):
        code, alone, _ = run_cli(capsys, *argv)
        assert code == 0
        code, sharded, _ = run_cli(capsys, *argv, "--workers", "2")
        assert code == 0 and json.loads(sharded) == json.loads(alone)
    code, _, err = run_cli(capsys, *base, "--workers", "-1")
    assert code == 2 and "--workers must be at least 0" in err


def test_workers_play_ahead_the_episodes_the_in_process_pipeline_plays(ray_cluster, tmp_path, tokenizer):
    ahead = ("iterations=3", "rollout.max_staleness=1")
    local = start_run(_config(tmp_path, "ahead-local", *ahead), tiny_model(tokenizer, seed=2)).fit()
    sharded = start_run(_config(tmp_path, "ahead-sharded", *ahead, "rollout.workers=2"), tiny_model(tokenizer, seed=2))
    run_dir = sharded.fit()
    for iteration, version in enumerate([0, 0, 1]):  # iteration j sampled by the policy after j - 1 iterations
        a = read_episodes(local / "episodes" / f"iter-{iteration:06d}.parquet")
        b = read_episodes(run_dir / "episodes" / f"iter-{iteration:06d}.parquet")
        assert [[t.response_ids for t in x.turns] for x in a] == [[t.response_ids for t in y.turns] for y in b]
        assert {t.policy_version for ep in b for t in ep.turns} == {version}
    # the learner reweights each token by the log-prob its sampler recorded: two copies agree to float rounding
    for x, y in zip(_lines(local), _lines(run_dir), strict=True):
        assert _same(x) == pytest.approx(_same(y), rel=1e-3, abs=1e-6)
    assert sharded.rollouts.workers is None and sharded.rollouts.pipeline is None  # both closed at the end

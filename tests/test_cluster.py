"""Several machines: rollout workers on a Ray cluster of two nodes started on this machine (``ray.cluster_utils``),
joined by address as a run joins its cluster's head, and the shared run directory such runs need."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from repertory.agents import LMOptions
from repertory.config import load_config
from repertory.models import load_tokenizer, tiny_model
from repertory.runs import RunDir
from repertory.store import read_episodes
from repertory.train import start_run
from repertory.types import RepertoryError
from repertory.workers import RolloutActors, RolloutWorker

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (make test does)")


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
            *extra,
        ],
    )


@needs_ray
def test_an_address_where_no_cluster_listens_fails_at_once(tmp_path):
    import ray

    if ray.is_initialized():
        pytest.skip("this process is already connected to a cluster")
    with pytest.raises(RepertoryError, match="no Ray cluster answers at '127.0.0.1:9'"):
        RolloutActors(1, "ipd", address="127.0.0.1:9")
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a connection another module left open would keep this process off the new cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
@needs_ray
def test_workers_join_a_cluster_by_address_and_play_the_in_process_episodes(two_nodes, tmp_path):
    tokenizer = load_tokenizer()
    local = start_run(_config(tmp_path, "local"), tiny_model(tokenizer, seed=2)).fit()
    config = _config(tmp_path, "cluster", "rollout.workers=2", f"rollout.ray_address={two_nodes.address}")
    trainer = start_run(config, tiny_model(tokenizer, seed=2))
    nodes: list[str] = []
    trainer.fit(lambda line: nodes.extend(trainer.rollouts.workers.nodes if trainer.rollouts.workers else []))
    assert len(nodes) == 4 and len(set(nodes)) == 2  # one actor on each node (one CPU each), both iterations
    for iteration in range(2):
        a = read_episodes(local / "episodes" / f"iter-{iteration:06d}.parquet")
        b = read_episodes(trainer.run_dir.episodes(iteration))
        assert [[t.response_ids for t in ep.turns] for ep in a] == [[t.response_ids for t in ep.turns] for ep in b]


def test_a_cluster_address_needs_workers(tmp_path):
    with pytest.raises(RepertoryError, match="rollout.ray_address does not support rollout.workers 0: it places"):
        _config(tmp_path, "x", "rollout.ray_address=auto")


def test_a_worker_that_cannot_see_the_run_directory_says_so(tmp_path):
    config = _config(tmp_path, "pool", "method.kind=adalign", "rollout.opponent=pool")
    trainer = start_run(config, tiny_model(load_tokenizer(), seed=2))
    elsewhere = replace(trainer.rollouts.live_source(), pool_run=RunDir(tmp_path / "not-mounted"))
    worker = RolloutWorker("ipd", LMOptions(), elsewhere)
    with pytest.raises(RepertoryError, match="not on this worker's node .*every node mounts at the same path"):
        worker.live.load_snapshot(0)

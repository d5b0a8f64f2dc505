"""The sharded learner's configuration and checkpoints in one process (its two-process runs are in
test_distributed): what it refuses, and its optimiser shards resuming exactly."""

from __future__ import annotations

import pytest
import torch

from repertory.config import AlgoConfig, CriticConfig, LoraConfig, load_config
from repertory.models import load_tokenizer, tiny_model, weights
from repertory.runs import RunDir
from repertory.train import resume_run, start_run
from repertory.train.heads import with_lora
from repertory.train.learner import Learner
from repertory.train.learner_state import load_learner, save_learner
from repertory.train.sharding import OPTIMIZER_SHARDS, check_shards
from repertory.types import RepertoryError


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=2",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=1",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=0",
            "algo.lr=1e-2",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (["method.kind=mt-sft", "method.logs=x.jsonl"], "method kind mt-sft"),
        (["rollout.env=craigslist", "model.adapters=per_role"], "model.adapters per_role"),
        (["rollout.workers=2"], "rollout.workers"),
        (["rollout.max_staleness=1"], "rollout.max_staleness"),
        (["method.kind=adalign", "rollout.opponent=pool"], "rollout.opponent pool"),
        (["method.estimator=gae", "method.critic.share_backbone=false"], "a critic on its own backbone"),
    ],
)
def test_sharding_refuses_what_it_does_not_support_yet(tmp_path, extra, refused):
    with pytest.raises(RepertoryError, match=f"model.sharding fsdp does not support {refused}"):
        _config(tmp_path, "x", "model.sharding=fsdp", *extra)


def test_one_process_run_keeps_the_optimizer_as_shards_and_resumes_exactly(tmp_path):
    tokenizer = load_tokenizer()
    straight = start_run(_config(tmp_path, "straight", "model.sharding=fsdp"), tiny_model(tokenizer, seed=2))
    straight.fit()
    half = start_run(_config(tmp_path, "half", "model.sharding=fsdp", "iterations=1"), tiny_model(tokenizer, seed=2))
    checkpoint = RunDir(half.fit()).complete_checkpoints()[-1]
    assert (checkpoint / OPTIMIZER_SHARDS / ".metadata").is_file()
    assert "optimizer" not in torch.load(checkpoint / "optimizer.pt", weights_only=True)  # kept once, as shards
    resumed = resume_run(half.run_dir.root, ["iterations=2"], loaded=tiny_model(tokenizer, seed=2))
    saved = [half.learner.optimizer.state[p] for p in half.learner.trainable_parameters()]
    loaded = [resumed.learner.optimizer.state[p] for p in resumed.learner.trainable_parameters()]
    assert len(saved) == len(loaded) and all(state["exp_avg"].abs().max() > 0 for state in saved)
    for mine, theirs in zip(loaded, saved):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    resumed.fit()
    for a, b in zip(resumed.learner.trainable_parameters(), straight.learner.trainable_parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_resumes_only_with_the_sharding_it_was_written_with(tmp_path):
    tokenizer = load_tokenizer()
    plain = start_run(_config(tmp_path, "plain", "iterations=1"), tiny_model(tokenizer, seed=2)).fit()
    with pytest.raises(RepertoryError, match="written without model.sharding fsdp: resume it with the sharding"):
        resume_run(plain, ["model.sharding=fsdp"], loaded=tiny_model(tokenizer, seed=2))
    assert "sharding: fsdp" not in (plain / "config.yaml").read_text()  # the refused resume changed nothing
    sharded = start_run(
        _config(tmp_path, "sharded", "model.sharding=fsdp", "iterations=1"), tiny_model(tokenizer, seed=2)
    )
    with pytest.raises(RepertoryError, match="written with model.sharding fsdp: resume it with the sharding"):
        resume_run(sharded.fit(), ["model.sharding=none"], loaded=tiny_model(tokenizer, seed=2))


def test_a_shard_written_to_another_machines_disk_is_named(tmp_path):
    tokenizer = load_tokenizer()
    run = start_run(_config(tmp_path, "run", "model.sharding=fsdp", "iterations=1"), tiny_model(tokenizer, seed=2))
    shards = RunDir(run.fit()).complete_checkpoints()[-1] / OPTIMIZER_SHARDS
    check_shards(shards)  # whole
    (shards / "__0_0.distcp").rename(tmp_path / "elsewhere.distcp")
    with pytest.raises(RepertoryError, match=r"shards \['__0_0.distcp'\] are not in .*every machine mounts"):
        check_shards(shards)


def test_a_checkpoint_before_the_first_step_resumes_a_fresh_optimizer(tmp_path):
    """The checkpoint writer would initialise AdamW's state with a zero-lr step that counts; the learner writes
    no shards then, and its optimiser stays fresh, as does the one that loads the checkpoint."""

    def learner():
        return Learner(
            tiny_model(load_tokenizer(), seed=2), AlgoConfig(), LoraConfig(), CriticConfig(), False, sharding="fsdp"
        )

    saving, loading = learner(), learner()
    save_learner(saving, tmp_path / "checkpoint")
    assert not saving.optimizer.state and not (tmp_path / "checkpoint" / OPTIMIZER_SHARDS).exists()
    assert torch.load(tmp_path / "checkpoint" / "optimizer.pt", weights_only=True)["optimizer_stepped"] is False
    load_learner(loading, tmp_path / "checkpoint")
    assert not loading.optimizer.state


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_weights_read_without_hooks_are_the_state_dict(lora):
    """What a weight sync reads (models.weights) is the module's state dict: the same names, tied ones included,
    and the same tensors; test_distributed checks that it leaves gathered FSDP layers gathered."""
    model = tiny_model(load_tokenizer()).model
    if lora:
        model = with_lora(model, LoraConfig(r=4), seed=0)
    state, read = model.state_dict(), weights(model)
    assert list(read) == list(state)
    assert all(torch.equal(read[k], state[k]) for k in state)
    assert any(k.endswith("lm_head.weight") for k in read) and any(k.endswith("embed_tokens.weight") for k in read)

"""What a learner's checkpoint holds: the policy (adapters or full weights), the critic, the optimiser (whole, or
as shards under ``model.sharding: fsdp``) and the scheduler, written and read back exactly."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from repertory.agents.lm import LIVE_ADAPTER
from repertory.train import distributed
from repertory.train.learner import Learner
from repertory.train.sharding import OPTIMIZER_SHARDS, full_state, load_full, load_optimizer, save_optimizer
from repertory.types import RepertoryError


def save_learner(learner: Learner, directory: Path) -> None:
    """Weights (adapter or full model), value head, optimizer and scheduler into ``directory``. Sharded
    (``learner.sharded``), every process calls it and writes its optimiser shard; otherwise process 0 alone."""
    directory.mkdir(parents=True, exist_ok=True)
    gathered = None
    # before any step AdamW has no state, and the checkpoint writer would initialise it (a zero-lr step that
    # counts): such a checkpoint records no shards, and its resume starts from a fresh optimiser
    stepped = bool(learner.optimizer.state)
    with learner.sharded.sharded():
        if learner.sharded.active:  # the weights, into process 0; a tied weight once, as unsharded
            named = {*dict(learner.scorer.named_parameters()), *dict(learner.scorer.named_buffers())}
            full = full_state(learner.scorer, trained_only=learner.peft is not None)
            gathered = {k.removeprefix("model."): v for k, v in full.items() if k in named}
        if learner.optimizer_shards and stepped:
            save_optimizer(learner.stateful(), learner.optimizer, directory / OPTIMIZER_SHARDS)
    if not distributed.is_main():
        return
    if learner.peft is not None:  # the live adapter in policy/, any other (per role) in policy/<name>/
        peft_state = None if gathered is None else {f"base_model.model.{k}": v for k, v in gathered.items()}
        adapters = learner.adapters
        learner.peft.save_pretrained(str(directory / "policy"), selected_adapters=adapters, state_dict=peft_state)
    else:
        learner.model.save_pretrained(str(directory / "policy"), safe_serialization=True, state_dict=gathered)
        learner.tokenizer.save_pretrained(str(directory / "policy"))
    if learner.critic is not None:
        save_file(_contiguous(learner.critic.head.state_dict()), str(directory / "value_head.safetensors"))
        if not learner.shared_critic:
            critic = learner.critic_peft if learner.critic_peft is not None else learner.critic.backbone
            tensors = get_peft_model_state_dict(critic) if learner.critic_peft is not None else critic.state_dict()
            save_file(_contiguous(tensors), str(directory / "critic.safetensors"))
    state = {"scheduler": learner.scheduler.state_dict()}
    if learner.optimizer_shards:
        state["optimizer_stepped"] = stepped
    else:
        state["optimizer"] = learner.optimizer.state_dict()
    torch.save(state, directory / "optimizer.pt")


def load_learner(learner: Learner, directory: Path) -> None:
    """Restore everything :func:`save_learner` wrote."""
    state = torch.load(directory / "optimizer.pt", weights_only=True)
    if learner.optimizer_shards == ("optimizer" in state):
        kept = "without model.sharding fsdp" if learner.optimizer_shards else "with model.sharding fsdp"
        raise RepertoryError(f"{directory} was written {kept}: resume it with the sharding it was trained with")
    with learner.sharded.sharded():
        _load_policy(learner, directory / "policy")
        if learner.optimizer_shards and state["optimizer_stepped"]:
            load_optimizer(learner.stateful(), learner.optimizer, directory / OPTIMIZER_SHARDS)
    if learner.critic is not None:
        learner.critic.head.load_state_dict(load_file(str(directory / "value_head.safetensors")))
        if not learner.shared_critic:
            tensors = load_file(str(directory / "critic.safetensors"))
            if learner.critic_peft is not None:
                set_peft_model_state_dict(learner.critic_peft, tensors)
            else:
                learner.critic.backbone.load_state_dict(tensors)
    if not learner.optimizer_shards:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])


def _load_policy(learner: Learner, policy: Path) -> None:
    if not learner.sharded.active and learner.peft is not None:
        for name in learner.adapters:
            folder = policy if name == LIVE_ADAPTER else policy / name
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            set_peft_model_state_dict(learner.peft, tensors, adapter_name=name)
    elif not learner.sharded.active:
        learner.model.load_state_dict(load_file(str(policy / "model.safetensors")), strict=False)
    elif learner.peft is not None:
        # PEFT saves an adapter's weight model.X.<adapter>.weight as base_model.model.X.weight
        names = {
            "base_model.model." + name.removeprefix("model.").replace(f".{LIVE_ADAPTER}", ""): name
            for name, _ in learner.scorer.named_parameters()
            if f".{LIVE_ADAPTER}." in name
        }
        saved = load_file(str(policy / "adapter_model.safetensors"))
        load_full(learner.scorer, {names.get(key, key): tensor for key, tensor in saved.items()})
    else:
        load_full(learner.scorer, {f"model.{k}": v for k, v in load_file(str(policy / "model.safetensors")).items()})


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}

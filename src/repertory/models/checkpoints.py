"""A trained policy from its run: load a checkpoint as one plain model, or export it as a Hugging Face checkpoint;
the precision a run's policy runs in."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from repertory.config import TrainConfig
from repertory.envs.roles import RoleAdapters
from repertory.models import LoadedModel, load_model, save_checkpoint
from repertory.models.adapters import merged_weights
from repertory.models.linear import resolve_precision, use_fast_linears
from repertory.runs import RunDir, resolve_checkpoint
from repertory.types import RepertoryError

ROLES_FILE = "roles.json"  # in an exported per-role policy: which role or team plays which directory


def run_precision(config: TrainConfig, device: str) -> str:
    """The precision of the frozen linear products of ``config``'s run on ``device`` (``model.precision``
    resolved): what its learner trains in and its hf engine samples in."""
    model = config.model
    device_type = torch.device(device).type
    sharded = model.sharding != "none"
    return resolve_precision(model.precision, device_type, model.lora.enabled, sharded, config.rollout.backend)


def load_policy(checkpoint: Path, config: TrainConfig, device: str | None = None) -> LoadedModel:
    """The trained policy of a checkpoint as one plain model (LoRA adapters merged into the base); a run with one
    adapter per role or team (``model.adapters``) keeps them unmerged on one base, in ``peft``."""
    policy = checkpoint / "policy"
    name = f"{RunDir.of_checkpoint(checkpoint).name}@{int(checkpoint.name)}"
    roles = RoleAdapters.of(config.rollout.env, config.model.adapters)
    if roles is not None:
        return _role_policy(policy, roles.adapters, config, device, name)
    if (policy / "adapter_config.json").is_file():
        from peft import PeftModel

        loaded = load_model(config.model.name, device or config.model.device)
        merged = PeftModel.from_pretrained(loaded.model, str(policy)).merge_and_unload()
        merged.eval()
        return LoadedModel(merged, loaded.tokenizer, name)
    loaded = load_model(str(policy), device or config.model.device)
    return LoadedModel(loaded.model, loaded.tokenizer, name)


def _role_policy(policy: Path, adapters: list[str], config: TrainConfig, device: str | None, name: str) -> LoadedModel:
    """The base with every role's adapter of a checkpoint's ``policy`` folder (one subfolder per adapter)."""
    from peft import PeftModel

    missing = [a for a in adapters if not (policy / a / "adapter_config.json").is_file()]
    if missing:
        raise RepertoryError(f"{policy} lacks the adapters {', '.join(missing)} its run's model.adapters names")
    loaded = load_model(config.model.name, device or config.model.device)
    peft = PeftModel.from_pretrained(loaded.model, str(policy / adapters[0]), adapter_name=adapters[0])
    for adapter in adapters[1:]:
        peft.load_adapter(str(policy / adapter), adapter_name=adapter)
    peft.base_model.set_adapter(adapters, inference_mode=True)  # all active: a row naming none is refused (hf)
    peft.eval()
    use_fast_linears(peft)
    return LoadedModel(loaded.model, loaded.tokenizer, name, peft)


def load_adapter(peft: Any, name: str, file: Path, live: str = "default") -> str:
    """Add the LoRA adapter saved in ``file`` (safetensors of its state dict) to ``peft`` as ``name``, shaped
    like its ``live`` adapter, which stays active; returns ``name``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    # A new adapter draws its initial weights (overwritten below) from the global RNG; forking keeps a
    # resumed run, which loads every snapshot at once, on the same random stream as a straight one.
    with torch.random.fork_rng(devices=[]):
        peft.add_adapter(name, peft.peft_config[live])
    set_peft_model_state_dict(peft, load_file(str(file)), adapter_name=name)
    peft.set_adapter(live)
    return name


def export_policy(path: str | Path, out_dir: str | Path, device: str = "cpu") -> Path:
    """Write a run's newest (or a given checkpoint's) policy as a plain Hugging Face checkpoint, LoRA merged into
    the base, usable as ``model.name``, ``--model`` or by any Hugging Face tool; a run with one adapter per role
    or team writes one per adapter (``out_dir/<adapter>/``, and ``roles.json``). The directory appears whole or
    not at all; an existing non-empty one is refused."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RepertoryError(f"{out_dir} already exists and is not an empty directory; choose a new one")
    checkpoint, config = resolve_checkpoint(path)
    loaded = load_policy(checkpoint, config, device)
    if loaded.peft is None:
        return save_checkpoint(loaded.model, loaded.tokenizer, out_dir)
    return _export_roles(loaded, config, out_dir)


def _export_roles(loaded: LoadedModel, config: TrainConfig, out_dir: Path) -> Path:
    """One merged Hugging Face checkpoint per role or team adapter, ``out_dir/<adapter>/``, and ``roles.json``
    (which role or team plays which directory); the whole directory appears at once."""
    roles = RoleAdapters.of(config.rollout.env, config.model.adapters)
    assert roles is not None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        plain = load_model(config.model.name, str(loaded.device))
        for adapter in roles.adapters:
            plain.model.load_state_dict(merged_weights(loaded, adapter))
            save_checkpoint(plain.model, loaded.tokenizer, work / adapter)
        mapping = {"env": roles.env, "by": roles.by, "adapters": roles.names}
        (work / ROLES_FILE).write_text(json.dumps(mapping, indent=1))
        if out_dir.is_dir():
            out_dir.rmdir()  # empty: checked by the caller
        os.replace(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir

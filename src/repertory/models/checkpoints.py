"""A trained policy from its run: load a checkpoint as one plain model, or export it as a Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from repertory.config import TrainConfig
from repertory.models import LoadedModel, load_model, save_checkpoint
from repertory.runs import RunDir, resolve_checkpoint
from repertory.types import RepertoryError


def load_policy(checkpoint: Path, config: TrainConfig, device: str | None = None) -> LoadedModel:
    """The trained policy of a checkpoint as one plain model (LoRA adapters merged into the base)."""
    policy = checkpoint / "policy"
    name = f"{RunDir.of_checkpoint(checkpoint).name}@{int(checkpoint.name)}"
    if (policy / "adapter_config.json").is_file():
        from peft import PeftModel

        loaded = load_model(config.model.name, device or config.model.device)
        merged = PeftModel.from_pretrained(loaded.model, str(policy)).merge_and_unload()
        merged.eval()
        return LoadedModel(merged, loaded.tokenizer, name)
    loaded = load_model(str(policy), device or config.model.device)
    return LoadedModel(loaded.model, loaded.tokenizer, name)


def load_adapter(peft: Any, name: str, file: Path, live: str = "default") -> str:
    """Add the LoRA adapter saved in ``file`` (safetensors of its state dict) to ``peft`` as ``name``, shaped
    like its ``live`` adapter, which stays active; returns ``name``."""
    import torch
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
    the base, usable as ``model.name``, ``--model`` or by any Hugging Face tool. The directory appears whole or
    not at all; an existing non-empty one is refused."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RepertoryError(f"{out_dir} already exists and is not an empty directory; choose a new one")
    checkpoint, config = resolve_checkpoint(path)
    loaded = load_policy(checkpoint, config, device)
    return save_checkpoint(loaded.model, loaded.tokenizer, out_dir)

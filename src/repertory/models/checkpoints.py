"""A trained policy from its run: load a checkpoint as one plain model, or export it as a Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

from repertory.config import TrainConfig
from repertory.models import LoadedModel, load_model, save_checkpoint
from repertory.runs import resolve_checkpoint
from repertory.types import RepertoryError


def load_policy(checkpoint: Path, config: TrainConfig, device: str | None = None) -> LoadedModel:
    """The trained policy of a checkpoint as one plain model (LoRA adapters merged into the base)."""
    policy = checkpoint / "policy"
    if (policy / "adapter_config.json").is_file():
        from peft import PeftModel

        loaded = load_model(config.model.name, device or config.model.device)
        merged = PeftModel.from_pretrained(loaded.model, str(policy)).merge_and_unload()
        merged.eval()
        return LoadedModel(merged, loaded.tokenizer, f"{checkpoint.parent.parent.name}@{int(checkpoint.name)}")
    loaded = load_model(str(policy), device or config.model.device)
    return LoadedModel(loaded.model, loaded.tokenizer, f"{checkpoint.parent.parent.name}@{int(checkpoint.name)}")


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

"""Per-row LoRA adapters in one batched forward pass.

PEFT's LoRA layers already mix adapters inside one batch (each adapter's sub-batch through its own A and B,
added to the shared base output); :func:`per_row_adapters` hands them the row-to-adapter list for one forward
pass, which sampling and the learner's loss both use. The sub-batch arithmetic is differentiable, so a row's
gradient reaches only its own adapter (one adapter per role: :mod:`repertory.envs.roles`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from repertory.models import LoadedModel, base_weights

BASE_ROW = "__base__"  # PEFT's name for a row that runs the base weights, adapters off


@contextlib.contextmanager
def per_row_adapters(peft: Any, names: Sequence[str]) -> Iterator[None]:
    """Inside, every forward pass of ``peft``'s model runs batch row i through adapter ``names[i]``
    (:data:`BASE_ROW`: the base alone). Hooks pass the list to each LoRA layer, as PEFT's own
    ``adapter_names`` argument does, but for any entry point of the model (the decoder alone, a KV-cached
    step) and in training as well."""
    from peft.tuners.lora import LoraLayer

    known = set(peft.peft_config) | {BASE_ROW}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"unknown adapters {unknown}; the model has {', '.join(peft.peft_config)}")
    rows = list(names)

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "adapter_names": rows}

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in peft.modules() if isinstance(m, LoraLayer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def merged_weights(loaded: LoadedModel, adapter: str) -> dict[str, torch.Tensor]:
    """The weights under the adapters with ``adapter`` merged in, by PEFT's own delta (W + scale * B @ A) and
    without touching the module; only the adapted layers are new tensors."""
    from peft.tuners.lora import LoraLayer

    weights = base_weights(loaded)
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.scaling:
                key = f"{name}.weight"
                weights[key] = weights[key] + module.get_delta_weight(adapter)
    return weights

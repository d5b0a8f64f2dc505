"""The trainer's live policy, as one object: :class:`LivePolicy`.

Every part of a run that touches the policy being trained holds this one value: the line-up seats its ``agent``,
specs resolve ``base`` and ``snapshot@K`` against it without loading weights, rollouts send its ``weights()``
after each update, and a sampler of its own (a Ray actor, the played-ahead worker) rebuilds it from its
:class:`LiveSource` (``portable()``, then :meth:`LivePolicy.rebuild`) and takes new weights with
``load_weights``. Line-ups and workers name it :data:`LIVE`; under LoRA its trained adapter is PEFT's
:data:`~repertory.agents.lm.LIVE_ADAPTER`.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from repertory.agents.lm import LIVE_ADAPTER, LMAgent
from repertory.generation import SamplingParams, make_backend
from repertory.models import LoadedModel, base_weights
from repertory.models.attention import ATTENTION
from repertory.models.checkpoints import load_adapter
from repertory.models.linear import use_fast_linears
from repertory.runs import RunDir
from repertory.types import RepertoryError

LIVE = "live"  # the live policy's spec in line-ups and workers, its agent's name and policy id


@dataclass
class LiveSource:
    """The live policy in a form that travels to another process: the architecture, the weights under the adapters
    (``base``), the live weights (``LivePolicy.weights``), the LoRA config (None under full fine-tuning), how its
    agent samples and on which engine, and the run whose opponent-pool snapshots ``snapshot@K`` loads."""

    model_config: Any
    tokenizer: Any
    name: str
    base: dict[str, torch.Tensor]
    live: dict[str, torch.Tensor]
    lora: Any
    version: int
    params: SamplingParams
    constrained: bool
    seed: int
    engine: str = "hf"
    engine_args: dict[str, Any] | None = None
    pool_run: RunDir | None = None


@dataclass
class LivePolicy:
    """The policy a trainer trains: ``agent`` samples it (its backend runs ``loaded``), ``loaded`` is the module the
    learner updates (LoRA injected, ``loaded.peft``), ``reference`` the frozen initial weights under full
    fine-tuning (what ``base`` samples there; under LoRA the base is the adapters switched off), and
    ``load_snapshot`` loads opponent-pool snapshot K as an adapter and returns its name."""

    agent: LMAgent
    loaded: LoadedModel
    reference: LoadedModel | None = None
    load_snapshot: Callable[[int], str] | None = None
    engine: str = "hf"  # the generation backend that samples it (``rollout.backend``)

    @property
    def peft(self) -> Any:
        """The LoRA model (None under full fine-tuning)."""
        return self.loaded.peft

    def weights(self) -> dict[str, torch.Tensor]:
        """What an update changes: the live adapter under LoRA, the whole model otherwise."""
        if self.peft is not None:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.peft, adapter_name=LIVE_ADAPTER)
        return self.loaded.model.state_dict()

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take new live weights (another process's update) as policy version ``version``."""
        if self.peft is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.peft, tensors, adapter_name=LIVE_ADAPTER)
        else:
            self.loaded.model.load_state_dict(tensors)
        backend = self.agent.backend
        backend.sync(self.loaded.model)
        backend.version = version

    def portable(self, engine_args: dict[str, Any] | None = None, pool_run: RunDir | None = None) -> LiveSource:
        """Everything a sampler of its own needs to rebuild this policy (on CPU tensors), on an engine built with
        ``engine_args``, its ``snapshot@K`` read from ``pool_run``."""
        if self.peft is None and self.reference is None:
            raise RepertoryError("a live policy under full fine-tuning travels with its frozen reference")
        base = base_weights(self.loaded) if self.peft is not None else self.reference.model.state_dict()  # type: ignore[union-attr]
        agent = self.agent
        return LiveSource(
            model_config=self.loaded.model.config,
            tokenizer=self.loaded.tokenizer,
            name=self.loaded.name,
            base={k: v.detach().cpu() for k, v in base.items()},
            live={k: v.detach().cpu() for k, v in self.weights().items()},
            lora=self.peft.peft_config[LIVE_ADAPTER] if self.peft is not None else None,
            version=agent.backend.version,
            params=agent.params,
            constrained=agent.constrained,
            seed=agent.seed,
            engine=self.engine,
            engine_args=engine_args,
            pool_run=pool_run,
        )

    @classmethod
    def rebuild(cls, source: LiveSource) -> LivePolicy:
        """The policy ``source`` describes, on a backend of its own in this process."""
        from peft import get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        dtype = next(iter(source.base.values())).dtype
        model = AutoModelForCausalLM.from_config(source.model_config, dtype=dtype, attn_implementation=ATTENTION)
        model.load_state_dict(source.base, strict=False)
        model.eval()
        use_fast_linears(model)
        peft, reference = None, None
        if source.lora is not None:
            with torch.random.fork_rng(devices=[]):
                peft = get_peft_model(model, copy.deepcopy(source.lora))
            use_fast_linears(peft)
            set_peft_model_state_dict(peft, source.live, adapter_name=LIVE_ADAPTER)
        else:
            reference = LoadedModel(copy.deepcopy(model), source.tokenizer, source.name)
            model.load_state_dict(source.live)
        loaded = LoadedModel(model, source.tokenizer, source.name, peft)
        backend = make_backend(source.engine, loaded, **(source.engine_args or {}))
        backend.version = source.version
        agent = LMAgent(backend, LIVE, source.params, source.constrained, source.seed, policy_id=LIVE)
        load_snapshot = _snapshot_loader(peft, source.pool_run) if source.pool_run is not None else None
        return cls(agent, loaded, reference, load_snapshot, source.engine)


def _snapshot_loader(peft: Any, pool_run: RunDir) -> Callable[[int], str]:
    """Snapshot K of ``pool_run``'s opponent pool, loaded once as an adapter of ``peft``; its name."""

    def load_snapshot(k: int) -> str:
        if peft is None:
            raise RepertoryError("snapshot@K needs a LoRA run with an opponent pool")
        name = f"snapshot-{k}"
        if name in peft.peft_config:
            return name
        if not pool_run.snapshot(k).is_file():
            raise RepertoryError(
                f"snapshot {pool_run.snapshot(k)} is not on this worker's node ({socket.gethostname()}): the run "
                "directory must be on a file system every node mounts at the same path"
            )
        return load_adapter(peft, name, pool_run.snapshot(k))

    return load_snapshot

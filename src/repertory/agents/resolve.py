"""The one resolver of agent specs: what ``--agents``, ``--vs``, ``rollout.opponent`` and the trainers name.

Specs, for an environment:

- a bot of the environment (``tit-for-tat``, ``bot``, ...; ``repertory envs`` lists them);
- ``script:FILE`` (one response per line, per seat and episode) and ``human`` (you, at the terminal);
- ``model``: the language model of the options (the embedded SmolLM2 unless another is given);
- ``base``: the untrained model; beside a live policy, the live model with its LoRA adapters off (or its
  frozen initial weights under full fine-tuning), so no second copy is loaded;
- ``model:PATH``: a Hugging Face checkpoint directory, or a run or checkpoint directory of repertory (its
  trained policy, frozen, LoRA merged); a bare run or checkpoint directory is the same;
- ``snapshot@K``: beside a live policy with an opponent pool, its snapshot of iteration K as an adapter;
- ``openai:MODEL@BASE_URL``: a model behind an OpenAI-compatible endpoint (a hosted model, or another
  ``repertory serve``), key from the variable ``options.api_key_env`` when it is set; never trained.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from repertory.agents import Agent, BotAgent, HumanAgent, LMOptions, RemoteAgent, ScriptAgent, agent_names
from repertory.agents.live import LivePolicy
from repertory.agents.lm import LMAgent, shared_backend
from repertory.envs import Env
from repertory.envs.roles import RoleAdapters
from repertory.generation import SamplingParams, engine_options, make_backend
from repertory.models import EMBEDDED
from repertory.models.checkpoints import load_policy, run_precision
from repertory.remote import ChatClient, Endpoint, openai_spec
from repertory.runs import is_run_or_checkpoint, resolve_checkpoint
from repertory.types import RepertoryError


def spec_kind(spec: str, env: type[Env], options: LMOptions | None = None) -> str:
    """What ``spec`` names for ``env``, decided from the spec and the file system alone, so that a line-up is
    checked before any model loads: ``bot``, ``script``, ``human``, ``openai``, ``base``, ``model``,
    ``snapshot``, ``run`` (a run or checkpoint directory, bare or as ``model:PATH``) or ``hf`` (``model:PATH``, a
    Hugging Face checkpoint). A spec that names nothing raises one line saying why."""
    if spec in env.bots:
        return "bot"
    if spec in ("human", "base", "model"):
        if spec == "model":
            _check_model(options.model if options else EMBEDDED, "--model")
        return spec
    prefix, _, rest = spec.partition(":")
    if prefix == "script" and rest:
        if not Path(rest).is_file():
            raise RepertoryError(f"cannot read script file {rest}: no such file")
        return "script"
    if prefix == "openai":
        if openai_spec(spec) is None:
            raise RepertoryError(
                f"agent {spec!r}: write openai:MODEL@BASE_URL, as in openai:gpt-4o@https://api.openai.com/v1"
            )
        return "openai"
    if re.fullmatch(r"snapshot@\d+", spec):
        return "snapshot"
    path = rest if prefix == "model" else spec
    if path and is_run_or_checkpoint(path):
        return "run"
    if prefix == "model" and path:
        _check_model(path, spec)
        return "hf"
    if prefix == "script":
        raise RepertoryError("script: needs a file, as in script:moves.txt")
    if os.sep in spec or "/" in spec or spec.startswith(("~", ".")):
        if not Path(spec).exists():
            raise RepertoryError(f"agent {spec!r}: no run or checkpoint directory at {spec}")
        raise RepertoryError(f"agent {spec!r}: {spec} is not a run or checkpoint directory (no config.yaml)")
    raise RepertoryError(f"unknown agent {spec!r} for {env.name}; choose from {', '.join(agent_names(env))}")


def _check_model(model: str, named: str) -> None:
    if model != EMBEDDED and not (Path(model) / "config.json").is_file():
        raise RepertoryError(f"{named}: {model} is not a Hugging Face checkpoint directory (no config.json)")


def make_agent(spec: str, env: type[Env], options: LMOptions | None = None, live: LivePolicy | None = None) -> Agent:
    """The agent ``spec`` names for ``env`` (see the module docstring and :func:`spec_kind`); ``options`` configure
    language models, ``live`` is the trainer's policy."""
    options = options or LMOptions()
    kind = spec_kind(spec, env, None if live is not None else options)
    if kind == "bot":
        return BotAgent(spec, env.bots[spec])
    if kind == "script":
        return ScriptAgent(spec.removeprefix("script:"))
    if kind == "human":
        return HumanAgent()
    if kind == "openai":
        return _remote(spec, options)
    if kind == "base":
        return _base(live) if live is not None else language_model(options.model, options, "base")
    if kind == "model":
        if live is not None:
            raise RepertoryError("opponent 'model' is ambiguous in training; use 'base' or 'model:PATH'")
        return language_model(options.model, options, "model")
    if kind == "snapshot":
        if live is None or live.load_snapshot is None:
            raise RepertoryError(f"agent {spec!r}: a snapshot plays only beside a live policy with an opponent pool")
        return snapshot_agent(live.agent, spec, live.load_snapshot(int(spec.removeprefix("snapshot@"))))
    if kind == "run":
        return trained_policy(spec.removeprefix("model:"), options, name=spec)
    return language_model(spec.removeprefix("model:"), options, spec)


def snapshot_agent(live: LMAgent, spec: str, adapter: str) -> LMAgent:
    """The live agent's snapshot ``spec`` (``snapshot@K``), loaded as ``adapter`` of the live model: sampled by the
    same backend, with the same settings."""
    return LMAgent(live.backend, spec, live.params, live.constrained, live.seed, spec, adapter)


def _remote(spec: str, options: LMOptions) -> RemoteAgent:
    """``openai:MODEL@BASE_URL`` as an agent sampling with ``options`` (temperature, max_new_tokens, seed)."""
    endpoint = openai_spec(spec)
    assert endpoint is not None, "spec_kind checks the form first"
    model, base_url = endpoint
    key_env = options.api_key_env if os.environ.get(options.api_key_env) else None
    client = ChatClient(Endpoint(base_url, model, key_env, concurrency=16))
    return RemoteAgent(client, options.temperature, options.max_new_tokens, options.seed)


def trained_policy(path: str, options: LMOptions, name: str | None = None, policy_id: str | None = None) -> LMAgent:
    """A run's newest (or a given checkpoint's) trained policy as a frozen agent with its own weights, sampled
    with ``options`` except the fields its run keeps (``options.as_trained``); named ``RUN@K`` and
    ``snapshot@K`` unless ``name`` and ``policy_id`` say otherwise."""
    checkpoint, config = resolve_checkpoint(path)
    trained = {field: getattr(config.rollout, field) for field in options.as_trained}
    options = replace(options, **trained)
    loaded = load_policy(checkpoint, config, options.device)
    precision = run_precision(config, str(loaded.device))  # sampled as it was trained
    engine = engine_options(config.rollout.backend, config.rollout.engine_args, precision)
    backend = make_backend(config.rollout.backend, loaded, **engine)
    agent_id = policy_id or f"snapshot@{int(checkpoint.name)}"
    roles = RoleAdapters.of(config.rollout.env, config.model.adapters)  # each seat its role's adapter
    params = sampling(options)
    return LMAgent(backend, name or loaded.name, params, options.constrained, options.seed, agent_id, roles=roles)


def language_model(model: str, options: LMOptions, name: str | None = None, policy_id: str = "base") -> LMAgent:
    """``model`` (the embedded one or a Hugging Face checkpoint directory) as an agent on the process's one copy of
    its weights, named ``name`` (default: the model's name)."""
    backend = shared_backend(model, options.device)
    return LMAgent(backend, name or backend.name, sampling(options), options.constrained, options.seed, policy_id)


def sampling(options: LMOptions) -> SamplingParams:
    """How an agent built with ``options`` samples."""
    return SamplingParams(options.temperature, options.top_p, options.max_new_tokens)


def _base(live: LivePolicy) -> Agent:
    agent = live.agent
    if live.peft is not None:
        return LMAgent(agent.backend, "base", agent.params, agent.constrained, agent.seed, "base", adapter=None)
    if live.reference is None:
        raise RepertoryError("'base' beside a live policy needs its LoRA model or its frozen reference")
    frozen = make_backend(live.engine, live.reference)
    return LMAgent(frozen, "base", agent.params, agent.constrained, agent.seed, "base")

"""Language-model agents: one loaded model answers a whole batch of seats in one generation call.

An :class:`LMAgent` renders each request's chat with the model's own chat template, samples all
of them in one batched call of the backend, and returns the exact prompt ids, response ids and
sampling log-probs with the text. The backend (the loaded weights) is separate from the agent,
so several agents — a live policy and frozen snapshots, or adapters later — share one model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from repertory.agents import LMOptions, Request, Response
from repertory.envs.parsing import clean
from repertory.generation import HFBackend, SamplingParams
from repertory.models import EMBEDDED, load_model
from repertory.types import Message, derive

_BACKENDS: dict[tuple[str, str | None], HFBackend] = {}


def shared_backend(model: str = EMBEDDED, device: str | None = None) -> HFBackend:
    """One backend (one copy of the weights) per model and device for the whole process."""
    key = (model, device)
    if key not in _BACKENDS:
        _BACKENDS[key] = HFBackend(load_model(model, device))
    return _BACKENDS[key]


def chat_prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """A chat rendered with the tokenizer's chat template, ready for the assistant turn (what a policy samples
    from, and what logged turns are rendered to)."""
    chat = [{"role": m.role, "content": m.content} for m in messages]
    encoded = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class LMAgent:
    """A language model in one or many seats; every ``act`` call is one batched generation."""

    def __init__(
        self,
        backend: HFBackend,
        name: str = "model",
        params: SamplingParams | None = None,
        constrained: bool = False,
        seed: int = 0,
        policy_id: str = "base",
    ):
        self.backend = backend
        self.name = name
        self.params = params or SamplingParams()
        self.constrained = constrained
        self.seed = seed
        self.policy_id = policy_id

    def prompt_ids(self, request: Request) -> list[int]:
        """The seat's chat rendered with the model's chat template, ready for the assistant turn."""
        return chat_prompt_ids(self.backend.tokenizer, request.messages)

    def act(self, requests: list[Request]) -> list[Response]:
        prompts = [self.prompt_ids(r) for r in requests]
        seeds = [
            derive(self.seed, r.episode_id, r.seat, r.turn_index, "sampler", *([r.attempt] if r.attempt else []))
            for r in requests
        ]
        constraints = [
            self.backend.trie(r.choices) if self.constrained and r.choices is not None else None for r in requests
        ]
        keys = [(self.name, r.episode_id, r.seat) for r in requests]
        enough = [_visible_text_exceeds(r.max_chars) if r.max_chars is not None else None for r in requests]
        generations = self.backend.generate(prompts, self.params, seeds, constraints, keys, enough)
        return [
            Response(
                text=self.backend.decode(g.token_ids),
                finish=g.finish,
                prompt_ids=prompt,
                response_ids=g.token_ids,
                logp_sample=g.logprobs,
            )
            for prompt, g in zip(prompts, generations)
        ]


def _visible_text_exceeds(limit: int) -> Callable[[str], bool]:
    """True once the text the environment reads (thinking removed) is past ``limit``: the
    environment cuts everything after it, so sampling more is wasted."""
    return lambda text: len(clean(text, limit + 1)) > limit


def make_lm_agent(spec: str, options: LMOptions) -> LMAgent:
    """``model`` (the model of ``options``) or ``model:PATH`` (another checkpoint) as an agent."""
    model = spec.split(":", 1)[1] if ":" in spec else options.model
    backend = shared_backend(model, options.device)
    params = SamplingParams(options.temperature, options.top_p, options.max_new_tokens)
    return LMAgent(backend, spec, params, options.constrained, options.seed)

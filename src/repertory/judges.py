"""Judges: a fixed language model that scores finished episodes on named scales (docs/environments.md 12).

An environment describes what to score as :class:`~repertory.types.JudgeRequest`s; the rollout engine
collects the requests of the episodes that finish in a tick and calls :meth:`Judge.score` once. Two kinds:

- ``openai``: any OpenAI-compatible chat endpoint (:mod:`repertory.remote`), temperature 0, JSON output
  requested; an answer that does not parse is asked again with the reason, twice, then the request fails.
- ``local``: a Hugging Face checkpoint (default: the embedded model) through the generation backend. Small
  models rarely write a valid JSON verdict, so each (agent, scale) is one short greedy answer constrained to
  the scale's integers: every answer parses, and all of them go to the model in one batched call.

Both cache every answer in SQLite keyed by a hash of (judge model, prompt, parameters), so scoring the same
episode again costs nothing and an interrupted evaluation resumes. Scores outside a scale are clipped (and
counted); a request that fails is returned as None, and the environment flags its episode ``judge_failed``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from repertory.remote import ChatClient, Endpoint, ResponseCache, openai_spec
from repertory.types import JudgeRequest, RepertoryError, Verdict

if TYPE_CHECKING:
    from repertory.config import JudgeConfig
    from repertory.generation import Backend

PARSE_RETRIES = 2
"""Times a judge is asked again after an answer that does not parse (docs/environments.md 12)."""

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


def rubric(request: JudgeRequest) -> str:
    """The scales of a request, one line each, with their ranges."""
    return "\n".join(f"- {d.name} ({d.low} to {d.high}): {d.meaning}" for d in request.dimensions)


def json_messages(request: JudgeRequest) -> list[dict[str, str]]:
    """The chat of a JSON verdict: every agent's every scale, with a reason, in one object."""
    example = {
        request.agents[0]: {d.name: {"reasoning": "...", "score": d.low} for d in request.dimensions[:2]},
    }
    system = (
        f"{request.instructions}\n\nDimensions:\n{rubric(request)}\n\n"
        f"Answer with one JSON object and nothing else: for each of {', '.join(request.agents)}, an object with every "
        "dimension as a key, each holding a short 'reasoning' and an integer 'score'. For example (shortened): "
        f"{json.dumps(example)}"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": request.context}]


def parse_verdict(request: JudgeRequest, text: str) -> tuple[Verdict, int]:
    """The verdict in a JSON answer and how many scores were clipped into range; ValueError saying what is
    missing or malformed. A score may be a bare number or ``{"score": n, ...}``."""
    body = _FENCE.sub("", text.strip())
    start, end = body.find("{"), body.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("the answer holds no JSON object")
    try:
        data = json.loads(body[start : end + 1])
    except ValueError as exc:
        raise ValueError(f"the answer is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ValueError("the answer must be a JSON object")
    verdict: Verdict = {}
    clipped = 0
    for agent in request.agents:
        scores = data.get(agent)
        if not isinstance(scores, dict):
            raise ValueError(f"no scores for {agent}")
        verdict[agent] = {}
        for d in request.dimensions:
            raw = scores.get(d.name)
            if isinstance(raw, dict):
                raw = raw.get("score")
            value = _number(raw)
            if value is None:
                raise ValueError(f"{agent}.{d.name} has no numeric score")
            bounded = min(max(value, d.low), d.high)
            clipped += bounded != value
            verdict[agent][d.name] = bounded
    return verdict, clipped


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return float(raw) if raw == raw and abs(raw) != float("inf") else None
    if isinstance(raw, str):
        try:
            return _number(float(raw.strip()))
        except ValueError:
            return None
    return None


def dimension_messages(request: JudgeRequest, agent: str, dimension: str) -> list[dict[str, str]]:
    """The chat of one (agent, scale) question for a constrained judge; the context comes first so that every
    question about one episode shares the same prompt prefix."""
    d = next(x for x in request.dimensions if x.name == dimension)
    system = f"{request.instructions}\n\nDimensions:\n{rubric(request)}"
    question = f"Score {agent} on {d.name} ({d.meaning}): one integer from {d.low} to {d.high}."
    return [{"role": "system", "content": system}, {"role": "user", "content": f"{request.context}\n\n{question}"}]


@dataclass
class JudgeStats:
    """What a judge did: requests scored, failed, retried after a bad answer, scores clipped, cache hits."""

    requests: int = 0
    failed: int = 0
    retried: int = 0
    clipped: int = 0
    cache_hits: int = 0
    calls: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"judge/{k}": float(v) for k, v in vars(self).items()}


@dataclass
class ChatJudge:
    """A judge behind an OpenAI-compatible endpoint: one JSON verdict per request."""

    client: ChatClient
    name: str
    fine_grained: bool = False
    max_tokens: int = 1024
    stats: JudgeStats = field(default_factory=JudgeStats)

    def score(self, requests: list[JudgeRequest]) -> list[Verdict | None]:
        """One verdict per request (None where the endpoint failed or the answer never parsed)."""
        self.stats.requests += len(requests)
        chats = [json_messages(r) for r in requests]
        out: list[Verdict | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        for attempt in range(PARSE_RETRIES + 1):
            if not todo:
                break
            if attempt:
                self.stats.retried += len(todo)
            self.stats.calls += 1
            answers = self.client.complete([chats[i] for i in todo], temperature=0.0, max_tokens=self.max_tokens)
            again = []
            for i, answer in zip(todo, answers):
                self.stats.cache_hits += answer.cached
                if answer.text is None:  # the client already retried the transport
                    continue
                try:
                    out[i], clipped = parse_verdict(requests[i], answer.text)
                    self.stats.clipped += clipped
                except ValueError as exc:
                    chats[i] = [
                        *chats[i],
                        {"role": "assistant", "content": answer.text},
                        {
                            "role": "user",
                            "content": f"That answer could not be used: {exc}. Reply with the JSON object only.",
                        },
                    ]
                    again.append(i)
            todo = again
        self.stats.failed += sum(v is None for v in out)
        return out


@dataclass
class LocalJudge:
    """A judge on a local model: one constrained greedy answer per (agent, scale), all in one batched call.
    Every question about one episode starts with the same prompt (the rubric and the episode) and carries that
    prompt as its cache key, so the questions that join the batch together encode the episode once
    (:class:`~repertory.generation.hf.HFBackend` shares a key's common prefix) instead of once per scale."""

    backend: Backend
    name: str
    cache: ResponseCache | None = None
    fine_grained: bool = False
    stats: JudgeStats = field(default_factory=JudgeStats)

    def score(self, requests: list[JudgeRequest]) -> list[Verdict | None]:
        from repertory.generation import GenerationRequest, SamplingParams
        from repertory.models.chat import chat_prompt_ids
        from repertory.types import Message

        self.stats.requests += len(requests)
        questions = [(i, a, d) for i, r in enumerate(requests) for a in r.agents for d in r.dimensions]
        answers: dict[int, str] = {}
        keys, todo = [], []
        for q, (i, agent, d) in enumerate(questions):
            messages = dimension_messages(requests[i], agent, d.name)
            key = ResponseCache.key(self.name, messages, {"choices": [d.low, d.high], "style": "constrained"})
            cached = self.cache.get(key) if self.cache is not None else None
            if cached is not None:
                answers[q] = cached
                self.stats.cache_hits += 1
            else:
                keys.append(key)
                todo.append((q, messages, d))
        if todo:
            self.stats.calls += 1
            tokenizer = self.backend.tokenizer
            prompts = [
                chat_prompt_ids(tokenizer, [Message(m["role"], m["content"]) for m in msgs]) for _, msgs, _ in todo
            ]
            rows = [
                GenerationRequest(
                    prompt,
                    seed=0,
                    constraint=self.backend.constraint([str(v) for v in range(d.low, d.high + 1)]),
                    cache_key=(self.name, requests[questions[q][0]].kind, requests[questions[q][0]].context),
                )
                for prompt, (q, _, d) in zip(prompts, todo)
            ]
            generations = self.backend.generate(rows, SamplingParams(temperature=0.0, max_new_tokens=4))
            for (q, _, _), key, g in zip(todo, keys, generations):
                answers[q] = self.backend.decode(g.response_ids).strip()
                if self.cache is not None:
                    self.cache.put(key, self.name, answers[q])
        out: list[Verdict | None] = [{a: {} for a in r.agents} for r in requests]
        for q, (i, agent, d) in enumerate(questions):
            value = _number(answers[q])
            verdict = out[i]
            if value is None or verdict is None:
                out[i] = None
                continue
            bounded = min(max(value, d.low), d.high)
            self.stats.clipped += bounded != value
            verdict[agent][d.name] = bounded
        self.stats.failed += sum(v is None for v in out)
        return out


def cache_path() -> Path:
    """The judge cache: ``judge.sqlite`` in the repertory cache directory."""
    from repertory.models import cache_dir

    return cache_dir() / "judge.sqlite"


def judge_config(spec: str, api_key_env: str | None = None, fine_grained: bool = False) -> JudgeConfig:
    """The judge of a command-line spec: ``none``, ``local`` (the embedded model), ``local:PATH`` (a checkpoint)
    or ``openai:MODEL@BASE_URL`` (key from the variable ``api_key_env``, if the endpoint needs one)."""
    from repertory.config import JudgeConfig

    if spec == "none":
        return JudgeConfig(fine_grained=fine_grained)
    if spec == "local" or spec.startswith("local:"):
        return JudgeConfig(kind="local", model=spec.partition(":")[2] or "smollm2", fine_grained=fine_grained)
    endpoint = openai_spec(spec)
    if endpoint is not None:
        model, base_url = endpoint
        return JudgeConfig(
            kind="openai", model=model, base_url=base_url, api_key_env=api_key_env, fine_grained=fine_grained
        )
    raise RepertoryError(f"unknown judge {spec!r}; use none, local, local:PATH or openai:MODEL@BASE_URL")


def make_judge(config: JudgeConfig, device: str | None = None) -> ChatJudge | LocalJudge | None:
    """The judge a config names (None for kind none)."""
    if config.kind == "none":
        return None
    cache = ResponseCache(Path(config.cache) if config.cache else cache_path()) if config.cache != "off" else None
    if config.kind == "openai":
        if not config.base_url:
            raise RepertoryError("judge.kind openai needs judge.base_url (an OpenAI-compatible endpoint, e.g. .../v1)")
        endpoint = Endpoint(
            base_url=config.base_url,
            model=config.model,
            api_key_env=config.api_key_env,
            timeout_s=config.timeout_s,
            max_retries=config.max_retries,
            concurrency=config.concurrency,
            json_mode=True,
        )
        return ChatJudge(
            ChatClient(endpoint, cache),
            f"openai:{config.model}@{config.base_url}",
            config.fine_grained,
            config.max_tokens,
        )
    from repertory.generation import make_backend
    from repertory.models import load_model

    backend = make_backend("hf", load_model(config.model, config.device or device))
    return LocalJudge(backend, f"local:{config.model}", cache, config.fine_grained)

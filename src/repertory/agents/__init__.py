"""Agents: who acts in a seat. A batch of requests in, a batch of responses out.

The rollout engine gathers every pending request of every running episode, groups them by agent
and makes one ``act`` call per agent per tick, so an agent that serves many seats (a language
model in self-play) answers all of them in one batch. :func:`repertory.agents.resolve.make_agent`
turns an agent spec (a bot name, ``model``, ``model:PATH``, ``base``, a run or checkpoint
directory, ``openai:MODEL@BASE_URL``, ``script:FILE``, ``human``) into an agent; this module holds the protocol and the
agents that need no model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from repertory.envs import Env
from repertory.envs.grammar import Syntax
from repertory.remote import ChatClient, RemoteError
from repertory.types import Message, RepertoryError, chat_dicts, derive


@dataclass
class Request:
    """One seat of one episode that must act now.

    ``messages`` is the seat's whole chat so far, ``view`` its knowledge as structured data (for
    bots), ``turn_index`` counts the seat's own turns, ``choices`` lists every complete valid
    response when the action here is a finite set (None for free text), ``syntax`` is the action's grammar
    (None where the seat only talks), and ``max_chars`` is how
    much visible text the environment reads (the rest is cut, so generating it is wasted).
    ``attempt`` counts the partner guard's requests for a new sample of the same turn (0 first).
    ``role`` is the seat's name in the game; ``label`` its game role and ``team`` its team (empty outside team
    games), by which a model with one adapter per role or team picks the seat's.
    """

    episode_id: str
    seat: int
    role: str
    messages: list[Message]
    view: dict[str, Any]
    turn_index: int = 0
    choices: list[str] | None = None
    syntax: Syntax | None = None
    max_chars: int | None = None
    attempt: int = 0
    label: str = ""
    team: str = ""

    @property
    def observation(self) -> list[Message]:
        """The messages that arrived since the seat last spoke."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "assistant":
                return self.messages[i + 1 :]
        return list(self.messages)


@dataclass
class Response:
    """What a seat wrote; language-model agents also return the exact tokens and their log-probs."""

    text: str
    finish: str = "stop"
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logp_sample: list[float] = field(default_factory=list)
    policy_version: int = 0  # the version of the policy that sampled it (a trainer's updates so far)
    grammar: str | None = None  # the TurnGrammar it was sampled under (its log-probs are the masked policy's)


class Agent(Protocol):
    """Anything that answers a batch of requests, in order."""

    name: str
    policy_id: str

    def act(self, requests: list[Request]) -> list[Response]: ...


@dataclass(frozen=True)
class LMOptions:
    """How language-model agents are built: which model, how to sample, constrained actions, seed. A trained
    policy (a run or checkpoint) takes the fields named in ``as_trained`` from its own run's rollout config
    (``temperature``, ``max_new_tokens``, ``constrained``) instead of these."""

    model: str = "smollm2"
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 400
    constrained: bool | str = False  # True: finite action sets; "grammar": every action under its grammar
    seed: int = 0
    device: str | None = None
    as_trained: tuple[str, ...] = ()
    api_key_env: str = "OPENAI_API_KEY"  # remote (openai:) agents send this variable's key when it is set


class BotAgent:
    """A scripted policy of one environment, applied to each request's structured view."""

    def __init__(self, name: str, bot: Callable[[dict[str, Any]], str]):
        self.name = name
        self.policy_id = f"scripted:{name}"
        self._bot = bot

    def act(self, requests: list[Request]) -> list[Response]:
        return [Response(self._bot(r.view)) for r in requests]


def _unescape(line: str) -> str:
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] in "n\\":
            out.append("\n" if line[i + 1] == "n" else "\\")
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


class ScriptAgent:
    """Replays a file's lines, one per turn, separately for each (episode, seat), cycling."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.name = f"script:{path}"
        self.policy_id = "scripted:script"
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as exc:
            raise RepertoryError(f"cannot read script file {self.path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise RepertoryError(f"cannot read script file {self.path}: it is not UTF-8 text") from None
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines:
            raise RepertoryError(f"script file {self.path} is empty; write one response per line")
        self.lines = [_unescape(line.rstrip("\r")) for line in lines]
        self._cursor: dict[tuple[str, int], int] = {}

    def act(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            k = self._cursor.get((r.episode_id, r.seat), 0)
            self._cursor[(r.episode_id, r.seat)] = k + 1
            out.append(Response(self.lines[k % len(self.lines)]))
        return out


class HumanAgent:
    """You at the terminal: shows what the seat sees since its last turn and reads one line."""

    name = "human"
    policy_id = "human"

    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None):
        self._in = stdin
        self._out = stdout

    def act(self, requests: list[Request]) -> list[Response]:
        stdin, stdout = self._in or sys.stdin, self._out or sys.stdout
        out = []
        for r in requests:
            stdout.write(f"\n=== {r.role} ({r.episode_id}) ===\n")
            for m in r.observation:
                label = "rules" if m.role == "system" else f"referee, {m.channel}" if m.channel else "referee"
                stdout.write(f"[{label}] {m.content}\n")
            stdout.write(f"{r.role}> ")
            stdout.flush()
            line = stdin.readline()
            if not line:
                raise RepertoryError(f"standard input closed while waiting for {r.role}'s move")
            out.append(Response(_unescape(line.rstrip("\r\n"))))
        return out


class RemoteAgent:
    """A model behind an OpenAI-compatible endpoint (``openai:MODEL@BASE_URL``): each seat's chat goes out as
    messages, all requests of a tick concurrently, with the client's retries and timeouts. It returns text only
    (no token ids), so its seats are never trained; the referee treats its answers as any agent's. A request
    that still fails after the retries stops the game with the endpoint's error rather than playing on with a
    made-up move."""

    def __init__(self, client: ChatClient, temperature: float, max_tokens: int, seed: int):
        self.client = client
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed
        endpoint = client.endpoint
        self.name = f"openai:{endpoint.model}@{endpoint.base_url}"
        self.policy_id = f"remote:{endpoint.model}"

    def act(self, requests: list[Request]) -> list[Response]:
        chats = [chat_dicts(r.messages) for r in requests]
        seeds = [
            derive(self.seed, r.episode_id, r.seat, r.turn_index, "remote", *([r.attempt] if r.attempt else [])) % 2**31
            for r in requests
        ]
        completions = self.client.complete(chats, temperature=self.temperature, max_tokens=self.max_tokens, seeds=seeds)
        for request, completion in zip(requests, completions):
            if completion.text is None:
                raise RemoteError(
                    f"{self.name} gave {request.role} of {request.episode_id} no answer: {completion.error}"
                )
        return [Response(c.text or "") for c in completions]


def is_model(agent: Agent) -> bool:
    """Whether a language model writes this agent's text (not a bot, a script or a person)."""
    return not agent.policy_id.startswith("scripted:") and agent.policy_id != "human"


def agent_names(env: type[Env]) -> list[str]:
    """The agent specs ``env`` accepts: its bots, then the generic forms."""
    return [
        *env.bots,
        "base",
        "model",
        "model:PATH",
        "RUN or CHECKPOINT directory",
        "openai:MODEL@BASE_URL",
        "script:FILE",
        "human",
    ]

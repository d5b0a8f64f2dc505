"""The OpenAI-compatible protocol of ``repertory serve``, without a server or a model: the options (checked before
anything loads), request validation (pure functions of the body and headers), errors in OpenAI's shape, and the
response bodies."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from repertory.envs import env_class, load_kernels, make
from repertory.envs.kernels import splits_of
from repertory.store.served import ServedTurn
from repertory.types import Kernel, Message, RepertoryError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "REPERTORY_API_KEY"
CONVERSATION_HEADER = "x-conversation-id"
KERNEL_HEADER = "x-repertory-kernel"
_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens, what it accepts and where it logs (``repertory serve --help`` documents each).
    Built before the model loads, so a bad address or a missing key fails at once."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 256
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 256
    max_pending: int = 1024  # queued requests beyond this get 503
    seed: int = 0

    def __post_init__(self) -> None:
        if self.host not in LOOPBACK and not self.api_key:
            raise RepertoryError(
                f"binding {self.host} exposes the model beyond this machine; give --api-key or set {API_KEY_ENV}"
            )
        if not 0 <= self.port <= 65535:
            raise RepertoryError(f"--port must be 0..65535 (got {self.port})")
        if min(self.max_body_bytes, self.max_messages, self.max_tokens, self.default_max_tokens, self.max_pending) < 1:
            raise RepertoryError("serve limits (body bytes, messages, max tokens, pending) must be at least 1")

    def listen(self) -> socket.socket:
        """A socket listening on the options' address (a free port for 0), so that the URL is known before the
        server runs and a busy port is refused before the model loads."""
        try:
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
            return socket.create_server((self.host, self.port), family=family, backlog=2048)
        except OSError as exc:
            raise RepertoryError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None


class ServeError(Exception):
    """A request that gets an HTTP error: its status and OpenAI's ``{"error": {message, type, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.headers = status, message, code, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]


class ChatRequest(BaseModel):
    """The fields of a chat-completion request that the server reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[_ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    stream_options: dict[str, Any] | None = None


class OutcomeRequest(BaseModel):
    """``POST /v1/outcomes``: a logged conversation's outcome."""

    model_config = ConfigDict(extra="forbid")
    conversation_id: str
    outcome: float = Field(allow_inf_nan=False)


def validation_message(error: ValidationError) -> str:
    """The first problem of a body, located (``messages[0].role: ...``), and how many more there are."""
    first = error.errors()[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    where = where or "body"
    return f"{where}: {first['msg']}" + (f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else "")


class SeatPrompt:
    """``--env ENV --role ROLE``: the system prompt and text limit of a seat of a game, per kernel, so that a
    client that runs the game sends only what the referee tells the seat."""

    def __init__(self, env_name: str, role: str, env_options: dict[str, Any] | None = None):
        cls = env_class(env_name)
        known = list(dict.fromkeys([*cls.roles, *cls.role_labels]))
        if role not in known:
            raise RepertoryError(f"{env_name} has no role {role!r}; choose from {', '.join(known)}")
        self.env_name, self.role, self.options = env_name, role, env_options or {}
        self.kernels: dict[str, Kernel] = {}
        for split in splits_of(cls):
            for kernel in load_kernels(env_name, split, self.options):
                self.kernels[kernel.id] = kernel
        self._cache: dict[str, tuple[str, str, int]] = {}

    def seat(self, kernel_id: str) -> tuple[str, str, int]:
        """(system prompt, seat name, visible characters) of the role in ``kernel_id``."""
        if kernel_id not in self._cache:
            kernel = self.kernels.get(kernel_id)
            if kernel is None:
                raise ServeError(422, f"{self.env_name} has no kernel {kernel_id!r}", "unknown_kernel")
            env = make(self.env_name, **self.options)
            env.reset(kernel, 0)
            names = list(env.roles)
            if self.role in names:
                seat = self.role
            elif self.role in env.role_labels:
                seat = names[list(env.role_labels).index(self.role)]
            else:
                raise ServeError(422, f"kernel {kernel_id} seats no {self.role!r}", "unknown_role")
            self._cache[kernel_id] = (env.system_prompt(seat), seat, env.max_chars(seat))
        return self._cache[kernel_id]


@dataclass(frozen=True)
class ChatInput:
    """A validated chat request: the chat to continue, how to sample it, and what the log records about it."""

    messages: list[Message]
    max_tokens: int
    stop: tuple[str, ...]
    conversation_id: str | None
    kernel_id: str | None
    seat_id: str = "assistant"
    max_chars: int | None = None  # the seat's visible text: sampling ends once more would be cut


def chat_input(
    chat: ChatRequest,
    headers: dict[str, str],
    served_name: str,
    limits: ServeOptions,
    seat: SeatPrompt | None = None,
) -> ChatInput:
    """Check a parsed request against what this server serves and its ``limits``; the
    seat's system message goes first when ``--env``/``--role`` name one and the client sent none."""
    if chat.model != served_name:
        raise ServeError(
            404, f"model {chat.model!r} is not served here; this server serves {served_name!r}", "model_not_found"
        )
    if len(chat.messages) > limits.max_messages:
        raise ServeError(
            422, f"{len(chat.messages)} messages exceed the limit of {limits.max_messages}", "too_many_messages"
        )
    max_tokens = chat.max_completion_tokens or chat.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise ServeError(
            422, f"max_tokens {max_tokens} exceeds this server's limit of {limits.max_tokens}", "max_tokens_too_large"
        )
    stop = (chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ())
    if len(stop) > 4 or any(not s for s in stop):
        raise ServeError(422, "stop takes at most 4 non-empty strings", "invalid_stop")
    conversation_id = headers.get(CONVERSATION_HEADER)
    if conversation_id is not None and not _ID.match(conversation_id):
        raise ServeError(422, "X-Conversation-Id must be 1-128 letters, digits or ._:@/-", "invalid_conversation_id")
    kernel_id = headers.get(KERNEL_HEADER)
    messages = [
        Message(
            "system" if m.role == "developer" else m.role,
            m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
        )
        for m in chat.messages
    ]
    base = ChatInput(messages, max_tokens, stop, conversation_id, kernel_id)
    if seat is None:
        return base
    if kernel_id is not None:
        system, seat_id, max_chars = seat.seat(kernel_id)
        if messages[0].role != "system":
            messages.insert(0, Message("system", system))
        return ChatInput(messages, max_tokens, stop, conversation_id, kernel_id, seat_id, max_chars)
    if messages[0].role != "system":
        raise ServeError(
            422,
            f"name the game's kernel in the X-Repertory-Kernel header (a {seat.env_name} kernel id) or send the "
            "seat's system message yourself",
            "missing_kernel",
        )
    return ChatInput(messages, max_tokens, stop, conversation_id, kernel_id, seat.role)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one occurred."""
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def usage(turn: ServedTurn) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.response_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(turn: ServedTurn, created: float) -> dict[str, Any]:
    """A non-streamed ``chat.completion``."""
    return {
        "id": turn.request_id,
        "object": "chat.completion",
        "created": int(created),
        "model": turn.model,
        "conversation_id": turn.conversation_id,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": turn.response},
                "finish_reason": turn.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage(turn),
    }


def chunk_event(turn: ServedTurn, created: float, delta: dict[str, Any], finish: str | None) -> str:
    """One server-sent ``chat.completion.chunk`` event."""
    body = {
        "id": turn.request_id,
        "object": "chat.completion.chunk",
        "created": int(created),
        "model": turn.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    return f"data: {json.dumps(body)}\n\n"


def usage_event(turn: ServedTurn, created: float) -> str:
    """The last chunk of a stream that asked for ``stream_options.include_usage``."""
    body = {
        "id": turn.request_id,
        "object": "chat.completion.chunk",
        "created": int(created),
        "model": turn.model,
        "choices": [],
        "usage": usage(turn),
    }
    return f"data: {json.dumps(body)}\n\n"


def error_event(error: ServeError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"

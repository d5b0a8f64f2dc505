"""``repertory serve``: a policy behind an OpenAI-compatible HTTP API that logs every conversation it has.

The deployment half of batch-online training (docs/algorithms.md 5): put pi_k in front of users, log what it
said, post each conversation's outcome, then train pi_{k+1} on the log with ``trainer: rounds`` and
``rounds.logs=LOGDIR``. Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``
(non-streaming and server-sent-event streaming) and ``POST /v1/outcomes``.

Requests are batched the way the rollout engine batches seats: handlers put jobs on a queue, and one
generation thread drains it each tick, samples every job of the tick with as few backend calls as there are
distinct sampling settings, writes the tick's completions to the log as one Parquet part
(:mod:`repertory.store.served`), and only then answers. A killed server therefore loses at most the requests in
flight. Streaming clients receive the text as it grows (the backend reports it every few tokens).

Security: the server binds 127.0.0.1 unless told otherwise; any other address needs an API key, and with a key
every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise). Bodies, message counts and
``max_tokens`` are bounded; every error is one line of JSON in OpenAI's shape
``{"error": {"message", "type", "code"}}``. The key is never logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from repertory.envs import env_class, load_kernels, make
from repertory.envs.kernels import SPLITS
from repertory.envs.parsing import clean
from repertory.generation import Backend, Generation, SamplingParams, make_backend
from repertory.models import EMBEDDED, load_model
from repertory.models.chat import chat_prompt_ids
from repertory.models.checkpoints import load_policy
from repertory.runs import is_run_or_checkpoint, resolve_checkpoint
from repertory.store.served import ServedLog, ServedTurn
from repertory.types import Kernel, Message, RepertoryError, derive

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "REPERTORY_API_KEY"
CONVERSATION_HEADER = "x-conversation-id"
KERNEL_HEADER = "x-repertory-kernel"
_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,128}$")


@dataclass(frozen=True)
class ServeOptions:
    """How the server listens, what it accepts and where it logs (``repertory serve --help`` documents each)."""

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
        if min(self.max_body_bytes, self.max_messages, self.max_tokens, self.default_max_tokens, self.max_pending) < 1:
            raise RepertoryError("serve limits (body bytes, messages, max tokens, pending) must be at least 1")


@dataclass
class ServedPolicy:
    """The model a server samples: its engine, the name clients ask for and the policy id its log records."""

    backend: Backend
    name: str
    policy_id: str
    run_dir: Path | None = None  # the run it was trained in (its log goes to RUN/served by default)


def load_served_policy(
    spec: str, backend: str | None = None, model: str = EMBEDDED, device: str | None = None, name: str | None = None
) -> ServedPolicy:
    """The policy ``spec`` names, sampled by the ``backend`` engine: ``base`` (``model``, the embedded one unless
    given), a run or checkpoint directory (its trained policy, frozen, on its run's engine unless ``backend``
    says otherwise), or ``model:PATH`` (a Hugging Face checkpoint directory)."""
    path = spec.removeprefix("model:")
    if spec != "base" and is_run_or_checkpoint(path):
        checkpoint, config = resolve_checkpoint(path)
        run = checkpoint.parent.parent  # RUN/checkpoints/STEP
        engine = make_backend(backend or config.rollout.backend, load_policy(checkpoint, config, device))
        step = int(checkpoint.name)
        return ServedPolicy(engine, name or f"{run.name}@{step}", f"snapshot@{step}", run)
    if spec == "base":
        return ServedPolicy(make_backend(backend or "hf", load_model(model, device)), name or "base", "base")
    if spec.startswith("model:") and path:
        if not Path(path).is_dir():
            raise RepertoryError(f"{path}: no such checkpoint directory")
        engine = make_backend(backend or "hf", load_model(path, device))
        return ServedPolicy(engine, name or Path(path).name, f"model:{Path(path).name}")
    raise RepertoryError(f"serve: {spec!r} is not base, a run or checkpoint directory, or model:PATH")


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
        for split in SPLITS:
            for kernel in load_kernels(env_name, split, self.options):
                self.kernels[kernel.id] = kernel
        self._cache: dict[str, tuple[str, str, int]] = {}

    def seat(self, kernel_id: str) -> tuple[str, str, int]:
        """(system prompt, seat name, visible characters) of the role in ``kernel_id``."""
        if kernel_id not in self._cache:
            kernel = self.kernels.get(kernel_id)
            if kernel is None:
                raise _Error(422, f"{self.env_name} has no kernel {kernel_id!r}", "unknown_kernel")
            env = make(self.env_name, **self.options)
            env.reset(kernel, 0)
            names = list(env.roles)
            if self.role in names:
                seat = self.role
            elif self.role in env.role_labels:
                seat = names[list(env.role_labels).index(self.role)]
            else:
                raise _Error(422, f"kernel {kernel_id} seats no {self.role!r}", "unknown_role")
            self._cache[kernel_id] = (env.system_prompt(seat), seat, env.max_chars(seat))
        return self._cache[kernel_id]


class _Error(Exception):
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


def _error_response(error: _Error) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]


class _ChatRequest(BaseModel):
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


class _OutcomeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    conversation_id: str
    outcome: float = Field(allow_inf_nan=False)


def _validation_message(error: ValidationError) -> str:
    first = error.errors()[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    where = where or "body"
    return f"{where}: {first['msg']}" + (f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else "")


@dataclass
class _Job:
    """One request waiting for the generation thread."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    cache_key: object
    max_chars: int | None
    turn: ServedTurn
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def enough(self, text: str) -> bool:
        """Called by the backend every few tokens with the text so far: streams it, and ends the row early
        once the client is gone or the game reads no more."""
        if self.cancelled.is_set():
            return True
        if self.on_text is not None:
            self.on_text(text)
        return self.max_chars is not None and len(clean(text, self.max_chars + 1)) > self.max_chars


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


class Batcher:
    """The generation thread: drains the queue each tick, samples, logs the tick as one part, answers."""

    def __init__(self, policy: ServedPolicy, served_log: ServedLog, max_pending: int):
        self.policy, self.log = policy, served_log
        self.queue: queue.Queue[_Job] = queue.Queue(maxsize=max_pending)
        self.ticks = self.completions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repertory-serve-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        while not self.queue.empty():
            self.queue.get_nowait().future.set_exception(_Error(503, "the server is shutting down", "shutting_down"))

    def submit(self, job: _Job) -> None:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise _Error(
                503, "too many requests are waiting; retry shortly", "overloaded", "server_error", {"Retry-After": "1"}
            ) from None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = [self.queue.get(timeout=0.05)]
            except queue.Empty:
                continue
            while True:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._tick(jobs)

    def _tick(self, jobs: list[_Job]) -> None:
        groups: dict[SamplingParams, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.params, []).append(job)
        done: list[tuple[_Job, Generation]] = []
        for params, group in groups.items():
            try:
                generations = self.policy.backend.generate(
                    [j.prompt_ids for j in group],
                    params,
                    [j.seed for j in group],
                    None,
                    [j.cache_key for j in group],
                    [j.enough for j in group],
                )
            except Exception as exc:  # one bad batch fails its requests, never the server
                log.exception("generation failed")
                for job in group:
                    job.future.set_exception(
                        _Error(500, f"generation failed: {type(exc).__name__}", "generation_error", "server_error")
                    )
                continue
            done.extend(zip(group, generations))
        finished = time.time()
        answered = []
        for job, generation in done:
            if job.cancelled.is_set():
                job.future.cancel()
                continue
            text, stopped = _cut_at_stop(self.policy.backend.decode(generation.token_ids), job.params.stop)
            turn = job.turn
            turn.response, turn.response_ids, turn.logp_sample = text, generation.token_ids, generation.logprobs
            turn.finish_reason = "stop" if stopped or generation.finish == "stop" else "length"
            turn.finished = finished
            answered.append(job)
        try:
            self.log.append_turns([job.turn for job in answered])
        except Exception as exc:  # unlogged completions are not returned: the log is the product
            log.exception("writing the log failed")
            for job in answered:
                job.future.set_exception(
                    _Error(500, f"could not write the log: {type(exc).__name__}", "log_error", "server_error")
                )
            return
        self.ticks += 1
        self.completions += len(answered)
        for job in answered:
            job.future.set_result(job.turn)


def create_app(
    policy: ServedPolicy, options: ServeOptions, served_log: ServedLog, seat: SeatPrompt | None = None
) -> FastAPI:
    """The FastAPI application serving ``policy`` (see the module docstring)."""
    batcher = Batcher(policy, served_log, options.max_pending)
    tokenizer = policy.backend.tokenizer
    context = _context_length(policy.backend)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="repertory serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher = batcher

    @app.exception_handler(_Error)
    async def _on_error(request: Request, error: _Error) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error_response(_Error(500, f"internal error: {type(error).__name__}", "internal_error", "server_error"))

    @app.exception_handler(404)
    async def _on_missing(request: Request, error: Exception) -> JSONResponse:
        return _error_response(_Error(404, f"no route {request.method} {request.url.path}", "not_found"))

    @app.exception_handler(405)
    async def _on_method(request: Request, error: Exception) -> JSONResponse:
        return _error_response(
            _Error(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        )

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise _Error(
                401,
                "missing or wrong API key (send Authorization: Bearer KEY)",
                "invalid_api_key",
                "authentication_error",
            )

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > options.max_body_bytes:
            raise _Error(
                413,
                f"request body of {int(declared)} bytes exceeds the limit of {options.max_body_bytes}",
                "body_too_large",
                headers={"Connection": "close"},
            )
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > options.max_body_bytes:
                raise _Error(
                    413,
                    f"request body exceeds the limit of {options.max_body_bytes} bytes",
                    "body_too_large",
                    headers={"Connection": "close"},
                )
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Error(422, f"the body is not valid JSON: {exc}", "invalid_json") from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": policy.name,
            "pending": batcher.queue.qsize(),
            "completions": batcher.completions,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        card = {
            "id": policy.name,
            "object": "model",
            "created": started,
            "owned_by": "repertory",
            "policy_id": policy.policy_id,
        }
        if seat is not None:
            card.update(env=seat.env_name, role=seat.role)
        return {"object": "list", "data": [card]}

    @app.post("/v1/outcomes")
    async def outcomes(request: Request) -> dict[str, Any]:
        authorize(request)
        try:
            posted = _OutcomeRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            raise _Error(422, _validation_message(exc), "invalid_outcome") from None
        if posted.conversation_id not in served_log.conversations:
            raise _Error(404, f"no logged conversation {posted.conversation_id!r}", "unknown_conversation")
        await asyncio.to_thread(served_log.append_outcome, posted.conversation_id, posted.outcome)
        return {"conversation_id": posted.conversation_id, "outcome": posted.outcome, "recorded": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        received = time.time()
        try:
            chat = _ChatRequest.model_validate(await read_json(request))
        except ValidationError as exc:
            raise _Error(422, _validation_message(exc), "invalid_request") from None
        if chat.model != policy.name:
            raise _Error(
                404, f"model {chat.model!r} is not served here; this server serves {policy.name!r}", "model_not_found"
            )
        if len(chat.messages) > options.max_messages:
            raise _Error(
                422, f"{len(chat.messages)} messages exceed the limit of {options.max_messages}", "too_many_messages"
            )
        max_tokens = chat.max_completion_tokens or chat.max_tokens or options.default_max_tokens
        if max_tokens > options.max_tokens:
            raise _Error(
                422,
                f"max_tokens {max_tokens} exceeds this server's limit of {options.max_tokens}",
                "max_tokens_too_large",
            )
        stop = (chat.stop,) if isinstance(chat.stop, str) else tuple(chat.stop or ())
        if len(stop) > 4 or any(not s for s in stop):
            raise _Error(422, "stop takes at most 4 non-empty strings", "invalid_stop")
        conversation_id = request.headers.get(CONVERSATION_HEADER)
        if conversation_id is not None and not _ID.match(conversation_id):
            raise _Error(422, "X-Conversation-Id must be 1-128 letters, digits or ._:@/-", "invalid_conversation_id")
        kernel_id = request.headers.get(KERNEL_HEADER)
        messages = [
            Message(
                "system" if m.role == "developer" else m.role,
                m.content if isinstance(m.content, str) else "".join(p.text for p in m.content),
            )
            for m in chat.messages
        ]
        seat_id, max_chars = "assistant", None
        if seat is not None:
            if kernel_id is not None:
                system, seat_id, max_chars = seat.seat(kernel_id)
                if messages[0].role != "system":
                    messages.insert(0, Message("system", system))
            elif messages[0].role != "system":
                raise _Error(
                    422,
                    f"name the game's kernel in the X-Repertory-Kernel header (a {seat.env_name} "
                    "kernel id) or send the seat's system message yourself",
                    "missing_kernel",
                )
            else:
                seat_id = seat.role
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        if context is not None and len(prompt_ids) + max_tokens > context:
            raise _Error(
                422,
                f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the model's context of {context}",
                "context_length_exceeded",
            )
        request_id = "chatcmpl-" + uuid.uuid4().hex
        seed = chat.seed if chat.seed is not None else derive(options.seed, request_id) % 2**62
        params = SamplingParams(chat.temperature, chat.top_p, max_tokens, stop)
        turn = ServedTurn(
            conversation_id=conversation_id or request_id,
            t=sum(m.role == "assistant" for m in messages),
            kernel_id=kernel_id or conversation_id or request_id,
            seat_id=seat_id,
            policy_id=policy.policy_id,
            model=policy.name,
            request_id=request_id,
            messages=messages,
            response="",
            prompt_ids=prompt_ids,
            response_ids=[],
            logp_sample=[],
            finish_reason="",
            temperature=chat.temperature,
            top_p=chat.top_p,
            max_tokens=max_tokens,
            seed=seed,
            received=received,
            finished=0.0,
        )
        headers = {"X-Conversation-Id": turn.conversation_id}
        job = _Job(prompt_ids, params, seed, conversation_id, max_chars, turn)
        if not chat.stream:
            batcher.submit(job)
            try:
                done = await asyncio.wrap_future(job.future)
            except asyncio.CancelledError:
                job.cancelled.set()
                raise
            return JSONResponse(_completion(done, received), headers=headers)
        include_usage = bool((chat.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _stream(job, batcher, stop, received, include_usage), media_type="text/event-stream", headers=headers
        )

    return app


def _usage(turn: ServedTurn) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.response_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion(turn: ServedTurn, created: float) -> dict[str, Any]:
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
        "usage": _usage(turn),
    }


def _chunk(turn: ServedTurn, created: float, delta: dict[str, Any], finish: str | None) -> str:
    body = {
        "id": turn.request_id,
        "object": "chat.completion.chunk",
        "created": int(created),
        "model": turn.model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    return f"data: {json.dumps(body)}\n\n"


async def _stream(
    job: _Job, batcher: Batcher, stop: tuple[str, ...], created: float, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of one completion: the role, the text as it grows, the finish, [DONE]."""
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[str] = asyncio.Queue()
    sent = 0
    hold = max((len(s) for s in stop), default=1) - 1  # never send the start of a stop string

    def on_text(text: str) -> None:
        nonlocal sent
        whole = text.rstrip("\ufffd")  # a partly decoded character is not sent yet
        visible = _cut_at_stop(whole, stop)[0]
        upto = len(visible) - hold if len(visible) == len(whole) else len(visible)
        if upto > sent:
            loop.call_soon_threadsafe(deltas.put_nowait, visible[sent:upto])
            sent = upto

    job.on_text = on_text
    batcher.submit(job)
    result = asyncio.wrap_future(job.future)
    try:
        yield _chunk(job.turn, created, {"role": "assistant", "content": ""}, None)
        while not (result.done() and deltas.empty()):
            getter = asyncio.ensure_future(deltas.get())
            await asyncio.wait({getter, result}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield _chunk(job.turn, created, {"content": getter.result()}, None)
            else:
                getter.cancel()
        try:
            turn = result.result()
        except _Error as error:
            failure = {"error": {"message": error.message, "type": error.kind, "code": error.code}}
            yield f"data: {json.dumps(failure)}\n\n"
            return
        rest = turn.response[sent:]  # what was sent is a prefix of the final text
        if rest:
            yield _chunk(turn, created, {"content": rest}, None)
        yield _chunk(turn, created, {}, turn.finish_reason)
        if include_usage:
            usage = {
                "id": turn.request_id,
                "object": "chat.completion.chunk",
                "created": int(created),
                "model": turn.model,
                "choices": [],
                "usage": _usage(turn),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not result.done():
            job.cancelled.set()


def _context_length(backend: Backend) -> int | None:
    loaded = getattr(backend, "loaded", None)
    config = getattr(getattr(loaded, "model", None), "config", None)
    return getattr(config, "max_position_embeddings", None)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket, so the URL (a free port for 0) is known before uvicorn serves it."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise RepertoryError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _uvicorn(app: FastAPI) -> Any:
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=10)
    return uvicorn.Server(config)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(
    policy: ServedPolicy,
    options: ServeOptions,
    served_log: ServedLog,
    seat: SeatPrompt | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run the server until interrupted (SIGINT or SIGTERM end it cleanly); ``on_ready`` gets its URL once the
    socket listens."""
    sock = _bind(options.host, options.port)
    if on_ready is not None:
        on_ready(_url(sock))
    _uvicorn(create_app(policy, options, served_log, seat)).run(sockets=[sock])


class ServerThread:
    """A server on a free port in a daemon thread, for tests, notebooks and benchmarks::

    with ServerThread(policy, ServeOptions(port=0), served_log) as url:
        ...  # url ends in /v1
    """

    def __init__(
        self, policy: ServedPolicy, options: ServeOptions, served_log: ServedLog, seat: SeatPrompt | None = None
    ):
        self.server = _uvicorn(create_app(policy, options, served_log, seat))
        self._socket = _bind(options.host, options.port)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="repertory-serve", daemon=True
        )
        self.url = _url(self._socket)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RepertoryError("the server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)

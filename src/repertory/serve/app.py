"""The HTTP application of ``repertory serve``: the served policy, the FastAPI routes and the server.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` (non-streaming and server-sent-event
streaming; the text streams as it grows, the backend reporting it every few tokens) and ``POST /v1/outcomes``.
Validation lives in :mod:`repertory.serve.protocol`, sampling and logging in :mod:`repertory.serve.batching`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from repertory.envs.roles import RoleAdapters
from repertory.generation import Backend, SamplingParams, make_backend
from repertory.models import EMBEDDED, load_model
from repertory.models.chat import chat_prompt_ids
from repertory.models.checkpoints import load_policy
from repertory.runs import RunDir, is_run_or_checkpoint, resolve_checkpoint
from repertory.serve.batching import Batcher, Job
from repertory.serve.protocol import (
    ChatInput,
    ChatRequest,
    OutcomeRequest,
    SeatPrompt,
    ServeError,
    ServeOptions,
    chat_input,
    chunk_event,
    completion_body,
    cut_at_stop,
    error_event,
    usage_event,
    validation_message,
)
from repertory.store.served import ServedLog, ServedTurn
from repertory.types import RepertoryError, derive

log = logging.getLogger(__name__)


@dataclass
class ServedPolicy:
    """The model a server samples: its engine, the name clients ask for and the policy id its log records."""

    backend: Backend
    name: str
    policy_id: str
    run_dir: Path | None = None  # the run it was trained in (its log goes to RUN/served by default)
    adapter: str | None = None  # of a run with one adapter per role or team: the one that answers


def load_served_policy(
    spec: str,
    backend: str | None = None,
    model: str = EMBEDDED,
    device: str | None = None,
    name: str | None = None,
    adapter: str | None = None,
) -> ServedPolicy:
    """The policy ``spec`` names, sampled by the ``backend`` engine: ``base`` (``model``, the embedded one unless
    given), a run or checkpoint directory (its trained policy, frozen, on its run's engine unless ``backend``
    says otherwise; of a run with one adapter per role or team, the ``adapter`` of a role or team), or
    ``model:PATH`` (a Hugging Face checkpoint directory)."""
    path = spec.removeprefix("model:")
    if adapter is not None and (spec == "base" or not is_run_or_checkpoint(path)):
        raise RepertoryError(f"serve: --adapter picks an adapter of a run; {spec} is not a run or checkpoint")
    if spec != "base" and is_run_or_checkpoint(path):
        checkpoint, config = resolve_checkpoint(path)
        run = RunDir.of_checkpoint(checkpoint)
        key, chosen = _served_adapter(spec, config.rollout.env, config.model.adapters, adapter)
        engine = make_backend(backend or config.rollout.backend, load_policy(checkpoint, config, device))
        step = int(checkpoint.name)
        suffix = f"/{key}" if key is not None else ""
        return ServedPolicy(
            engine, name or f"{run.name}@{step}{suffix}", f"snapshot@{step}{suffix}", run.root, adapter=chosen
        )
    if spec == "base":
        return ServedPolicy(make_backend(backend or "hf", load_model(model, device)), name or "base", "base")
    if spec.startswith("model:") and path:
        if not Path(path).is_dir():
            raise RepertoryError(f"{path}: no such checkpoint directory")
        engine = make_backend(backend or "hf", load_model(path, device))
        return ServedPolicy(engine, name or Path(path).name, f"model:{Path(path).name}")
    raise RepertoryError(f"serve: {spec!r} is not base, a run or checkpoint directory, or model:PATH")


def _served_adapter(spec: str, env: str, mode: str, asked: str | None) -> tuple[str | None, str | None]:
    """(role or team, adapter name) of the adapter a run with ``model.adapters: mode`` serves; (None, None) for
    a shared adapter."""
    roles = RoleAdapters.of(env, mode)
    if roles is None:
        if asked is not None:
            raise RepertoryError(f"serve: {spec} trained one shared adapter; --adapter picks one of a per-role run's")
        return None, None
    keys = {**roles.names, **{name: name for name in roles.adapters}}
    if asked not in keys:
        chosen = "no --adapter" if asked is None else f"--adapter {asked!r}"
        raise RepertoryError(
            f"serve: {spec} keeps one adapter per {roles.by} and a chat names no seat ({chosen}): serve one with "
            f"--adapter {roles.by.upper()} ({', '.join(roles.names)}), or export them (repertory export {spec} "
            "--out DIR) and serve model:DIR/<adapter>"
        )
    key = next(k for k, name in roles.names.items() if name == keys[asked])
    return key, keys[asked]


def _error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _handle_errors(app: FastAPI) -> None:
    """Every error, the framework's own included, as one line of JSON in OpenAI's shape."""

    @app.exception_handler(ServeError)
    async def _on_error(request: Request, error: ServeError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error_response(
            ServeError(500, f"internal error: {type(error).__name__}", "internal_error", "server_error")
        )

    @app.exception_handler(404)
    async def _on_missing(request: Request, error: Exception) -> JSONResponse:
        return _error_response(ServeError(404, f"no route {request.method} {request.url.path}", "not_found"))

    @app.exception_handler(405)
    async def _on_method(request: Request, error: Exception) -> JSONResponse:
        return _error_response(
            ServeError(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")
        )


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ServeError(
            401, "missing or wrong API key (send Authorization: Bearer KEY)", "invalid_api_key", "authentication_error"
        )


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refused (413) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    too_large = {"Connection": "close"}
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        message = f"request body of {int(declared)} bytes exceeds the limit of {max_bytes}"
        raise ServeError(413, message, "body_too_large", headers=too_large)
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise ServeError(
                413, f"request body exceeds the limit of {max_bytes} bytes", "body_too_large", headers=too_large
            )
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServeError(422, f"the body is not valid JSON: {exc}", "invalid_json") from None


def _new_turn(
    chat: ChatRequest, given: ChatInput, policy: ServedPolicy, prompt_ids: list[int], server_seed: int, received: float
) -> ServedTurn:
    """The log record of one completion, before sampling fills in the response; a request without a seed gets
    one derived from the server's seed and its id (the log records it, so its text replays)."""
    request_id = "chatcmpl-" + uuid.uuid4().hex
    seed = chat.seed if chat.seed is not None else derive(server_seed, request_id) % 2**62
    return ServedTurn(
        conversation_id=given.conversation_id or request_id,
        t=sum(m.role == "assistant" for m in given.messages),
        kernel_id=given.kernel_id or given.conversation_id or request_id,
        seat_id=given.seat_id,
        policy_id=policy.policy_id,
        model=policy.name,
        request_id=request_id,
        messages=given.messages,
        response="",
        prompt_ids=prompt_ids,
        response_ids=[],
        logp_sample=[],
        finish_reason="",
        temperature=chat.temperature,
        top_p=chat.top_p,
        max_tokens=given.max_tokens,
        seed=seed,
        received=received,
        finished=0.0,
    )


def create_app(
    policy: ServedPolicy, options: ServeOptions, served_log: ServedLog, seat: SeatPrompt | None = None
) -> FastAPI:
    """The FastAPI application serving ``policy``: one generation thread, routes that validate and queue."""
    batcher = Batcher(policy.backend, served_log, options.max_pending, policy.adapter)
    context = policy.backend.context_window
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
    _handle_errors(app)

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
        _authorize(request, options.api_key)
        card = {"id": policy.name, "object": "model", "created": started, "owned_by": "repertory"}
        card["policy_id"] = policy.policy_id
        if seat is not None:
            card.update(env=seat.env_name, role=seat.role)
        return {"object": "list", "data": [card]}

    @app.post("/v1/outcomes")
    async def outcomes(request: Request) -> dict[str, Any]:
        _authorize(request, options.api_key)
        try:
            posted = OutcomeRequest.model_validate(await _read_json(request, options.max_body_bytes))
        except ValidationError as exc:
            raise ServeError(422, validation_message(exc), "invalid_outcome") from None
        if posted.conversation_id not in served_log.conversations:
            raise ServeError(404, f"no logged conversation {posted.conversation_id!r}", "unknown_conversation")
        await asyncio.to_thread(served_log.append_outcome, posted.conversation_id, posted.outcome)
        return {"conversation_id": posted.conversation_id, "outcome": posted.outcome, "recorded": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _authorize(request, options.api_key)
        received = time.time()
        try:
            chat = ChatRequest.model_validate(await _read_json(request, options.max_body_bytes))
        except ValidationError as exc:
            raise ServeError(422, validation_message(exc), "invalid_request") from None
        given = chat_input(chat, dict(request.headers), policy.name, options, seat)
        prompt_ids = chat_prompt_ids(policy.backend.tokenizer, given.messages)
        if context is not None and len(prompt_ids) + given.max_tokens > context:
            message = f"{len(prompt_ids)} prompt tokens + max_tokens {given.max_tokens} exceed the model's context"
            raise ServeError(422, f"{message} of {context}", "context_length_exceeded")
        turn = _new_turn(chat, given, policy, prompt_ids, options.seed, received)
        params = SamplingParams(chat.temperature, chat.top_p, given.max_tokens, given.stop)
        job = Job(prompt_ids, params, turn.seed, given.conversation_id, given.max_chars, turn)
        headers = {"X-Conversation-Id": turn.conversation_id}
        if chat.stream:
            include_usage = bool((chat.stream_options or {}).get("include_usage"))
            events = _stream(job, batcher, given.stop, received, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        batcher.submit(job)
        try:
            done = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        return JSONResponse(completion_body(done, received), headers=headers)

    return app


async def _stream(
    job: Job, batcher: Batcher, stop: tuple[str, ...], created: float, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of one completion: the role, the text as it grows, the finish, [DONE]."""
    loop = asyncio.get_running_loop()
    deltas: asyncio.Queue[str] = asyncio.Queue()
    sent = 0
    hold = max((len(s) for s in stop), default=1) - 1  # never send the start of a stop string

    def on_text(text: str) -> None:
        nonlocal sent
        whole = text.rstrip("\ufffd")  # a partly decoded character is not sent yet
        visible = cut_at_stop(whole, stop)[0]
        upto = len(visible) - hold if len(visible) == len(whole) else len(visible)
        if upto > sent:
            loop.call_soon_threadsafe(deltas.put_nowait, visible[sent:upto])
            sent = upto

    job.on_text = on_text
    batcher.submit(job)
    result = asyncio.wrap_future(job.future)
    try:
        yield chunk_event(job.turn, created, {"role": "assistant", "content": ""}, None)
        while not (result.done() and deltas.empty()):
            getter = asyncio.ensure_future(deltas.get())
            await asyncio.wait({getter, result}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield chunk_event(job.turn, created, {"content": getter.result()}, None)
            else:
                getter.cancel()
        try:
            turn = result.result()
        except ServeError as error:
            yield error_event(error)
            return
        rest = turn.response[sent:]  # what was sent is a prefix of the final text
        if rest:
            yield chunk_event(turn, created, {"content": rest}, None)
        yield chunk_event(turn, created, {}, turn.finish_reason)
        if include_usage:
            yield usage_event(turn, created)
        yield "data: [DONE]\n\n"
    finally:
        if not result.done():
            job.cancelled.set()


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
    sock: socket.socket | None = None,
) -> None:
    """Run the server until interrupted (SIGINT or SIGTERM end it cleanly) on ``sock`` (default: a socket bound to
    the options' address); ``on_ready`` gets its URL once the socket listens."""
    sock = sock or options.listen()
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
        self._socket = options.listen()
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

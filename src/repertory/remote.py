"""A client for OpenAI-compatible chat-completions servers, with a persistent response cache.

:class:`ChatClient` posts chats to ``{base_url}/chat/completions`` over ``httpx``, several at once,
retrying rate limits, server errors, timeouts, dropped connections and malformed replies with
exponential backoff; a request that still fails comes back as a :class:`Completion` whose ``text``
is None and whose ``error`` says why, so one bad chat never sinks a batch. :class:`ResponseCache`
keeps every successful reply in SQLite, keyed by the model, the messages and the sampling
parameters, so a rerun costs no network calls.

This is a low layer: it imports the standard library, ``httpx`` and :mod:`repertory.types` only.
The API key is read from the environment variable an :class:`Endpoint` names and is kept only in
the client; it never reaches an error, a log line, the cache or a ``repr``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from repertory.types import RepertoryError, canonical_json

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
MESSAGE_CHARS = 200
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx


def openai_spec(spec: str) -> tuple[str, str] | None:
    """(model, base URL) of a spec ``openai:MODEL@BASE_URL`` (judges and agents name endpoints so); None when
    ``spec`` is not of that form."""
    model, _, base_url = spec.removeprefix("openai:").partition("@")
    if not spec.startswith("openai:") or not model or not base_url:
        return None
    return model, base_url


class RemoteError(RepertoryError):
    """A remote endpoint is misconfigured (for example its API key variable is named but unset)."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to reach an OpenAI-compatible server.

    ``api_key_env`` is the *name* of the environment variable holding the key, never the key.
    ``max_retries`` counts retries after the first attempt; the backoff starts at ``backoff_s`` and
    doubles each retry up to 30 s, and a ``Retry-After`` header (seconds) replaces it. ``json_mode``
    asks for ``response_format: {"type": "json_object"}`` and drops it for the rest of the client's
    life if the server rejects it with a 400 that mentions ``response_format``.
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    concurrency: int = 8
    json_mode: bool = False


@dataclass
class Completion:
    """One chat's answer: ``text`` is None when the request failed, and ``error`` says why in one line."""

    text: str | None
    error: str = ""
    cached: bool = False
    attempts: int = 0


class ResponseCache:
    """SQLite table (key TEXT PRIMARY KEY, model TEXT, response TEXT, created REAL) at a path; safe for use
    from several threads; survives process restarts; WAL mode."""

    def __init__(self, path: str | os.PathLike):
        """Open (or create, with its parent directories) the cache database at ``path``."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # One connection shared by the client's worker threads, serialised by the lock; autocommit
        # so every put is durable at once.
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, model TEXT, response TEXT, created REAL)"
        )

    def __repr__(self) -> str:
        return f"ResponseCache({str(self.path)!r})"

    @staticmethod
    def key(model: str, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
        """The sha256 hex digest of the canonical JSON of ``{"model", "messages", "params"}``."""
        payload = canonical_json({"model": model, "messages": messages, "params": params})
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RemoteError(f"the response cache at {self.path} is closed")
        return self._conn

    def get(self, key: str) -> str | None:
        """The stored response for ``key``, or None."""
        with self._lock:
            row = self._connection().execute("SELECT response FROM responses WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, model: str, response: str) -> None:
        """Store (or replace) the response for ``key``, committed at once."""
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO responses (key, model, response, created) VALUES (?, ?, ?, ?)",
                (key, model, response, time.time()),
            )

    def __len__(self) -> int:
        with self._lock:
            return self._connection().execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        """Close the database; closing twice is harmless."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


@dataclass
class _Outcome:
    """One HTTP attempt: the text, or an error and whether retrying may help."""

    text: str | None = None
    error: str = ""
    retry: bool = False
    retry_after: float | None = None
    status: int = 0
    body: str = ""


def _one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _retry_after(response: httpx.Response) -> float | None:
    """The ``Retry-After`` header in seconds (HTTP dates are ignored), capped at 30 s."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_BACKOFF_S)


def _delay(backoff_s: float, retry: int, retry_after: float | None) -> float:
    """Seconds to wait before retry number ``retry`` (1-based)."""
    if retry_after is not None:
        return min(retry_after, MAX_BACKOFF_S)
    return min(backoff_s * 2 ** (retry - 1), MAX_BACKOFF_S)


def _server_message(response: httpx.Response) -> str:
    """The server's own short error message: ``error.message``, ``error``, ``detail`` or the raw body."""
    text = response.text
    try:
        data = response.json()
    except ValueError:
        return _one_line(text)
    if isinstance(data, dict):
        for candidate in (data.get("error"), data.get("detail"), data.get("message")):
            if isinstance(candidate, dict) and candidate.get("message"):
                return _one_line(candidate["message"])
            if isinstance(candidate, str) and candidate:
                return _one_line(candidate)
            if candidate:
                return _one_line(canonical_json(candidate))
    return _one_line(text)


def _content(response: httpx.Response) -> str | None:
    """``choices[0].message.content`` when it is a string, else None."""
    try:
        data = response.json()
        content = data["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


class ChatClient:
    """Sends batches of chats to one :class:`Endpoint`, concurrently, with retries and an optional cache."""

    def __init__(self, endpoint: Endpoint, cache: ResponseCache | None = None):
        """Read the API key from ``os.environ[endpoint.api_key_env]`` when a variable is named.

        Raises :class:`RemoteError` (naming the variable, never its value) when it is unset or empty,
        or when the endpoint's URL or counts are unusable.
        """
        if not endpoint.base_url.startswith(("http://", "https://")):
            raise RemoteError(f"endpoint base_url must start with http:// or https://, got {endpoint.base_url!r}")
        if endpoint.concurrency < 1 or endpoint.max_retries < 0 or endpoint.timeout_s <= 0:
            raise RemoteError("endpoint needs concurrency >= 1, max_retries >= 0 and timeout_s > 0")
        self._key: str | None = None
        if endpoint.api_key_env:
            self._key = os.environ.get(endpoint.api_key_env) or None
            if self._key is None:
                raise RemoteError(
                    f"the API key variable {endpoint.api_key_env} is not set; export it, or leave api_key_env "
                    "empty for a server that needs no key"
                )
        self.endpoint = endpoint
        self.cache = cache
        self._url = endpoint.base_url.rstrip("/") + "/chat/completions"
        self._json_mode = endpoint.json_mode
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "cache_hits": 0, "failures": 0}
        self._http = httpx.Client(
            timeout=httpx.Timeout(endpoint.timeout_s),
            limits=httpx.Limits(max_connections=endpoint.concurrency, max_keepalive_connections=endpoint.concurrency),
        )

    def __repr__(self) -> str:
        return f"ChatClient(base_url={self.endpoint.base_url!r}, model={self.endpoint.model!r})"

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, int]:
        """Counters so far: ``requests`` (HTTP attempts), ``retries``, ``cache_hits``, ``failures``."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Close the HTTP connections (the cache belongs to the caller and stays open)."""
        self._http.close()

    def complete(
        self,
        chats: list[list[dict[str, str]]],
        *,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        seed: int | None = None,
        stop: list[str] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """One :class:`Completion` per chat, in order; never raises for a failed request. ``seeds`` gives each
        chat its own seed instead of ``seed``.

        Chats whose (model, messages, parameters) are in the cache are answered without a network
        call; the rest go out at most ``endpoint.concurrency`` at a time, and each success is cached
        under the parameters actually sent. Identical chats within one call are each sent (so sampled
        replies stay independent); the cache then holds the last.
        """
        if seeds is not None and len(seeds) != len(chats):
            raise ValueError("one seed per chat is required")
        samplings = [
            {
                "temperature": float(temperature),
                "max_tokens": int(max_tokens),
                "seed": None if chosen is None else int(chosen),
                "stop": list(stop) if stop else None,
            }
            for chosen in (seeds if seeds is not None else [seed] * len(chats))
        ]
        results: list[Completion | None] = [None] * len(chats)
        pending: list[int] = []
        json_mode = self._json_mode
        for index, messages in enumerate(chats):
            hit = None
            if self.cache is not None:
                hit = self.cache.get(self._cache_key(messages, samplings[index], json_mode))
            if hit is None:
                pending.append(index)
            else:
                results[index] = Completion(text=hit, cached=True, attempts=0)
                self._count("cache_hits")
        if len(pending) == 1:
            results[pending[0]] = self._send(chats[pending[0]], samplings[pending[0]])
        elif pending:
            with ThreadPoolExecutor(max_workers=min(self.endpoint.concurrency, len(pending))) as pool:
                sent = pool.map(lambda i: self._send(chats[i], samplings[i]), pending)
                for index, completion in zip(pending, sent):
                    results[index] = completion
        return [completion for completion in results if completion is not None]

    def _cache_key(self, messages: list[dict[str, str]], sampling: dict[str, Any], json_mode: bool) -> str:
        return ResponseCache.key(self.endpoint.model, messages, {**sampling, "response_format": json_mode})

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "[redacted]") if self._key else text

    def _body(self, messages: list[dict[str, str]], sampling: dict[str, Any], json_mode: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": messages,
            "temperature": sampling["temperature"],
            "max_tokens": sampling["max_tokens"],
        }
        if sampling["seed"] is not None:
            body["seed"] = sampling["seed"]
        if sampling["stop"]:
            body["stop"] = sampling["stop"]
        if json_mode:
            body["response_format"] = {"type": "json_object"}
        return body

    def _attempt(self, body: dict[str, Any]) -> _Outcome:
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            response = self._http.post(self._url, json=body, headers=headers)
        except httpx.TimeoutException:
            return _Outcome(error=f"timeout after {self.endpoint.timeout_s:g} s", retry=True)
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            return _Outcome(error=f"connection error: {type(exc).__name__}: {_one_line(exc)}", retry=True)
        except httpx.HTTPError as exc:
            return _Outcome(error=f"request error: {type(exc).__name__}: {_one_line(exc)}")
        status = response.status_code
        if 200 <= status < 300:
            text = _content(response)
            if text is None:
                snippet = _one_line(response.text, 80)
                return _Outcome(
                    error=f"malformed response: no choices[0].message.content string in {snippet!r}", retry=True
                )
            return _Outcome(text=text)
        message = _server_message(response)
        return _Outcome(
            error=f"HTTP {status}: {message}" if message else f"HTTP {status}",
            retry=status in RETRYABLE_STATUS or status >= 500,
            retry_after=_retry_after(response),
            status=status,
            body=response.text,
        )

    def _send(self, messages: list[dict[str, str]], sampling: dict[str, Any]) -> Completion:
        """One chat, through retries and the response_format fallback; caches a success."""
        json_mode = self._json_mode
        fell_back = False
        attempts = retries = 0
        while True:
            attempts += 1
            self._count("requests")
            outcome = self._attempt(self._body(messages, sampling, json_mode))
            if outcome.text is not None:
                if self.cache is not None:
                    key = self._cache_key(messages, sampling, json_mode)
                    self.cache.put(key, self.endpoint.model, outcome.text)
                return Completion(text=outcome.text, attempts=attempts)
            if json_mode and not fell_back and outcome.status == 400 and "response_format" in outcome.body:
                # The server does not support JSON mode: resend once without it, and stop asking.
                fell_back, json_mode = True, False
                with self._lock:
                    self._json_mode = False
                continue
            if not outcome.retry or retries >= self.endpoint.max_retries:
                break
            retries += 1
            self._count("retries")
            wait = _delay(self.endpoint.backoff_s, retries, outcome.retry_after)
            log.debug("retrying %s in %.2f s after %s", self._url, wait, self._redact(outcome.error))
            time.sleep(wait)
        self._count("failures")
        plural = "attempt" if attempts == 1 else "attempts"
        return Completion(
            text=None, error=self._redact(f"{outcome.error} (after {attempts} {plural})"), attempts=attempts
        )

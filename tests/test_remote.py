"""The remote chat client against a real HTTP server on 127.0.0.1: the request it sends, retries on
429 / 5xx / timeouts / malformed bodies, immediate failure on other 4xx, the JSON-mode fallback, bounded
concurrency, the SQLite response cache (across a process restart) and that the API key never leaks."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest
from fake_openai import FakeOpenAI

from repertory.remote import (
    ChatClient,
    Completion,
    Endpoint,
    RemoteError,
    ResponseCache,
    _delay,
)
from repertory.types import RepertoryError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def fast(url: str, **overrides) -> Endpoint:
    """An endpoint with test-sized timeouts and backoff."""
    return Endpoint(**{"base_url": url, "model": "m", "timeout_s": 0.3, "backoff_s": 0.01, **overrides})


def then_ok(first, content: str = "fine"):
    """A handler whose first request gets ``first`` and every later one ``content``."""
    return lambda body, n: first if n == 0 else content


def test_valid_reply_and_request_body():
    with FakeOpenAI(lambda body, n: '{"answer": 1}') as server:
        client = ChatClient(fast(server.url + "/", json_mode=True))  # a trailing slash is tolerated
        [result] = client.complete([CHAT], max_tokens=64)
        assert result == Completion(text='{"answer": 1}', error="", cached=False, attempts=1)
        [request] = server.requests
        assert request["path"] == "/v1/chat/completions"
        assert request["body"] == {
            "model": "m",
            "messages": CHAT,
            "temperature": 0.0,
            "max_tokens": 64,
            "response_format": {"type": "json_object"},
        }
        assert "authorization" not in request["headers"]
        assert client.stats == {"requests": 1, "retries": 0, "cache_hits": 0, "failures": 0}
        client.complete([CHAT], temperature=0.7, seed=5, stop=["\n"])
        body = server.requests[1]["body"]
        assert (body["temperature"], body["max_tokens"], body["seed"], body["stop"]) == (0.7, 1024, 5, ["\n"])
        client.close()


def test_results_come_back_in_order():
    with FakeOpenAI() as server:
        client = ChatClient(fast(server.url, concurrency=3))
        chats = [[{"role": "user", "content": f"q{i}"}] for i in range(7)]
        assert [c.text for c in client.complete(chats)] == [f"q{i}" for i in range(7)]
        assert client.complete([]) == []


@pytest.mark.parametrize(
    "first",
    [
        ("status", 500, "boom"),
        ("status", 502, "bad gateway"),
        ("status", 429, '{"error": {"message": "slow down"}}', {"Retry-After": "0"}),
        ("sleep", 1.0, "too late"),
        ("raw", "this is not json"),
        ("raw", '{"choices": []}'),
        ("raw", '{"choices": [{"message": {"role": "assistant", "content": null}}]}'),
    ],
    ids=["500", "502", "429", "timeout", "not-json", "no-choices", "null-content"],
)
def test_a_transient_failure_is_retried_once(first):
    with FakeOpenAI(then_ok(first)) as server:
        client = ChatClient(fast(server.url))
        [result] = client.complete([CHAT])
        assert (result.text, result.error, result.attempts) == ("fine", "", 2)
        assert len(server.requests) == 2
        assert client.stats == {"requests": 2, "retries": 1, "cache_hits": 0, "failures": 0}


def test_retry_after_overrides_the_backoff():
    first = ("status", 429, "busy", {"Retry-After": "0"})
    with FakeOpenAI(then_ok(first)) as server:
        client = ChatClient(fast(server.url, backoff_s=5.0))
        start = time.monotonic()
        assert client.complete([CHAT])[0].text == "fine"
        assert time.monotonic() - start < 1.0


def test_backoff_doubles_and_is_capped():
    assert [_delay(0.5, retry, None) for retry in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert _delay(0.5, 20, None) == 30.0
    assert _delay(0.5, 1, 2.5) == 2.5
    assert _delay(0.5, 1, 0.0) == 0.0
    with FakeOpenAI(lambda body, n: ("status", 503, "down")) as server:
        client = ChatClient(fast(server.url, backoff_s=0.1, max_retries=2))
        start = time.monotonic()
        client.complete([CHAT])
        assert time.monotonic() - start >= 0.1 + 0.2


def test_all_attempts_failing():
    with FakeOpenAI(lambda body, n: ("status", 503, "overloaded")) as server:
        client = ChatClient(fast(server.url, max_retries=2))
        [result] = client.complete([CHAT])
        assert result.text is None
        assert result.attempts == 3 and len(server.requests) == 3
        assert result.error == "HTTP 503: overloaded (after 3 attempts)"
        assert client.stats == {"requests": 3, "retries": 2, "cache_hits": 0, "failures": 1}


def test_timeouts_until_the_end():
    with FakeOpenAI(lambda body, n: ("sleep", 1.0, "late")) as server:
        [result] = ChatClient(fast(server.url, max_retries=1)).complete([CHAT])
        assert (result.text, result.attempts, result.error) == (None, 2, "timeout after 0.3 s (after 2 attempts)")


def test_connection_refused_is_retried_then_reported():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = ChatClient(fast(f"http://127.0.0.1:{port}/v1", max_retries=2))
    [result] = client.complete([CHAT])
    assert result.text is None and result.attempts == 3
    assert result.error.startswith("connection error: ConnectError")
    assert "\n" not in result.error


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_fail_at_once(status):
    reply = ("status", status, json.dumps({"error": {"message": "no such thing", "type": "invalid_request"}}))
    with FakeOpenAI(lambda body, n: reply) as server:
        client = ChatClient(fast(server.url, max_retries=3))
        [result] = client.complete([CHAT])
        assert (result.text, result.attempts, len(server.requests)) == (None, 1, 1)
        assert result.error == f"HTTP {status}: no such thing (after 1 attempt)"
        assert client.stats["failures"] == 1 and client.stats["retries"] == 0


def test_the_server_message_is_truncated_to_one_short_line():
    long = "bad input\n" + "x" * 1000
    with FakeOpenAI(lambda body, n: ("status", 422, json.dumps({"detail": long}))) as server:
        [result] = ChatClient(fast(server.url)).complete([CHAT])
        message = result.error.removeprefix("HTTP 422: ").removesuffix(" (after 1 attempt)")
        assert len(message) == 200 and message.startswith("bad input xxx") and message.endswith("...")


def test_json_mode_falls_back_when_response_format_is_rejected():
    rejected = ("status", 400, json.dumps({"error": {"message": "response_format is not supported"}}))

    def handler(body, n):
        return rejected if "response_format" in body else "plain"

    with FakeOpenAI(handler) as server:
        client = ChatClient(fast(server.url, json_mode=True))
        [result] = client.complete([CHAT])
        assert (result.text, result.attempts) == ("plain", 2)
        assert ["response_format" in r["body"] for r in server.requests] == [True, False]
        # The client remembers: the next call goes out without response_format at once.
        assert client.complete([[{"role": "user", "content": "again"}]])[0].attempts == 1
        assert "response_format" not in server.requests[2]["body"]


def test_a_400_that_does_not_mention_response_format_is_not_resent():
    with FakeOpenAI(lambda body, n: ("status", 400, "context too long")) as server:
        [result] = ChatClient(fast(server.url, json_mode=True)).complete([CHAT])
        assert (result.text, result.attempts, len(server.requests)) == (None, 1, 1)


def test_concurrency_is_bounded():
    with FakeOpenAI(lambda body, n: ("sleep", 0.2, body["messages"][-1]["content"])) as server:
        client = ChatClient(fast(server.url, concurrency=4, timeout_s=5.0))
        chats = [[{"role": "user", "content": f"c{i}"}] for i in range(8)]
        start = time.monotonic()
        results = client.complete(chats)
        elapsed = time.monotonic() - start
        assert [r.text for r in results] == [f"c{i}" for i in range(8)]
        assert 0.4 <= elapsed < 0.8 * 8 * 0.2  # two waves of four, not eight in a row
        assert server.max_in_flight == 4


def test_cache_serves_repeats_without_network(tmp_path):
    cache = ResponseCache(tmp_path / "sub" / "cache.sqlite")
    with FakeOpenAI() as server:
        client = ChatClient(fast(server.url), cache=cache)
        assert client.complete([CHAT])[0] == Completion(text="hi", cached=False, attempts=1)
        assert client.complete([CHAT])[0] == Completion(text="hi", cached=True, attempts=0)
        assert len(server.requests) == 1 and len(cache) == 1
        assert client.stats == {"requests": 1, "retries": 0, "cache_hits": 1, "failures": 0}
        client.complete([CHAT], temperature=0.5)  # other parameters: a miss
        client.complete([CHAT[:1] + [{"role": "user", "content": "hello"}]])  # other messages: a miss
        assert len(server.requests) == 3 and len(cache) == 3
        mixed = client.complete([[{"role": "user", "content": "new"}], CHAT])
        assert [(c.text, c.cached) for c in mixed] == [("new", False), ("hi", True)]
        assert len(server.requests) == 4
    params = {"temperature": 0.0, "max_tokens": 1024, "seed": None, "stop": None, "response_format": False}
    assert cache.get(ResponseCache.key("m", CHAT, params)) == "hi"
    assert cache.get(ResponseCache.key("other-model", CHAT, params)) is None
    with sqlite3.connect(tmp_path / "sub" / "cache.sqlite") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT model FROM responses").fetchall() == [("m",)] * 4
    cache.close()


def test_failures_are_not_cached(tmp_path):
    cache = ResponseCache(tmp_path / "cache.sqlite")
    with FakeOpenAI(then_ok(("status", 401, "nope"))) as server:
        client = ChatClient(fast(server.url), cache=cache)
        assert client.complete([CHAT])[0].text is None
        assert len(cache) == 0
        assert client.complete([CHAT])[0] == Completion(text="fine", attempts=1)
        assert len(cache) == 1


def test_cache_key_is_canonical():
    params = {"temperature": 0.0, "max_tokens": 8}
    key = ResponseCache.key("m", CHAT, params)
    assert len(key) == 64 and key == ResponseCache.key("m", CHAT, dict(reversed(params.items())))
    assert key != ResponseCache.key("m", CHAT, {**params, "temperature": 1.0})


RESTARTED = """
import json, sys
from repertory.remote import ChatClient, Endpoint, ResponseCache
cache = ResponseCache(sys.argv[1])
client = ChatClient(Endpoint(sys.argv[2], "m", timeout_s=0.3, max_retries=0), cache=cache)
[result] = client.complete([[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]])
print(json.dumps([len(cache), result.text, result.cached, result.attempts]))
"""


def test_cache_survives_a_process_restart(tmp_path):
    path = tmp_path / "cache.sqlite"
    with FakeOpenAI(lambda body, n: "remembered") as server:
        cache = ResponseCache(path)
        ChatClient(fast(server.url), cache=cache).complete([CHAT])
        cache.close()
        run = subprocess.run(
            [sys.executable, "-c", RESTARTED, str(path), server.url], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == [1, "remembered", True, 0]
        assert len(server.requests) == 1


def test_api_key_is_sent_and_never_leaks(tmp_path, monkeypatch, caplog):
    key = f"sk-test-{uuid.uuid4()}"
    monkeypatch.setenv("REPERTORY_TEST_KEY", key)

    def handler(body, n):
        if body["messages"][-1]["content"] == "fail":
            return ("status", 401, json.dumps({"error": {"message": f"bad key {key}"}}))
        if body["messages"][-1]["content"] == "retry":
            return ("status", 500, f"upstream rejected {key}")
        return "ok"

    caplog.set_level(logging.DEBUG)
    cache = ResponseCache(tmp_path / "cache.sqlite")
    with FakeOpenAI(handler) as server:
        client = ChatClient(fast(server.url, api_key_env="REPERTORY_TEST_KEY", max_retries=1), cache=cache)
        ok, bad, retried = client.complete(
            [CHAT, [{"role": "user", "content": "fail"}], [{"role": "user", "content": "retry"}]]
        )
        assert ok.text == "ok"
        assert {r["headers"]["authorization"] for r in server.requests} == {f"Bearer {key}"}
        assert bad.text is None and bad.error == "HTTP 401: bad key [redacted] (after 1 attempt)"
        assert retried.text is None and retried.error == "HTTP 500: upstream rejected [redacted] (after 2 attempts)"
        assert repr(client) == f"ChatClient(base_url={server.url!r}, model='m')"
        assert "retrying" in caplog.text and "[redacted]" in caplog.text
        for text in (repr(client), repr(client.endpoint), repr(cache), repr(ok), repr(bad), repr(retried), caplog.text):
            assert key not in text
        files = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert {p.name for p in files} >= {"cache.sqlite", "cache.sqlite-wal", "cache.sqlite-shm"}
        for path in files:
            assert key.encode() not in path.read_bytes(), path
        cache.close()
        client.close()
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or key.encode() not in path.read_bytes(), path


def test_a_named_but_unset_key_variable_is_an_error(monkeypatch):
    monkeypatch.delenv("REPERTORY_MISSING_KEY", raising=False)
    with pytest.raises(RemoteError, match="REPERTORY_MISSING_KEY") as info:
        ChatClient(Endpoint("http://127.0.0.1:9/v1", "m", api_key_env="REPERTORY_MISSING_KEY"))
    assert isinstance(info.value, RepertoryError)
    monkeypatch.setenv("REPERTORY_MISSING_KEY", "")
    with pytest.raises(RemoteError, match="REPERTORY_MISSING_KEY"):
        ChatClient(Endpoint("http://127.0.0.1:9/v1", "m", api_key_env="REPERTORY_MISSING_KEY"))
    with pytest.raises(RemoteError, match="base_url"):
        ChatClient(Endpoint("127.0.0.1:9/v1", "m"))


LIGHT = """
import sys
import repertory.remote
print(sorted(m for m in sys.modules if m.startswith("repertory") or m.split(".")[0] in ("torch", "transformers")))
"""


def test_remote_is_a_light_layer():
    run = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "['repertory', 'repertory.remote', 'repertory.types']"

"""A real OpenAI-compatible HTTP server for tests, on 127.0.0.1 and a free port, in a daemon thread.

``handler(body, n)`` (``n`` counts requests from 0) returns what the server does with a request:

- a string: reply 200 with a valid chat completion whose content is that string;
- ``("status", code, body_text[, headers])``: reply with that status, body and headers;
- ``("sleep", seconds, then_content)``: wait, then reply with ``then_content`` (for client timeouts);
- ``("raw", text)``: reply 200 with ``text`` as the body (malformed on purpose).

The default handler echoes the last message's content. Use it as a context manager::

    with FakeOpenAI() as server:
        server.handler = lambda body, n: "hello"
        client = ChatClient(Endpoint(server.url, "m"))
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def echo(body: dict[str, Any], n: int) -> str:
    """The default behaviour: answer with the last message's content."""
    return body["messages"][-1]["content"]


class FakeOpenAI:
    """The server: ``.url`` ends in ``/v1``; ``.requests`` holds ``{"path", "body", "headers"}`` per request
    (header names lower-cased);
    ``.max_in_flight`` is the most requests it was handling at once."""

    def __init__(self, handler=echo):
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._request_handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        # A short poll interval so leaving the context (shutdown) takes milliseconds, not half a second.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _request_handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw or b"{}")
                with fake._lock:
                    n = len(fake.requests)
                    fake.requests.append(
                        {"path": self.path, "body": body, "headers": {k.lower(): v for k, v in self.headers.items()}}
                    )
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    code, text, headers = self._behave(fake.handler(body, n))
                finally:
                    # Counted out before the reply is written, so a client that answers the reply with
                    # its next request can never see a stale count.
                    with fake._lock:
                        fake.in_flight -= 1
                try:
                    self._reply(code, text, headers)
                except OSError:  # the client gave up (timed out) and closed the socket
                    pass

            def _behave(self, behaviour: Any) -> tuple[int, str, dict[str, str]]:
                if isinstance(behaviour, str):
                    return 200, json.dumps(completion(behaviour)), {}
                kind, *args = behaviour
                if kind == "status":
                    return args[0], args[1], args[2] if len(args) > 2 else {}
                if kind == "sleep":
                    time.sleep(args[0])
                    return 200, json.dumps(completion(args[1])), {}
                if kind == "raw":
                    return 200, args[0], {}
                raise ValueError(f"unknown behaviour {behaviour!r}")

            def _reply(self, code: int, text: str, headers: dict[str, str]) -> None:
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        return Handler


def completion(content: str) -> dict[str, Any]:
    """A minimal valid chat-completion body with ``content`` as the assistant's message."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }

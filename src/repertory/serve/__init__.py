"""``repertory serve``: a policy behind an OpenAI-compatible HTTP API that logs every conversation it has.

The deployment half of batch-online training (docs/algorithms.md 5): put pi_k in front of users, log what it
said, post each conversation's outcome, then train pi_{k+1} on the log with a round method and
``method.logs=LOGDIR``. Three modules, in the order a request meets them:

- :mod:`repertory.serve.protocol` — options, request validation, errors and response bodies: pure, no model;
- :mod:`repertory.serve.batching` — the generation thread: one batched call per tick, the tick logged as one
  Parquet part before anyone is answered, so a killed server loses at most the requests in flight;
- :mod:`repertory.serve.app` — the served policy, the FastAPI routes and the server.

Security: the server binds 127.0.0.1 unless told otherwise; any other address needs an API key (refused before
the model loads), and with a key every ``/v1`` request must carry ``Authorization: Bearer KEY`` (401 otherwise).
Bodies, message counts and ``max_tokens`` are bounded; every error is one line of JSON in OpenAI's shape
``{"error": {"message", "type", "code"}}``. The key is never logged.

This package imports neither torch nor FastAPI; ``repertory.serve.app`` does.
"""

from repertory.serve.protocol import API_KEY_ENV, LOOPBACK, SeatPrompt, ServeError, ServeOptions

__all__ = ["API_KEY_ENV", "LOOPBACK", "SeatPrompt", "ServeError", "ServeOptions"]

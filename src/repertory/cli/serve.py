"""``repertory serve``: a policy behind an OpenAI-compatible endpoint that logs every conversation."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from repertory.cli.common import out
from repertory.types import RepertoryError


def serve(
    policy: str = typer.Argument(
        ..., help="What to serve: a run or checkpoint directory, base (the untrained model) or model:PATH."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; any but loopback needs an API key."),
    port: int = typer.Option(8000, "--port", help="Port to bind (0: any free port, printed at start)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="The key every /v1 request must carry (visible to other users of this machine in "
        "its process list: prefer the variable).",
    ),
    api_key_env: str = typer.Option(
        "REPERTORY_API_KEY", "--api-key-env", help="Variable holding the key every /v1 request must carry."
    ),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where conversations are logged (default: RUN/served, or ./served for base)."
    ),
    name: str | None = typer.Option(None, "--name", help="The model id clients ask for (default: RUN@STEP or base)."),
    backend: str | None = typer.Option(None, "--backend", help="Generation engine: hf or vllm (default: the run's)."),
    model: str = typer.Option("smollm2", "--model", help="base: the model (embedded SmolLM2, or a checkpoint dir)."),
    env: str | None = typer.Option(None, "--env", help="Play a seat of this game: apply its system prompt."),
    role: str | None = typer.Option(None, "--role", help="--env: the seat (a role name or label) the model plays."),
    adapter: str | None = typer.Option(
        None, "--adapter", help="A per-role (per-team) run: the role (team) whose adapter answers, e.g. vendor."
    ),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="The largest max_tokens a request may ask for."),
    max_messages: int = typer.Option(256, "--max-messages", help="The most messages one request may hold."),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", help="The largest request body, in MiB."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    seed: int = typer.Option(0, "--seed", help="Seeds requests that give none (each logged seed replays its text)."),
) -> None:
    """Serve a policy with an OpenAI-compatible API (/v1/chat/completions, /v1/models, /v1/outcomes, /health),
    logging every completion for a round method (--set method.logs=LOGDIR). docs/guide.md: Serving a policy."""
    from repertory.serve import API_KEY_ENV, SeatPrompt, ServeOptions

    if (env is None) != (role is None):
        raise RepertoryError("--env and --role go together: the game and the seat the model plays")
    key = api_key or os.environ.get(api_key_env) or None
    if api_key is None and api_key_env != API_KEY_ENV and key is None:
        raise RepertoryError(f"--api-key-env {api_key_env}: the variable is not set")
    options = ServeOptions(
        host=host,
        port=port,
        api_key=key,
        max_body_bytes=int(max_body_mb * 1024 * 1024),
        max_messages=max_messages,
        max_tokens=max_tokens,
        default_max_tokens=min(256, max_tokens),
        seed=seed,
    )
    seat = SeatPrompt(env, role) if env is not None and role is not None else None
    from repertory.runs import RunDir  # the model loads only after every argument was checked
    from repertory.serve.app import load_served_policy
    from repertory.serve.app import serve as run_server
    from repertory.store.served import ServedLog

    sock = options.listen()  # a busy port fails now, not after minutes of loading
    served = load_served_policy(policy, backend, model, device, name, adapter)
    directory = log_dir or (RunDir(served.run_dir).served if served.run_dir is not None else Path("served"))
    served_log = ServedLog(directory, served.name, served.policy_id, len(served.backend.tokenizer))

    def ready(url: str) -> None:
        out.print(f"serving {served.name} ({served.policy_id}) at {url}" + (" (API key required)" if key else ""))
        out.print(f"logging to {directory} ({len(served_log.conversations)} conversations so far)")

    run_server(served, options, served_log, seat, on_ready=ready, sock=sock)

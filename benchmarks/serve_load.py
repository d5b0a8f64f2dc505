"""Load and fault benchmark of ``repertory serve`` on loopback: ``python benchmarks/serve_load.py [--clients 32]
[--requests 20] [--max-tokens 16] [--model DIR]``.

Serves a model (default: a tiny random one saved to a temporary directory) in a subprocess and prints one JSON
object:

- ``load``: ``clients`` threads x ``requests`` sequential completions each; throughput, p50/p99 latency,
  errors, and the log's records counted against the answers (lost, duplicated);
- ``baseline``: the same completions from one client, one at a time (what batching buys), and ``limit``: the
  backend sampling the same prompts in batches of ``clients`` in-process, without HTTP or logging;
- ``kill``: the server killed with SIGKILL during the same load; every part written before reads back, a
  restart appends, outcomes are posted for every conversation and the rounds trainer's reader reads them all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from repertory.envs import env_class
from repertory.generation import GenerationRequest, SamplingParams, make_backend
from repertory.models import load_model, load_tokenizer, save_checkpoint, tiny_model
from repertory.models.chat import chat_prompt_ids
from repertory.store.served import read_served
from repertory.train.turns import read_logs
from repertory.types import Message


def start(model: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "repertory", "serve", model, "--port", "0", "--log-dir", str(log_dir)]
    command += ["--name", "bench"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    line = process.stdout.readline()
    if not line.startswith("serving"):
        raise SystemExit(line + process.stderr.read())
    return process, line.split(" at ")[1].split()[0]


def prompt(k: int, n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Client {k}, request {n}: make me an offer for the lamp."}]


def load(
    url: str, clients: int, requests: int, max_tokens: int, stop: threading.Event | None = None, tag: str = "c"
) -> dict:
    latencies: list[float] = []
    answered: list[str] = []
    tokens: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as http:
            for n in range(requests):
                if stop is not None and stop.is_set():
                    return
                body = {"model": "bench", "messages": prompt(k, n), "max_tokens": max_tokens, "seed": k * 1000 + n}
                began = time.perf_counter()
                try:
                    response = http.post(
                        f"{url}/chat/completions", json=body, headers={"X-Conversation-Id": f"{tag}{k}-{n}"}
                    )
                except httpx.HTTPError as exc:
                    with lock:
                        errors.append(type(exc).__name__)
                    return
                with lock:
                    if response.status_code != 200:
                        errors.append(str(response.status_code))
                        continue
                    latencies.append(time.perf_counter() - began)
                    answered.append(response.json()["id"])
                    tokens.append(response.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    ordered = sorted(latencies) or [0.0]
    return {
        "completions": len(answered),
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(answered) / wall, 2),
        "tokens_per_s": round(sum(tokens) / wall, 1),
        "p50_s": round(statistics.median(ordered), 3),
        "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "ids": answered,
    }


def logged_ids(log_dir: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [
        row["request_id"]
        for part in sorted((log_dir / "turns").glob("part-*.parquet"))
        for row in pq.read_table(part, columns=["request_id"]).to_pylist()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="A Hugging Face checkpoint directory (default: tiny, random).")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    model_dir = (
        Path(args.model)
        if args.model
        else save_checkpoint(tiny_model(load_tokenizer(), seed=0).model, load_tokenizer(), root / "tiny")
    )
    result: dict = {"clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens}

    process, url = start(f"model:{model_dir}", root / "load")
    try:
        run = load(url, args.clients, args.requests, args.max_tokens)
        baseline = load(url, 1, args.clients * args.requests // 8, args.max_tokens, tag="one")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    ids = logged_ids(root / "load")
    result["load"] = {k: v for k, v in run.items() if k != "ids"}
    result["load"]["logged"] = len(ids)
    result["load"]["logged_with_baseline"] = result["load"].pop("logged")
    result["load"]["lost"] = len(set(run["ids"] + baseline["ids"]) - set(ids))
    result["load"]["duplicated"] = len(ids) - len(set(ids))
    result["load"]["parts"] = len(list((root / "load" / "turns").glob("part-*.parquet")))
    result["baseline_one_client"] = {k: v for k, v in baseline.items() if k != "ids"}

    loaded = load_model(str(model_dir))
    backend = make_backend("hf", loaded)
    prompts = [
        chat_prompt_ids(loaded.tokenizer, [Message("user", p[0]["content"])])
        for p in (prompt(k, 0) for k in range(args.clients))
    ]
    params = SamplingParams(1.0, 1.0, args.max_tokens)
    backend.generate([GenerationRequest(p, k) for k, p in enumerate(prompts)], params)
    began, generated = time.perf_counter(), 0
    for n in range(3):
        out = backend.generate([GenerationRequest(p, n * 100 + k) for k, p in enumerate(prompts)], params)
        generated += sum(len(g.response_ids) for g in out)
    elapsed = time.perf_counter() - began
    result["limit_in_process"] = {
        "requests_per_s": round(3 * len(prompts) / elapsed, 2),
        "tokens_per_s": round(generated / elapsed, 1),
    }
    result["ratios"] = {
        "served_vs_one_client": round(run["requests_per_s"] / baseline["requests_per_s"], 2),
        "served_vs_in_process_limit": round(run["requests_per_s"] / result["limit_in_process"]["requests_per_s"], 2),
    }

    kill_dir = root / "kill"
    process, url = start(f"model:{model_dir}", kill_dir)
    stop = threading.Event()
    holder: dict = {}
    loader = threading.Thread(
        target=lambda: holder.update(load(url, args.clients, args.requests, args.max_tokens, stop))
    )
    loader.start()
    time.sleep(max(1.0, run["wall_s"] / 3))
    process.send_signal(signal.SIGKILL)
    process.wait()
    stop.set()
    loader.join()
    before = logged_ids(kill_dir)
    parts_before = len(list((kill_dir / "turns").glob("part-*.parquet")))
    answered = set(holder["ids"])
    process, url = start(f"model:{model_dir}", kill_dir)
    try:
        after = load(url, 4, 5, args.max_tokens, tag="after")
        with httpx.Client(timeout=60) as http:
            for conversation in read_served(kill_dir).skipped_ids:
                http.post(f"{url}/outcomes", json={"conversation_id": conversation, "outcome": 1.0}).raise_for_status()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    served = read_served(kill_dir)
    turns, _, _ = read_logs(kill_dir, env_class("ipd"), loaded.tokenizer, 0.95)
    result["kill"] = {
        "answered_before_kill": len(answered),
        "logged_before_kill": len(before),
        "parts_before_kill": parts_before,
        "answered_but_not_logged": len(answered - set(before)),
        "logged_but_not_answered": len(set(before) - answered),
        "answered_after_restart": after["completions"],
        "parts_after_restart": len(list((kill_dir / "turns").glob("part-*.parquet"))),
        "completions_read": served.completions,
        "conversations": served.conversations,
        "trainer_turns_read": len(turns),
        "skipped_no_outcome": served.skipped_no_outcome,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

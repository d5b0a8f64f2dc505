"""``repertory serve`` with the official ``openai`` client on 127.0.0.1: completions, streaming, seeds, the log
(exactly what was exchanged), outcomes, limits and keys, batching, the rounds trainer on the log, a killed
server, and ``openai:`` agents in play."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pyarrow.parquet as pq
import pytest
from conftest import run_cli, tiny_checkpoint
from fake_openai import FakeOpenAI
from pydantic import ValidationError

from repertory.agents import LMOptions, Request
from repertory.agents.resolve import make_agent
from repertory.config import load_config
from repertory.envs import env_class, load_kernels, make
from repertory.generation import GenerationRequest, SamplingParams, make_backend
from repertory.models import load_tokenizer, tiny_model
from repertory.models.chat import chat_prompt_ids
from repertory.remote import RemoteError
from repertory.serve import SeatPrompt, ServeError, ServeOptions
from repertory.serve.app import ServedPolicy, ServerThread
from repertory.serve.protocol import ChatInput, ChatRequest, chat_input, validation_message
from repertory.store.served import ServedLog, read_served
from repertory.train import start_run
from repertory.types import Message, RepertoryError

HI = [{"role": "user", "content": "Hello there, who are you?"}]
LONG = [{"role": "user", "content": "Hello there. " * 1500}]  # 4,500 tokens: with 4,096 more, past 8,192


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def loaded(tokenizer):
    return tiny_model(tokenizer, seed=3)


def _server(loaded, directory: Path, seat: SeatPrompt | None = None, **options) -> ServerThread:
    policy = ServedPolicy(make_backend("hf", loaded), "tiny", "base")
    served_log = ServedLog(directory, "tiny", "base", len(loaded.tokenizer))
    return ServerThread(policy, ServeOptions(port=0, **options), served_log, seat)


def _rows(directory: Path) -> list[dict]:
    rows = []
    for part in sorted((directory / "turns").glob("part-*.parquet")):
        rows.extend(pq.read_table(part).to_pylist())
    return rows


def test_openai_client_completes_streams_and_seeds_reproduce(tmp_path, loaded):
    with _server(loaded, tmp_path / "log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        first = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, seed=11, temperature=1.0)
        again = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, seed=11, temperature=1.0)
        other = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, seed=12, temperature=1.0)
        text = first.choices[0].message.content
        assert text and text == again.choices[0].message.content != other.choices[0].message.content
        assert first.usage.completion_tokens == 24 and first.choices[0].finish_reason == "length"
        assert first.usage.prompt_tokens == len(chat_prompt_ids(loaded.tokenizer, [Message("user", HI[0]["content"])]))
        stream = client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=24, seed=11, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert len(deltas) >= 3 and "".join(deltas) == text  # the text arrived in pieces, and whole
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 24
        cut = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, seed=11, stop=[cut])
        assert stopped.choices[0].message.content == text[: text.index(cut)]
        assert stopped.choices[0].finish_reason == "stop"
        greedy = [
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0, seed=s)
            for s in (1, 2)
        ]
        assert greedy[0].choices[0].message.content == greedy[1].choices[0].message.content


def test_the_log_holds_exactly_what_was_exchanged(tmp_path, loaded):
    chat = [*HI, {"role": "assistant", "content": "A model."}, {"role": "user", "content": "Tell me more."}]
    with _server(loaded, tmp_path / "log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused")
        answers = [
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10, seed=5, extra_headers={"X-Conversation-Id": "conv-7"}
            )
            for messages in (HI, chat)
        ]
        anonymous = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6)
    rows = sorted(_rows(tmp_path / "log"), key=lambda r: r["received"])
    assert len(rows) == 3
    for row, messages, answer in zip(rows, (HI, chat), answers):
        assert row["conversation_id"] == "conv-7" and row["policy_id"] == "base" and row["model"] == "tiny"
        assert [(m["role"], m["content"]) for m in row["messages"]] == [(m["role"], m["content"]) for m in messages]
        assert row["response"] == answer.choices[0].message.content and row["request_id"] == answer.id
        prompt = [Message(m["role"], m["content"]) for m in messages]
        assert row["prompt_ids"] == chat_prompt_ids(loaded.tokenizer, prompt)
        assert loaded.tokenizer.decode(row["response_ids"], skip_special_tokens=True) == row["response"]
        assert len(row["logp_sample"]) == len(row["response_ids"]) == 10
        assert all(math.isfinite(x) and x <= 0 for x in row["logp_sample"])
        assert row["seed"] == 5 and row["temperature"] == 1.0 and row["max_tokens"] == 10
        assert row["received"] <= row["finished"]
    assert [row["t"] for row in rows[:2]] == [0, 1]  # turns count the model's earlier answers
    assert rows[2]["conversation_id"] == anonymous.id and rows[2]["seed"] > 0  # no header: its own conversation
    backend = make_backend("hf", loaded)  # a logged seed replays its completion exactly
    replayed = backend.generate(
        [GenerationRequest(rows[0]["prompt_ids"], rows[0]["seed"])], SamplingParams(1.0, 1.0, 10)
    )[0]
    assert replayed.response_ids == rows[0]["response_ids"]


def test_outcomes_attach_to_conversations_and_unmatched_ones_are_skipped(tmp_path, loaded):
    with _server(loaded, tmp_path / "log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused")
        for conversation in ("a", "b", "c"):
            client.chat.completions.create(
                model="tiny", messages=HI, max_tokens=4, extra_headers={"X-Conversation-Id": conversation}
            )
        assert httpx.post(f"{url}/outcomes", json={"conversation_id": "a", "outcome": 0.25}).json()["recorded"]
        assert httpx.post(f"{url}/outcomes", json={"conversation_id": "b", "outcome": 0.5}).status_code == 200
        assert httpx.post(f"{url}/outcomes", json={"conversation_id": "b", "outcome": 0.75}).status_code == 200
        missing = httpx.post(f"{url}/outcomes", json={"conversation_id": "zzz", "outcome": 1.0})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_conversation"
        for bad in ({"conversation_id": "a"}, {"conversation_id": "a", "outcome": "high"}, {"outcome": 1}):
            response = httpx.post(f"{url}/outcomes", json=bad)
            assert response.status_code == 422 and "\n" not in response.text
        nan = httpx.post(f"{url}/outcomes", content=b'{"conversation_id": "a", "outcome": NaN}')
        assert nan.status_code == 422
    served = read_served(tmp_path / "log")
    assert (served.conversations, served.skipped_no_outcome, served.skipped_ids) == (3, 1, ["c"])
    assert {r["conversation_id"]: r["outcome"] for r in served.rows} == {"a": 0.25, "b": 0.75}  # the latest wins


def test_bad_requests_get_their_status_and_one_line_of_json(tmp_path, loaded):
    with _server(loaded, tmp_path / "log", max_messages=4) as url:
        cases = {
            "malformed JSON": (dict(content=b'{"model": "tiny", '), 422, "invalid_json"),
            "unknown model": (dict(json={"model": "gpt-9", "messages": HI}), 404, "model_not_found"),
            "wrong role": (dict(json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}), 422, ""),
            "no messages": (dict(json={"model": "tiny", "messages": []}), 422, "invalid_request"),
            "10 MB body": (dict(content=b" " * (10 * 1024 * 1024)), 413, "body_too_large"),
            "max_tokens 10^9": (dict(json={"model": "tiny", "messages": HI, "max_tokens": 10**9}), 422, ""),
            "too many messages": (dict(json={"model": "tiny", "messages": HI * 5}), 422, "too_many_messages"),
            "past the context": (
                dict(json={"model": "tiny", "messages": LONG, "max_tokens": 4096}),
                422,
                "context_length_exceeded",
            ),
            "n = 2": (dict(json={"model": "tiny", "messages": HI, "n": 2}), 422, "invalid_request"),
            "bad temperature": (dict(json={"model": "tiny", "messages": HI, "temperature": -1}), 422, ""),
            "bad conversation id": (
                dict(json={"model": "tiny", "messages": HI}, headers={"X-Conversation-Id": "a b"}),
                422,
                "invalid_conversation_id",
            ),
        }
        for name, (kwargs, status, code) in cases.items():
            response = httpx.post(f"{url}/chat/completions", **kwargs)
            assert response.status_code == status, name
            assert response.text.count("\n") == 0 and "Traceback" not in response.text, name
            error = response.json()["error"]
            assert error["message"] and (not code or error["code"] == code), name
        assert "messages[0].role" in httpx.post(f"{url}/chat/completions", **cases["wrong role"][0]).text
        assert httpx.get(f"{url}/nowhere").status_code == 404
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    assert _rows(tmp_path / "log") == []  # refused requests log nothing


def test_an_api_key_is_required_off_loopback_and_checked_and_never_logged(tmp_path, loaded):
    with pytest.raises(RepertoryError, match="give --api-key"):
        ServeOptions(host="0.0.0.0")
    key = "sk-test-7f3a9c1d"
    with _server(loaded, tmp_path / "log", api_key=key) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            response = httpx.post(f"{url}/chat/completions", json={"model": "tiny", "messages": HI}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong").models.list()
        client = openai.OpenAI(base_url=url, api_key=key)
        client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=4, extra_headers={"X-Conversation-Id": "k"}
        )
        assert (
            httpx.post(
                f"{url}/outcomes",
                json={"conversation_id": "k", "outcome": 1},
                headers={"Authorization": f"Bearer {key}"},
            ).status_code
            == 200
        )
    written = [p for p in (tmp_path / "log").rglob("*") if p.is_file()]
    assert len(written) >= 3 and not any(key.encode() in p.read_bytes() for p in written)


def test_concurrent_requests_are_batched_and_each_logged_once(tmp_path, loaded):
    results: list[str] = []
    with _server(loaded, tmp_path / "log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        server_app = None

        def ask(k: int) -> None:
            answer = client.chat.completions.create(
                model="tiny", messages=HI, max_tokens=16, seed=k, extra_headers={"X-Conversation-Id": f"c{k}"}
            )
            results.append(answer.id)

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        del server_app
    rows = _rows(tmp_path / "log")
    assert sorted(r["request_id"] for r in rows) == sorted(results) and len(results) == 16
    parts = list((tmp_path / "log" / "turns").glob("part-*.parquet"))
    assert len(parts) < 16  # several requests shared a tick (one backend batch, one part)


def test_env_role_applies_the_seats_system_prompt(tmp_path, loaded):
    with pytest.raises(RepertoryError, match="has no role 'judge'"):
        SeatPrompt("ipd", "judge")
    seat = SeatPrompt("ipd", "Alice")
    kernel = load_kernels("ipd", "heldout")[0]
    with _server(loaded, tmp_path / "log", seat=seat) as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Round 1. Your move."}], "max_tokens": 4}
        answered = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Repertory-Kernel": kernel.id})
        assert answered.status_code == 200
        missing = httpx.post(f"{url}/chat/completions", json=body)
        assert missing.status_code == 422 and missing.json()["error"]["code"] == "missing_kernel"
        unknown = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Repertory-Kernel": "nope"})
        assert unknown.status_code == 422 and unknown.json()["error"]["code"] == "unknown_kernel"
        assert httpx.get(f"{url}/models").json()["data"][0]["env"] == "ipd"
    env = make("ipd")
    env.reset(kernel, 0)
    (row,) = _rows(tmp_path / "log")
    assert row["messages"][0] == {"role": "system", "content": env.system_prompt("Alice"), "channel": ""}
    assert (row["kernel_id"], row["seat_id"]) == (kernel.id, "Alice")


def test_rounds_trainer_learns_round_zero_from_a_served_log(tmp_path, loaded, tokenizer):
    with _server(loaded, tmp_path / "log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused")
        for k in range(6):
            chat = [{"role": "user", "content": f"Offer number {k}?"}]
            for _ in range(2):
                answer = client.chat.completions.create(
                    model="tiny", messages=chat, max_tokens=6, extra_headers={"X-Conversation-Id": f"user-{k}"}
                )
                chat += [{"role": "assistant", "content": answer.choices[0].message.content}]
                chat += [{"role": "user", "content": "And then?"}]
            if k < 5:
                httpx.post(f"{url}/outcomes", json={"conversation_id": f"user-{k}", "outcome": k / 4})
    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "name=served",
            "method.kind=igrpo",
            "iterations=1",
            "rollout.env=ipd",
            "rollout.opponent=always-cooperate",
            "rollout.max_new_tokens=4",
            "eval.episodes=0",
            "method.candidates=2",
            "method.states_per_step=4",
            "method.q.max_epochs=1",
            f"method.logs={tmp_path / 'log'}",
        ],
    )
    trainer = start_run(config, loaded)
    turns, episodes = trainer.deploy(0)[:2]
    assert len(turns) == 10 and episodes == [] and {t.episode_id for t in turns} == {f"user-{k}" for k in range(5)}
    assert {(t.t, t.T) for t in turns} == {(0, 1), (1, 1)}
    assert {t.outcome for t in turns if t.episode_id == "user-4"} == {1.0}
    first = next(t for t in turns if t.episode_id == "user-2" and t.t == 0)
    assert first.ret == pytest.approx(0.95 * 0.5)  # gamma^(T - t) * outcome
    trainer.fit()
    line = json.loads((tmp_path / "served" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["deploy/turns"] == 10 and line["logs/skipped_no_outcome"] == 1 and line["logs/conversations"] == 6
    assert trainer.partner.calls == 0


def test_a_served_log_without_outcomes_or_of_another_vocabulary_is_refused(tmp_path, loaded, tokenizer):
    with _server(loaded, tmp_path / "log") as url:
        openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    with pytest.raises(RepertoryError, match="none of its 1 conversations has an outcome"):
        from repertory.train.turns import read_logs

        read_logs(tmp_path / "log", env_class("ipd"), tokenizer, 0.95)
    with pytest.raises(RepertoryError, match="vocabulary"):
        ServedLog(tmp_path / "log", "other", "base", 17)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(RepertoryError, match="holds no served log"):
        ServedLog(tmp_path / "junk", "tiny", "base", len(tokenizer))


def test_openai_agents_play_against_a_served_model(tmp_path, loaded, tokenizer, capsys):
    model_dir = tiny_checkpoint(tmp_path / "tiny", tokenizer, seed=2)
    with _server(loaded, tmp_path / "log") as url:
        code, out, err = run_cli(
            capsys,
            "play",
            "ipd",
            "--agents",
            f"model,openai:tiny@{url}",
            "--model",
            str(model_dir),
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "games"),
            "--quiet",
        )
        assert code == 0, err
        agent = make_agent(f"openai:tiny@{url}", env_class("ipd"), LMOptions(max_new_tokens=5, seed=1))
        request = Request("e1", 1, "p1", [Message("system", "Play."), Message("user", "Your move.")], {})
        first = agent.act([request])[0].text
        assert agent.act([request])[0].text == first and first  # seeded per seat and turn
        assert agent.policy_id == "remote:tiny" and agent.act([request])[0].response_ids == []
    rows = _rows(tmp_path / "log")
    assert len(rows) >= 5 and all(r["messages"][0]["role"] == "system" for r in rows)
    with pytest.raises(RepertoryError, match="openai:MODEL@BASE_URL"):
        make_agent("openai:gpt", env_class("ipd"))
    with FakeOpenAI(lambda body, n: ("status", 400, '{"error": {"message": "bad model"}}')) as fake:
        broken = make_agent(f"openai:m@{fake.url}", env_class("ipd"))
        with pytest.raises(RemoteError, match="gave p1 of e1 no answer: HTTP 400: bad model"):
            broken.act([request])


@pytest.mark.slow
def test_openai_agents_sit_in_eval_crossplay_exploit_and_training(tmp_path, loaded, tokenizer, capsys):
    model_dir = tiny_checkpoint(tmp_path / "tiny", tokenizer, seed=2)
    with _server(loaded, tmp_path / "log") as url:
        remote = f"openai:tiny@{url}"
        code, out, err = run_cli(
            capsys, "eval", "base", "--env", "ipd", "--vs", remote, "-n", "2", "--model", str(model_dir),
            "--max-new-tokens", "6", "--json",
        )  # fmt: skip
        assert code == 0, err
        assert json.loads(out)["episodes"] == 2
        code, out, err = run_cli(
            capsys, "eval", "crossplay", "--env", "ipd", "--agents", f"always-defect,{remote}", "-n", "1",
            "--max-new-tokens", "6", "--json",
        )  # fmt: skip
        assert code == 0, err
        code, out, err = run_cli(
            capsys, "eval", "exploit", "--env", "ipd", "--victim", remote, "--iterations", "1", "--seeds", "1",
            "-n", "2", "--out", str(tmp_path / "exploit"), "--json", "--set", f"model.name={model_dir}",
            "--set", "rollout.kernels_per_iteration=1", "--set", "rollout.max_new_tokens=4",
        )  # fmt: skip
        assert code == 0, err
        config = load_config(
            None,
            [
                f"output_dir={tmp_path}", "name=vs-remote", "iterations=1", "rollout.env=ipd",
                f"rollout.opponent={remote}", "rollout.kernels_per_iteration=1", "rollout.episodes_per_kernel=2",
                "rollout.max_new_tokens=4", "eval.episodes=0",
            ],
        )  # fmt: skip
        trainer = start_run(config, tiny_model(tokenizer, seed=1))
        trainer.fit()
    episodes = pq.read_table(tmp_path / "vs-remote" / "episodes" / "iter-000000.parquet").to_pylist()
    seats = [seat for episode in episodes for seat in episode["seats"]]
    assert {seat["agent"] for seat in seats if not seat["trainable"]} == {remote}
    assert all(seat["trainable"] for seat in seats if seat["agent"] != remote)
    remote_turns = [
        turn
        for episode in episodes
        for turn in episode["turns"]
        if turn["seat_id"] in {s["seat_id"] for s in episode["seats"] if s["agent"] == remote}
    ]
    assert remote_turns and all(turn["response_ids"] == [] for turn in remote_turns)  # text only, never trained


def _start(model_dir: Path, log_dir: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "repertory",
            "serve",
            f"model:{model_dir}",
            "--port",
            "0",
            "--log-dir",
            str(log_dir),
            "--name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    line = process.stdout.readline()
    assert line.startswith("serving tiny"), line + process.stderr.read()
    return process, line.split(" at ")[1].split()[0]


@pytest.mark.slow
def test_a_killed_server_keeps_every_written_part_and_a_restart_appends(tmp_path, tokenizer):
    model_dir = tiny_checkpoint(tmp_path / "tiny", tokenizer, seed=4)
    log_dir = tmp_path / "log"
    process, url = _start(model_dir, log_dir)
    answered: list[str] = []
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(timeout=30) as http:
            for n in range(200):
                if stop.is_set():
                    return
                body = {"model": "tiny", "messages": HI, "max_tokens": 16}
                try:
                    response = http.post(
                        f"{url}/chat/completions", json=body, headers={"X-Conversation-Id": f"k{k}-{n}"}
                    )
                except httpx.HTTPError:
                    return
                answered.append(response.json()["id"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    while len(answered) < 40:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stop.set()
    for thread in threads:
        thread.join()
    logged = {r["request_id"] for r in _rows(log_dir)}  # every part reads back
    assert set(answered) <= logged and len(logged) - len(answered) <= 8  # at most the requests in flight
    parts_before = set((log_dir / "turns").glob("part-*.parquet"))
    process, url = _start(model_dir, log_dir)
    try:
        with httpx.Client(timeout=30) as http:
            body = {"model": "tiny", "messages": HI, "max_tokens": 4}
            after = http.post(f"{url}/chat/completions", json=body, headers={"X-Conversation-Id": "k0-0"}).json()
            assert http.post(f"{url}/outcomes", json={"conversation_id": "k0-0", "outcome": 1.0}).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert parts_before < set((log_dir / "turns").glob("part-*.parquet"))
    served = read_served(log_dir)
    assert served.completions == len(logged) + 1 and served.replaced == 1  # k0-0's t = 0 answered twice
    assert [r["request_id"] for r in served.rows] == [after["id"]]


def test_serve_usage_errors_exit_2_with_one_line(capsys, monkeypatch):
    monkeypatch.delenv("REPERTORY_API_KEY", raising=False)
    cases = [
        (["serve", "base", "--host", "0.0.0.0"], "give --api-key or set REPERTORY_API_KEY"),
        (["serve", "base", "--env", "ipd"], "--env and --role go together"),
        (["serve", "base", "--env", "ipd", "--role", "judge"], "ipd has no role 'judge'; choose from Alice, Bob"),
        (["serve", "base", "--api-key-env", "NO_SUCH_VARIABLE_SET"], "NO_SUCH_VARIABLE_SET: the variable is not set"),
        (["serve", "model:/no/such/dir"], "/no/such/dir: no such checkpoint directory"),
        (["serve", "base", "--port", "70000"], "--port must be 0..65535"),
    ]
    for args, message in cases:
        code, out, err = run_cli(capsys, *args)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)


def test_usage_errors_come_before_the_model_loads(capsys, monkeypatch):
    import repertory.serve.app as app

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(app, "load_served_policy", no_load)
    monkeypatch.delenv("REPERTORY_API_KEY", raising=False)
    for args in (["--host", "0.0.0.0"], ["--port", "-1"], ["--env", "ipd", "--role", "judge"]):
        code, _, err = run_cli(capsys, "serve", "base", *args)
        assert code == 2 and "loaded" not in err, (args, err)


def _chat(**fields):
    return ChatRequest.model_validate({"model": "tiny", "messages": HI, **fields})


def test_chat_requests_are_validated_without_a_model():
    limits = ServeOptions(max_messages=4, max_tokens=64, default_max_tokens=16)
    given = chat_input(_chat(stop="END", max_completion_tokens=8), {"x-conversation-id": "c-1"}, "tiny", limits)
    assert given == ChatInput([Message("user", HI[0]["content"])], 8, ("END",), "c-1", None)
    developer = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}]
    assert chat_input(_chat(messages=developer), {}, "tiny", limits).messages == [Message("system", "be brief")]
    assert chat_input(_chat(), {}, "tiny", limits).max_tokens == 16  # the server's default
    refused = {
        "model_not_found": (_chat(model="gpt-9"), {}),
        "too_many_messages": (_chat(messages=HI * 5), {}),
        "max_tokens_too_large": (_chat(max_tokens=65), {}),
        "invalid_stop": (_chat(stop=["a", ""]), {}),
        "invalid_conversation_id": (_chat(), {"x-conversation-id": "a b"}),
    }
    for code, (chat, headers) in refused.items():
        with pytest.raises(ServeError) as caught:
            chat_input(chat, headers, "tiny", limits)
        assert (caught.value.status, caught.value.code) == (404 if code == "model_not_found" else 422, code)
    with pytest.raises(ValidationError) as bad:
        ChatRequest.model_validate({"model": "tiny", "messages": [{"role": "robot", "content": "x"}], "n": 2})
    assert validation_message(bad.value).startswith("messages[0].role: ") and "(and 1 more)" in validation_message(
        bad.value
    )


def test_a_seat_prompt_goes_first_unless_the_client_sent_one():
    limits, seat = ServeOptions(), SeatPrompt("ipd", "Bob")
    kernel = next(iter(seat.kernels))
    given = chat_input(_chat(), {"x-repertory-kernel": kernel}, "tiny", limits, seat)
    system, name, chars = seat.seat(kernel)
    assert given.messages == [Message("system", system), Message("user", HI[0]["content"])]
    assert (given.seat_id, given.max_chars, given.kernel_id) == (name, chars, kernel) and name == "Bob"
    own = [{"role": "system", "content": "you are Bob"}, *HI]
    assert chat_input(_chat(messages=own), {}, "tiny", limits, seat).seat_id == "Bob"
    with pytest.raises(ServeError, match="X-Repertory-Kernel") as missing:
        chat_input(_chat(), {}, "tiny", limits, seat)
    assert missing.value.code == "missing_kernel"
    with pytest.raises(ServeError, match="has no kernel") as unknown:
        chat_input(_chat(), {"x-repertory-kernel": "no-such-kernel"}, "tiny", limits, seat)
    message = "ipd has no kernel 'no-such-kernel'"
    error = {"message": message, "type": "invalid_request_error", "code": "unknown_kernel"}
    assert unknown.value.body() == {"error": error}

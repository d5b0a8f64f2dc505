"""Judges (environments.md 12): a real HTTP judge on 127.0.0.1 that answers well, badly, slowly or not at all;
clipping, retries, failure flags, the persistent cache, key hygiene, and the constrained local judge."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import pytest
from conftest import rows
from fake_openai import FakeOpenAI

from repertory.agents import BotAgent
from repertory.config import JudgeConfig, TrainConfig
from repertory.envs.social import DIMENSIONS, FINE_GRAINED, Social
from repertory.eval import evaluate
from repertory.generation import make_backend
from repertory.judges import ChatJudge, LocalJudge, dimension_messages, json_messages, make_judge, parse_verdict
from repertory.models import tiny_model
from repertory.models.chat import chat_prompt_ids
from repertory.remote import ChatClient, Endpoint, ResponseCache
from repertory.store import write_episodes
from repertory.types import JudgeRequest, Message, RepertoryError

GUITAR = [8, 9, 5, 0, 0, 2, 3]


def request(agents=("agent_1", "agent_2"), context="Turn 1. Ann: hello") -> JudgeRequest:
    return JudgeRequest("episode", "Score them.", context, tuple(agents), DIMENSIONS)


def verdict_json(scores=GUITAR, agents=("agent_1", "agent_2")) -> str:
    return json.dumps(
        {a: {d.name: {"reasoning": "because", "score": s} for d, s in zip(DIMENSIONS, scores)} for a in agents}
    )


def judge_for(server, tmp_path, retries=2, timeout=0.3, key_env=None) -> ChatJudge:
    endpoint = Endpoint(
        server.url, "judge-m", key_env, timeout_s=timeout, max_retries=retries, backoff_s=0.01, json_mode=True
    )
    return ChatJudge(ChatClient(endpoint, ResponseCache(tmp_path / "judge.sqlite")), "judge-m")


def test_parse_verdict_reads_scores_clips_and_names_what_is_missing():
    r = request()
    verdict, clipped = parse_verdict(r, "```json\n" + verdict_json() + "\n```")
    assert verdict["agent_1"] == dict(zip([d.name for d in DIMENSIONS], map(float, GUITAR))) and clipped == 0
    verdict, clipped = parse_verdict(r, verdict_json([14, 9, 5, 3, -12, 2, "-7"]))
    assert [verdict["agent_2"][d.name] for d in DIMENSIONS] == [10, 9, 5, 0, -10, 2, -5] and clipped == 2 * 4
    for text, reason in [
        ("no json here", "no JSON object"),
        ("{not json}", "not valid JSON"),
        (json.dumps({"agent_1": {}}), "agent_1.goal has no numeric score"),
        (verdict_json(agents=("agent_1",)), "no scores for agent_2"),
        (verdict_json([None, 1, 1, 0, 0, 0, 0]), "agent_1.goal has no numeric score"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_verdict(r, text)


def test_a_valid_answer_is_used_and_requested_as_json_at_temperature_zero(tmp_path):
    with FakeOpenAI(lambda body, n: verdict_json()) as server:
        judge = judge_for(server, tmp_path)
        (verdict,) = judge.score([request()])
        body = server.requests[0]["body"]
    assert verdict["agent_2"]["financial_and_material_benefits"] == 3
    assert body["temperature"] == 0 and body["response_format"] == {"type": "json_object"}
    assert body["model"] == "judge-m" and body["messages"] == json_messages(request())


def test_malformed_answers_are_asked_again_with_the_reason_then_fail(tmp_path):
    answers = ["I think they did fine.", verdict_json()]
    with FakeOpenAI(lambda body, n: answers[min(n, 1)]) as server:
        judge = judge_for(server, tmp_path)
        (verdict,) = judge.score([request()])
        second = server.requests[1]["body"]["messages"]
    assert verdict is not None and judge.stats.retried == 1 and judge.stats.failed == 0
    assert second[-2] == {"role": "assistant", "content": "I think they did fine."}
    assert "could not be used: the answer holds no JSON object" in second[-1]["content"]
    with FakeOpenAI(lambda body, n: "{broken") as server:
        judge = judge_for(server, tmp_path / "b")
        assert judge.score([request()]) == [None]
        assert len(server.requests) == 3  # the first answer and two retries
    assert judge.stats.failed == 1 and judge.stats.retried == 2


def test_server_errors_and_timeouts_are_retried_by_the_client_then_flag_the_request(tmp_path):
    plan = [("status", 500, "boom"), ("sleep", 1.0, "late"), ("status", 429, "slow down", {"Retry-After": "0"})]
    with FakeOpenAI(lambda body, n: plan[n] if n < len(plan) else verdict_json()) as server:
        judge = judge_for(server, tmp_path, retries=3)
        (verdict,) = judge.score([request()])
    assert verdict is not None and judge.client.stats["retries"] == 3
    with FakeOpenAI(lambda body, n: ("status", 503, "down")) as server:
        judge = judge_for(server, tmp_path / "down", retries=2)
        assert judge.score([request(), request(context="other")]) == [None, None]
        assert len(server.requests) == 2 * 3
    assert judge.stats.failed == 2


def test_out_of_range_scores_are_clipped_and_counted(tmp_path):
    with FakeOpenAI(lambda body, n: verdict_json([11, 9, 5, 2, 0, 2, 9])) as server:
        judge = judge_for(server, tmp_path)
        (verdict,) = judge.score([request()])
    assert verdict["agent_1"]["goal"] == 10 and verdict["agent_1"]["secret"] == 0
    assert verdict["agent_1"]["financial_and_material_benefits"] == 5 and judge.stats.clipped == 6


def test_the_cache_answers_a_repeated_request_without_the_network_and_survives_a_restart(tmp_path):
    with FakeOpenAI(lambda body, n: verdict_json()) as server:
        judge = judge_for(server, tmp_path)
        first = judge.score([request()])
        assert judge.score([request()]) == first and len(server.requests) == 1 and judge.stats.cache_hits == 1
        judge.client.cache.close()
        script = (
            "import sys, json; sys.path.insert(0, 'tests'); from test_judges import judge_for, request;"
            "from pathlib import Path; from fake_openai import FakeOpenAI;"
            f"server = type('S', (), {{'url': {server.url!r}}});"
            f"j = judge_for(server, Path({str(tmp_path)!r}));"
            "print(json.dumps([j.score([request()])[0]['agent_1']['goal'], j.stats.cache_hits]))"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == [8.0, 1] and len(server.requests) == 1


def test_a_judged_evaluation_keeps_the_api_key_out_of_every_written_file(tmp_path, monkeypatch):
    key = f"sk-test-{uuid.uuid4()}"
    monkeypatch.setenv("JUDGE_KEY", key)
    monkeypatch.setenv("REPERTORY_CACHE", str(tmp_path / "cache"))
    with FakeOpenAI(lambda body, n: verdict_json(agents=("agent_1", "agent_2", "agent_3"))) as server:
        config = TrainConfig.model_validate(
            {
                "rollout": {"env": "social", "env_options": {"reward": "judge"}},
                "judge": {"kind": "openai", "base_url": server.url, "model": "judge-m", "api_key_env": "JUDGE_KEY"},
            }
        )
        judge = make_judge(config.judge)
        agent = BotAgent("agreeable", Social.bots["agreeable"])
        result = evaluate("social", agent, 4, seed=0, env_options={"reward": "judge"}, judge=judge)
        headers = server.requests[0]["headers"]
    assert headers["authorization"] == f"Bearer {key}"
    assert result.judged is not None and result.judged.judge_failed == 0
    assert result.judged.dimensions["goal"][0] == 8 and result.outcome  # scored by the judge
    write_episodes(tmp_path / "episodes.parquet", result.played)
    (tmp_path / "eval.json").write_text(json.dumps(result.to_json()))
    (tmp_path / "config.yaml").write_text(config.model_dump_json())
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.startswith("judge.sqlite") for p in written)
    assert all(key.encode() not in p.read_bytes() for p in written)
    assert key not in repr(judge.client)


def test_make_judge_refuses_an_incomplete_configuration(monkeypatch):
    with pytest.raises(RepertoryError, match="needs judge.base_url"):
        make_judge(JudgeConfig(kind="openai"))
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(RepertoryError, match="NO_SUCH_KEY"):
        make_judge(JudgeConfig(kind="openai", base_url="http://127.0.0.1:9/v1", api_key_env="NO_SUCH_KEY"))
    with pytest.raises(ValueError, match="set judge.kind"):
        TrainConfig.model_validate({"rollout": {"env": "social", "env_options": {"reward": "hybrid"}}})
    assert make_judge(JudgeConfig()) is None


def test_the_local_judge_answers_every_scale_in_range_in_one_batched_call(tmp_path):
    backend = make_backend("hf", tiny_model())
    judge = LocalJudge(backend, "local:tiny", ResponseCache(tmp_path / "local.sqlite"))
    requests = [request(), JudgeRequest("fine-grained", "Score.", "Turn 1. Bo: hi", ("agent_1",), FINE_GRAINED)]
    first = judge.score(requests)
    assert judge.stats.calls == 1 and judge.stats.failed == 0
    # each request's questions share its prompt up to the question: that prefix is encoded once per request
    encoded = 0
    for r in requests:
        chats = [dimension_messages(r, a, d.name) for a in r.agents for d in r.dimensions]
        prompts = [chat_prompt_ids(backend.tokenizer, [Message(m["role"], m["content"]) for m in c]) for c in chats]
        common = next(n for n in range(len(prompts[0])) if len({tuple(p[: n + 1]) for p in prompts}) > 1)
        encoded += common + sum(len(p) - common for p in prompts)
    stats = backend.stats
    assert stats.reused_prompt_tokens == 0 and stats.prompt_tokens - stats.shared_prompt_tokens == encoded
    for r, verdict in zip(requests, first):
        assert set(verdict) == set(r.agents)
        for scores in verdict.values():
            assert all(
                d.low <= scores[d.name] <= d.high and scores[d.name] == int(scores[d.name]) for d in r.dimensions
            )
    again = judge.score(requests)
    assert again == first and judge.stats.calls == 1 and judge.stats.cache_hits == 2 * 7 + 5


def test_omar_trains_on_social_with_a_hybrid_judge_over_http_and_skips_failed_episodes(tmp_path, monkeypatch):
    """One tiny-model OMAR iteration: every finished conversation goes to the judge; one it fails on stays in
    the episode store, flagged, and is left out of the batch and of the metrics' means."""
    from conftest import tiny_checkpoint

    from repertory.config import load_config
    from repertory.models import load_tokenizer
    from repertory.store import read_episodes
    from repertory.train import start_run

    monkeypatch.setenv("REPERTORY_CACHE", str(tmp_path / "cache"))
    model = tiny_checkpoint(tmp_path / "model", load_tokenizer(), seed=3)
    three = ("agent_1", "agent_2", "agent_3")

    failing: list[str] = []
    lock = threading.Lock()

    def answer(body, n):
        # The first conversation the judge sees never gets a verdict that parses; the others get the guitar scores.
        context = body["messages"][1]["content"]
        with lock:
            failing[:] = failing or [context]
        return "not json" if context == failing[0] else verdict_json(agents=three)

    with FakeOpenAI(answer) as server:
        config = load_config(
            "omar-social",
            [
                f"output_dir={tmp_path}",
                "name=social",
                f"model.name={model}",
                "iterations=1",
                "rollout.kernels_per_iteration=2",
                "rollout.episodes_per_kernel=2",
                "rollout.max_new_tokens=4",
                "rollout.env_options={reward: hybrid, max_turns: 3}",
                "judge.kind=openai",
                f"judge.base_url={server.url}",
                "judge.model=judge-m",
                "judge.timeout_s=5",
                "eval.episodes=0",
            ],
        )
        trainer = start_run(config)
        lines = []
        trainer.fit(on_line=lines.append)
    (line,) = lines
    episodes = read_episodes(trainer.run_dir.episodes(0))
    failed = [ep for ep in episodes if ep.judge_failed]
    assert len(episodes) == 4 and len(failed) == 1 and line["judge_failed"] == 1.0
    assert all("judge" in ep.result.info for ep in episodes if not ep.judge_failed)
    scored = [ep for ep in episodes if not ep.judge_failed]
    trained = [ep.result.roles[s.name].outcome for ep in scored for s in ep.seats]
    assert line["outcome"] == pytest.approx(sum(trained) / len(trained))
    assert line["samples"] == sum(len(ep.turns) for ep in scored)


def test_eval_command_scores_social_with_a_served_judge_and_refuses_bad_flags(tmp_path, capsys, monkeypatch):
    from conftest import run_cli, tiny_checkpoint

    from repertory.models import load_tokenizer

    monkeypatch.setenv("REPERTORY_CACHE", str(tmp_path / "cache"))
    model = str(tiny_checkpoint(tmp_path / "model", load_tokenizer(), seed=5))
    common = ["eval", "base", "--env", "social", "--model", model, "-n", "2", "--max-new-tokens", "3"]
    three = ("agent_1", "agent_2", "agent_3")
    both = {a: {**json.loads(verdict_json(agents=three))[a], **{d.name: 6 for d in FINE_GRAINED}} for a in three}
    with FakeOpenAI(lambda body, n: json.dumps(both)) as server:
        judge = f"openai:judge-m@{server.url}"
        code, out, err = run_cli(
            capsys, *common, "--option", "max_turns=2", "--judge", judge, "--fine-grained", "--json"
        )
        kinds = {"fine-grained" if "compromise_seeking" in r["body"]["messages"][0]["content"] else "episode"
                 for r in server.requests}  # fmt: skip
    assert code == 0, err
    judged = json.loads(out)["judged"]
    assert judged["dimensions"]["goal"] == 8 and judged["judge_failed"] == 0 and kinds == {"episode", "fine-grained"}
    assert set(judged["fine_grained"]) >= {"empathy_expression", "empathy_expression_se"}
    for flags, message in [
        (["--option", "max_turns"], "--option takes KEY=VALUE"),
        (["--option", "reward=vibes"], "reward must be one of"),
        (["--judge", "gpt"], "unknown judge 'gpt'"),
        (["--option", "reward=judge"], "needs a judge"),
    ]:
        code, out, err = run_cli(capsys, *common, *flags)
        assert code == 2 and message in err, (flags, err)


def test_the_local_judges_prefix_reuse_gives_the_answers_of_questions_asked_one_by_one(tmp_path):
    from repertory.generation import SamplingParams
    from repertory.judges import dimension_messages
    from repertory.models.chat import chat_prompt_ids
    from repertory.types import Message

    backend = make_backend("hf", tiny_model(seed=4))
    requests = [request(context="Turn 1. Ann: I can pay 270."), request(context="Turn 1. Bo: no deal.")]
    verdicts = LocalJudge(backend, "local:tiny").score(requests)
    alone = make_backend("hf", tiny_model(seed=4))
    for r, verdict in zip(requests, verdicts):
        for agent in r.agents:
            for d in r.dimensions:
                chat = [Message(m["role"], m["content"]) for m in dimension_messages(r, agent, d.name)]
                choices = alone.constraint([str(v) for v in range(d.low, d.high + 1)])
                (g,) = alone.generate(
                    rows([chat_prompt_ids(alone.tokenizer, chat)], [0], constraints=[choices]),
                    SamplingParams(0.0, 1.0, 4),
                )
                assert float(alone.decode(g.response_ids).strip()) == verdict[agent][d.name]

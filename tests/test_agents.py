"""Agents: spec parsing, script replay, the terminal agent."""

from __future__ import annotations

import io

import pytest
from conftest import play

from repertory.agents import BotAgent, HumanAgent, Request, ScriptAgent, agent_names
from repertory.agents.resolve import make_agent
from repertory.envs import env_class
from repertory.types import Message, RepertoryError

IPD = env_class("ipd")


def _request(episode="e", seat=0, messages=None):
    return Request(episode, seat, "Alice", messages or [Message("system", "rules"), Message("user", "go")], {})


def test_make_agent_knows_bots_scripts_and_human(tmp_path):
    script = tmp_path / "s.txt"
    script.write_text("x\n")
    assert isinstance(make_agent("tit-for-tat", IPD), BotAgent)
    assert isinstance(make_agent(f"script:{script}", IPD), ScriptAgent)
    assert isinstance(make_agent("human", IPD), HumanAgent)
    assert agent_names(IPD)[-2:] == ["script:FILE", "human"]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("greedy", "unknown agent 'greedy' for ipd; choose from always-cooperate"),
        ("script:", "needs a file"),
        ("script:/no/such/file.txt", "cannot read script file /no/such/file.txt"),
    ],
)
def test_bad_specs_give_clear_errors(spec, message):
    with pytest.raises(RepertoryError, match=message):
        make_agent(spec, IPD)


def test_empty_and_binary_script_files_are_rejected(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(RepertoryError, match="is empty"):
        ScriptAgent(empty)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x80")
    with pytest.raises(RepertoryError, match="cannot read script file"):
        ScriptAgent(binary)


def test_script_replays_per_episode_and_seat_and_cycles(tmp_path):
    script = tmp_path / "s.txt"
    script.write_text("one\ntwo\\nlines\n\nback\\\\slash\n")
    agent = ScriptAgent(script)
    assert agent.lines == ["one", "two\nlines", "", "back\\slash"]
    texts = [r.text for r in agent.act([_request("a", 0), _request("a", 1), _request("b", 0)])]
    assert texts == ["one", "one", "one"]
    texts = [agent.act([_request("a", 0)])[0].text for _ in range(5)]
    assert texts == ["two\nlines", "", "back\\slash", "one", "two\nlines"]


def test_script_agent_drives_a_whole_episode(tmp_path):
    script = tmp_path / "alice.txt"
    script.write_text("<choose>A</choose>\n<choose>A</choose>\n<choose>B</choose>\n")
    [ep] = play("ipd", [f"script:{script}", "tit-for-tat"])
    assert [t.action.value for t in ep.trajectory("p0")] == list("AAB" * 3 + "A")
    # Alice AAB AAB AAB A vs tit-for-tat (A A A B A A B A A B):
    # rounds: 3 3 5 0 3 5 0 3 5 0 -> Alice 27; Bob 3 3 0 5 3 0 5 3 0 5 -> 27
    assert ep.result.roles["Alice"].points == 27 and ep.result.roles["Bob"].points == 27


def test_human_agent_shows_only_new_messages_and_reads_a_line():
    stdin = io.StringIO("<choose>A</choose>\nsecond\\nline\n")
    stdout = io.StringIO()
    human = HumanAgent(stdin, stdout)
    first = human.act([_request()])
    history = [
        Message("system", "rules"),
        Message("user", "go"),
        Message("assistant", "<choose>A</choose>"),
        Message("user", "Round 1: ..."),
    ]
    second = human.act([_request(messages=history)])
    assert [first[0].text, second[0].text] == ["<choose>A</choose>", "second\nline"]
    shown = stdout.getvalue()
    assert "[rules] rules" in shown and shown.count("[rules]") == 1
    assert "[referee] Round 1: ..." in shown


def test_human_agent_reports_closed_stdin():
    with pytest.raises(RepertoryError, match="standard input closed while waiting for Alice's move"):
        HumanAgent(io.StringIO(""), io.StringIO()).act([_request()])


def test_request_observation_is_everything_after_the_last_own_message():
    request = _request(
        messages=[Message("system", "s"), Message("assistant", "a"), Message("user", "u1"), Message("user", "u2")]
    )
    assert request.observation == [Message("user", "u1"), Message("user", "u2")]
    assert _request().observation == _request().messages

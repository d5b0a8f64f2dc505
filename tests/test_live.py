"""Live play: turns print as the referee applies them, a model's text streams while it is sampled, and progress
bars count the games of evaluations and cross-play."""

from __future__ import annotations

import io
import json

import pytest
from conftest import run_cli, tiny_checkpoint
from rich.console import Console

from repertory.agents.lm import LMAgent
from repertory.agents.resolve import make_agent
from repertory.cli import common
from repertory.cli.play import LiveTranscript
from repertory.envs import env_class
from repertory.generation import SamplingParams
from repertory.generation.hf import HFBackend
from repertory.models import load_tokenizer, tiny_model
from repertory.rollout import run_episodes, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_a_models_text_streams_as_it_grows_and_the_games_are_unchanged(tokenizer):
    backend = HFBackend(tiny_model(tokenizer, layers=2, hidden=64, seed=0))
    model = LMAgent(backend, "model", SamplingParams(1.0, 1.0, 40), seed=3)
    bot = make_agent("tit-for-tat", env_class("ipd"))
    quiet = run_episodes(schedule("ipd", [model, bot], episodes=2, seed=1))

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200, color_system=None)
    live = LiveTranscript(console, full=False, episodes=2, live=True)
    seen: list[tuple[str, int, str, int]] = []
    frames: list[str] = []

    def watch(request, text, tokens):
        live.stream(request, text, tokens)
        seen.append((request.episode_id, request.turn_index, text, tokens))
        with console.capture() as frame:
            console.print(live.render())
        frames.append(frame.get())

    model.watch = watch
    with live:
        played = run_episodes(schedule("ipd", [model, bot], episodes=2, seed=1), 1, live.episode, on_turn=live.turn)
    # Seeds are per (episode, seat, turn): one game at a time plays the same games (log-probs differ by float
    # noise: the batches are padded differently).
    assert [[(t.text, t.response_ids, t.reward) for t in ep.turns] for ep in played] == [
        [(t.text, t.response_ids, t.reward) for t in ep.turns] for ep in quiet
    ]
    assert [ep.result for ep in played] == [ep.result for ep in quiet]
    first = played[0].trajectory("p0")[0]
    streamed = [(text, tokens) for ep, t, text, tokens in seen if ep == played[0].episode_id and t == 0]
    assert [tokens for _, tokens in streamed] == [8 * (k + 1) for k in range(len(streamed))]
    # Backends call the watcher every 8 tokens, except at the token that ends the row (here the budget of 40).
    assert first.finish == "length" and len(streamed) == (len(first.response_ids) - 1) // 8 == 4
    assert all(first.text.startswith(text) or text.endswith("\ufffd") for text, _ in streamed)
    assert any("Alice ▸ " in frame and "tokens/s" in frame and "episode 1/2 · turn 1 ·" in frame for frame in frames)
    printed = screen.getvalue()
    assert printed.count("━━ ") == 2 and printed.count("end: rounds_complete") == 2
    assert printed.index(played[0].episode_id) < printed.index("end: rounds_complete") < printed.index(
        played[1].episode_id
    )
    assert f"Alice ▸ {first.text[:30]}" in printed
    assert live.turns == sum(len(ep.turns) for ep in played)
    assert live.tokens == sum(len(t.response_ids) for ep in played for t in ep.turns)


def test_play_prints_each_turn_and_keeps_json_and_quiet(capsys, tokenizer, tmp_path):
    tiny_checkpoint(tmp_path / "ckpt", tokenizer, seed=5)
    common_args = ["play", "ipd", "-a", "model,tit-for-tat", "--model", str(tmp_path / "ckpt"), "-n", "2"]
    code, out, err = run_cli(capsys, *common_args, "--max-new-tokens", "12")
    assert code == 0 and err == ""
    assert out.count("Alice ▸ ") == 20 and out.count("Bob ▸ <choose>") == 20 and "2 episodes" in out
    code, out, _ = run_cli(capsys, *common_args, "--max-new-tokens", "12", "--json")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(records) == 2 and records[0]["seats"] == {"Alice": "model", "Bob": "tit-for-tat"}
    code, out, _ = run_cli(capsys, *common_args, "--max-new-tokens", "12", "--quiet")
    assert code == 0 and "▸" not in out and "2 episodes" in out


def test_evaluations_and_crossplay_count_games_on_a_terminal(capsys, monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(common, "err", Console(file=screen, force_terminal=True, width=160, color_system=None))
    code, out, _ = run_cli(capsys, "eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat,always-defect", "-n", "3")
    assert code == 0 and "M, mean normalised outcome" in out
    drawn = screen.getvalue()
    assert "cross-play ipd" in drawn and "12/12 games" in drawn and "0:00:00" in drawn
    screen.truncate(0)
    code, out, _ = run_cli(capsys, "tournament", "-e", "ipd", "-a", "tit-for-tat,always-defect", "-n", "2")
    assert code == 0 and "8/8 games" in screen.getvalue()


def test_progress_bars_stay_off_where_nobody_watches(capsys):
    code, out, err = run_cli(capsys, "eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat,always-defect", "-n", "1")
    assert code == 0 and err == ""

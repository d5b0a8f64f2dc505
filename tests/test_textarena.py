"""TextArena's games through the ordinary registry: kernels, scripted games, invalid moves, bots, CLI, training."""

from __future__ import annotations

import json
import math
import random
import re
import sys

import pytest

pytest.importorskip("textarena")

from conftest import play, run_cli, tiny_checkpoint  # noqa: E402

from repertory.cli import main  # noqa: E402
from repertory.config import load_config  # noqa: E402
from repertory.envs import env_class, env_names, generate_kernels, load_kernels, make  # noqa: E402
from repertory.envs.checks import check_env, check_episode  # noqa: E402
from repertory.envs.textarena import TextArenaGame, textarena  # noqa: E402
from repertory.models import load_tokenizer  # noqa: E402
from repertory.store import EpisodeStore, read_episodes  # noqa: E402
from repertory.types import Message, RepertoryError  # noqa: E402

TTT = "textarena:TicTacToe-v0"
KUHN = "textarena:KuhnPoker-v0"
NEGOTIATION = "textarena:SimpleNegotiation-v0"


def _start(name: str, index: int = 0):
    env = make(name)
    env.reset(load_kernels(name, "train")[index], 0)
    return env


def _play(env, moves: list[str]) -> list:
    """Step the acting seat with each move in turn until the game ends; the step results."""
    steps = []
    for move in moves:
        if env.done:
            break
        (role,) = env.acting_roles()
        steps.append(env.step({role: move}))
    return steps


# the registry and kernels


def test_specs_resolve_through_the_registry_without_being_listed():
    cls = env_class(TTT)
    assert issubclass(cls, TextArenaGame) and env_class(TTT) is cls
    assert (cls.name, cls.env_id, cls.num_players) == (TTT, "TicTacToe-v0", 2)
    assert cls.roles == ("Player 0", "Player 1") and cls.role_labels == ("player_0", "player_1")
    assert cls.default_trained_role == "Player 0" and not cls.fixed_seat
    assert not any(name.startswith("textarena:") for name in env_names())
    assert isinstance(make(KUHN), TextArenaGame)


def test_kernels_are_deterministic_disjoint_and_valid():
    train, heldout = load_kernels(NEGOTIATION, "train"), load_kernels(NEGOTIATION, "heldout")
    validation = load_kernels(NEGOTIATION, "validation")
    assert len(train) == len(heldout) == len(validation) == 100
    assert [k.id for k in train[:2]] == [f"{NEGOTIATION}/train/000", f"{NEGOTIATION}/train/001"]
    assert generate_kernels(env_class(NEGOTIATION)) == {"train": train, "heldout": heldout, "validation": validation}
    every = train + heldout + validation
    assert all(set(k.data) == {"env_id", "num_players", "game_seed"} for k in every)
    assert {k.data["env_id"] for k in every} == {"SimpleNegotiation-v0"}
    assert len({k.data["game_seed"] for k in every}) == 300  # the three splits' games never coincide
    cls = env_class(NEGOTIATION)
    assert cls.validate_kernel(train[0].data) == []
    assert cls.validate_kernel({**train[0].data, "env_id": "TicTacToe-v0"}) == ["env_id must be 'SimpleNegotiation-v0'"]
    assert cls.validate_kernel({**train[0].data, "game_seed": -1}) == ["game_seed must be a non-negative integer"]


def test_the_game_seed_fixes_the_deal_and_episode_seeds_do_not():
    def prompt(index: int, episode_seed: int) -> str:
        env = make(NEGOTIATION)
        env.reset(load_kernels(NEGOTIATION, "train")[index], episode_seed)
        return env.system_prompt("Player 0")

    assert prompt(0, 1) == prompt(0, 2) != prompt(1, 1)
    assert "Qty:" in prompt(0, 1)


def test_playing_leaves_the_global_random_state_alone():
    random.seed(5)
    expected = [random.random() for _ in range(3)]
    random.seed(5)
    first = random.random()
    env = _start(KUHN)
    _play(env, ["[check]"] * 4)
    assert [first, random.random(), random.random()] == expected


# scripted games


def test_scripted_tictactoe_win_gives_exact_outcomes_rewards_and_transcripts():
    env = _start(TTT)
    assert env.system_prompt("Player 0").startswith("You are Player 0 in Tic Tac Toe.")
    opening = env.observe("Player 1")
    assert opening[0] == Message("system", env.system_prompt("Player 1"))
    assert opening[1].content.startswith("[GAME] Current Board:") and opening[1].channel == ""
    steps = _play(env, ["I take the centre: [4]", "[0]", "[1]", "[8]", "[7]"])  # O: 4, 1, 7 is column 1
    assert [s.rewards for s in steps[:-1]] == [{}] * 4
    assert steps[-1].rewards == {"Player 0": 1.0, "Player 1": 0.0}
    assert env.done and env.acting_roles() == []
    result = env.result()
    assert {r: (rr.points, rr.outcome, rr.n_turns, rr.n_invalid) for r, rr in result.roles.items()} == {
        "Player 0": (1.0, 1.0, 3, 0),
        "Player 1": (-1.0, 0.0, 2, 0),
    }
    assert result.end_reason == "game_over" and result.info["reason"] == "Player 0 has won!"
    seen = "\n".join(m.content for m in env.observe("Player 1"))
    assert seen.startswith("[Player 0] I take the centre: [4]\n[GAME] Player 0 placed their symbol (O) in cell 4.")
    assert "[GAME] The game is over: Player 0 has won! Your reward: -1." in seen
    # A seat's own moves are its assistant messages, not echoed back by the referee.
    assert "[Player 0]" not in "\n".join(m.content for m in env.observe("Player 0"))
    assert env.metrics() == {"game_steps": 5.0, "invalid_end": 0.0, "draw": 0.0}


def test_scripted_tictactoe_draw_scores_half_each():
    env = _start(TTT, 3)
    steps = _play(env, ["[4]", "[0]", "[2]", "[6]", "[3]", "[5]", "[1]", "[7]", "[8]"])
    assert steps[-1].rewards == {"Player 0": 0.5, "Player 1": 0.5}
    assert env.result().info["reason"] == "The game is a draw!"
    assert env.metrics()["draw"] == 1.0


def test_an_invalid_move_counts_with_textarenas_reason_and_a_second_one_loses():
    env = _start(TTT)
    _play(env, ["[4]"])
    assert env.validate("Player 1", "[4]") == (False, "cell 4 is already occupied.")
    assert env.validate("Player 0", "[0]") == (False, "Player 0 is not to act now")
    [step] = _play(env, ["[4]"])
    assert step.parsed["Player 1"].invalid and step.parsed["Player 1"].error == "cell 4 is already occupied."
    assert env.acting_roles() == ["Player 1"] and not env.done  # TextArena lets the seat try again
    private = [m for m in env.observe("Player 1") if m.channel == "private"]
    assert [m.content for m in private] == [
        "[GAME] Player 1 attempted an invalid move. Reason: cell 4 is already occupied. Please resubmit a valid "
        "move and remember to follow the game rules to avoid penalties."
    ]
    assert all(m.channel == "" for m in env.observe("Player 0"))
    [last] = _play(env, ["no move at all"])
    assert last.parsed["Player 1"].error == "The submitted move does not follow the correct format."
    assert last.rewards == {"Player 0": 1.0, "Player 1": 0.0}
    result = env.result()
    assert result.end_reason == "invalid_move" and result.roles["Player 1"].n_invalid == 2
    assert env.metrics()["invalid_end"] == 1.0


def test_a_move_textarena_crashes_on_is_refused_without_touching_the_game(monkeypatch):
    from textarena.envs.TicTacToe.env import TicTacToeEnv

    original = TicTacToeEnv.step

    def fragile(game, action):
        if "boom" in action:
            game.state.game_state["board"][0][0] = "?"  # a half-done update that must never reach the episode
            raise KeyError("boom")
        return original(game, action)

    monkeypatch.setattr(TicTacToeEnv, "step", fragile)
    env = _start(TTT)
    [step] = _play(env, ["boom"])
    assert step.parsed["Player 0"].invalid
    assert step.parsed["Player 0"].error == "TextArena could not process the move (KeyError('boom'))"
    assert env.acting_roles() == ["Player 0"] and env._game.state.game_state["board"][0][0] == ""
    assert "Reason: TextArena could not process the move" in env.observe("Player 0")[-1].content
    _play(env, ["[4]", "[0]"])
    assert env.acting_roles() == ["Player 0"] and not env.done


def test_validate_is_pure_and_agrees_with_step():
    env = _start(TTT)
    before = env.view("Player 0")
    for text in ["[9]", "[x]", "", "[4]", "<think>[0]</think>"]:
        env.validate("Player 0", text)
    assert env.view("Player 0") == before and env.acting_roles() == ["Player 0"]
    assert env.validate("Player 0", "<think>[0]</think>")[0] is False  # thinking is cut before TextArena sees it


def test_kuhn_poker_with_bots_scores_the_cards_it_dealt():
    [episode] = play(KUHN, ["first-option", "first-option"], kernel=7)
    # first-option always checks, so every round is a showdown of the dealt cards for a pot of 2.
    chips = {"p0": 0, "p1": 0}
    cards = {}
    for seat in ("p0", "p1"):
        seen = [m for t in episode.turns if t.seat_id == seat for m in t.observation]
        text = "\n".join(m.content for m in seen + episode.final_observations[seat])
        # TextArena tells the seat that does not open a round its card twice, and deals a fourth round as it ends.
        cards[seat] = dict(re.findall(r"Starting round ([123]) out of 3 rounds. Your card is: '([JQK])'", text))
    assert sorted(cards["p0"]) == sorted(cards["p1"]) == ["1", "2", "3"]
    rounds = [(cards["p0"][r], cards["p1"][r]) for r in "123"]
    for c0, c1 in rounds:
        winner = "p0" if "JQK".index(c0) > "JQK".index(c1) else "p1"
        chips[winner] += 1
        chips["p1" if winner == "p0" else "p0"] -= 1
    expected = {"Player 0": 1.0 if chips["p0"] > 0 else 0.0, "Player 1": 1.0 if chips["p1"] > 0 else 0.0}
    assert {r: rr.outcome for r, rr in episode.result.roles.items()} == expected
    assert {r: rr.n_turns for r, rr in episode.result.roles.items()} == {"Player 0": 3, "Player 1": 3}
    assert all(not t.invalid for t in episode.turns)
    # The cards are dealt privately.
    card_lines = [m for t in episode.turns for m in t.observation if "Your card is" in m.content]
    assert card_lines and all(m.channel == "private" for m in card_lines)


def _values(prompt: str) -> dict[str, tuple[int, int]]:
    return {r: (int(q), int(v)) for r, q, v in re.findall(r"\[(\w+)\]\s+Qty: (\d+)\s+Value: (\d+)", prompt)}


def test_simple_negotiation_scripted_trade_decides_the_winner():
    env = _start(NEGOTIATION, 2)
    mine, theirs = _values(env.system_prompt("Player 0")), _values(env.system_prompt("Player 1"))
    assert set(mine) == set(theirs) == {"Wheat", "Wood", "Sheep", "Brick", "Ore"}
    steps = _play(env, ["Deal? [Offer: 3 Wheat -> 1 Ore]", "[Accept]"] + ["[Deny]"] * 20)
    assert env.done and len(steps) == 11  # TextArena checks its 10-turn limit before counting the turn
    gain0 = mine["Ore"][1] - 3 * mine["Wheat"][1]
    gain1 = 3 * theirs["Wheat"][1] - theirs["Ore"][1]
    expected = 0.5 if gain0 == gain1 else float(gain0 > gain1)
    assert steps[-1].rewards == {"Player 0": expected, "Player 1": 1.0 - expected}
    assert not any(s.parsed[r].invalid for s in steps for r in s.parsed)
    assert "accepted the trade offer from Player 0" in "\n".join(m.content for m in env.observe("Player 1"))


def test_simple_negotiation_passes_the_episode_checks_with_bots():
    from repertory.envs.fuzz import bot_policy

    cls = env_class(NEGOTIATION)
    for i, kernel in enumerate(load_kernels(NEGOTIATION, "heldout")[:3]):
        played = check_episode(cls, kernel, i, bot_policy(("random-option", "first-option")))
        assert played.result is not None and sum(rr.outcome for rr in played.result.roles.values()) == 1.0


@pytest.mark.parametrize("name", [TTT, KUHN])
def test_conformance_checks(name):
    summary = check_env(env_class(name), episodes=1, examples=6)
    # four bot line-ups (first-option and random-option in each seat) on one kernel of each split, six fuzzed
    assert (summary.kernels, summary.episodes) == (300, 4 * 3 + 6)


# the command line, the store, training


def test_cli_play_writes_episodes_to_the_store(capsys, tmp_path):
    code, out, err = run_cli(
        capsys, "play", KUHN, "--agents", "random-option,first-option", "-n", "2", "--json", "--out", str(tmp_path)
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["env"] for r in records] == [KUHN, KUHN]
    assert all(sorted(r["outcome"].values()) in ([0.0, 1.0], [0.5, 0.5]) for r in records)
    [path] = EpisodeStore(tmp_path).files()
    stored = read_episodes(path)
    assert [ep.kernel.id for ep in stored] == [r["kernel"] for r in records]
    assert stored[0].kernel.data["env_id"] == "KuhnPoker-v0"


def test_config_accepts_specs_and_their_bots_and_refuses_unknown_ids():
    config = load_config("default", [f"rollout.env={TTT}", "rollout.opponent=random-option"])
    assert config.rollout.env == TTT
    with pytest.raises(
        RepertoryError, match=r"unknown TextArena environment 'TicTacToe-v9'; did you mean TicTacToe-v0"
    ):
        load_config("default", ["rollout.env=textarena:TicTacToe-v9"])


def test_one_training_iteration_on_tictactoe(tmp_path, capsys):
    model = tiny_checkpoint(tmp_path / "model", load_tokenizer(), seed=3)
    main(
        [
            "train",
            "--quiet",
            "--set", f"model.name={model}",
            "--set", f"output_dir={tmp_path}",
            "--set", "name=ttt",
            "--set", f"rollout.env={TTT}",
            "--set", "rollout.opponent=self",
            "--set", "iterations=1",
            "--set", "rollout.kernels_per_iteration=1",
            "--set", "rollout.episodes_per_kernel=2",
            "--set", "rollout.max_new_tokens=8",
            "--set", "eval.episodes=0",
        ]
    )  # fmt: skip
    run_dir = tmp_path / "ttt"
    [line] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert line["iteration"] == 0 and line["episodes"] == 2 and line["samples"] > 0
    assert math.isfinite(line["loss/policy"]) and line["outcome/Player 0"] + line["outcome/Player 1"] == 1.0
    assert 0.0 <= line["invalid_rate"] <= 1.0 and line["env/game_steps"] >= 2
    episodes = read_episodes(run_dir / "episodes" / "iter-000000.parquet")
    assert len(episodes) == 2 and {ep.env for ep in episodes} == {TTT}
    assert all(sorted(rr.outcome for rr in ep.result.roles.values()) in ([0.0, 1.0], [0.5, 0.5]) for ep in episodes)
    assert all(seat.trainable for ep in episodes for seat in ep.seats)
    assert all(turn.response_ids for ep in episodes for turn in ep.turns)


# errors


def test_unknown_ids_name_close_matches():
    with pytest.raises(
        RepertoryError, match=r"unknown TextArena environment 'tictactoe-v0'; did you mean TicTacToe-v0"
    ):
        env_class("textarena:tictactoe-v0")
    with pytest.raises(RepertoryError, match=r"unknown TextArena environment 'Zzzz'; TextArena has \d+ ids, e\.g\."):
        make("textarena:Zzzz")


def test_a_game_that_needs_network_data_fails_clearly(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(RepertoryError) as err:
        env_class("textarena:Hangman-v0")
    message = str(err.value)
    assert message.startswith("textarena:Hangman-v0 does not run offline: it needs NLTK data")
    assert "python -m nltk.downloader words" in message


def test_a_missing_textarena_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(RepertoryError, match=r"install it with pip install 'repertory\[textarena\]'"):
        textarena()
    with pytest.raises(RepertoryError, match=r"repertory\[textarena\]"):
        env_class("textarena:NotBuiltYet-v0")


# review fixes: one-player outcomes, free-for-all end reasons, isolation


def test_one_player_puzzles_score_their_progress():
    episodes = play("textarena:ThreeCardMonte-v0", ["first-option"], episodes=6)
    rewards = [ep.result.info["textarena_rewards"]["Player 0"] for ep in episodes]
    assert set(rewards) <= {0.0, 1.0} and 0.0 in rewards  # some guesses fail
    assert [ep.result.roles["Player 0"].outcome for ep in episodes] == rewards  # a failed guess is 0, not a draw


def test_a_free_for_all_game_that_goes_on_after_an_elimination_ends_as_game_over():
    env = _start("textarena:ThreePlayerGOPS-v0")
    eliminated = []
    while not env.done:
        (role,) = env.acting_roles()
        if role == "Player 0":
            eliminated.append(env.step({role: "nonsense"}))
        else:
            env.step({role: env.bots["first-option"](env.view(role))})
    assert eliminated and env.end_reason == "game_over"  # Player 0 was out long before the end


def test_importing_textarena_leaves_the_global_random_state_alone(monkeypatch):
    for name in [m for m in sys.modules if m == "textarena" or m.startswith(("textarena.", "rich"))]:
        monkeypatch.delitem(sys.modules, name)
    random.seed(11)
    state = random.getstate()
    textarena()
    assert random.getstate() == state


def test_other_threads_still_print_while_textarena_runs(capsys):
    import threading
    import time

    from repertory.envs.textarena import _call, _Randomness

    printed = threading.Event()

    def speak():
        time.sleep(0.05)
        print("from another thread")
        printed.set()

    thread = threading.Thread(target=speak)
    thread.start()
    _call(_Randomness(0), lambda: (print("from textarena"), printed.wait(2)))
    thread.join()
    out = capsys.readouterr().out
    assert "from another thread" in out and "from textarena" not in out

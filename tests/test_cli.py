"""The command line: outputs, JSON contracts, and one-line errors with exit status 2."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from conftest import play
from conftest import run_cli as run

from repertory.eval.scores import summarize
from repertory.store import EpisodeStore


def test_acceptance_tit_for_tat_vs_always_defect(capsys):
    code, out, err = run(
        capsys, "play", "ipd", "--agents", "tit-for-tat,always-defect", "--episodes", "1", "--seed", "0", "--json"
    )
    assert code == 0 and err == ""
    [line] = out.strip().splitlines()
    record = json.loads(line)
    assert record["env"] == "ipd"
    assert record["seats"] == {"Alice": "tit-for-tat", "Bob": "always-defect"}
    assert record["rewards"] == {"Alice": 9, "Bob": 14}
    assert record["outcome"] == pytest.approx({"Alice": 0.18, "Bob": 0.28})
    assert record["n_turns"] == {"Alice": 10, "Bob": 10}
    assert record["kernel"].startswith("ipd/train/")
    assert record["metrics"]["cooperation_rate/Alice"] == pytest.approx(0.1)


def test_envs_table_and_json(capsys):
    code, out, _ = run(capsys, "envs", "--json")
    rows = json.loads(out)
    assert [r["name"] for r in rows] == [
        "ipd",
        "split-no-comm",
        "trust-and-split",
        "craigslist",
        "ultimatum",
        "deal-or-no-deal",
        "casino",
        "job-interview",
        "alliance",
        "werewolf",
        "social",
    ]
    assert all(r["roles"] == ["Alice", "Bob"] and r["trained_seat"] is None for r in rows[:3])
    assert [r["trained_seat"] for r in rows[3:9]] == ["vendor", "proposer", "A", "Camper A", "recruiter", "University"]
    assert all(r["default_partner"] == "bot" and "bot" in r["bots"] for r in rows[3:9])
    werewolf = rows[9]
    assert werewolf["roles"] == [f"p{i}" for i in range(6)] and werewolf["teams"] == ["village", "wolves"]
    assert werewolf["bots"] == ["random-legal", "heuristic"] and werewolf["default_partner"] == "self"
    assert all(r["teams"] == [] for r in rows[:9] + rows[10:])
    social = rows[10]
    assert social["roles"] == ["p0", "p1", "p2"] and social["bots"] == ["agreeable", "quiet"]
    assert all(r["description"] for r in rows)
    code, out, _ = run(capsys, "envs")
    assert code == 0 and "trust-and-split" in out and "tit-for-tat" in out


def test_play_prints_transcripts_with_each_role_view_and_summary(capsys):
    code, out, _ = run(capsys, "play", "trust-and-split", "-a", "honest-cooperative,greedy", "-n", "2", "--seed", "3")
    assert code == 0
    assert "Alice sees │ Round 1 of 10. Your hand:" in out or "Bob sees │ Round 1 of 10. Your hand:" in out
    assert "Bob ▸ I'd like to keep all ten coins this round." in out
    assert "trust-and-split: 2 episodes" in out and "collective_payoff_normalized" in out
    code, out, _ = run(capsys, "play", "ipd", "-a", "random,random", "-n", "3", "--quiet")
    assert code == 0 and "sees" not in out and "3 episodes" in out


def test_play_json_writes_one_object_per_episode_and_store(capsys, tmp_path):
    code, out, err = run(
        capsys,
        "play",
        "split-no-comm",
        "-a",
        "greedy,welfare-maximizing",
        "-n",
        "4",
        "--split",
        "heldout",
        "--out",
        str(tmp_path / "eps"),
        "--json",
    )
    assert code == 0
    records = [json.loads(line) for line in out.strip().splitlines()]
    assert len(records) == 4 and all(r["kernel"].startswith("split-no-comm/heldout/") for r in records)
    assert all(0 <= r["metrics"]["split_efficiency"] <= 1 for r in records)
    episodes, errors = EpisodeStore(tmp_path / "eps").load()
    assert errors == [] and [e.summary() for e in episodes] == records
    assert "wrote 4 episodes" in err


def test_same_seed_same_output(capsys):
    first = run(capsys, "play", "ipd", "-a", "random,random", "-n", "3", "--seed", "11", "--json")
    second = run(capsys, "play", "ipd", "-a", "random,random", "-n", "3", "--seed", "11", "--json")
    third = run(capsys, "play", "ipd", "-a", "random,random", "-n", "3", "--seed", "12", "--json")
    assert first == second and first[1] != third[1]


def test_tournament_json_and_tables(capsys):
    code, out, _ = run(capsys, "tournament", "--env", "ipd", "-n", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["agents"] == ["always-cooperate", "always-defect", "tit-for-tat", "grim-trigger", "random"]
    assert len(result["pairs"]) == 25
    tft_vs_ad = next(p for p in result["pairs"] if p["agents"] == ["tit-for-tat", "always-defect"])
    assert tft_vs_ad["points"] == {"Alice": 9, "Bob": 14} and tft_vs_ad["points_se"] == {"Alice": 0, "Bob": 0}
    code, out, _ = run(capsys, "tournament", "-e", "trust-and-split", "-a", "greedy,honest-cooperative", "-n", "2")
    assert code == 0 and "mean outcome over all games" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["play", "chess"], "unknown environment 'chess'; known: ipd, split-no-comm, trust-and-split"),
        (["play", "ipd", "-a", "tit-for-tat,nobody"], "unknown agent 'nobody' for ipd"),
        (["play", "ipd", "-a", "tit-for-tat"], "ipd needs 2 agents, one per seat (Alice, Bob)"),
        (["play", "ipd", "-n", "0"], "--episodes must be at least 1 (got 0)"),
        (["play", "ipd", "-n", "many"], "Invalid value for '--episodes'"),
        (["play", "ipd", "--seed", "-1"], "--seed must be a non-negative integer"),
        (["play", "ipd", "--split", "dev"], "unknown split 'dev'"),
        (["play", "ipd", "--kernel", "100"], "kernel index must be in 0..99"),
        (["play", "ipd", "-a", "script:/nope.txt,random"], "cannot read script file /nope.txt"),
        (["tournament", "-e", "chess"], "unknown environment 'chess'"),
        (["tournament", "-n", "0"], "--episodes must be at least 1"),
        (["play", "ipd", "--bogus"], "No such option: --bogus"),
    ],
)
def test_user_errors_are_one_line_with_status_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_out_path_that_is_a_file_is_rejected_before_playing(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    code, out, err = run(capsys, "play", "ipd", "--out", str(target), "--json")
    assert code == 2 and "is not a directory" in err and out == ""
    assert target.read_text() == "keep me"


def test_module_entry_point_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "repertory", "play", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: unknown environment 'nope'; known: ipd, split-no-comm, trust-and-split, craigslist, ultimatum, "
        "deal-or-no-deal, casino, job-interview, alliance, werewolf, social"
    )


@pytest.mark.parametrize(
    "env,agents", [("werewolf", ["heuristic"] * 6), ("social", ["agreeable", "quiet", "agreeable"])]
)
def test_play_games_whose_kernels_name_the_seats_summarises_and_stores_every_game(capsys, tmp_path, env, agents):
    code, out, err = run(capsys, "play", env, "--agents", ",".join(agents), "-n", "3", "-q", "--out", str(tmp_path))
    assert code == 0 and "wrote 3 episodes" in err
    episodes, errors = EpisodeStore(tmp_path).load()
    assert errors == [] and len(episodes) == 3
    assert len({tuple(s.name for s in ep.seats) for ep in episodes}) == 3  # every kernel names its seats anew
    assert f"{env}: 3 episodes" in out and "│ p0   │" in out and "per game role" in out
    if env == "werewolf":  # both teams' records: every game is won by one of them or drawn
        assert "village" in out and "wolves" in out


def test_play_summary_keys_seats_by_position_with_games_and_outcomes():
    episodes = play("werewolf", ["heuristic"] * 6, episodes=3)
    stats = summarize(episodes)
    assert list(stats.outcome) == [f"p{i}" for i in range(6)] and stats.games == dict.fromkeys(stats.outcome, 3)
    first = [ep.result.roles[ep.seats[0].name].outcome for ep in episodes]
    assert stats.outcome["p0"][0] == pytest.approx(sum(first) / 3)


def test_play_social_with_two_agents_plays_the_two_person_scenarios(capsys, tmp_path):
    code, _, _ = run(capsys, "play", "social", "-a", "agreeable,quiet", "-n", "6", "-q", "--out", str(tmp_path))
    episodes, _ = EpisodeStore(tmp_path).load()
    assert code == 0 and len(episodes) == 6 and all(len(ep.seats) == 2 for ep in episodes)
    code, _, err = run(capsys, "play", "social", "-a", "agreeable", "-n", "1")
    assert code == 2 and "social needs 2 to 3 agents" in err


def test_episodes_are_stored_before_the_summary_can_fail(capsys, tmp_path, monkeypatch):
    import repertory.cli.play as play_cli

    def broken(episodes):
        raise RuntimeError("summary failed")

    monkeypatch.setattr(play_cli, "_print_summary", broken)
    with pytest.raises(RuntimeError):
        run(capsys, "play", "ipd", "-n", "2", "-q", "--out", str(tmp_path))
    episodes, _ = EpisodeStore(tmp_path).load()
    assert len(episodes) == 2


MODEL_LOADS_AND_GAMES = [
    ("repertory.agents.lm", "load_model"),
    ("repertory.train.base", "load_model"),
    ("repertory.models.checkpoints", "load_model"),
    ("repertory.cli.play", "run_episodes"),
    ("repertory.eval.crossplay", "play"),
]
"""Where a command loads a model or plays games: each refusal below must come before all of them."""


@pytest.mark.parametrize(
    "args,message",
    [
        (["play", "ipd", "-a", "runs/nope,random"], "agent 'runs/nope': no run or checkpoint directory at runs/nope"),
        (["play", "ipd", "-a", "model:/no/model,random"], "/no/model is not a Hugging Face checkpoint directory"),
        (["play", "ipd", "-a", "model,random", "--model", "/no/model"], "--model: /no/model is not a Hugging Face"),
        (["play", "ipd", "--out", "/proc/no/such"], "cannot create the episode store /proc/no/such"),
        (["tournament", "-e", "werewolf", "-e", "social"], "cross-play needs a two-seat or two-team environment"),
        (["tournament", "-e", "ipd", "-a", "random,nobody"], "unknown agent 'nobody' for ipd"),
        (["eval", "base", "--env", "ipd", "--option", "reward=hybrid"], "ipd has no option 'reward'; its options are"),
        (["eval", "base", "--env", "craigslist", "--option", "x=1"], "craigslist has no option 'x'; it takes no"),
        (["eval", "base", "--env", "ipd", "--vs", "runs/nope"], "no run or checkpoint directory at runs/nope"),
        (["eval", "exploit", "--env", "ipd", "--victim", "runs/nope"], "--victim runs/nope: agent 'runs/nope': no run"),
        (["train", "--set", "eval.opponent=nosuch"], "(eval.opponent) 'nosuch': unknown agent 'nosuch' for ipd"),
        (["train", "--set", "eval.opponent=model"], "(eval.opponent) 'model': 'model' is ambiguous in training"),
        (["train", "--set", "rollout.opponent=model:/no"], "rollout.opponent 'model:/no': model:/no: /no is not a"),
    ],
)
def test_user_errors_are_refused_before_any_game_or_model(capsys, monkeypatch, args, message):
    def forbidden(*args, **kwargs):
        raise AssertionError("loaded a model or played a game before refusing")

    for module, name in MODEL_LOADS_AND_GAMES:
        monkeypatch.setattr(importlib.import_module(module), name, forbidden)
    code, out, err = run(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert "Traceback" not in err and out == ""


def test_serve_refuses_a_busy_port_before_the_model_loads(capsys, monkeypatch):
    import socket

    import repertory.serve.app

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded the model before binding the port")

    monkeypatch.setattr(repertory.serve.app, "load_served_policy", forbidden)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, _, err = run(capsys, "serve", "base", "--port", str(port))
    assert code == 2 and f"error: cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1


def test_envs_names_textarena_games(capsys):
    code, out, _ = run(capsys, "envs")
    assert code == 0 and "textarena:<EnvId>" in out and "repertory[textarena]" in out


@pytest.mark.parametrize("split,name", [("heldout", "held-out"), ("validation", "validation")])
def test_progress_lines_name_the_kernel_split_the_evaluation_played(capsys, split, name):
    from types import SimpleNamespace

    from repertory.cli.train import _train_progress
    from repertory.config import load_config

    config = load_config(None, [f"eval.split={split}"])
    on_line, progress = _train_progress(SimpleNamespace(config=config, iteration=0), quiet=False)
    with progress:
        on_line({"iteration": 0, "eval/outcome": 0.5, "kl": 0.01})
        on_line({"iteration": 1, "q/val_spearman": 0.64, "q/val_examples": 16.0, "final/discounted_return": 0.6123})
    printed = capsys.readouterr().out
    assert f"iteration 0 | {name} outcome 0.500 | KL 0.0100" in printed
    assert f"iteration 1 | after: {name} J 0.612 | Q rank corr. 0.64 over 16 turns | KL 0.0000" in printed


def test_the_train_banner_names_the_recipe_the_method_and_the_game():
    from types import SimpleNamespace

    from repertory.cli.train import _banner
    from repertory.config import load_config

    recipe = "ppo-ipd-vs-cooperator"
    config = load_config(recipe, ["iterations=1"]).model_copy(update={"recipe": recipe})
    assert _banner(SimpleNamespace(config=config, run_dir="runs/r")) == (
        "training recipe ppo-ipd-vs-cooperator: omar on ipd (opponent: always-cooperate) with smollm2 + LoRA: "
        "1 iteration of 8 episodes -> runs/r"
    )

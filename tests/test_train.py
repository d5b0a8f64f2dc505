"""The trainer end to end on a tiny model: configs, run directory, resume, learning, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_cli, tiny_checkpoint
from safetensors.torch import load_file

from repertory.cli import main
from repertory.config import RULES, TrainConfig, broken_rule, load_config, recipe_names
from repertory.experiments import load_suite
from repertory.models import load_model, load_tokenizer, tiny_model
from repertory.models.checkpoints import load_policy
from repertory.report.metrics import held_out_change
from repertory.rollout import run_episodes
from repertory.runs import RunDir, resolve_checkpoint
from repertory.store import read_credit, read_episodes
from repertory.train import TIMING_PREFIXES, resume_run, start_run
from repertory.train.batch import collect
from repertory.types import RepertoryError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, tokenizer):
    """A tiny random checkpoint on disk, for the command line."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tokenizer, seed=11)


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=3",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=1",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=2",
            "algo.lr=1e-3",
            "algo.mini_batches=2",
            *extra,
        ],
    )


# configuration


def test_shipped_recipes_load_and_include_the_required_ones():
    names = recipe_names()
    for required in ("default", "omar-trust-and-split", "omar-ipd", "ppo-ipd-vs-cooperator"):
        assert required in names
    for name in names:
        # a suite validates every run's config as it loads
        assert load_suite(name) is not None or isinstance(load_config(name), TrainConfig)
    default = load_config("default")
    assert (default.method.kind, default.method.estimator, default.rollout.env) == ("selfplay", "omar", "ipd")
    assert default.model.name == "smollm2"
    assert default.model.lora.enabled


def test_set_overrides_nested_keys_with_yaml_values():
    config = load_config("default", ["algo.lr=3e-4", "rollout.opponent=always-defect", "algo.dual_clip=3", "name=x"])
    assert config.algo.lr == 3e-4
    assert config.rollout.opponent == "always-defect"
    assert config.algo.dual_clip == 3.0
    assert config.name == "x"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.bogus=1", "algo.bogus: unknown key; allowed here: policy_loss, is_cap"),
        ("method.bogus=1", "method.bogus: unknown key; allowed here: gamma_token, lam, estimator, gamma, whiten"),
        ("method.kind=ppo", "method.kind: unknown method 'ppo'; allowed: selfplay, adalign, igrpo, st-grpo"),
        ("method.estimator=adalign", "method.estimator: unknown estimator 'adalign'; allowed: gae, grpo, omar"),
        ("rollout.envv=ipd", "rollout.envv: unknown key; allowed here: env, env_options, opponent"),
        ("method.estimator=ppo2", "method.estimator: unknown estimator 'ppo2'; allowed: gae, grpo, omar, rae"),
        ("algo.aggregation=mean", "algo.aggregation: Input should be 'token-mean', 'seq-mean-token-mean'"),
        ("iterations=0", "iterations: Input should be greater than or equal to 1"),
        ("algo.lr=fast", "algo.lr: Input should be a valid number"),
        ("rollout.env=chess", "rollout.env: unknown environment 'chess'; allowed: ipd"),
        ("rollout.opponent=tit-for-two-tats", "rollout.opponent: unknown opponent 'tit-for-two-tats' for ipd; allowed"),
        ("lr", "expected key=value"),
        ("iterations.x=1", "iterations is not a section"),
    ],
)
def test_bad_keys_and_values_are_rejected_with_the_key_path(override, expected):
    with pytest.raises(RepertoryError) as err:
        load_config("default", [override])
    assert expected in str(err.value)


def test_feature_rules_are_one_documented_table_and_refuse_in_one_line():
    documented = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    assert [r for r in RULES if f"| {r.feature} | {r.forbids} | {r.why} |" not in documented] == []
    rounds = load_config("igrpo-craigslist")
    assert broken_rule(rounds) is None  # one process: the data-parallel rules hold
    assert broken_rule(rounds, processes=2) == (
        "data-parallel training (--gpus) does not support method kind igrpo (a round method): "
        "it runs an online method in step on every process"
    )
    with pytest.raises(RepertoryError) as err:
        load_config(None, ["model.sharding=fsdp", "rollout.workers=2"])
    assert str(err.value).splitlines()[1] == (
        "  model.sharding fsdp does not support rollout.workers: sharded weights are not sent to workers yet"
    )


def test_bad_recipe_files(tmp_path):
    with pytest.raises(RepertoryError, match="no recipe file"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2\n")
    with pytest.raises(RepertoryError, match="not valid YAML"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(RepertoryError, match="must be a mapping"):
        load_config(str(listy))


# the run directory, resume, learning


def _comparable(lines):
    return [{k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)} for line in lines]


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _adapter(checkpoint):
    return load_file(str(checkpoint / "policy" / "adapter_model.safetensors"))


class _Stop(Exception):
    pass


@pytest.mark.parametrize("precision,gap", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_short_run_writes_a_valid_run_directory_and_resumes_exactly(tmp_path, tokenizer, precision, gap):
    straight = start_run(_config(tmp_path, "straight", f"model.precision={precision}"), tiny_model(tokenizer, seed=2))
    assert straight.learner.precision == precision and straight.backend.precision == precision
    run_dir = straight.fit()
    assert (run_dir / "config.yaml").is_file()
    assert load_config(str(run_dir / "config.yaml")) == straight.config
    episodes = [ep for i in range(3) for ep in read_episodes(run_dir / "episodes" / f"iter-{i:06d}.parquet")]
    assert len(episodes) == 6 and {ep.iteration for ep in episodes} == {0, 1, 2}
    assert all(seat.trainable and seat.policy_id == "live" for ep in episodes for seat in ep.seats)
    lines = _lines(run_dir)
    assert [line["iteration"] for line in lines] == [0, 1, 2]
    for key in ("outcome", "outcome/Alice", "outcome/Bob", "kl", "entropy", "loss/policy", "loss/value", "value/mse"):
        assert key in lines[1], key
    assert lines[1]["advantage/raw_sd"] >= 0 and 0 <= lines[1]["advantage/nonzero_share"] <= 1
    assert "eval/outcome" in lines[0] and "final/outcome" in lines[2]
    # the final evaluation's games are kept, as pi_3's, and are the games its final/ line scores
    final = read_episodes(RunDir(run_dir).heldout(3))
    assert len(final) == 2 and {(ep.iteration, ep.kernel.split) for ep in final} == {(3, "heldout")}
    outcomes = [ep.result.roles[seat.name].outcome for ep in final for seat in ep.seats]
    assert lines[2]["final/outcome"] == pytest.approx(sum(outcomes) / len(outcomes))
    # the hf backend samples the learner's own module at its precision: the gap is rounding, reported; float32's
    # is float noise and takes no correction, bfloat16's takes the truncated importance weights (tis)
    assert 0 < lines[1]["offpolicy/max_gap"] <= gap
    assert (lines[1]["offpolicy/weight_mean"] == 1.0) == (precision == "float32")
    assert [c.name for c in RunDir(run_dir).complete_checkpoints()] == ["000002", "000003"]  # keep_checkpoints = 2
    assert {p.name for p in (run_dir / "report").iterdir()} >= {"outcome.png", "losses.png", "kl_entropy.png"}
    assert (run_dir / "report" / "index.html").is_file()
    credit = [read_credit(run_dir / "credit" / f"iter-{i:06d}.parquet") for i in range(3)]
    trained = [
        {(ep.episode_id, t.seat_id, t.turn_index) for ep in episodes if ep.iteration == i for t in ep.turns}
        for i in range(3)
    ]
    assert [set(c) for c in credit] == trained  # self-play: every turn of every seat is trained and credited
    assert all(ret is not None for c in credit for _, ret in c.values())  # omar has a critic: returns too

    # the same run, killed after iteration 2 with debris a crash could leave, then resumed
    interrupted = start_run(
        _config(tmp_path, "interrupted", f"model.precision={precision}"), tiny_model(tokenizer, seed=2)
    )

    def stop_after_two(line):
        if line["iteration"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        interrupted.fit(stop_after_two)
    broken = interrupted.run_dir
    (broken / "checkpoints" / ".tmp-000003-999").mkdir()
    (broken / "checkpoints" / ".tmp-000003-999" / "optimizer.pt").write_text("half")
    with (broken / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 2, "outc')
    resumed = resume_run(broken, loaded=tiny_model(tokenizer, seed=2))
    assert resumed.iteration == 2
    resumed.fit()
    assert _comparable(_lines(broken)) == _comparable(lines)
    assert [read_credit(broken / "credit" / f"iter-{i:06d}.parquet") for i in range(3)] == credit
    a, b = _adapter(RunDir(run_dir).complete_checkpoints()[-1]), _adapter(RunDir(broken).complete_checkpoints()[-1])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not list((broken / "checkpoints").glob(".tmp-*"))


def test_a_new_run_never_overwrites_an_existing_directory(tmp_path, tokenizer):
    (tmp_path / "taken").mkdir()
    with pytest.raises(RepertoryError, match="already exists"):
        start_run(_config(tmp_path, "taken"), tiny_model(tokenizer))


def _defection_rate(episodes):
    moves = [t.action.value for ep in episodes for s in ep.seats if s.trainable for t in ep.trajectory(s.seat_id)]
    return sum(m == "B" for m in moves) / len(moves)


@pytest.mark.slow
def test_one_tiny_model_in_both_seats_learns_to_defect_like_the_main_job(tmp_path, tokenizer):
    # OMAR's direction at tiny scale, in the main job's shape: one model plays both seats of the IPD in
    # self-play, credited by hierarchical GAE, and is measured against a fixed cooperator. Turn-level gamma 0:
    # each round's credit is that round's reward, which defection raises whatever the other seat plays.
    # Full fine-tuning: with frozen tied embeddings behind an RMSNorm, LoRA on a random 64-wide model cannot
    # open a logit gap between A and B wider than about 1.8 nats (p(B) <= 0.86), whatever the estimator.
    config = _config(
        tmp_path,
        "learn",
        "iterations=6",
        "rollout.kernels_per_iteration=4",
        "eval.episodes=16",
        "eval.opponent=always-cooperate",
        "method.estimator=omar",
        "method.gamma=0",
        "algo.lr=3e-3",
        "model.lora.enabled=false",
    )
    trainer = start_run(config, tiny_model(tokenizer, seed=0))
    run_dir = trainer.fit()
    first = read_episodes(run_dir / "episodes" / "iter-000000.parquet")
    last = read_episodes(run_dir / "episodes" / "iter-000005.parquet")
    assert all(len([s for s in ep.seats if s.trainable]) == 2 for ep in first + last)
    # Measured: 0.42 -> 0.92 (sampling at temperature 1); held-out 0.78 -> 0.97, 12 SE.
    assert _defection_rate(first) < 0.6
    assert _defection_rate(last) > 0.8
    change = held_out_change(_lines(run_dir))
    assert change.rise > 0.1 and change.standard_errors > 2


def test_a_line_up_the_game_lacks_is_named_only_when_the_run_evaluates(tmp_path, tokenizer):
    # The default recipe evaluates against always-cooperate, an IPD bot; Werewolf has none.
    config = load_config("default", [f"output_dir={tmp_path}", "rollout.env=werewolf"])
    with pytest.raises(RepertoryError, match=r"line-up \(eval.opponent\) 'always-cooperate': unknown agent"):
        start_run(config, tiny_model(tokenizer))
    silent = load_config("default", [f"output_dir={tmp_path}", "rollout.env=werewolf", "eval.episodes=0"])
    assert start_run(silent, tiny_model(tokenizer)).lineup.eval_opponent is None


# command line


def test_cli_train_then_eval(tmp_path, tiny_path, capsys):
    main(
        [
            "train",
            "--quiet",
            "--set", f"model.name={tiny_path}",
            "--set", f"output_dir={tmp_path}",
            "--set", "name=cli",
            "--set", "iterations=1",
            "--set", "rollout.kernels_per_iteration=1",
            "--set", "rollout.constrained=true",
            "--set", "eval.episodes=0",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    run_dir = tmp_path / "cli"
    assert f"run: {run_dir}" in printed and "report" in printed
    main(["eval", str(run_dir), "--episodes", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["env"] == "ipd" and result["episodes"] == 2 and set(result["outcome"]) == {"Alice", "Bob"}
    main(["eval", str(run_dir), "--episodes", "2", "--vs", "always-defect", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["opponent"] == "always-defect"
    assert set(result["outcome"]) == {"Alice", "Bob"}  # seats balanced: one game in each
    main(["eval", str(run_dir / "checkpoints" / "000001"), "--episodes", "2"])
    assert "outcome" in capsys.readouterr().out
    main(["eval", str(run_dir), "--episodes", "2", "--vs", f"model:{run_dir}", "--json"])
    assert json.loads(capsys.readouterr().out)["opponent"] == f"model:{run_dir}"


def test_export_writes_the_merged_policy_as_a_plain_checkpoint(tmp_path, tiny_path, capsys):
    run_dir = start_run(_config(tmp_path, "lora", "iterations=1", "eval.episodes=0", f"model.name={tiny_path}")).fit()
    code, printed, _ = run_cli(capsys, "export", str(run_dir), "--out", str(tmp_path / "exported"))
    assert code == 0 and printed.strip() == str(tmp_path / "exported")
    exported = load_model(str(tmp_path / "exported"), "cpu")
    merged = load_policy(*resolve_checkpoint(run_dir), "cpu")
    base = load_model(str(tiny_path), "cpu")
    ids = torch.tensor([exported.tokenizer.encode("Alice: I cooperate. <C/>")])
    with torch.no_grad():
        logits = [m.model(ids).logits for m in (exported, merged, base)]
    torch.testing.assert_close(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])  # the trained adapter is in the weights
    # the exported directory starts a new run like any checkpoint, and is never overwritten
    exported_name = f"model.name={tmp_path / 'exported'}"
    start_run(_config(tmp_path, "again", "iterations=1", "eval.episodes=0", exported_name)).fit()
    code, _, err = run_cli(capsys, "export", str(run_dir), "--out", str(tmp_path / "exported"))
    assert code == 2 and "already exists and is not an empty directory" in err
    code, _, err = run_cli(capsys, "export", str(tmp_path), "--out", str(tmp_path / "other"))
    assert code == 2 and "neither a run directory" in err and not (tmp_path / "other").exists()


def test_training_against_a_frozen_checkpoint_trains_only_the_live_seat(tmp_path, tokenizer, tiny_path):
    # the frozen policy is loaded from disk: its run must name its base model (a LoRA adapter needs it)
    first = start_run(_config(tmp_path, "first", "iterations=1", "eval.episodes=0", f"model.name={tiny_path}"))
    first_dir = first.fit()
    second = start_run(
        _config(tmp_path, "second", "iterations=1", "eval.episodes=0", f"rollout.opponent=model:{first_dir}"),
        tiny_model(tokenizer, seed=2),
    )
    episodes = read_episodes(second.fit() / "episodes" / "iter-000000.parquet")
    for i, ep in enumerate(episodes):
        live, frozen = ep.seats[i % 2], ep.seats[1 - i % 2]
        assert live.trainable and live.policy_id == "live"
        assert not frozen.trainable and frozen.policy_id == "snapshot@1"
        assert ep.trajectory(frozen.seat_id)[0].response_ids  # the frozen model really played


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--set", "method.estimator=nope"], "unknown estimator 'nope'"),
        (["train", "--set", "rollout.bogus=1"], "rollout.bogus: unknown key"),
        (["train", "missing-recipe"], "no recipe file 'missing-recipe'"),
        (["train", "default", "--resume", "runs/x"], "give no recipe"),
        (["eval", "no/such/run"], "neither a run directory"),
        (["eval", "base"], "--env is required"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_train_reports_packed_unpacked_and_limit(tiny_path, capsys):
    main(["bench", "train", "--model", str(tiny_path), "--episodes", "2", "--turns", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    keys = ("train_tok_s", "limit_tok_s", "packed_speedup", "packed_seconds", "unpacked_seconds", "score_seconds")
    for key in (*keys, "score_reused_seconds", "score_reused_speedup"):
        assert result[key] > 0, key
    for key in ("packed_bfloat16_seconds", "bfloat16_limit_tok_s", "bfloat16_speedup"):  # the CPU's bfloat16 step
        assert result[key] > 0, key
    assert result["packed_bfloat16_tokens"] == result["packed_tokens"]
    assert result["trained_tokens"] == 2 * 2 * 3 * 8
    # 2 x 2 seats, each packed into one sequence of 190 + 3 x (48 + 8) tokens
    assert result["packed_tokens"] == 4 * (190 + 3 * 56)
    assert result["unpacked_tokens"] == 4 * sum(190 + k * 56 for k in range(1, 4))


def test_bench_candidates_reports_shared_separate_and_limit(tiny_path, capsys):
    argv = ["bench", "candidates", "--model", str(tiny_path), "-n", "2", "-c", "3", "--prompt-tokens", "40"]
    main([*argv, "--response-tokens", "5", "--json"])
    result = json.loads(capsys.readouterr().out)
    for key in ("limit_tok_s", "shared_speedup", "shared_seconds", "separate_seconds"):
        assert result[key] > 0, key
    assert result["trained_tokens"] == 2 * 3 * 5
    assert result["shared_tokens"] == 2 * (40 + 3 * 5)  # each prompt once, then its three candidates
    assert result["separate_tokens"] == 2 * 3 * (40 + 5)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "candidates", "--model", str(tiny_path), "--candidates", "0"])
    assert exit_info.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_training_against_the_base_model_switches_adapters_off_for_its_seat(tmp_path, tokenizer):
    trainer = start_run(
        _config(tmp_path, "vs-base", "iterations=2", "eval.episodes=0", "rollout.opponent=base", "algo.lr=5e-2",
                "model.precision=float32"),  # fmt: skip
        tiny_model(tokenizer, seed=2),
    )
    run_dir = trainer.fit()
    episodes = read_episodes(run_dir / "episodes" / "iter-000001.parquet")
    batch = collect(episodes)
    trainer.learner.score(batch)
    for i, ep in enumerate(episodes):
        base = ep.seats[1 - i % 2]
        assert (base.policy_id, base.trainable) == ("base", False)
    # after an update the live policy has moved, while the base seat still samples from the initial weights
    base_turns = [t for ep in episodes for t in ep.turns if not ep.seat(t.seat_id).trainable]
    assert all(t.response_ids for t in base_turns)
    assert max(float((x.logp_old - x.logp_ref).abs().max()) for x in batch.experience.values()) > 1e-3
    reference = tiny_model(tokenizer, seed=2)
    prompt, response = base_turns[0].prompt_ids, base_turns[0].response_ids
    with torch.no_grad():
        logits = reference.model(torch.tensor([prompt + response])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    recomputed = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]
    assert max(abs(a - b) for a, b in zip(recomputed, base_turns[0].logp_sample)) < 1e-4


def test_kl_in_reward_mode_lowers_each_turn_reward_by_its_penalty(tmp_path, tokenizer):
    trainer = start_run(
        _config(tmp_path, "kl-reward", "method.estimator=grpo", "algo.kl_mode=reward", "algo.beta_kl=0.5"),
        tiny_model(tokenizer, seed=2),
    )
    episodes = run_episodes(trainer.lineup.specs(0))
    batch = collect(episodes)
    trainer.learner.score(batch)
    for scored in batch.experience.values():
        scored.logp_ref = scored.logp_old - 0.1  # k3 = exp(-0.1) + 0.1 - 1 per token
    captured = {}
    estimator = trainer.method.estimator

    def spy(inputs, params, state):
        captured["rewards"] = [list(t.rewards) for t in inputs]
        return estimator.fn(inputs, params, state)

    trainer.method.estimator = dataclasses.replace(estimator, fn=spy)
    trainer.method.credit(batch, trainer.config.algo)
    k3 = math.exp(-0.1) + 0.1 - 1
    for traj, ref in zip(captured["rewards"], batch.trajectories):
        raw = [t.reward for t in ref.episode.trajectory(ref.seat_id)]
        for k, index in enumerate(ref.samples):
            penalty = 0.5 * k3 * batch.samples[index].n_tokens
            assert traj[k] == pytest.approx(raw[k] - penalty, abs=1e-6)


def test_eval_base_on_a_negotiation_faces_the_bot_from_the_trained_seat(tiny_path, capsys):
    common = ["eval", "base", "--model", str(tiny_path), "--env", "craigslist", "--episodes", "2"]
    main([*common, "--max-new-tokens", "6", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["opponent"] == "bot" and set(result["outcome"]) == {"vendor"}
    assert result["gamma"] == 0.95 and 0.0 <= result["discounted_return"] <= result["mean_outcome"]
    main([*common, "--max-new-tokens", "6", "--vs", "base", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["opponent"] == "base" and set(result["outcome"]) == {"vendor"}
    assert "guard/resampled" in result["metrics"], "a model partner is watched by the partner guard"
    with pytest.raises(SystemExit):
        main([*common, "--max-new-tokens", "0"])
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err


def test_training_on_a_negotiation_trains_the_first_seat_against_a_guarded_partner(tmp_path, tiny_path):
    trainer = start_run(
        _config(tmp_path, "nego", "rollout.env=ultimatum", "rollout.opponent=base", f"model.name={tiny_path}")
    )
    specs = trainer.lineup.specs(0)
    assert all(s.trainable == [True, False] and s.guarded == [False, True] for s in specs)
    assert all(s.agents[0] is trainer.lineup.live for s in specs)

"""Advantage Alignment (algorithms.md 7): group-relative baselines, credits, the truncated-IS loss, the
opponent pool, and the round data the trainer hands to the estimators."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import tiny_checkpoint
from safetensors.torch import load_file

from repertory import algos
from repertory.algos import AlignmentParams, TrajectoryInput, estimators, losses
from repertory.cli import main
from repertory.config import load_config
from repertory.experiments import exploit_gain_loss
from repertory.models import load_tokenizer, tiny_model
from repertory.runs import RunDir
from repertory.train import TIMING_PREFIXES, resume_run, start_run
from repertory.train.batch import collect
from repertory.types import RepertoryError

AA1 = AlignmentParams(gamma=0.96, aa_gamma=0.96, aa_beta=2.0, reward_constant=100.0)


def _traj(episode, points, opponent_points, seat="p0", group="g", env="trust-and-split", rounds=None):
    rounds = rounds if rounds is not None else list(range(len(points)))
    return TrajectoryInput(
        env=env,
        kernel_id="k",
        iteration=0,
        role="player",
        episode_index=episode,
        seat_index=int(seat[1]),
        rewards=[0.0] * len(rounds),
        lengths=[2] * len(rounds),
        group_id=group,
        seat_id=seat,
        turn_rounds=rounds,
        round_points=points,
        opponent_seat_id="p1" if seat == "p0" else "p0",
        opponent_round_points=opponent_points,
    )


def _aa1_batch():
    return [_traj(0, [50, 10, 100], [5, 55, 0]), _traj(1, [27.5, 27.5, 50], [27.5, 10, 50])]


def _credits(name, batch, params=AA1):
    estimate = algos.get_estimator(name).fn(batch, params, {})
    return [[turn[0] if turn else None for turn in traj] for traj in estimate.advantages], estimate.metrics


def test_aa1_returns_baselines_and_credits():
    assert algos.discounted_returns([0.5, 0.1, 1.0], 0.96) == pytest.approx([1.5176, 1.06, 1.0], abs=1e-4)
    metrics: dict[str, float] = {}
    (a1_g1, a2_g1), (a1_g2, a2_g2) = estimators._round_advantages(_aa1_batch(), AA1, metrics)
    assert a1_g1 == pytest.approx([0.5178, 0.3050, 0.5000], abs=1e-4)
    assert a2_g1 == pytest.approx([-0.2538, -0.0300, -0.5000], abs=1e-4)
    assert a1_g2 == pytest.approx([-0.5178, -0.3050, -0.5000], abs=1e-4)
    assert a2_g2 == pytest.approx([0.2538, 0.0300, 0.5000], abs=1e-4)
    expected = {
        "adalign": ([0.5178, 0.2764, -0.2392], [-0.5178, -0.3336, -1.2392]),
        "naive": ([0.5178, 0.3050, 0.5000], [-0.5178, -0.3050, -0.5000]),
        "shared-reward": ([0.2640, 0.2750, 0.0000], [-0.2640, -0.2750, 0.0000]),
    }
    for name, (g1, g2) in expected.items():
        credits, metrics = _credits(name, _aa1_batch())
        assert credits[0] == pytest.approx(g1, abs=1e-4), name
        assert credits[1] == pytest.approx(g2, abs=1e-4), name
        assert metrics["singleton_groups"] == 0


def test_aa2_credit_recursion():
    credits = algos.aa_credits([1, -0.5, 0.2, 0], [0.5, 1, -1, 2], beta=2.0, gamma_aa=0.96)
    assert credits == pytest.approx([1.0, 1.3432, -0.6479, 2.3652], abs=1e-4)
    # beta 0 is the naive credit; the first round never carries shaping.
    assert algos.aa_credits([1, -0.5, 0.2], [9, 9, 9], beta=0.0, gamma_aa=0.9) == [1, -0.5, 0.2]
    assert algos.aa_credits([0.3], [5.0], beta=2.0, gamma_aa=0.9) == [0.3]


def test_aa3_truncated_importance_weighted_loss():
    logp_new = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    logp_sample = torch.tensor([-0.6, -2.0, -2.1], dtype=torch.float64)
    credit = torch.tensor([0.8, 0.8, -0.3], dtype=torch.float64)
    per_token, weights = losses.truncated_is_loss(logp_new, logp_sample, credit, cap=2.0)
    assert weights.tolist() == pytest.approx([1.1052, 2.0, 1.1052], abs=1e-4)
    assert float(per_token.mean()) == pytest.approx(0.4597, abs=1e-4)
    assert not weights.requires_grad


def test_credits_reach_every_token_of_their_round():
    # Trust-and-Split: two turns (message, proposal) per round; turn k of round r gets C_r on all its tokens.
    batch = [
        _traj(0, [50, 10, 100], [5, 55, 0], rounds=[0, 0, 1, 1, 2, 2]),
        _traj(1, [27.5, 27.5, 50], [27.5, 10, 50], rounds=[0, 0, 1, 1, 2, 2]),
    ]
    batch[0].lengths = [3, 1, 2, 0, 4, 2]
    estimate = algos.get_estimator("adalign").fn(batch, AA1, {})
    rows = estimate.advantages[0]
    assert [len(r) for r in rows] == [3, 1, 2, 0, 4, 2]
    assert rows[0] == pytest.approx([0.5178] * 3, abs=1e-4) and rows[1] == pytest.approx([0.5178], abs=1e-4)
    assert rows[4] == pytest.approx([-0.2392] * 4, abs=1e-4)


def test_state_visitation_discount_multiplies_round_t_by_gamma_t():
    params = AlignmentParams(**{**AA1.__dict__, "discount_state_visitation": True})
    credits, _ = _credits("naive", _aa1_batch(), params)
    assert credits[0] == pytest.approx([0.5178, 0.3050 * 0.96, 0.5 * 0.96**2], abs=1e-4)


def test_groups_never_mix_crn_groups_or_seats():
    # Two crn groups of two matches each; mixing them would change every baseline.
    batch = _aa1_batch() + [
        _traj(2, [0, 0, 0], [90, 90, 90], group="h"),
        _traj(3, [100, 100, 100], [0, 0, 0], group="h"),
    ]
    credits, metrics = _credits("naive", batch)
    assert credits[0] == pytest.approx([0.5178, 0.3050, 0.5000], abs=1e-4)
    assert credits[2][0] == pytest.approx(-(1 + 0.96 + 0.96**2), abs=1e-4)
    # The same matches with the trained seat p1 form their own pool: a lone p1 trajectory gets 0, counted.
    lone = _traj(4, [80, 80, 80], [0, 0, 0], seat="p1", group="g")
    credits, metrics = _credits("naive", _aa1_batch() + [lone])
    assert credits[2] == [0.0, 0.0, 0.0]
    assert credits[0] == pytest.approx([0.5178, 0.3050, 0.5000], abs=1e-4)
    assert metrics["singleton_groups"] == 2  # p1's own pool and p0's pool as opponent in that group


def test_singleton_crn_groups_pool_the_batch_per_seat_and_side():
    # IPD (K = 1): every match is its own crn group; the baseline is the rest of the batch, same seat.
    batch = [
        _traj(0, [3, 3], [3, 3], group="a", env="ipd"),
        _traj(1, [5, 5], [0, 0], group="b", env="ipd"),
        _traj(2, [0, 1], [5, 1], seat="p1", group="c", env="ipd"),
        _traj(3, [1, 1], [1, 1], seat="p1", group="d", env="ipd"),
    ]
    params = AlignmentParams(gamma=0.0, reward_constant=1.0, aa_beta=1.0, aa_gamma=1.0)
    metrics: dict[str, float] = {}
    pairs = estimators._round_advantages(batch, params, metrics)
    assert pairs[0][0] == [-2.0, -2.0] and pairs[1][0] == [2.0, 2.0]
    assert pairs[0][1] == [3.0, 3.0] and pairs[1][1] == [-3.0, -3.0]
    assert pairs[2][0] == [-1.0, 0.0] and pairs[2][1] == [4.0, 0.0]
    assert metrics["singleton_groups"] == 0


def test_opponent_advantage_comes_from_the_same_match_whatever_the_batch_order():
    batch = _aa1_batch() + [_traj(2, [10, 20, 30], [70, 0, 20]), _traj(3, [0, 5, 0], [60, 60, 60])]
    reference, _ = _credits("adalign", batch)
    order = list(range(len(batch)))
    random.Random(3).shuffle(order)
    shuffled, _ = _credits("adalign", [batch[i] for i in order])
    for position, i in enumerate(order):
        assert shuffled[position] == pytest.approx(reference[i], abs=1e-12)


def test_naive_ignores_the_opponent_and_aa_depends_on_it_only_through_a2():
    batch = _aa1_batch()
    perturbed = _aa1_batch()
    perturbed[0].opponent_round_points = [99, 0, 42]
    assert _credits("naive", batch)[0] == _credits("naive", perturbed)[0]
    aa, aa_perturbed = _credits("adalign", batch)[0], _credits("adalign", perturbed)[0]
    assert aa[0][0] == aa_perturbed[0][0]  # round 0 has no shaping term
    assert aa[0][1:] != aa_perturbed[0][1:]
    shared = _credits("shared-reward", perturbed)[0]
    metrics: dict[str, float] = {}
    pairs = estimators._round_advantages(perturbed, AA1, metrics)
    assert shared[0] == pytest.approx([x + y for x, y in zip(*pairs[0])], abs=1e-12)


def test_round_estimators_refuse_games_without_rounds_and_bad_rounds():
    plain = TrajectoryInput("craigslist", "k", 0, "vendor", 0, 0, [0.0, 0.5], [3, 2])
    with pytest.raises(RepertoryError, match="round-based two-player games"):
        algos.get_estimator("adalign").fn([plain], AA1, {})
    bad = _traj(0, [1, 2], [2, 1], rounds=[0, 5])
    with pytest.raises(RepertoryError, match="round 5"):
        algos.get_estimator("naive").fn([bad, _traj(1, [1, 2], [2, 1], rounds=[0, 1])], AA1, {})


def test_strict_mode_refuses_a_lone_match():
    params = AlignmentParams(**{**AA1.__dict__, "strict": True})
    with pytest.raises(RepertoryError, match="single match"):
        algos.get_estimator("naive").fn([_traj(0, [1, 2], [2, 1])], params, {})


# the trainer: round data, opponent pool


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _aa_config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=2",
            "rollout.env=ipd",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=4",
            "rollout.episodes_per_kernel=1",
            "eval.episodes=0",
            "method.kind=adalign",
            "algo.policy_loss=tis",
            "method.reward_constant=5",
            "algo.mini_batches=1",
            "algo.lr=1e-3",
            *extra,
        ],
    )


def test_episodes_carry_raw_round_points_for_the_estimators(tmp_path, tokenizer):
    trainer = start_run(
        _aa_config(
            tmp_path,
            "rounds",
            "rollout.env=trust-and-split",
            "rollout.max_new_tokens=4",
            "rollout.constrained=false",
            "rollout.kernels_per_iteration=1",
            "rollout.episodes_per_kernel=2",
        ),
        tiny_model(tokenizer, seed=1),
    )
    specs = trainer.lineup.specs(0)
    assert specs[0].episode_seed == specs[1].episode_seed  # one crn group shares its environment seed
    from repertory.rollout import run_episodes

    episodes = run_episodes(specs)
    inputs = collect(episodes).estimator_inputs()
    assert len(inputs) == 4  # self-play: both seats of both matches are trained
    for traj in inputs:
        episode = episodes[traj.episode_index]
        seat = episode.seat(traj.seat_id)
        other = next(s for s in episode.seats if s.seat_id != traj.seat_id)
        assert traj.group_id == episode.group_id and traj.opponent_seat_id == other.seat_id
        assert traj.turn_rounds == [r for r in range(10) for _ in range(2)]  # message + proposal per round
        assert sum(traj.round_points) == pytest.approx(episode.result.roles[seat.name].points)
        assert sum(traj.opponent_round_points) == pytest.approx(episode.result.roles[other.name].points)


def test_opponent_pool_snapshots_alternating_seats_and_adapter_switching(tmp_path, tokenizer):
    config = _aa_config(
        tmp_path, "pool", "rollout.opponent=pool", "method.pool.snapshot_every=1", "method.pool.p_snapshot=0.75"
    )
    trainer = start_run(config, tiny_model(tokenizer, seed=2))
    trainable_before = {n for n, p in trainer.learner.peft.named_parameters() if p.requires_grad}
    run_dir = trainer.fit()
    assert sorted(p.name for p in (run_dir / "snapshots").iterdir()) == ["000000.safetensors", "000001.safetensors"]
    specs = trainer.lineup.specs(1)
    for g, spec in enumerate(specs):
        assert spec.trainable == [g % 2 == 0, g % 2 == 1]  # crn group g trains seat g mod 2
        assert spec.agents[g % 2] is trainer.lineup.live
    opponents = [spec.agents[1 - g % 2].name for g, spec in enumerate(specs)]
    assert set(opponents) <= {"live", "snapshot@0", "snapshot@1"} and any(o.startswith("snapshot@") for o in opponents)
    # The same draws again: opponents are a function of (seed, iteration, match).
    assert [spec.agents[1 - g % 2].name for g, spec in enumerate(trainer.lineup.specs(1))] == opponents
    # Serving snapshots never changes what the optimizer trains.
    assert {n for n, p in trainer.learner.peft.named_parameters() if p.requires_grad} == trainable_before
    assert trainer.learner.peft.active_adapter == "default"


class _Stop(Exception):
    pass


def test_a_pool_run_resumed_after_a_kill_equals_the_uninterrupted_run(tmp_path, tokenizer):
    # micro-batches of about a sequence, on the exact path: the sampler's log-probs stand for the old policy's
    # beyond the first
    extra = (
        "model.precision=float32",
        "rollout.opponent=pool",
        "method.pool.snapshot_every=1",
        "method.pool.p_snapshot=0.5",
        "iterations=3",
        "algo.micro_batch_tokens=128",
    )
    straight = start_run(_aa_config(tmp_path, "straight", *extra), tiny_model(tokenizer, seed=2))
    straight.fit()
    interrupted = start_run(_aa_config(tmp_path, "interrupted", *extra), tiny_model(tokenizer, seed=2))

    def stop_after_two(line):
        if line["iteration"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        interrupted.fit(stop_after_two)
    resumed = resume_run(interrupted.run_dir, loaded=tiny_model(tokenizer, seed=2))
    assert resumed.iteration == 2
    resumed.fit()

    def lines(run_dir):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING_PREFIXES)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]

    assert lines(interrupted.run_dir) == lines(straight.run_dir)
    assert lines(straight.run_dir)[2]["pool/snapshots"] == 3
    assert all(0 < line["offpolicy/rescored_frac"] < 1 for line in lines(straight.run_dir))
    a = load_file(str(RunDir(straight.run_dir).complete_checkpoints()[-1] / "policy" / "adapter_model.safetensors"))
    b = load_file(str(RunDir(interrupted.run_dir).complete_checkpoints()[-1] / "policy" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_snapshot_answers_with_its_own_weights(tmp_path, tokenizer):
    from repertory.agents import Request
    from repertory.types import Message

    config = _aa_config(
        tmp_path, "weights", "rollout.opponent=pool", "method.pool.p_snapshot=1", "rollout.max_new_tokens=8"
    )
    trainer = start_run(config, tiny_model(tokenizer, seed=2))
    trainer.fit()  # snapshot 0 is the initial adapter (= the base model); the live adapter has moved since
    (snapshot,) = trainer.lineup.pool.serve(1)
    request = Request("e", 0, "Alice", [Message("user", "Round 1. Choose.")], {}, choices=None)
    with torch.no_grad():
        from_snapshot = snapshot.act([request])[0]
        with trainer.learner.peft.disable_adapter():
            from_base = trainer.lineup.live.act([request])[0]
        trainer.backend.reset_cache()  # the cached prefix was computed without the adapter
        from_live = trainer.lineup.live.act([request])[0]
    assert from_snapshot.logp_sample == pytest.approx(from_base.logp_sample, abs=1e-5)
    assert from_live.logp_sample != pytest.approx(from_base.logp_sample, abs=1e-5)


def test_pool_needs_lora(tmp_path, tokenizer):
    config = _aa_config(tmp_path, "full", "rollout.opponent=pool", "model.lora.enabled=false")
    with pytest.raises(RepertoryError, match="LoRA"):
        start_run(config, tiny_model(tokenizer, seed=2))


# exploitability (8.3)


def test_x1_exploiter_gain_and_victim_loss():
    gain, loss = exploit_gain_loss(exploiter_before=0.40, exploiter_after=0.52, victim_before=0.45, victim_after=0.41)
    assert gain == pytest.approx(0.12, abs=1e-12) and loss == pytest.approx(0.04, abs=1e-12)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, tokenizer):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", tokenizer, seed=0)


@pytest.mark.slow
def test_exploit_command_finds_the_always_cooperate_bot_exploitable(tmp_path, tiny_path, capsys):
    # Full fine-tuning: LoRA on a random 64-wide model cannot open a wide gap between A and B (test_train).
    main(
        [
            "eval", "exploit", "--env", "ipd", "--victim", "always-cooperate", "--iterations", "5", "--seeds", "2",
            "-n", "8", "--out", str(tmp_path / "exploit"), "--json",
            "--set", f"model.name={tiny_path}", "--set", "model.lora.enabled=false",
            "--set", "rollout.constrained=true", "--set", "rollout.kernels_per_iteration=8",
            "--set", "algo.lr=3e-3", "--set", "algo.mini_batches=2",
        ]
    )  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert [r["seed"] for r in result["runs"]] == [0, 1]
    for run in result["runs"]:
        assert run["gain"] == pytest.approx(run["exploiter_after"] - run["exploiter_before"])
        # Whatever the exploiter gains by defecting more, the cooperator loses (0 instead of 3 per round).
        assert run["gain"] > 0.1 and run["loss"] > 0.1
        assert (tmp_path / "exploit" / f"exploiter-seed{run['seed']}" / "metrics.jsonl").is_file()
    # Always-cooperate in self-play scores 3 of 5 per round.
    assert result["victim_selfplay"] == pytest.approx(0.6) and result["exploitable"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "exploit", "--env", "ipd"], "exploit needs --env and --victim"),
        (["eval", "exploit", "--env", "ipd", "--victim", "nobody"], "--victim nobody: unknown agent 'nobody' for ipd"),
        (["eval", "exploit", "--env", "ipd", "--victim", "always-defect", "--seeds", "0"], "at least 1"),
        (["eval", "base", "--env", "ipd", "--victim", "always-defect"], "No such option: --victim"),
    ],
)
def test_exploit_command_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and "Traceback" not in err


def _cooperation(line):
    return (line["env/cooperation_rate/Alice"] + line["env/cooperation_rate/Bob"]) / 2


@pytest.mark.slow
def test_naive_self_play_drifts_to_defection_while_adalign_keeps_cooperating(tmp_path, tokenizer):
    # The same tiny model, seeds and budget; both seats live and trained (no pool: snapshots need LoRA, and
    # LoRA on a random 64-wide model barely moves the A/B logits, see test_train). Only the credit differs.
    rates = {}
    for estimator in ("naive", "adalign"):
        config = _aa_config(
            tmp_path,
            estimator,
            f"method.estimator={estimator}",
            "method.aa_beta=2",
            "algo.beta_kl=0",
            "algo.lr=3e-3",
            "model.lora.enabled=false",
            "iterations=6",
            "rollout.kernels_per_iteration=8",
        )
        lines = []
        start_run(config, tiny_model(tokenizer, seed=0)).fit(lines.append)
        rates[estimator] = [_cooperation(line) for line in lines]
    assert rates["naive"][0] == rates["adalign"][0]  # the same first rollout
    assert rates["naive"][-1] < rates["naive"][0] - 0.3
    assert rates["adalign"][-1] > rates["naive"][-1] + 0.2

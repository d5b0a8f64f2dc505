"""Advantage estimators and losses: every worked example of algorithms.md 2-4 and the invariants of section 9."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from repertory.algos import ESTIMATORS, TrajectoryInput, TurnParams, get_estimator, register_estimator, whiten
from repertory.algos.losses import (
    AGGREGATIONS,
    TokenTerms,
    ValueTerms,
    aggregate,
    aggregation_weights,
    entropy_from_logits,
    kl_penalty,
    objective,
    policy_loss,
    reinforce_loss,
    rollout_correction,
    sampler_mismatch,
    value_loss,
)
from repertory.config import AlgoConfig
from repertory.types import RepertoryError

TOL = 1e-4
CRITIC_FREE = ("grpo", "rloo", "reinforce", "rae", "reinforce-pp")

# The Advantage Alignment family reads per-round points and has its own invariant tests
# (tests/test_advantage_alignment.py: batch shuffling, seat isolation through A2 only).
ROUND_ESTIMATORS = {"adalign", "naive", "shared-reward"}
TURN_ESTIMATORS = sorted(set(ESTIMATORS) - ROUND_ESTIMATORS)


def traj(
    rewards,
    lengths=None,
    values=None,
    *,
    role="buyer",
    episode=0,
    seat=0,
    kernel="k7",
    iteration=0,
    env="bargain",
) -> TrajectoryInput:
    lengths = [len(v) for v in values] if lengths is None and values is not None else lengths
    return TrajectoryInput(
        env, kernel, iteration, role, episode, seat, list(rewards), lengths or [1] * len(rewards), values
    )


def close(actual, expected, tol=TOL):
    actual, expected = list(actual), list(expected)
    return len(actual) == len(expected) and all(abs(a - e) <= tol for a, e in zip(actual, expected))


def scalars(estimate) -> list[float]:
    """One advantage per trajectory (critic-free estimators with a single turn)."""
    return [turns[-1][0] for turns in estimate.advantages]


# ----- O1-O3: OMAR on the 2-seat, 3-turn example ---------------------------------------------------------------

O_PARAMS = TurnParams(gamma=0.9, lambda_turn=0.8, gamma_token=1.0, lambda_token=0.9, lam=0.9)
V_A = [[0.20, 0.30], [0.35, 0.40, 0.50], [0.60, 0.70]]
V_B = [[0.10, 0.00, -0.10], [-0.20, -0.10], [0.10, 0.20]]
R_A = [0.0, 0.0, 1.0]
R_B = [0.0, -0.1, 0.3]


def o_seats() -> list[TrajectoryInput]:
    return [
        traj(R_A, values=copy.deepcopy(V_A), role="buyer", seat=0),
        traj(R_B, values=copy.deepcopy(V_B), role="seller", seat=1),
    ]


def stage1_reference(rewards, values, gamma, lam):
    """Section 2.2 written out independently: (A_turn, Ret_turn)."""
    v_turn = [v[-1] for v in values] + [0.0]
    a_turn = [0.0] * (len(rewards) + 1)
    for k in reversed(range(len(rewards))):
        a_turn[k] = rewards[k] + gamma * v_turn[k + 1] - v_turn[k] + gamma * lam * a_turn[k + 1]
    return a_turn[:-1], [a + v for a, v in zip(a_turn, v_turn)]


def test_o1_stage1_turn_level_gae():
    est = get_estimator("omar").fn(o_seats(), O_PARAMS, {})
    a_turn = [[turn[-1] for turn in adv] for adv in est.advantages]
    ret_turn = [[turn[-1] for turn in ret] for ret in est.returns]
    assert close(a_turn[0], [0.3991, 0.3460, 0.3000]) and close(ret_turn[0], [0.6991, 0.8460, 1.0000])
    assert close(a_turn[1], [0.1914, 0.2520, 0.1000]) and close(ret_turn[1], [0.0914, 0.1520, 0.3000])
    assert abs(a_turn[0][0] - 0.39912) < 1e-9


def test_o2_stage2_token_level_gae():
    est = get_estimator("omar").fn(o_seats(), O_PARAMS, {})
    expected_a = [
        [[0.4592, 0.3991], [0.4203, 0.4114, 0.3460], [0.3700, 0.3000]],
        [[-0.0349, 0.0723, 0.1914], [0.3268, 0.2520], [0.1900, 0.1000]],
    ]
    expected_g = [
        [[0.6592, 0.6991], [0.7703, 0.8114, 0.8460], [0.9700, 1.0000]],
        [[0.0651, 0.0723, 0.0914], [0.1268, 0.1520], [0.2900, 0.3000]],
    ]
    for seat in range(2):
        for k in range(3):
            assert close(est.advantages[seat][k], expected_a[seat][k])
            assert close(est.returns[seat][k], expected_g[seat][k])
    assert est.metrics["dropped_trajectories"] == 0


@pytest.mark.parametrize("gamma_t,lambda_t", [(1.0, 0.9), (0.97, 0.5), (1.0, 1.0)])
def test_o2_turn_boundary_identities(gamma_t, lambda_t):
    params = TurnParams(gamma=0.9, lambda_turn=0.8, gamma_token=gamma_t, lambda_token=lambda_t)
    est = get_estimator("omar").fn(o_seats(), params, {})
    for i, (rewards, values) in enumerate([(R_A, V_A), (R_B, V_B)]):
        a_turn, ret_turn = stage1_reference(rewards, values, 0.9, 0.8)
        for k, v in enumerate(values):
            assert abs(est.advantages[i][k][-1] - a_turn[k]) < 1e-6
            assert abs(est.returns[i][k][-1] - ret_turn[k]) < 1e-6
            if gamma_t == lambda_t == 1.0:
                assert close(est.advantages[i][k], [ret_turn[k] - x for x in v], 1e-9)


def test_omar_stage2_never_bootstraps_across_turns():
    """Stage 1 reads only the last-token value of each turn: other tokens of turn k+1 cannot reach turn k."""
    base = get_estimator("omar").fn(o_seats(), O_PARAMS, {})
    seats = o_seats()
    seats[0].values[1][0] = 5.0  # first token of turn 1
    moved = get_estimator("omar").fn(seats, O_PARAMS, {})
    assert moved.advantages[0][0] == base.advantages[0][0]
    assert moved.advantages[0][2] == base.advantages[0][2]
    assert moved.advantages[0][1][0] != base.advantages[0][1][0]
    # MT-PPO, by contrast, bootstraps turn 0's last token from turn 1's first token (section 3).
    gae_base = get_estimator("gae").fn(o_seats(), O_PARAMS, {})
    gae_moved = get_estimator("gae").fn(seats, O_PARAMS, {})
    assert gae_moved.advantages[0][0][-1] != gae_base.advantages[0][0][-1]


def test_o3_whitening_over_all_tokens():
    est = get_estimator("omar").fn(o_seats(), O_PARAMS, {})
    flat = [a for seat in est.advantages for turn in seat for a in turn]
    assert len(flat) == 14
    mean = sum(flat) / 14
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / 13)
    assert abs(mean - 0.271685) < 1e-5 and abs(std - 0.149041) < 1e-5
    white = whiten(est.advantages)
    assert [[len(t) for t in seat] for seat in white] == [[2, 3, 2], [3, 2, 2]]
    expected = [1.2582, 0.8550, 0.9969, 0.9374, 0.4986, 0.6596, 0.1900]
    expected += [-2.0573, -1.3378, -0.5384, 0.3698, -0.1321, -0.5481, -1.1519]
    assert close([a for seat in white for turn in seat for a in turn], expected)


def test_whitening_fewer_than_two_tokens_gives_zeros():
    assert whiten([[[3.5], []]]) == [[[0.0], []]]
    assert whiten([[[]]]) == [[[]]]


# ----- O4-O6: losses -------------------------------------------------------------------------------------------

O4_ADV = torch.tensor([1.0, -0.5, 0.8, -1.2, 0.3], dtype=torch.float64)
O4_OLD = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7], dtype=torch.float64)
O4_NEW = [-0.7, -2.4, -0.6, -1.0, -0.7]


def test_o4_ppo_clip_and_aggregations():
    new = torch.tensor(O4_NEW, dtype=torch.float64, requires_grad=True)
    loss, clipped = policy_loss(new, O4_OLD, O4_ADV, eps_low=0.2, eps_high=0.2)
    assert close(torch.exp(new - O4_OLD).tolist(), [1.3499, 0.6703, 0.9048, 1.6487, 1.0000])
    assert close(loss.tolist(), [-1.2000, 0.4000, -0.7239, 1.9785, -0.3000])
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0] and clipped.mean().item() == pytest.approx(0.4)
    lengths = [2, 3]
    assert aggregate(loss, lengths, "token-mean").item() == pytest.approx(0.0309, abs=TOL)
    assert aggregate(loss, lengths, "seq-mean-token-mean").item() == pytest.approx(-0.0409, abs=TOL)
    assert close([loss[:2].mean().item(), loss[2:].mean().item()], [-0.4000, 0.3182])
    assert aggregate(loss, lengths, "seq-mean-token-sum").item() == pytest.approx(0.0773, abs=TOL)
    dual, dual_clipped = policy_loss(new, O4_OLD, O4_ADV, dual_clip=3.0)
    assert torch.equal(dual, loss) and torch.equal(dual_clipped, clipped)
    # Clipped tokens carry no gradient; unclipped ones carry -A * rho.
    aggregate(loss, lengths, "seq-mean-token-sum").backward()
    rho = torch.exp(new.detach() - O4_OLD)
    expected_grad = [0.0, 0.0, -0.8 * rho[2].item() / 2, 1.2 * rho[3].item() / 2, -0.3 * rho[4].item() / 2]
    assert close(new.grad.tolist(), expected_grad, 1e-9)


def test_dual_clip_bounds_negative_advantages():
    loss, _ = policy_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([-1.0]), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)  # -min(e^2 * -1, 1.2 * -1) = e^2 = 7.39, bounded by -3 * A
    with pytest.raises(RepertoryError):
        policy_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0]), dual_clip=1.0)


def test_reinforce_loss_is_minus_advantage_times_logp():
    logp = torch.tensor([-0.5, -2.0], requires_grad=True)
    loss = reinforce_loss(logp, torch.tensor([2.0, -1.0]))
    assert loss.tolist() == [1.0, -2.0]
    loss.sum().backward()
    assert logp.grad.tolist() == [-2.0, 1.0]


def test_o5_value_clip():
    v_new = torch.tensor([0.8, 0.1], requires_grad=True)
    loss = value_loss(v_new, torch.tensor([0.5, 0.2]), torch.tensor([1.0, 0.0]), eps_v=0.2)
    assert close(loss.tolist(), [0.0450, 0.0050])
    assert aggregate(loss, [2], "token-mean").item() == pytest.approx(0.0250, abs=TOL)
    loss.sum().backward()  # token 0: the clipped term wins, so no gradient flows to v_new
    assert close(v_new.grad.tolist(), [0.0, 0.1], 1e-6)


def test_o6_kl_estimators_and_entropy():
    new = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-1.2, -0.7], dtype=torch.float64)
    assert close(kl_penalty(new, ref, "k1").tolist(), [0.2000, -0.3000])
    assert close(kl_penalty(new, ref, "k2").tolist(), [0.0200, 0.0450])
    assert close(kl_penalty(new, ref, "k3").tolist(), [0.0187, 0.0499])
    logits = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    assert close(torch.softmax(logits, -1)[0].tolist(), [0.6652, 0.2447, 0.0900])
    assert entropy_from_logits(logits).tolist() == pytest.approx([0.8324], abs=TOL)
    assert entropy_from_logits(logits, temperature=0.5).tolist() == pytest.approx([0.4411], abs=TOL)
    assert entropy_from_logits(torch.zeros(3, 4, 5)).shape == (3, 4)


def test_kl_clamps_far_apart_policies():
    new, ref = torch.tensor([-100.0, -1.0, -1.0]), torch.tensor([-1.0, -100.0, -4.0])
    assert kl_penalty(new, ref, "k3").tolist() == [10.0, 10.0, pytest.approx(math.exp(-3) + 2)]
    assert kl_penalty(new, ref, "k1").tolist() == [-20.0, 20.0, 3.0]
    assert kl_penalty(new, ref, "k2").tolist() == [200.0, 200.0, 4.5]
    with pytest.raises(RepertoryError, match="k1, k2, k3"):
        kl_penalty(torch.tensor([0.0]), torch.tensor([0.0]), "k4")


@given(
    st.lists(st.floats(-50, 0, allow_nan=False), min_size=1, max_size=20),
    st.lists(st.floats(-50, 0, allow_nan=False), min_size=1, max_size=20),
)
def test_k3_nonnegative_everywhere_and_zero_on_equal_policies(new, ref):
    """Invariant 9."""
    n = min(len(new), len(ref))
    for dtype in (torch.float32, torch.float64):
        a, b = torch.tensor(new[:n], dtype=dtype), torch.tensor(ref[:n], dtype=dtype)
        assert bool((kl_penalty(a, b, "k3") >= 0).all())
        assert bool((kl_penalty(a, a, "k3") == 0).all())


# ----- aggregation (invariant 7) -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_reproduce_the_mini_batch(mode):
    lengths = [3, 0, 1, 5, 2]
    torch.manual_seed(0)
    old = torch.randn(11, dtype=torch.float64)
    adv = torch.randn(11, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(11, dtype=torch.float64)).requires_grad_()

    whole = aggregate(policy_loss(logp, old, adv)[0], lengths, mode)
    (whole_grad,) = torch.autograd.grad(whole, logp)

    weights = aggregation_weights(lengths, mode, dtype=torch.float64)
    assert weights.shape == (11,)
    # One sample per micro-batch (N x 1), the mini-batch weights sliced per micro-batch.
    total, start = 0.0, 0
    logp.grad = None
    for n in lengths:
        part = slice(start, start + n)
        micro = (weights[part] * policy_loss(logp[part], old[part], adv[part])[0]).sum()
        micro.backward()
        total += micro.item()
        start += n
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(logp.grad, whole_grad, rtol=1e-6, atol=1e-12)


def test_aggregation_weights_values():
    assert aggregation_weights([2, 0, 3], "token-mean").tolist() == pytest.approx([0.2] * 5)
    assert aggregation_weights([2, 0, 3], "seq-mean-token-mean").tolist() == pytest.approx([0.25] * 2 + [1 / 6] * 3)
    assert aggregation_weights([2, 0, 3], "seq-mean-token-sum").tolist() == pytest.approx([0.5] * 5)
    assert aggregation_weights([0, 0], "token-mean").numel() == 0
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert aggregate(per_token, [1, 3], "seq-mean-token-mean").item() == pytest.approx((1.0 + 3.0) / 2)
    with pytest.raises(RepertoryError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        aggregation_weights([1], "sum")
    with pytest.raises(RepertoryError):
        aggregate(per_token, [2, 3], "token-mean")


# ----- P1-P2: MT-PPO -------------------------------------------------------------------------------------------


def flat(rows) -> list[float]:
    return [a for turn in rows for a in turn]


def test_p1_mt_ppo_token_gae():
    est = get_estimator("gae").fn(o_seats(), O_PARAMS, {})
    assert close(flat(est.advantages[0]), [0.5425, 0.4917, 0.4907, 0.4897, 0.4330, 0.3700, 0.3000])
    assert close(flat(est.returns[0]), [0.7425, 0.7917, 0.8407, 0.8897, 0.9330, 0.9700, 1.0000])
    assert close(flat(est.advantages[1]), [-0.0203, 0.0886, 0.2095, 0.3439, 0.2710, 0.1900, 0.1000])
    assert close(flat(est.returns[1]), [0.0797, 0.0886, 0.1095, 0.1439, 0.1710, 0.2900, 0.3000])
    assert [len(t) for t in est.advantages[1]] == [3, 2, 2]


@pytest.mark.parametrize("name", ["gae", "omar"])
def test_p2_empty_turns_between_turns_change_nothing(name):
    base = get_estimator(name).fn(o_seats(), O_PARAMS, {})
    padded = traj(
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [0, 2, 0, 0, 3, 2, 0],
        [[], [0.20, 0.30], [], [], [0.35, 0.40, 0.50], [0.60, 0.70], []],
    )
    est = get_estimator(name).fn([padded], O_PARAMS, {})
    assert est.advantages[0] == [[], base.advantages[0][0], [], [], base.advantages[0][1], base.advantages[0][2], []]
    assert est.returns[0] == [[], base.returns[0][0], [], [], base.returns[0][1], base.returns[0][2], []]


@pytest.mark.parametrize("name", ["gae", "omar"])
def test_empty_turn_rewards_move_to_the_next_retained_turn(name):
    values = [[0.2, 0.3], [0.35, 0.4, 0.5], [0.6, 0.7]]
    rewards = [0.4, 0.15, 0.25, 0.0, 0.5, 0.0, 0.1]
    moved = traj(rewards, [2, 0, 3, 0, 2, 0, 0], [values[0], [], values[1], [], values[2], [], []])
    equivalent = traj([0.4, 0.25 + 0.15, 0.5 + 0.1], values=copy.deepcopy(values))
    est, ref = (get_estimator(name).fn([t], O_PARAMS, {}) for t in (moved, equivalent))
    assert [t for t in est.advantages[0] if t] == ref.advantages[0]
    assert [t for t in est.returns[0] if t] == ref.returns[0]
    shifted = traj([0.0, 0.3, 0.0, 0.0], [2, 0, 3, 2], [values[0], [], values[1], values[2]])
    reference = traj([0.0, 0.3, 0.0], values=copy.deepcopy(values))
    est, ref = (get_estimator(name).fn([t], O_PARAMS, {}) for t in (shifted, reference))
    assert [t for t in est.advantages[0] if t] == ref.advantages[0]


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_trajectory_without_retained_turn_contributes_nothing(name):
    dead = traj([1.0, 2.0], [0, 0], [[], []], episode=1)
    live = [traj([1.0], values=[[0.5]], episode=e) for e in (0, 2)]
    est = get_estimator(name).fn([live[0], dead, live[1]], TurnParams(), {})
    assert est.advantages[1] == [[], []]
    assert est.metrics["dropped_trajectories"] == 1
    if est.returns is not None:
        assert est.returns[1] == [[], []]
    if "singleton_groups" in est.metrics:
        assert est.metrics["singleton_groups"] == 0  # the dead seat is not a group member


# ----- C1-C5: critic-free estimators ---------------------------------------------------------------------------

BUYER_R = [1.0, 0.0, 0.5, 0.5]
SELLER_R = [0.2, 0.9, 0.4, 0.6]


def c1_batch(kernel="k7") -> list[TrajectoryInput]:
    """4 self-play episodes, buyer in seat 0 and seller in seat 1, interleaved as rollouts store them."""
    batch = []
    for e, (rb, rs) in enumerate(zip(BUYER_R, SELLER_R)):
        batch.append(traj([rb], role="buyer", episode=e, seat=0, kernel=kernel))
        batch.append(traj([rs], role="seller", episode=e, seat=1, kernel=kernel))
    return batch


def by_role(estimate, batch) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for t, a in zip(batch, scalars(estimate)):
        out.setdefault(t.role, []).append(a)
    return out


def test_c1_grpo_groups_per_role():
    batch = c1_batch()
    est = get_estimator("grpo").fn(batch, TurnParams(), {})
    got = by_role(est, batch)
    assert close(got["buyer"], [1.2247, -1.2247, 0.0, 0.0])
    assert close(got["seller"], [-1.0884, 1.2558, -0.4186, 0.2512])
    assert est.metrics["singleton_groups"] == 0
    # The forbidden output: one normalisation group pooling both roles.
    pooled = BUYER_R + SELLER_R
    mean = sum(pooled) / 8
    std = math.sqrt(sum((r - mean) ** 2 for r in pooled) / 7)
    forbidden = [(r - mean) / (std + 1e-6) for r in BUYER_R]
    assert close(forbidden, [1.4711, -1.5465, -0.0377, -0.0377])
    assert not close(got["buyer"], forbidden, 1e-2)
    none = by_role(get_estimator("grpo").fn(batch, TurnParams(grpo_scale="none"), {}), batch)
    assert close(none["buyer"], [0.5, -0.5, 0.0, 0.0])
    assert close(none["seller"], [-0.3250, 0.3750, -0.1250, 0.0750])


def test_c2_rloo():
    batch = c1_batch()
    got = by_role(get_estimator("rloo").fn(batch, TurnParams(), {}), batch)
    assert close(got["buyer"], [0.6667, -0.6667, 0.0, 0.0])
    assert close(got["seller"], [-0.4333, 0.5000, -0.1667, 0.1000])


def test_reinforce_pp_subtracts_group_mean_and_is_whitened_by_default():
    batch = c1_batch()
    got = by_role(get_estimator("reinforce-pp").fn(batch, TurnParams(), {}), batch)
    assert close(got["buyer"], [0.5, -0.5, 0.0, 0.0])
    assert close(got["seller"], [-0.3250, 0.3750, -0.1250, 0.0750])
    assert get_estimator("reinforce-pp").whiten and not get_estimator("grpo").whiten


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce-pp"])
def test_c3_all_equal_groups_are_exactly_zero_and_singletons_counted(name):
    fn = get_estimator(name).fn
    equal = [traj([0.3], episode=e) for e in range(3)]
    assert scalars(fn(equal, TurnParams(), {})) == [0.0, 0.0, 0.0]
    # Values where the unguarded formulas leave float noise (mean of three 0.1, leave-one-out over six).
    for r, n in [(0.1, 3), (0.1, 7), (0.7, 3)]:
        assert scalars(fn([traj([r], episode=e) for e in range(n)], TurnParams(), {})) == [0.0] * n
    equal_sums = [traj([0.25, 0.5], episode=0), traj([0.5, 0.25], episode=1), traj([0.75, 0.0], episode=2)]
    assert [a for t in fn(equal_sums, TurnParams(), {}).advantages for turn in t for a in turn] == [0.0] * 6
    lone = fn([traj([5.0], role="seller")], TurnParams(), {})
    assert scalars(lone) == [0.0] and lone.metrics["singleton_groups"] == 1
    mixed = fn(equal + [traj([5.0], role="seller", seat=1)], TurnParams(), {})
    assert mixed.metrics["singleton_groups"] == 1 and scalars(mixed)[-1] == 0.0
    with pytest.raises(RepertoryError, match="single member"):
        fn([traj([5.0])], TurnParams(strict=True), {})


def test_c4_ema_baseline_per_trajectory():
    state: dict = {}
    batch = [traj([r], episode=e) for e, r in enumerate([1.0, -1.0, 1.0])]
    assert close(scalars(get_estimator("reinforce").fn(batch, TurnParams(), state)), [1.0000, -1.0500, 1.0025])
    assert state["ema"]["bargain|buyer"] == pytest.approx(0.047625, abs=1e-12)
    baselines = []
    state = {}
    for t in batch:
        get_estimator("reinforce").fn([t], TurnParams(), state)
        baselines.append(state["ema"]["bargain|buyer"])
    assert close(baselines, [0.0500, -0.0025, 0.047625], 1e-12)


def test_c4_ema_baseline_per_batch():
    state: dict = {}
    params = TurnParams(ema_update="per_batch")
    first = get_estimator("reinforce").fn([traj([1.0], episode=0), traj([-1.0], episode=1)], params, state)
    assert scalars(first) == [1.0, -1.0] and state["ema"]["bargain|buyer"] == 0.0
    second = get_estimator("reinforce").fn([traj([1.0], episode=0)], params, state)
    assert scalars(second) == [1.0] and state["ema"]["bargain|buyer"] == pytest.approx(0.05)


def test_c5_rae_discounts_per_turn():
    state: dict = {}
    batch = [traj([1.0], episode=0), traj([-1.0], episode=1), traj([0.0, 0.0, 1.0], [2, 1, 3], episode=2)]
    est = get_estimator("rae").fn(batch, TurnParams(gamma=0.9, ema_update="per_batch"), state)
    assert close(scalars(est), [1.0, -1.05, 1.0025])
    assert close([turn[0] for turn in est.advantages[2]], [0.8120, 0.9023, 1.0025])
    assert state["ema"]["bargain|buyer"] == pytest.approx(0.047625, abs=1e-12)  # per_trajectory regardless


def test_ema_keys_by_env_and_role_and_persists():
    state = {"ema": {"bargain|seller": 0.5}}
    batch = [traj([1.0], role="seller"), traj([1.0], role="buyer", seat=1), traj([1.0], role="seller", env="ipd")]
    assert close(scalars(get_estimator("reinforce").fn(batch, TurnParams(), state)), [0.5, 1.0, 1.0], 1e-12)
    assert set(state["ema"]) == {"bargain|seller", "bargain|buyer", "ipd|seller"}
    with pytest.raises(RepertoryError, match="share"):
        get_estimator("reinforce").fn([traj([1.0]), traj([2.0])], TurnParams(), {})


# ----- invariants 2-4 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce-pp"])
def test_groups_come_from_explicit_fields(name):
    fn = get_estimator(name).fn
    alone = by_role(fn(c1_batch("k7"), TurnParams(), {}), c1_batch("k7"))
    # A second kernel, a later iteration and another env never join the k7 groups.
    others = c1_batch("k8")
    for t in others:
        t.rewards = [3 * t.rewards[0] - 1]
    later = [traj([10.0 * (e % 2)], role="buyer", episode=10 + e, iteration=1) for e in range(3)]
    elsewhere = [traj([-4.0 * (e % 2)], role="buyer", episode=20 + e, env="ipd") for e in range(2)]
    batch = c1_batch("k7") + others + later + elsewhere
    mixed = fn(batch, TurnParams(), {})
    got = by_role(mixed, batch[:8])
    assert got == alone
    assert mixed.metrics["singleton_groups"] == 0


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_shuffling_the_batch_changes_no_advantage(name):
    rng = random.Random(3)
    batch = [
        traj(
            [round(rng.uniform(-1, 1), 3) for _ in range(k)],
            values=[[round(rng.uniform(-1, 1), 3) for _ in range(1 + (k + j) % 3)] for j in range(k)],
            role=role,
            episode=e,
            seat=s,
        )
        for e in range(6)
        for s, (role, k) in enumerate([("buyer", 1 + e % 3), ("seller", 2)])
    ]
    start = {"ema": {"bargain|buyer": 0.2}}
    ref_state = copy.deepcopy(start)
    reference = get_estimator(name).fn(batch, TurnParams(gamma=0.9), ref_state)
    for seed in range(3):
        order = list(range(len(batch)))
        random.Random(seed).shuffle(order)
        state = copy.deepcopy(start)
        est = get_estimator(name).fn([batch[i] for i in order], TurnParams(gamma=0.9), state)
        assert [est.advantages[order.index(i)] for i in range(len(batch))] == reference.advantages
        assert state == ref_state
    assert any(a != 0.0 for t in reference.advantages for turn in t for a in turn)


@pytest.mark.parametrize("name", CRITIC_FREE)
def test_per_turn_broadcast_has_no_off_by_one(name):
    """Distinct per-turn values: turn k's value is on every token of turn k and on none of turn k+1."""
    batch = [
        traj([0.0, 0.0, 0.0, 2.0], [2, 0, 3, 1], episode=0),
        traj([0.0, 0.0, 0.0, 0.0], [1, 1, 0, 4], episode=1),
    ]
    est = get_estimator(name).fn(batch, TurnParams(gamma=0.5, strict=True), {})
    a_traj = est.advantages[0][3][0]
    assert a_traj != 0.0
    assert est.advantages[0] == [[a_traj / 4] * 2, [], [a_traj / 2] * 3, [a_traj]]
    b_traj = est.advantages[1][3][0]
    assert est.advantages[1] == [[b_traj / 4], [b_traj / 2], [], [b_traj] * 4]


@pytest.mark.parametrize("name", TURN_ESTIMATORS)
def test_seat_isolation(name):
    """Perturbing seat 1's rewards and values leaves seat 0's advantages unchanged (invariant 4)."""
    batch = []
    for e in range(3):
        batch.append(traj([0.0, 0.0, 1.0 - 0.4 * e], values=copy.deepcopy(V_A), role="buyer", episode=e, seat=0))
        batch.append(traj([0.0, -0.1, 0.3 * e], values=copy.deepcopy(V_B), role="seller", episode=e, seat=1))
    changed = copy.deepcopy(batch)
    for t in changed[1::2]:
        t.rewards = [r * -3 + 0.7 for r in t.rewards]
        t.values = [[x + 1.5 * j for j, x in enumerate(v)] for v in t.values]
    params = TurnParams(gamma=0.9, lambda_turn=0.8, lambda_token=0.9)
    before = get_estimator(name).fn(batch, params, {"ema": {"bargain|buyer": 0.1}}).advantages
    after = get_estimator(name).fn(changed, params, {"ema": {"bargain|buyer": 0.1}}).advantages
    assert before[0::2] == after[0::2]
    assert before[1::2] != after[1::2]  # the perturbation is real


# ----- registry and bad input ----------------------------------------------------------------------------------


def test_registry():
    assert set(ESTIMATORS) == {"omar", "gae", "grpo", "rloo", "reinforce", "rae", "reinforce-pp"} | ROUND_ESTIMATORS
    flags = {name: (spec.needs_critic, spec.whiten) for name, spec in ESTIMATORS.items()}
    assert flags["omar"] == flags["gae"] == (True, True)
    assert flags["grpo"] == flags["rloo"] == flags["reinforce"] == flags["rae"] == (False, False)
    assert flags["reinforce-pp"] == (False, True)
    assert all(spec.name == name for name, spec in ESTIMATORS.items())
    with pytest.raises(
        RepertoryError, match="adalign, gae, grpo, naive, omar, rae, reinforce, reinforce-pp, rloo, shared-reward"
    ):
        get_estimator("ppo")
    with pytest.raises(RepertoryError, match="already registered"):
        register_estimator("grpo")(lambda trajectories, params, state: None)


def test_register_a_new_estimator():
    @register_estimator("constant-test", whiten=True)
    def constant(trajectories, params, state):
        return None

    try:
        spec = get_estimator("constant-test")
        assert spec.fn is constant and spec.whiten and not spec.needs_critic
    finally:
        ESTIMATORS.remove("constant-test")


def test_bad_input_is_refused():
    with pytest.raises(RepertoryError, match="needs critic values"):
        get_estimator("omar").fn([traj([1.0])], TurnParams(), {})
    with pytest.raises(RepertoryError, match="do not match"):
        get_estimator("gae").fn([traj([1.0], [2], [[0.1]])], TurnParams(), {})
    with pytest.raises(RepertoryError, match="rewards for"):
        get_estimator("grpo").fn([traj([1.0, 2.0], [1])], TurnParams(), {})
    # The params refuse both on construction; an estimator called with unchecked ones refuses them too.
    with pytest.raises(ValueError, match="unknown grpo_scale 'batch'; allowed: group, none"):
        TurnParams(grpo_scale="batch")
    with pytest.raises(RepertoryError, match="grpo_scale"):
        get_estimator("grpo").fn([traj([1.0])], TurnParams.model_construct(grpo_scale="batch"), {})
    with pytest.raises(RepertoryError, match="ema_update"):
        get_estimator("reinforce").fn([traj([1.0])], TurnParams.model_construct(ema_update="per_step"), {})


# the sampler-learner mismatch (docs/algorithms.md 1.2)


def test_rollout_correction_weights_and_mismatch_by_hand():
    learner = torch.tensor([0.0, -1.0, -2.0])
    sampled = torch.tensor([-0.5, -1.0, 0.0])  # ratios e^0.5 = 1.6487, 1, e^-2 = 0.1353
    assert rollout_correction(learner, sampled, "none", 2.0).tolist() == [1.0, 1.0, 1.0]
    assert rollout_correction(learner, sampled, "tis", 2.0).tolist() == pytest.approx(
        [1.648721, 1.0, 0.135335], abs=1e-6
    )
    assert rollout_correction(learner, sampled, "tis", 1.5).tolist() == pytest.approx([1.5, 1.0, 0.135335], abs=1e-6)
    assert rollout_correction(learner, sampled, "mis", 1.5).tolist() == pytest.approx([0.0, 1.0, 0.135335], abs=1e-6)
    with pytest.raises(RepertoryError, match="unknown rollout correction"):
        rollout_correction(learner, sampled, "is", 2.0)
    # gaps 0.5, 0, 2; k3 terms e^g - 1 - g = 0.148721, 0, 1.135335
    assert sampler_mismatch(learner, sampled) == pytest.approx(
        {"offpolicy/max_gap": 2.0, "offpolicy/mean_gap": 2.5 / 3, "offpolicy/kl": 1.284056 / 3}, abs=1e-6
    )
    assert sampler_mismatch(learner, learner)["offpolicy/kl"] == 0.0


def test_the_objective_sums_the_corrected_policy_loss_entropy_kl_and_value_by_hand():
    # Two tokens of one sample, token-mean weights 1/2. Ratios 1 and 1.5 (clipped to 1.2 for A = 2): the PPO
    # terms are -1 and -2.4, the second halved by its correction: -0.5 - 0.6 = -1.1. Entropy 1 and 3 at 0.1:
    # -0.2. k3 KL 0 and ln 2 - 0.5 (the policy is twice the reference's) at 0.1: 0.1 * (ln 2 - 0.5) / 2.
    # Values 0.5 against returns 1.5 and 0.5: 0.5 * 1^2 / 2 = 0.25 at coef 0.5.
    logp = torch.tensor([math.log(0.4), math.log(0.6)], requires_grad=True)
    old = torch.tensor([math.log(0.4), math.log(0.4)])
    tokens = TokenTerms(
        logp, old, torch.tensor([math.log(0.4), math.log(0.3)]), torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5]),
        torch.tensor([1.0, 0.5]), torch.tensor([1.0, 3.0]),
    )  # fmt: skip
    values = torch.tensor([0.5, 0.5], requires_grad=True)
    value = ValueTerms(values, torch.tensor([0.5, 0.5]), torch.tensor([1.5, 0.5]), 0.5)
    algo = AlgoConfig(policy_loss="ppo", entropy_coef=0.1, beta_kl=0.1, kl_mode="loss", kl_estimator="k3")
    loss, stats = objective(tokens, algo, value)
    kl = (math.log(2) - 0.5) / 2
    assert float(loss) == pytest.approx(-1.1 - 0.2 + 0.1 * kl + 0.5 * 0.25, abs=1e-6)
    expected = {"loss/policy": -1.1, "kl": kl, "entropy": 2.0, "clip_frac": 0.5, "loss/value": 0.25}
    assert {name: float(s) for name, s in stats.items()} == pytest.approx(expected, abs=1e-6)
    assert not any(s.requires_grad for s in stats.values())
    loss.backward()
    assert logp.grad is not None and value.values.grad is not None
    # KL in the reward instead: the loss leaves it out and still reports it.
    reward_kl, _ = objective(tokens, algo.model_copy(update={"kl_mode": "reward"}))
    assert float(reward_kl) == pytest.approx(-1.1 - 0.2, abs=1e-6)

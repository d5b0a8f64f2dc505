"""Batch-online math of algorithms.md 5 (Iterative GRPO) and 6 (its baselines): every worked example, edges."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
import torch

from repertory.algos import TrajectoryInput, TurnParams, discounted_returns, get_estimator, group_normalise
from repertory.algos.offline import (
    archer_actor_loss,
    archer_q_target,
    candidate_advantages,
    expected_discounted_return,
    filtered_bc_keep,
    kto_labels,
    kto_lambdas,
    kto_loss,
    q_head_init_bias,
    q_loss,
    q_uses_bce,
    q_values,
    soft_update,
)
from repertory.stats import format_mean_se, plus_minus, seed_summary
from repertory.types import RepertoryError

TOL = 1e-4


def approx(expected):
    return pytest.approx(expected, abs=TOL)


def values(t: torch.Tensor) -> list[float]:
    return t.detach().reshape(-1).tolist()


# ---------------------------------------------------------------------------------------------------------
# 5.4 step returns and the Q-head
# ---------------------------------------------------------------------------------------------------------


def test_q1_step_returns():
    assert discounted_returns([0.0, 0.0, 0.8], 0.95) == approx([0.7220, 0.7600, 0.8000])
    assert discounted_returns([0.0, 0.0, 0.0], 0.95) == [0.0, 0.0, 0.0]


def test_q2_bce_on_sigmoid_of_the_logit():
    z = torch.tensor([0.5], dtype=torch.float64)
    assert values(q_values(z, bce=True)) == approx([0.6225])
    assert q_loss(z, torch.tensor([0.722]), bce=True).item() == approx(0.6131)


def test_q_loss_picks_mse_when_a_target_leaves_the_unit_interval():
    targets = [0.3, 1.5, 0.0]
    assert q_uses_bce([0.0, 0.5, 1.0]) and not q_uses_bce(targets) and not q_uses_bce([-0.1])
    z = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)
    bce = q_uses_bce(targets)
    # MSE on q = z: ((0.2)^2 + (0.5)^2 + (1.0)^2) / 3
    assert q_loss(z, torch.tensor(targets), bce).item() == approx(0.4300)
    assert values(q_values(z, bce)) == values(z)
    with pytest.raises(RepertoryError, match="MSE"):
        q_loss(z, torch.tensor(targets), bce=True)


def test_q_loss_bce_is_stable_for_large_logits():
    z = torch.tensor([100.0, -100.0], requires_grad=True)
    loss = q_loss(z, torch.tensor([1.0, 1.0]), bce=True)
    loss.backward()
    assert loss.item() == approx(50.0)  # (0 + 100) / 2
    assert torch.isfinite(z.grad).all()


def test_q_head_init_bias():
    assert q_head_init_bias(0.5, bce=True) == approx(0.0)
    assert torch.sigmoid(torch.tensor(q_head_init_bias(0.3, bce=True))).item() == approx(0.3)
    # clip(., 1e-3, 1 - 1e-3) keeps the logit finite: log(0.001 / 0.999)
    assert q_head_init_bias(0.0, bce=True) == approx(-6.9068)
    assert q_head_init_bias(1.0, bce=True) == approx(6.9068)
    assert q_head_init_bias(1.7, bce=False) == 1.7


# ---------------------------------------------------------------------------------------------------------
# 5.5 candidate advantages
# ---------------------------------------------------------------------------------------------------------


def test_q3_candidate_advantages_use_the_sample_std():
    r = [0.62, 0.70, 0.55, 0.81]
    assert statistics.mean(r) == approx(0.6700)
    assert statistics.stdev(r) == approx(0.1117)  # ddof = 1
    assert candidate_advantages(r) == approx([-0.4478, 0.2687, -1.0747, 1.2539])


def test_candidate_advantages_of_one_candidate_or_equal_scores_are_zero():
    assert candidate_advantages([0.7]) == [0.0]
    assert candidate_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    assert candidate_advantages([0.1 * 3] * 4) == [0.0] * 4


def test_unscaled_candidate_advantages_stay_in_q_units():
    # mean of [0.2, 0.4, 0.0 (gated)] is 0.2
    assert candidate_advantages([0.2, 0.4, 0.9], [True, True, False], scale=False) == approx([0.0, 0.2, -0.2])
    # Q that cannot tell the candidates apart: tiny advantages, where normalising makes them unit-scale
    assert max(map(abs, candidate_advantages([1e-4, 2e-4, 1.5e-4], scale=False))) == approx(5e-5)
    assert max(map(abs, candidate_advantages([1e-4, 2e-4, 1.5e-4]))) == approx(0.9804)  # 5e-5 / (5e-5 + 1e-6)
    assert candidate_advantages([0.3] * 3, scale=False) == [0.0] * 3


def test_format_gate_scores_invalid_candidates_zero():
    r = [0.62, 0.70, 0.55, 0.81]
    gated = candidate_advantages(r, valid=[True, False, True, True])
    assert gated == group_normalise([0.62, 0.0, 0.55, 0.81])
    assert min(gated) == gated[1]
    assert candidate_advantages([0.4, 0.4], valid=[False, False]) == [0.0, 0.0]
    with pytest.raises(RepertoryError, match="format-gate"):
        candidate_advantages(r, valid=[True])


def test_trajectory_grpo_normalises_like_the_candidates():
    returns = [0.62, 0.70, 0.55, 0.81]
    batch = [TrajectoryInput("bargain", "k", 0, "buyer", i, 0, [r], [2]) for i, r in enumerate(returns)]
    estimate = get_estimator("grpo").fn(batch, TurnParams(), {})
    assert [a[0][0] for a in estimate.advantages] == candidate_advantages(returns)


# ---------------------------------------------------------------------------------------------------------
# 5.7 metric and reporting
# ---------------------------------------------------------------------------------------------------------


def test_q4_expected_discounted_return():
    conversations = [(1.0, 0), (0.8, 2), (0.0, 3), (0.6, 1)]
    assert [0.95**t * r for r, t in conversations] == approx([1.0000, 0.7220, 0.0000, 0.5700])
    assert expected_discounted_return(conversations, 0.95) == approx(0.5730)
    with pytest.raises(RepertoryError):
        expected_discounted_return([], 0.95)


def test_q5_seed_summary_and_its_print():
    mean, se = seed_summary([0.55, 0.57, 0.53])
    assert (mean, se) == approx((0.5500, 0.0115))
    assert format_mean_se(mean, se) == "0.55 ± .01"
    assert seed_summary([0.4]) == (0.4, 0.0)
    assert format_mean_se(-0.1, 0.02) == "-0.10 ± .02"
    assert format_mean_se(12.0, 1.234) == "12.00 ± 1.23"
    with pytest.raises(RepertoryError):
        seed_summary([])


def test_plus_minus_shows_no_standard_error_for_one_value_and_no_exponents():
    assert plus_minus(0.8, 0.02, 16) == "0.800 ± 0.020"
    assert plus_minus(629.4, 250.31, 3) == "629.4 ± 250.3"  # not 2.5e+02
    assert plus_minus(14.0, 0.0, 1) == "14.00 (n = 1)"  # one game has no standard error, not "± 0"
    assert plus_minus(0.18, 0.0, 1, 4) == "0.1800 (n = 1)"


# ---------------------------------------------------------------------------------------------------------
# 6.1 MT-SFT
# ---------------------------------------------------------------------------------------------------------


def test_s1_filtered_bc():
    returns = [0.1, 0.5, 0.3, 0.9, 0.7]
    cutoff, keep = filtered_bc_keep(returns, 0.6)
    assert cutoff == approx(0.5800)
    assert {g for g, k in zip(returns, keep) if k} == {0.9, 0.7}


def test_filtered_bc_keeps_no_zero_returns():
    cutoff, keep = filtered_bc_keep([0.0, 0.0, 0.0], 0.9)
    assert cutoff == 0.0 and keep == [False, False, False]
    _, keep = filtered_bc_keep([0.0, 0.0, 0.0, 0.5], 0.5)
    assert keep == [False, False, False, True]


def test_filtered_bc_cutoff_is_numpys_default_quantile():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        returns = [rng.choice([0.0, 0.95**3, rng.random()]) for _ in range(n)]
        for q in (0.0, 0.1, 0.5, 0.6, 0.9, 1.0, rng.random()):
            assert filtered_bc_keep(returns, q)[0] == float(np.quantile(returns, q))
    for bad in (-0.1, 1.1):
        with pytest.raises(RepertoryError):
            filtered_bc_keep([0.5], bad)
    with pytest.raises(RepertoryError):
        filtered_bc_keep([], 0.9)


# ---------------------------------------------------------------------------------------------------------
# 6.2 MT-KTO
# ---------------------------------------------------------------------------------------------------------


def test_k1_labels_against_the_kernel_mean():
    g0 = [0.722, 0.0, 0.9025, 0.722]
    assert statistics.mean(g0) == approx(0.5866)
    assert kto_labels(["k"] * 4, g0) == [True, False, True, True]


def test_kto_labels_drop_equal_returns_per_kernel():
    kernels = ["a", "a", "a", "b", "b", "c", "c"]
    g0 = [0.1, 0.1, 0.1, 0.2, 0.5, 0.95**3 * 0.8, 0.95**3 * 0.8]
    assert kto_labels(kernels, g0) == [None, None, None, False, True, None, None]
    assert kto_labels(["a", "a", "a"], [0.0, 0.3, 0.6]) == [False, None, True]
    with pytest.raises(RepertoryError):
        kto_labels(["a"], [0.1, 0.2])


def test_k2_and_the_imbalance_rule():
    lambda_d, lambda_u = kto_lambdas(3, 1)
    assert (lambda_d, lambda_u) == approx((1.0, 2.25))
    assert lambda_d * 3 / (lambda_u * 1) == approx(1.3333)
    for n_d, n_u in ((1, 1), (5, 4), (4, 3)):  # ratio 1, 1.25 and exactly 4/3: inside [1, 4/3]
        assert kto_lambdas(n_d, n_u) == (1.0, 1.0)
    assert kto_lambdas(1, 3) == approx((3.0, 1.0))  # ratio 1/3 < 1 -> lambda_D = n_U / n_D
    assert kto_lambdas(2, 1, lambda_d=0.5, lambda_u=1.0) == (0.5, 1.0)  # ratio 1 with the given weights
    lambda_d, lambda_u = kto_lambdas(1, 2, lambda_d=1.0, lambda_u=2.0)  # ratio 0.25 -> brought to 1
    assert lambda_d * 1 / (lambda_u * 2) == approx(1.0)
    assert kto_lambdas(0, 5) == (1.0, 1.0) and kto_lambdas(5, 0) == (1.0, 1.0)


def test_k3_kto_loss():
    r = torch.tensor([0.5, -0.2, 0.3, -0.4], dtype=torch.float64, requires_grad=True)
    mismatched = torch.tensor([0.1, 0.05, -0.02, 0.07], dtype=torch.float64, requires_grad=True)
    desirable = torch.tensor([True, True, False, False])
    losses = kto_loss(r, mismatched, desirable, beta=0.1)
    assert values(losses) == approx([0.4888, 0.5062, 0.5062, 0.4888])
    assert losses.mean().item() == approx(0.4975)
    losses.mean().backward()
    assert mismatched.grad is None  # z0 is detached
    assert r.grad is not None


def test_kto_loss_reference_point_is_clipped_at_zero_and_weighted():
    r = torch.tensor([0.0, 0.0])
    desirable = torch.tensor([True, False])
    assert values(kto_loss(r, torch.tensor([-1.0, -3.0]), desirable)) == approx([0.5, 0.5])
    assert values(kto_loss(r, torch.tensor([-1.0]), desirable, lambda_d=1.0, lambda_u=2.25)) == approx([0.5, 1.125])


# ---------------------------------------------------------------------------------------------------------
# 6.4 ArCHer
# ---------------------------------------------------------------------------------------------------------


def test_r1_q_targets_and_squared_errors():
    v_bar = torch.tensor([0.6, 0.5], requires_grad=True)
    y_q = archer_q_target(torch.tensor(0.0), torch.tensor(0.0), v_bar, 0.95)
    assert values(y_q) == approx([0.5700, 0.4750])
    assert not y_q.requires_grad
    assert values((torch.tensor([0.5, 0.45]) - y_q) ** 2) == approx([0.0049, 0.000625])
    terminal = archer_q_target(torch.tensor([0.8]), torch.tensor([True]), torch.tensor([0.6]), 0.95)
    assert values(terminal) == approx([0.8])


def test_r2_actor_loss():
    q1 = torch.tensor([0.58], requires_grad=True)
    seq_logp = torch.tensor([-12.3], requires_grad=True)
    loss, advantages = archer_actor_loss(q1, torch.tensor([0.62]), torch.tensor([0.50]), torch.tensor([0.48]), seq_logp)
    assert values(advantages) == approx([0.1000])
    assert loss.item() == approx(1.2300)
    loss.backward()
    assert q1.grad is None  # the critic is detached
    assert values(seq_logp.grad) == approx([-0.1000])


def test_r3_soft_update_on_tensors():
    target, online = torch.tensor([0.2]), torch.tensor([1.0])
    soft_update([target], [online], 0.1)
    assert values(target) == approx([0.2800])
    assert values(online) == [1.0]


def test_soft_update_on_modules_leaves_the_online_network_alone():
    torch.manual_seed(0)
    target, online = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in target.parameters()]
    online_before = [p.detach().clone() for p in online.parameters()]
    soft_update(target, online, 0.1)
    for t, b, o, o_before in zip(target.parameters(), before, online.parameters(), online_before):
        assert torch.allclose(t, 0.9 * b + 0.1 * o_before, atol=1e-6)
        assert torch.equal(o, o_before)
    assert not any(p.grad is not None for p in target.parameters())
    with pytest.raises(RepertoryError, match="shape"):
        soft_update(target, torch.nn.Linear(3, 1), 0.1)
    with pytest.raises(RepertoryError, match="shape"):
        soft_update([torch.zeros(3)], [torch.zeros(1)], 0.1)

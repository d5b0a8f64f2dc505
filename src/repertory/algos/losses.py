"""Per-token losses (docs/algorithms.md 2.6-2.7, 7.4) and the registry of policy losses.

Every loss is a torch function of per-token tensors; :func:`aggregation_weights` turns per-token losses into one
scalar per mini-batch so that gradient accumulation over micro-batches reproduces the unsplit gradient. A
policy loss is registered by name (``algo.policy_loss``) with :func:`register_policy_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from repertory.algos import AGGREGATIONS
from repertory.types import Registry, RepertoryError


def policy_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, and a 0/1 indicator of tokens where the clipped term is strictly
    smaller (clip fraction); ``dual_clip`` = c > 1 bounds the loss by -c * A where A < 0."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise RepertoryError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss, (clipped < unclipped).to(loss.dtype)


def truncated_is_loss(
    logp_new: Tensor, logp_sample: Tensor, advantages: Tensor, cap: float = 2.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE with a truncated importance weight (7.4): -w * A * logp_new per token, and the detached
    weights w = min(exp(logp_new - logp_sample), cap), which also weight the KL term."""
    weights = torch.clamp(torch.exp(logp_new - logp_sample), max=cap).detach()
    return -weights * advantages * logp_new, weights


ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def rollout_correction(logp_learner: Tensor, logp_sample: Tensor, mode: str, cap: float) -> Tensor:
    """Per-token weights for the sampler-learner mismatch (docs/algorithms.md 1.2): with the ratio
    r = exp(logp_learner - logp_sample) at the sampled tokens, ``none`` gives 1, ``tis`` min(r, cap) and
    ``mis`` r where r <= cap, else 0 (the token is masked). Detached: they reweight, never get a gradient."""
    if mode == "none":
        return torch.ones_like(logp_learner)
    ratio = torch.exp(logp_learner.detach() - logp_sample.to(logp_learner))
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "mis":
        return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    raise RepertoryError(f"unknown rollout correction {mode!r}; known: {', '.join(ROLLOUT_CORRECTIONS)}")


def sampler_mismatch(logp_learner: Tensor, logp_sample: Tensor) -> dict[str, float]:
    """How far the sampler's log-probs are from the learner's on the same tokens: the largest and mean
    absolute gap, and the k3 estimate of KL(sampler || learner) from the sampler's own tokens."""
    gap = logp_learner.detach() - logp_sample.to(logp_learner)
    return {
        "offpolicy/max_gap": float(gap.abs().max()),
        "offpolicy/mean_gap": float(gap.abs().mean()),
        "offpolicy/kl": float((torch.exp(gap) - 1 - gap).mean()),
    }


def reinforce_loss(logp_new: Tensor, advantages: Tensor) -> Tensor:
    """Plain policy-gradient loss per token: -A * logp_new."""
    return -advantages * logp_new


def value_loss(v_new: Tensor, v_old: Tensor, returns: Tensor, eps_v: float = 0.2) -> Tensor:
    """Clipped critic loss per token: 0.5 * max((v_new - G)^2, (v_clip - G)^2) (2.7)."""
    v_clip = v_old + torch.clamp(v_new - v_old, -eps_v, eps_v)
    return 0.5 * torch.maximum((v_new - returns) ** 2, (v_clip - returns) ** 2)


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp_new: Tensor, logp_ref: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate of the current policy from the reference (Schulman's k1, k2, k3)."""
    # Clamps keep exp finite and k3 bounded when the policies drift far apart (2.7).
    d = torch.clamp(logp_ref - logp_new, -20.0, 20.0)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.clamp(torch.exp(d) - d - 1, 0.0, 10.0)
    raise RepertoryError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T) at each position (over the last dimension); a -inf logit (a token a grammar
    masks) adds nothing."""
    if temperature <= 0:
        raise RepertoryError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * torch.where(torch.isfinite(logp), logp, 0.0)).sum(dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Aggregation (2.7)
# ----------------------------------------------------------------------------------------------------------


def aggregation_weights(sample_lengths: list[int], mode: str, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token weights, concatenated in sample order, with sum(weights * l) = the aggregation of l over the
    whole mini-batch. Slice them per micro-batch: N_tok and the sample count stay those of the mini-batch,
    so accumulated micro-batch gradients equal the unsplit one. Samples with no tokens are ignored."""
    if mode not in AGGREGATIONS:
        raise RepertoryError(f"unknown aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")
    if any(n < 0 for n in sample_lengths):
        raise RepertoryError(f"negative sample length in {sample_lengths}")
    n_tokens = sum(sample_lengths)
    n_samples = sum(1 for n in sample_lengths if n > 0)
    if mode == "token-mean":
        per_sample = [1 / n_tokens if n else 0.0 for n in sample_lengths]
    elif mode == "seq-mean-token-mean":
        per_sample = [1 / (n_samples * n) if n else 0.0 for n in sample_lengths]
    else:
        per_sample = [1 / n_samples if n else 0.0 for n in sample_lengths]
    weights = torch.tensor(per_sample, dtype=torch.float64)
    return torch.repeat_interleave(weights, torch.tensor(sample_lengths, dtype=torch.long)).to(dtype)


def aggregate(per_token: Tensor, sample_lengths: list[int], mode: str) -> Tensor:
    """Aggregate a 1-D per-token loss over a mini-batch whose samples have ``sample_lengths`` tokens."""
    weights = aggregation_weights(sample_lengths, mode, dtype=per_token.dtype).to(per_token.device)
    if per_token.shape != weights.shape:
        raise RepertoryError(f"per-token loss of shape {tuple(per_token.shape)} for {sum(sample_lengths)} tokens")
    return (weights * per_token).sum()


# ----------------------------------------------------------------------------------------------------------
# The policy-loss registry
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyTerms:
    """A policy loss on one micro-batch: the per-token loss, the per-token clip indicator (its mean is
    ``clip_frac``) and, where the loss reweights tokens, the weights that also apply to the KL term."""

    loss: Tensor
    clipped: Tensor
    kl_weights: Tensor | None = None


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Any], PolicyTerms]
"""(log-probs now, log-probs at sampling, advantages, the ``algo`` config) -> :class:`PolicyTerms`."""

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a policy loss to :data:`POLICY_LOSSES` under ``name`` (select it with ``algo.policy_loss``)."""
    return POLICY_LOSSES.decorator(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss called ``name``."""
    return POLICY_LOSSES[name]


@register_policy_loss("ppo")
def _ppo(logp: Tensor, old: Tensor, adv: Tensor, algo: Any) -> PolicyTerms:
    return PolicyTerms(*policy_loss(logp, old, adv, algo.eps_low, algo.eps_high, algo.dual_clip))


@register_policy_loss("tis")
def _tis(logp: Tensor, old: Tensor, adv: Tensor, algo: Any) -> PolicyTerms:
    loss, weights = truncated_is_loss(logp, old, adv, algo.is_cap)
    return PolicyTerms(loss, (weights >= algo.is_cap).to(logp.dtype), weights)


@register_policy_loss("reinforce")
def _reinforce(logp: Tensor, old: Tensor, adv: Tensor, algo: Any) -> PolicyTerms:
    return PolicyTerms(reinforce_loss(logp, adv), torch.zeros_like(logp))


# ----------------------------------------------------------------------------------------------------------
# The learner's objective
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenTerms:
    """One micro-batch's trained tokens, aligned: log-probs now (with gradient), at sampling and under the
    reference, advantages, aggregation weights (:func:`aggregation_weights`), the sampler-learner correction
    (:func:`rollout_correction`) and the policy's entropy."""

    logp: Tensor
    old: Tensor
    ref: Tensor
    advantages: Tensor
    weights: Tensor
    correction: Tensor
    entropy: Tensor


@dataclass(frozen=True)
class ValueTerms:
    """The critic's values now (with gradient) and at scoring, the returns, and the value loss's weight."""

    values: Tensor
    old: Tensor
    returns: Tensor
    coef: float


def objective(tokens: TokenTerms, algo: Any, value: ValueTerms | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The learner's loss on one micro-batch (docs/algorithms.md 2.6-2.7): the ``algo.policy_loss`` corrected
    token by token, minus ``entropy_coef`` times the entropy, plus ``beta_kl`` times the KL to the reference when
    ``kl_mode`` is loss, plus the weighted value loss; each a weighted sum, so micro-batches add up to their
    mini-batch. Also the detached sums the learner logs: loss/policy, kl, entropy, clip_frac (and loss/value)."""
    w = tokens.weights
    kl = kl_penalty(tokens.logp, tokens.ref, algo.kl_estimator)
    terms = POLICY_LOSSES[algo.policy_loss](tokens.logp, tokens.old, tokens.advantages, algo)
    l_pg = terms.loss * tokens.correction
    if terms.kl_weights is not None:
        kl = terms.kl_weights * kl
    loss = (w * l_pg).sum() - algo.entropy_coef * (w * tokens.entropy).sum()
    if algo.kl_mode == "loss":
        loss = loss + algo.beta_kl * (w * kl).sum()
    stats = {"loss/policy": (w * l_pg).sum(), "kl": (w * kl).sum(), "entropy": (w * tokens.entropy).sum()}
    stats["clip_frac"] = (w * terms.clipped).sum()
    if value is not None:
        l_v = (w * value_loss(value.values, value.old, value.returns, algo.eps_v)).sum()
        loss = loss + value.coef * l_v
        stats["loss/value"] = l_v
    return loss, {name: s.detach() for name, s in stats.items()}

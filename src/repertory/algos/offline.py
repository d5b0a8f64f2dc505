"""The batch-online math (docs/algorithms.md sections 5 and 6): Iterative GRPO's Q-head loss and candidate
advantages, the reporting metric J, and the pieces of MT-SFT, MT-KTO and ArCHer. The trainers that use them
are :mod:`repertory.train.methods`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.nn import functional as F

from repertory.algos.estimators import group_normalise
from repertory.stats import mean as _mean
from repertory.stats import quantile as _quantile
from repertory.types import RepertoryError

# The Monte-Carlo Q targets G_t of 5.4 are discounted_returns (shared pieces) of the per-turn rewards.


def q_uses_bce(targets: list[float]) -> bool:
    """Whether the Q-head trains with BCE (every target in [0, 1]) rather than MSE (5.4); decide once per
    dataset, since the warm-start bias and the meaning of the head output depend on it."""
    return all(0.0 <= g <= 1.0 for g in targets)


def q_head_init_bias(mean_target: float, bce: bool) -> float:
    """Round-0 bias of the Q-head, whose weights start at 0 (5.4): logit(clip(mean G, 1e-3, 1 - 1e-3)) under
    BCE, mean G under MSE."""
    if not bce:
        return mean_target
    p = min(max(mean_target, 1e-3), 1 - 1e-3)
    return math.log(p / (1 - p))


def q_values(z: Tensor, bce: bool) -> Tensor:
    """Q estimates from head outputs z (5.4): sigma(z) under BCE, z under MSE."""
    return torch.sigmoid(z) if bce else z


def q_loss(z: Tensor, targets: Tensor, bce: bool) -> Tensor:
    """Q-head loss, mean over examples (5.4): BCE with soft targets on q = sigma(z), else MSE on q = z."""
    targets = targets.to(z.dtype)
    if not bce:
        return F.mse_loss(z, targets)
    if ((targets < 0) | (targets > 1)).any():
        raise RepertoryError("BCE needs Q targets in [0, 1]; train with bce=False (MSE)")
    # On the logits: log(sigma(z)) underflows for large |z|.
    return F.binary_cross_entropy_with_logits(z, targets)


def candidate_advantages(scores: list[float], valid: list[bool] | None = None, scale: bool = True) -> list[float]:
    """Single-turn GRPO advantages of one state's N_c candidates (5.5): the Qhat scores, 0 for candidates that
    fail the format gate (``valid`` False), normalised with :func:`group_normalise`; with ``scale`` False only
    centred (Dr. GRPO), so they stay in Q's units and a group Q cannot tell apart gets advantages near 0."""
    if valid is not None:
        if len(valid) != len(scores):
            raise RepertoryError(f"{len(valid)} format-gate flags for {len(scores)} candidates")
        scores = [s if ok else 0.0 for s, ok in zip(scores, valid)]
    if scale or len(scores) < 2 or all(x == scores[0] for x in scores):
        return group_normalise(scores)
    mean = _mean(scores)
    return [s - mean for s in scores]


def expected_discounted_return(conversations: list[tuple[float, int]], gamma: float) -> float:
    """J = mean of gamma^T * R over held-out conversations given as (R, T), i.e. the mean G_0 (5.7)."""
    if not conversations:
        raise RepertoryError("no conversations to score")
    return _mean([gamma**t * r for r, t in conversations])


def filtered_bc_keep(returns: list[float], q: float = 0.9) -> tuple[float, list[bool]]:
    """MT-SFT filter over one round's conversations (6.1): the cutoff quantile(G_0, q) and, per conversation,
    whether it is kept (G_0 >= cutoff and G_0 > 0)."""
    if not returns:
        raise RepertoryError("no conversations to filter")
    if not 0.0 <= q <= 1.0:
        raise RepertoryError(f"quantile q must be in [0, 1], got {q}")
    cutoff = _quantile(returns, q)
    return cutoff, [g >= cutoff and g > 0 for g in returns]


def kto_labels(kernel_ids: list[str], returns: list[float]) -> list[bool | None]:
    """MT-KTO label of each conversation of one round (6.2): True (desirable) if its G_0 is above the mean G_0
    of its kernel's conversations, False (undesirable) if below, None (dropped) if equal."""
    if len(kernel_ids) != len(returns):
        raise RepertoryError(f"{len(kernel_ids)} kernel ids for {len(returns)} returns")
    by_kernel: dict[str, list[float]] = {}
    for kernel, g in zip(kernel_ids, returns):
        by_kernel.setdefault(kernel, []).append(g)
    means = {kernel: _mean(gs) for kernel, gs in by_kernel.items()}
    # The tolerance absorbs the rounding of a mean of equal returns, so all-equal kernels drop every conversation.
    return [None if abs(g - means[k]) <= 1e-12 else g > means[k] for k, g in zip(kernel_ids, returns)]


def kto_lambdas(n_d: int, n_u: int, lambda_d: float = 1.0, lambda_u: float = 1.0) -> tuple[float, float]:
    """KTO class weights after the once-per-round imbalance rule (6.2): a ratio lambda_D n_D / (lambda_U n_U)
    below 1 raises lambda_D to make it 1, one above 4/3 raises lambda_U to make it 4/3; unchanged otherwise
    or when a class is empty. With unit weights this is lambda_D = n_U / n_D, lambda_U = 0.75 n_D / n_U."""
    if n_d == 0 or n_u == 0:
        return lambda_d, lambda_u
    ratio = lambda_d * n_d / (lambda_u * n_u)
    if ratio < 1:
        return lambda_u * n_u / n_d, lambda_u
    if ratio > 4 / 3:
        return lambda_d, 0.75 * lambda_d * n_d / n_u
    return lambda_d, lambda_u


def kto_loss(
    r: Tensor,
    mismatched_r: Tensor,
    desirable: Tensor,
    beta: float = 0.1,
    lambda_d: float = 1.0,
    lambda_u: float = 1.0,
) -> Tensor:
    """Per-sample KTO loss (6.2). ``r`` = log pi(y|x) - log pi_ref(y|x) summed over the response tokens;
    ``mismatched_r`` = the same for the micro-batch's pairs (x_i, y_{(i-1) mod n}), whose mean clipped at 0 is
    the detached reference point z0; ``desirable`` is a bool tensor of labels."""
    z0 = torch.clamp(mismatched_r.detach().mean(), min=0.0)
    loss_d = lambda_d * (1 - torch.sigmoid(beta * (r - z0)))
    loss_u = lambda_u * (1 - torch.sigmoid(beta * (z0 - r)))
    return torch.where(desirable, loss_d, loss_u)


def archer_q_target(reward: Tensor, done: Tensor, v_bar: Tensor, gamma: float) -> Tensor:
    """ArCHer critic target y_Q = r + gamma * (1 - d) * Vbar(s') of a Q head (6.4); no gradient reaches the
    target network."""
    return (reward + gamma * (1 - done.to(v_bar.dtype)) * v_bar).detach()


def archer_actor_loss(q1: Tensor, q2: Tensor, v1: Tensor, v2: Tensor, seq_logp: Tensor) -> tuple[Tensor, Tensor]:
    """ArCHer actor loss -mean_s[A * log pi(a_pi|s)] over states, with the sequence log-prob summed over the
    tokens of a_pi, and the detached advantages A = min(Q1, Q2)(s, a_pi) - min(V1, V2)(s) (6.4)."""
    advantages = (torch.minimum(q1, q2) - torch.minimum(v1, v2)).detach()
    return -(advantages * seq_logp).mean(), advantages


@torch.no_grad()
def soft_update(
    target: torch.nn.Module | Iterable[Tensor], online: torch.nn.Module | Iterable[Tensor], tau: float
) -> None:
    """Polyak update of a target network in place, theta_bar = (1 - tau) * theta_bar + tau * theta (6.4)."""
    targets, onlines = (list(m.parameters()) if isinstance(m, torch.nn.Module) else list(m) for m in (target, online))
    # lerp_ would broadcast a smaller tensor silently.
    if [t.shape for t in targets] != [o.shape for o in onlines]:
        raise RepertoryError("target and online parameters differ in number or shape")
    for t, o in zip(targets, onlines):
        t.lerp_(o, tau)

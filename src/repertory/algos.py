"""Advantage estimators and per-token losses (algorithms.md sections 2-7).

Estimators turn the per-turn rewards (and, for critic estimators, per-token values) of trainable seats into
per-token advantages. They are pure functions over plain lists of Python floats (float64 math); the only
state they touch is the trainer-owned, JSON-serialisable ``state`` dict holding the EMA baselines. The
losses are per-token torch functions; :func:`aggregation_weights` turns them into one scalar per
mini-batch so that gradient accumulation over micro-batches reproduces the unsplit gradient. The
batch-online section (sections 5 and 6) holds the math of Iterative GRPO and its baselines: the Q-head
loss, candidate advantages, the reporting metric, and the MT-SFT, MT-KTO and ArCHer pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from repertory.types import RepertoryError

# ----------------------------------------------------------------------------------------------------------
# Data in and out
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TrajectoryInput:
    """One trainable seat's turns in one episode, as estimators see them."""

    env: str
    kernel_id: str
    iteration: int
    role: str  # game-role label used for grouping
    episode_index: int  # position of the episode in the stored batch (EMA order)
    seat_index: int  # seat position (EMA order tie-break)
    rewards: list[float]  # r_k per turn of this seat, terminal reward R already added to the last turn
    lengths: list[int]  # L_k = valid (loss-mask 1) tokens of each turn; 0 marks an empty turn
    values: list[list[float]] | None = None  # v[k][j] per valid token (critic estimators); [] for empty turns
    # Round-based games (Advantage Alignment family, section 7); empty/None elsewhere.
    group_id: str = ""  # crn group: episodes sharing kernel and environment seed
    seat_id: str = ""
    turn_rounds: list[int] | None = None  # 0-based game round of each turn
    round_points: list[float] | None = None  # this seat's raw points per round
    opponent_seat_id: str = ""
    opponent_round_points: list[float] | None = None  # the other seat's raw points per round, same match


@dataclass
class EstimatorParams:
    """Hyper-parameters of every estimator; each estimator reads only its own."""

    gamma_turn: float = 0.95  # OMAR stage 1
    lambda_turn: float = 0.95
    gamma_token: float = 1.0  # OMAR stage 2
    lambda_token: float = 1.0
    gamma: float = 1.0  # MT-PPO token-level GAE (section 3)
    lam: float = 0.95
    grpo_scale: str = "group"  # "group" | "none" (Dr. GRPO)
    ema_alpha: float = 0.95
    ema_update: str = "per_trajectory"  # "per_trajectory" | "per_batch"
    turn_discount: float = 1.0  # 4.6 gamma for critic-free per-turn advantages
    strict: bool = False  # singleton groups raise instead of giving 0
    round_gamma: float = 0.9  # 7.2 return discount over rounds
    aa_gamma: float = 0.9  # 7.3 gamma_aa of the shaping sum
    aa_beta: float = 0.5  # 7.3 shaping strength
    reward_constant: float = 1.0  # 7.1 c: step reward = raw round points / c
    discount_state_visitation: bool = False  # 7.3 multiply C_t by round_gamma^t


@dataclass
class Estimate:
    """Per-token advantages (and critic targets) in the input's [trajectory][turn][token] shape."""

    advantages: list[list[list[float]]]
    returns: list[list[list[float]]] | None  # critic targets G (critic estimators only)
    metrics: dict[str, float]


Estimator = Callable[[list[TrajectoryInput], EstimatorParams, dict], Estimate]


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator; ``whiten`` is the default of the option whiten_advantages (2.6)."""

    name: str
    fn: Estimator
    needs_critic: bool
    whiten: bool


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_estimator(
    name: str, *, needs_critic: bool = False, whiten: bool = False
) -> Callable[[Estimator], Estimator]:
    """Decorator adding an estimator to :data:`ESTIMATORS` under ``name``."""

    def decorate(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise RepertoryError(f"estimator {name!r} is already registered")
        ESTIMATORS[name] = EstimatorSpec(name, fn, needs_critic, whiten)
        return fn

    return decorate


def get_estimator(name: str) -> EstimatorSpec:
    """The registered estimator called ``name``."""
    if name not in ESTIMATORS:
        raise RepertoryError(f"unknown estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


# ----------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    # fsum is exactly rounded, so group statistics do not depend on the order of the batch.
    return math.fsum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    """Unbiased standard deviation; 0 for fewer than two numbers (section 0)."""
    if len(xs) < 2:
        return 0.0
    mean = _mean(xs)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """G_t = sum_{l>=t} gamma^(l-t) r_l (5.4, 7.2)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = out[t] = rewards[t] + gamma * running
    return out


def group_normalise(xs: list[float]) -> list[float]:
    """(x - mean) / (std + 1e-6) (4.2, 5.5); all zeros for fewer than two numbers or all equal ones."""
    # Exactly 0, not the ~1e-11 a float formula can leave on equal numbers (4.1).
    if len(xs) < 2 or all(x == xs[0] for x in xs):
        return [0.0] * len(xs)
    mean, scale = _mean(xs), _std(xs) + 1e-6
    return [(x - mean) / scale for x in xs]


def _check(traj: TrajectoryInput, needs_values: bool) -> None:
    if len(traj.rewards) != len(traj.lengths):
        raise RepertoryError(f"{len(traj.rewards)} rewards for {len(traj.lengths)} turns")
    if any(n < 0 for n in traj.lengths):
        raise RepertoryError(f"negative turn length in {traj.lengths}")
    if not needs_values:
        return
    if traj.values is None:
        raise RepertoryError("this estimator needs critic values; TrajectoryInput.values is None")
    if [len(v) for v in traj.values] != list(traj.lengths):
        raise RepertoryError(f"values per turn {[len(v) for v in traj.values]} do not match lengths {traj.lengths}")


def _retain(traj: TrajectoryInput) -> tuple[list[int], list[float]]:
    """Indices of the non-empty turns and their rewards, with each empty turn's reward moved to the next
    retained turn, else to the last retained turn (1.5, 2.5)."""
    kept: list[int] = []
    rewards: list[float] = []
    pending = 0.0
    for k, (reward, length) in enumerate(zip(traj.rewards, traj.lengths)):
        if length == 0:
            pending += reward
            continue
        kept.append(k)
        rewards.append(float(reward) + pending)
        pending = 0.0
    if kept:
        rewards[-1] += pending
    return kept, rewards


def _gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE over one chain of steps with no bootstrap past its end: (advantages, lambda-returns)."""
    advantages = [0.0] * len(rewards)
    next_value = next_advantage = 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = advantages[t] = delta + gamma * lam * next_advantage
        next_value = values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def _empty_like(traj: TrajectoryInput) -> list[list[float]]:
    return [[] for _ in traj.lengths]


# ----------------------------------------------------------------------------------------------------------
# Critic estimators (sections 2 and 3)
# ----------------------------------------------------------------------------------------------------------

_Rows = list[list[float]]  # [turn][token] over the retained turns of one trajectory
# (rewards, values) of the retained turns -> (advantages, returns)
_TurnGAE = Callable[[list[float], _Rows, EstimatorParams], tuple[_Rows, _Rows]]


def _critic_estimate(
    trajectories: list[TrajectoryInput], params: EstimatorParams, per_trajectory: _TurnGAE
) -> Estimate:
    advantages, returns, dropped = [], [], 0
    for traj in trajectories:
        _check(traj, needs_values=True)
        kept, rewards = _retain(traj)
        adv, ret = _empty_like(traj), _empty_like(traj)
        if not kept:
            dropped += 1
        else:
            values = [[float(x) for x in traj.values[k]] for k in kept]
            for k, turn_adv, turn_ret in zip(kept, *per_trajectory(rewards, values, params)):
                adv[k], ret[k] = turn_adv, turn_ret
        advantages.append(adv)
        returns.append(ret)
    return Estimate(advantages, returns, {"dropped_trajectories": float(dropped)})


def _omar_turns(rewards: list[float], values: _Rows, p: EstimatorParams) -> tuple[_Rows, _Rows]:
    # Stage 1 reads the critic at the position predicting the turn's last token (2.2).
    _, turn_returns = _gae(rewards, [v[-1] for v in values], p.gamma_turn, p.lambda_turn)
    # Stage 2: the turn lambda-return is the pseudo-reward, so the last-token target equals it (2.4).
    per_turn = [
        _gae([0.0] * (len(v) - 1) + [ret], v, p.gamma_token, p.lambda_token) for v, ret in zip(values, turn_returns)
    ]
    return [adv for adv, _ in per_turn], [ret for _, ret in per_turn]


def _mt_ppo_turns(rewards: list[float], values: _Rows, p: EstimatorParams) -> tuple[_Rows, _Rows]:
    step_rewards = [x for r, v in zip(rewards, values) for x in [0.0] * (len(v) - 1) + [r]]
    adv, ret = _gae(step_rewards, [x for v in values for x in v], p.gamma, p.lam)
    bounds = [0]
    for v in values:
        bounds.append(bounds[-1] + len(v))
    return [adv[a:b] for a, b in zip(bounds, bounds[1:])], [ret[a:b] for a, b in zip(bounds, bounds[1:])]


@register_estimator("omar", needs_critic=True, whiten=True)
def omar(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """OMAR (section 2): turn-level GAE over the seat's own turns, then token-level GAE inside each turn with
    the turn lambda-return as pseudo-reward at its last token and no bootstrap past the turn."""
    return _critic_estimate(trajectories, params, _omar_turns)


@register_estimator("gae", needs_critic=True, whiten=True)
def gae(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """MT-PPO (section 3): plain token-level GAE over the seat's valid tokens chained across its turns."""
    return _critic_estimate(trajectories, params, _mt_ppo_turns)


# ----------------------------------------------------------------------------------------------------------
# Critic-free estimators (section 4)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Seat:
    """A trajectory with at least one retained turn, and where it sits in the input list."""

    position: int
    traj: TrajectoryInput
    kept: list[int]

    @property
    def seat_return(self) -> float:
        # gamma_R = 1 (4.1); summing the raw rewards makes R_e independent of empty-turn moves.
        return math.fsum(self.traj.rewards)


# (seats in stored order, metrics to fill) -> A_traj per seat
_Baseline = Callable[[list[_Seat], dict[str, float]], list[float]]


def _critic_free_estimate(
    trajectories: list[TrajectoryInput], params: EstimatorParams, baseline: _Baseline
) -> Estimate:
    seats: list[_Seat] = []
    for position, traj in enumerate(trajectories):
        _check(traj, needs_values=False)
        kept, _ = _retain(traj)
        if kept:
            seats.append(_Seat(position, traj, kept))
    # Stored-batch order, never input (completion) order: EMA updates are sequential (4.4).
    seats.sort(key=lambda s: (s.traj.episode_index, s.traj.seat_index))
    metrics = {"dropped_trajectories": float(len(trajectories) - len(seats))}
    advantages = [_empty_like(traj) for traj in trajectories]
    for seat, a_traj in zip(seats, baseline(seats, metrics)):
        n_turns = len(seat.kept)
        for i, k in enumerate(seat.kept):
            # 4.6: discount counted in the seat's own retained turns, after the baseline is subtracted.
            advantages[seat.position][k] = [params.turn_discount ** (n_turns - 1 - i) * a_traj] * seat.traj.lengths[k]
    return Estimate(advantages, None, metrics)


def _grouped(
    seats: list[_Seat], params: EstimatorParams, metrics: dict[str, float], centre: Callable[[list[float]], list[float]]
) -> list[float]:
    """Apply ``centre`` to the seat returns of each (env, kernel, iteration, role) group (1.4, 4.1)."""
    groups: dict[tuple[str, str, int, str], list[int]] = {}
    for i, seat in enumerate(seats):
        t = seat.traj
        groups.setdefault((t.env, t.kernel_id, t.iteration, t.role), []).append(i)
    out = [0.0] * len(seats)
    singletons = 0
    for key, members in groups.items():
        if len(members) < 2:
            if params.strict:
                raise RepertoryError(f"group {key} has a single member; a baseline needs at least two")
            singletons += 1
            continue
        returns = [seats[i].seat_return for i in members]
        # Exactly 0, not the ~1e-11 a float formula can leave on equal returns (4.1).
        if all(r == returns[0] for r in returns):
            continue
        for i, a in zip(members, centre(returns)):
            out[i] = a
    metrics["singleton_groups"] = float(singletons)
    return out


@register_estimator("grpo")
def grpo(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """Trajectory-level GRPO (4.2): group-normalised seat return; grpo_scale "none" only centres (Dr. GRPO)."""
    if params.grpo_scale not in ("group", "none"):
        raise RepertoryError(f"grpo_scale must be 'group' or 'none', got {params.grpo_scale!r}")

    def centre(returns: list[float]) -> list[float]:
        if params.grpo_scale == "group":
            return group_normalise(returns)
        mean = _mean(returns)
        return [r - mean for r in returns]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


@register_estimator("rloo")
def rloo(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """RLOO (4.3): seat return minus the mean return of the other members of its group."""

    def centre(returns: list[float]) -> list[float]:
        return [r - math.fsum(returns[:i] + returns[i + 1 :]) / (len(returns) - 1) for i, r in enumerate(returns)]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


@register_estimator("reinforce-pp", whiten=True)
def reinforce_pp(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """REINFORCE++-baseline (4.4): seat return minus its group mean; the trainer whitens the batch (2.6)."""

    def centre(returns: list[float]) -> list[float]:
        mean = _mean(returns)
        return [r - mean for r in returns]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


def _ema(seats: list[_Seat], params: EstimatorParams, state: dict, per_batch: bool) -> list[float]:
    """A_e = R_e - b with b read before its update; b per (env, role) in ``state["ema"]``, initially 0."""
    baselines: dict[str, float] = state.setdefault("ema", {})
    alpha = params.ema_alpha
    out = [0.0] * len(seats)
    by_key: dict[str, list[int]] = {}
    for i, seat in enumerate(seats):
        by_key.setdefault(f"{seat.traj.env}|{seat.traj.role}", []).append(i)
    for key, members in by_key.items():
        if per_batch:
            b = baselines.get(key, 0.0)
            for i in members:
                out[i] = seats[i].seat_return - b
            baselines[key] = alpha * b + (1 - alpha) * _mean([seats[i].seat_return for i in members])
            continue
        order = [(seats[i].traj.episode_index, seats[i].traj.seat_index) for i in members]
        if len(set(order)) != len(order):
            raise RepertoryError(
                f"two trajectories of {key!r} share (episode_index, seat_index); EMA order is undefined"
            )
        for i in members:
            b = baselines.get(key, 0.0)
            out[i] = seats[i].seat_return - b
            baselines[key] = alpha * b + (1 - alpha) * seats[i].seat_return
    return out


@register_estimator("reinforce")
def reinforce(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """REINFORCE with a persistent EMA baseline per (env, role) (4.4), updated per trajectory or per batch."""
    if params.ema_update not in ("per_trajectory", "per_batch"):
        raise RepertoryError(f"ema_update must be 'per_trajectory' or 'per_batch', got {params.ema_update!r}")
    per_batch = params.ema_update == "per_batch"
    return _critic_free_estimate(trajectories, params, lambda seats, _: _ema(seats, params, state, per_batch))


@register_estimator("rae")
def rae(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """SPIRAL role-conditioned advantage estimation (4.5): per-trajectory EMA baseline per (env, role),
    discounted per turn with turn_discount."""
    return _critic_free_estimate(trajectories, params, lambda seats, _: _ema(seats, params, state, per_batch=False))


# ----------------------------------------------------------------------------------------------------------
# Advantage Alignment family (section 7): round steps, crn-group leave-one-out baselines, credits
# ----------------------------------------------------------------------------------------------------------


def _leave_one_out(
    members: list[tuple[int, list[float]]], metrics: dict[str, float], strict: bool, key: object
) -> dict[int, list[float]]:
    """A = G - mean of the other members' G, per round index; all zeros (counted) without another member."""
    if len(members) < 2:
        if strict:
            raise RepertoryError(f"group {key} has a single match; a leave-one-out baseline needs two")
        metrics["singleton_groups"] += 1
        return {m: [0.0] * len(g) for m, g in members}
    out = {}
    for m, g in members:
        others = [other for n, other in members if n != m]
        out[m] = [
            g[t] - math.fsum(o[t] for o in others if t < len(o)) / max(1, sum(t < len(o) for o in others))
            for t in range(len(g))
        ]
    return out


def _round_advantages(
    trajectories: list[TrajectoryInput], params: EstimatorParams, metrics: dict[str, float]
) -> list[tuple[list[float], list[float]]]:
    """(A1, A2) per trajectory over rounds (7.2): own and opponent advantages from the same match."""
    for traj in trajectories:
        _check(traj, needs_values=False)
        if traj.round_points is None or traj.opponent_round_points is None or traj.turn_rounds is None:
            raise RepertoryError(
                "Advantage Alignment estimators need round-based two-player games (ipd, split-no-comm, "
                f"trust-and-split); {traj.env} episodes carry no per-round points"
            )
        if len(traj.turn_rounds) != len(traj.lengths):
            raise RepertoryError(f"{len(traj.turn_rounds)} turn rounds for {len(traj.lengths)} turns")
    c = params.reward_constant
    # One entry per (match, seat, side): the trained side's own returns, and its opponent's.
    own = [discounted_returns([p / c for p in t.round_points], params.round_gamma) for t in trajectories]
    opp = [discounted_returns([p / c for p in t.opponent_round_points], params.round_gamma) for t in trajectories]
    matches: dict[tuple[str, str], set[int]] = {}
    for t in trajectories:
        matches.setdefault((t.env, t.group_id), set()).add(t.episode_index)
    # Singleton crn groups pool the whole batch, still per seat and side (7.2).
    groups = [t.group_id if len(matches[(t.env, t.group_id)]) > 1 else None for t in trajectories]
    pools: dict[tuple, list[tuple[int, list[float]]]] = {}
    for i, (t, group) in enumerate(zip(trajectories, groups)):
        pools.setdefault((t.env, group, t.seat_id, "own"), []).append((t.episode_index, own[i]))
        pools.setdefault((t.env, group, t.opponent_seat_id, "opponent"), []).append((t.episode_index, opp[i]))
    advantages: dict[tuple, dict[int, list[float]]] = {}
    metrics["singleton_groups"] = 0.0
    for key, members in pools.items():
        if len({m for m, _ in members}) != len(members):
            raise RepertoryError(f"two trajectories of one match share the baseline pool {key}")
        advantages[key] = _leave_one_out(members, metrics, params.strict, key)
    out = []
    for t, group in zip(trajectories, groups):
        a1 = advantages[(t.env, group, t.seat_id, "own")][t.episode_index]
        a2 = advantages[(t.env, group, t.opponent_seat_id, "opponent")][t.episode_index]
        out.append((a1, a2))
    return out


def aa_credits(a1: list[float], a2: list[float], beta: float, gamma_aa: float) -> list[float]:
    """Advantage Alignment credit (7.3): C_t = A1_t + beta * gamma_aa * (sum_{k<t} gamma_aa^(t-k) A1_k) * A2_t."""
    credits, past = [], 0.0  # past = sum_{k<t} gamma_aa^(t-k) A1_k, carried forward one round at a time
    for t, (own, opponent) in enumerate(zip(a1, a2)):
        past = gamma_aa * past + (gamma_aa * a1[t - 1] if t else 0.0)
        credits.append(own + beta * gamma_aa * past * opponent)
    return credits


_Credit = Callable[[list[float], list[float], EstimatorParams], list[float]]


def _round_estimate(trajectories: list[TrajectoryInput], params: EstimatorParams, credit: _Credit) -> Estimate:
    metrics: dict[str, float] = {}
    pairs = _round_advantages(trajectories, params, metrics)
    advantages = []
    own_sum = opp_sum = credit_sum = 0.0
    n_rounds = 0
    for traj, (a1, a2) in zip(trajectories, pairs):
        c = credit(a1, a2, params)
        if params.discount_state_visitation:
            c = [params.round_gamma**t * x for t, x in enumerate(c)]
        for k, r in enumerate(traj.turn_rounds):
            if not 0 <= r < len(c):
                raise RepertoryError(f"turn {k} is in round {r}, but the game has {len(c)} rounds")
        advantages.append([[c[r]] * n for r, n in zip(traj.turn_rounds, traj.lengths)])
        own_sum, opp_sum, credit_sum = own_sum + math.fsum(a1), opp_sum + math.fsum(a2), credit_sum + math.fsum(c)
        n_rounds += len(c)
    if n_rounds:
        metrics.update(
            {"a1_mean": own_sum / n_rounds, "a2_mean": opp_sum / n_rounds, "credit_mean": credit_sum / n_rounds}
        )
    return Estimate(advantages, None, metrics)


@register_estimator("adalign")
def adalign(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """Advantage Alignment (7.3): own advantage plus the opponent-shaping term."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: aa_credits(a1, a2, p.aa_beta, p.aa_gamma))


@register_estimator("naive")
def naive(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """Naive learner (7.3): the own round advantage only."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: list(a1))


@register_estimator("shared-reward")
def shared_reward(trajectories: list[TrajectoryInput], params: EstimatorParams, state: dict) -> Estimate:
    """Shared reward (7.3): own plus opponent round advantage."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: [x + y for x, y in zip(a1, a2)])


# ----------------------------------------------------------------------------------------------------------
# Batch-online RL (sections 5, 6): I-GRPO's Q-head and candidates, the metric, MT-SFT, MT-KTO, ArCHer
# ----------------------------------------------------------------------------------------------------------

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


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (unbiased std / sqrt(n)); SE 0 for a single value, both NaN for none."""
    if not values:
        return math.nan, math.nan
    return _mean(values), _std(values) / math.sqrt(len(values))


def seed_summary(scores: list[float]) -> tuple[float, float]:
    """Mean and standard error of per-seed scores (5.7); SE 0 for a single seed."""
    if not scores:
        raise RepertoryError("no seed scores to summarise")
    return mean_se(scores)


def format_mean_se(mean: float, se: float, digits: int = 2) -> str:
    """Mean ± SE the way the I-GRPO tables print it (5.7): "0.55 ± .01", the SE without its leading zero."""
    se_text = f"{se:.{digits}f}"
    if se_text.startswith("0."):
        se_text = se_text[1:]
    return f"{mean:.{digits}f} ± {se_text}"


def _quantile(xs: list[float], q: float) -> float:
    """numpy.quantile's default: linear interpolation between order statistics, from the nearer one as numpy
    does, so cutoffs match numpy to the bit."""
    xs = sorted(xs)
    position = (len(xs) - 1) * q
    if position >= len(xs) - 1:
        return xs[-1]
    lo = math.floor(position)
    a, b, frac = xs[lo], xs[lo + 1], position - lo
    return b - (b - a) * (1 - frac) if frac >= 0.5 else a + (b - a) * frac


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


# ----------------------------------------------------------------------------------------------------------
# Whitening and per-token losses (2.6, 2.7)
# ----------------------------------------------------------------------------------------------------------


def whiten(advantages: list[list[list[float]]]) -> list[list[list[float]]]:
    """(A - mean) / (std + 1e-8) over every token of the batch (2.6); all zeros when fewer than two tokens."""
    flat = [a for traj in advantages for turn in traj for a in turn]
    if len(flat) < 2:
        return [[[0.0] * len(turn) for turn in traj] for traj in advantages]
    mean, scale = _mean(flat), _std(flat) + 1e-8
    return [[[(a - mean) / scale for a in turn] for turn in traj] for traj in advantages]


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
    """Entropy of softmax(logits / T) at each position (over the last dimension)."""
    if temperature <= 0:
        raise RepertoryError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


# ----------------------------------------------------------------------------------------------------------
# Aggregation (2.7)
# ----------------------------------------------------------------------------------------------------------

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


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

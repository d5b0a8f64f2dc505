"""Advantage estimators (docs/algorithms.md sections 2-4 and 7): what they read and return, their registry, and
the built-in ones, pure Python over float64 (no torch, so configs validate estimator names without it).

Each estimator is registered by name with its metadata (needs a critic, whitened by default);
:func:`whiten` is the batch-level post-processing of section 2.6.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from repertory.stats import mean as _mean
from repertory.stats import std as _std
from repertory.types import Registry, RepertoryError

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


GRPO_SCALES = ("group", "none")
EMA_UPDATES = ("per_trajectory", "per_batch")


class _Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GaeParams(_Knobs):
    """Token-level GAE (OMAR's second stage, MT-PPO's ``gae``)."""

    gamma_token: float = Field(1.0, ge=0, le=1, description="Discount per token (omar's token stage, gae).")
    lam: float = Field(0.95, ge=0, le=1, description="gae (MT-PPO) lambda.")


class EstimatorParams(_Knobs):
    """What every estimator reads: which one, the discount per agent turn and the batch-level options. A
    family's parameters extend it (:class:`TurnParams`, :class:`AlignmentParams`); each is the one declaration
    of its knobs, which the config's method sections inherit."""

    family: ClassVar[str] = ""

    estimator: str = Field("omar", description="Advantage estimator (its family's, see `repertory estimators`).")
    gamma: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Discount per agent turn (per round in round games): of the estimator's turn-level credit and of "
        "the held-out expected discounted return; default: the estimator's (omar 0.95, adalign family 0.9, others 1).",
    )
    whiten: bool | None = Field(None, description="Whiten advantages over the batch; default: the estimator's.")
    strict: bool = Field(False, description="Critic-free estimators: a group with one member is an error, not 0.")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        family = [n for n, spec in sorted(ESTIMATORS.items()) if not cls.family or spec.family == cls.family]
        if name not in family:
            raise ValueError(f"unknown estimator {name!r}; allowed: {', '.join(family)}")
        return name


class TurnParams(EstimatorParams, GaeParams):
    """Estimators over a seat's turns: OMAR and GAE with a critic, the critic-free group and EMA baselines."""

    family: ClassVar[str] = "turn"

    lambda_turn: float = Field(0.95, ge=0, le=1, description="OMAR turn-level GAE lambda.")
    lambda_token: float = Field(1.0, ge=0, le=1, description="OMAR token-level GAE lambda.")
    grpo_scale: str = Field("group", description="GRPO: divide by the group std (group) or not (none, Dr. GRPO).")
    ema_alpha: float = Field(0.95, ge=0, lt=1, description="EMA baseline decay (reinforce, rae).")
    ema_update: str = Field(
        "per_trajectory", description="EMA baseline update order: per_trajectory or per_batch (reinforce, rae)."
    )

    @field_validator("grpo_scale", "ema_update")
    @classmethod
    def _known_choice(cls, value: str, info: ValidationInfo) -> str:
        allowed = GRPO_SCALES if info.field_name == "grpo_scale" else EMA_UPDATES
        if value not in allowed:
            raise ValueError(f"unknown {info.field_name} {value!r}; allowed: {', '.join(allowed)}")
        return value


class AlignmentParams(EstimatorParams):
    """The Advantage Alignment family (section 7): adalign and its naive and shared-reward baselines, over the
    per-round points of two-player round games; ``gamma`` discounts the round returns."""

    family: ClassVar[str] = "alignment"

    estimator: str = Field("adalign", description="adalign, naive or shared-reward.")
    aa_gamma: float = Field(
        0.9, ge=0, le=1, description="adalign: discount gamma_aa of the opponent-shaping sum (not a return discount)."
    )
    aa_beta: float = Field(0.5, ge=0, description="adalign: strength beta of the opponent-shaping term.")
    reward_constant: float = Field(1.0, gt=0, description="Step reward = raw round points / this constant c.")
    discount_state_visitation: bool = Field(False, description="Multiply round t's credit by gamma^t.")


@dataclass
class Estimate:
    """Per-token advantages (and critic targets) in the input's [trajectory][turn][token] shape."""

    advantages: list[list[list[float]]]
    returns: list[list[list[float]]] | None  # critic targets G (critic estimators only)
    metrics: dict[str, float]


Estimator = Callable[[list[TrajectoryInput], Any, dict], Estimate]
"""(trajectories, the family's params, the trainer-owned state) -> Estimate."""


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator: ``whiten`` is the default of the option whiten_advantages (2.6), ``gamma`` the
    default discount per agent turn, ``family`` which parameters it reads (turn or alignment)."""

    name: str
    fn: Estimator
    needs_critic: bool
    whiten: bool
    gamma: float
    family: str


ESTIMATORS: Registry[EstimatorSpec] = Registry("estimator")


def register_estimator(
    name: str, *, needs_critic: bool = False, whiten: bool = False, gamma: float = 1.0, family: str = "turn"
) -> Callable[[Estimator], Estimator]:
    """Decorator adding an estimator to :data:`ESTIMATORS` under ``name``. The registered function (and the
    name it is bound to) sees ``params.gamma`` resolved: unset, it is this estimator's ``gamma``."""

    def decorate(fn: Estimator) -> Estimator:
        def resolved(trajectories: list[TrajectoryInput], params: Any, state: dict) -> Estimate:
            if params.gamma is None:
                params = params.model_copy(update={"gamma": gamma})
            return fn(trajectories, params, state)

        resolved.__doc__, resolved.__name__ = fn.__doc__, fn.__name__
        ESTIMATORS.add(name, EstimatorSpec(name, resolved, needs_critic, whiten, gamma, family))
        return resolved

    return decorate


def get_estimator(name: str) -> EstimatorSpec:
    """The registered estimator called ``name``."""
    return ESTIMATORS[name]


# ----------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------


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
_TurnGAE = Callable[[list[float], _Rows, TurnParams], tuple[_Rows, _Rows]]


def _critic_estimate(trajectories: list[TrajectoryInput], params: TurnParams, per_trajectory: _TurnGAE) -> Estimate:
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


def _omar_turns(rewards: list[float], values: _Rows, p: TurnParams) -> tuple[_Rows, _Rows]:
    # Stage 1 reads the critic at the position predicting the turn's last token (2.2).
    _, turn_returns = _gae(rewards, [v[-1] for v in values], p.gamma, p.lambda_turn)
    # Stage 2: the turn lambda-return is the pseudo-reward, so the last-token target equals it (2.4).
    per_turn = [
        _gae([0.0] * (len(v) - 1) + [ret], v, p.gamma_token, p.lambda_token) for v, ret in zip(values, turn_returns)
    ]
    return [adv for adv, _ in per_turn], [ret for _, ret in per_turn]


def _mt_ppo_turns(rewards: list[float], values: _Rows, p: TurnParams) -> tuple[_Rows, _Rows]:
    step_rewards = [x for r, v in zip(rewards, values) for x in [0.0] * (len(v) - 1) + [r]]
    adv, ret = _gae(step_rewards, [x for v in values for x in v], p.gamma_token, p.lam)
    bounds = [0]
    for v in values:
        bounds.append(bounds[-1] + len(v))
    return [adv[a:b] for a, b in zip(bounds, bounds[1:])], [ret[a:b] for a, b in zip(bounds, bounds[1:])]


@register_estimator("omar", needs_critic=True, whiten=True, gamma=0.95)
def omar(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
    """OMAR (section 2): turn-level GAE over the seat's own turns, then token-level GAE inside each turn with
    the turn lambda-return as pseudo-reward at its last token and no bootstrap past the turn."""
    return _critic_estimate(trajectories, params, _omar_turns)


@register_estimator("gae", needs_critic=True, whiten=True)
def gae(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
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


def _critic_free_estimate(trajectories: list[TrajectoryInput], params: TurnParams, baseline: _Baseline) -> Estimate:
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
            advantages[seat.position][k] = [params.gamma ** (n_turns - 1 - i) * a_traj] * seat.traj.lengths[k]
    return Estimate(advantages, None, metrics)


def _grouped(
    seats: list[_Seat], params: TurnParams, metrics: dict[str, float], centre: Callable[[list[float]], list[float]]
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
def grpo(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
    """Trajectory-level GRPO (4.2): group-normalised seat return; grpo_scale "none" only centres (Dr. GRPO)."""
    if params.grpo_scale not in GRPO_SCALES:
        raise RepertoryError(f"grpo_scale must be 'group' or 'none', got {params.grpo_scale!r}")

    def centre(returns: list[float]) -> list[float]:
        if params.grpo_scale == "group":
            return group_normalise(returns)
        mean = _mean(returns)
        return [r - mean for r in returns]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


@register_estimator("rloo")
def rloo(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
    """RLOO (4.3): seat return minus the mean return of the other members of its group."""

    def centre(returns: list[float]) -> list[float]:
        return [r - math.fsum(returns[:i] + returns[i + 1 :]) / (len(returns) - 1) for i, r in enumerate(returns)]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


@register_estimator("reinforce-pp", whiten=True)
def reinforce_pp(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
    """REINFORCE++-baseline (4.4): seat return minus its group mean; the trainer whitens the batch (2.6)."""

    def centre(returns: list[float]) -> list[float]:
        mean = _mean(returns)
        return [r - mean for r in returns]

    return _critic_free_estimate(trajectories, params, lambda seats, metrics: _grouped(seats, params, metrics, centre))


def _ema(seats: list[_Seat], params: TurnParams, state: dict, per_batch: bool) -> list[float]:
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
def reinforce(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
    """REINFORCE with a persistent EMA baseline per (env, role) (4.4), updated per trajectory or per batch."""
    if params.ema_update not in EMA_UPDATES:
        raise RepertoryError(f"ema_update must be 'per_trajectory' or 'per_batch', got {params.ema_update!r}")
    per_batch = params.ema_update == "per_batch"
    return _critic_free_estimate(trajectories, params, lambda seats, _: _ema(seats, params, state, per_batch))


@register_estimator("rae")
def rae(trajectories: list[TrajectoryInput], params: TurnParams, state: dict) -> Estimate:
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
    trajectories: list[TrajectoryInput], params: AlignmentParams, metrics: dict[str, float]
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
    own = [discounted_returns([p / c for p in t.round_points], params.gamma) for t in trajectories]
    opp = [discounted_returns([p / c for p in t.opponent_round_points], params.gamma) for t in trajectories]
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


_Credit = Callable[[list[float], list[float], AlignmentParams], list[float]]


def _round_estimate(trajectories: list[TrajectoryInput], params: AlignmentParams, credit: _Credit) -> Estimate:
    metrics: dict[str, float] = {}
    pairs = _round_advantages(trajectories, params, metrics)
    advantages = []
    own_sum = opp_sum = credit_sum = 0.0
    n_rounds = 0
    for traj, (a1, a2) in zip(trajectories, pairs):
        c = credit(a1, a2, params)
        if params.discount_state_visitation:
            c = [params.gamma**t * x for t, x in enumerate(c)]
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


@register_estimator("adalign", gamma=0.9, family="alignment")
def adalign(trajectories: list[TrajectoryInput], params: AlignmentParams, state: dict) -> Estimate:
    """Advantage Alignment (7.3): own advantage plus the opponent-shaping term."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: aa_credits(a1, a2, p.aa_beta, p.aa_gamma))


@register_estimator("naive", gamma=0.9, family="alignment")
def naive(trajectories: list[TrajectoryInput], params: AlignmentParams, state: dict) -> Estimate:
    """Naive learner (7.3): the own round advantage only."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: list(a1))


@register_estimator("shared-reward", gamma=0.9, family="alignment")
def shared_reward(trajectories: list[TrajectoryInput], params: AlignmentParams, state: dict) -> Estimate:
    """Shared reward (7.3): own plus opponent round advantage."""
    return _round_estimate(trajectories, params, lambda a1, a2, p: [x + y for x, y in zip(a1, a2)])


def whiten(advantages: list[list[list[float]]]) -> list[list[list[float]]]:
    """(A - mean) / (std + 1e-8) over every token of the batch (2.6); all zeros when fewer than two tokens."""
    flat = [a for traj in advantages for turn in traj for a in turn]
    if len(flat) < 2:
        return [[[0.0] * len(turn) for turn in traj] for traj in advantages]
    mean, scale = _mean(flat), _std(flat) + 1e-8
    return [[[(a - mean) / scale for a in turn] for turn in traj] for traj in advantages]

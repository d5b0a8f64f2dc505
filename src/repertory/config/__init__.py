"""Training configuration: one documented pydantic model, YAML recipes and ``--set key=value`` overrides.

A recipe is a YAML file holding any subset of :class:`TrainConfig`; what it leaves out keeps the
default. Unknown keys and invalid values are rejected before any work starts, with the key path
and the allowed values in one message. Recipes shipped with repertory live in
``repertory/recipes`` and can be named without a path (``repertory train omar-ipd``).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from repertory.config.compat import leaves, switch_kind, translate, translate_override
from repertory.config.methods import (
    METHOD_CONFIGS,
    AdAlignConfig,
    AdapterConfig,
    ArcherConfig,
    ArcherLCConfig,
    CriticConfig,
    IGRPOConfig,
    MethodConfig,
    MTKTOConfig,
    MTPPOConfig,
    MTSFTConfig,
    PoolConfig,
    QConfig,
    RoundMethodConfig,
    SelfPlayConfig,
    STGRPOConfig,
    method_kind,
    round_kinds,
)
from repertory.config.rules import RULES, Rule, broken_rule
from repertory.config.sections import (
    AlgoConfig,
    EvalConfig,
    JudgeConfig,
    LoraConfig,
    ModelConfig,
    ProbesConfig,
    RolloutConfig,
    WandbConfig,
    WarmStartConfig,
    _Section,
)
from repertory.envs import env_class
from repertory.envs.roles import RoleAdapters
from repertory.types import RepertoryError

ARM_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
"""What names an arm (a run directory's prefix): a letter or digit, then letters, digits, '.', '_' or '-'."""


class TrainConfig(_Section):
    """Everything a training run needs. Every field has a default; a recipe overrides some."""

    name: str | None = Field(
        None, description="Run name; default: <method>-<env>-<timestamp>, after <recipe>_ for a recipe but the default."
    )
    arm: str | None = Field(
        None,
        pattern=ARM_NAME,
        description="The run's row in a comparison (a suite methods entry's `name`: two settings of one method, "
        "igrpo-steps-4 and igrpo-steps-8); default: the method's name (see method_name).",
    )
    recipe: str | None = Field(
        None,
        description="The recipe a run was started from: a shipped recipe's name or a file's stem (set by "
        "`repertory train`; it names the run directory and the banner).",
    )
    output_dir: str = Field("runs", description="Where run directories are created.")
    seed: int = Field(0, ge=0, description="Master seed of kernels, sampling and mini-batch order.")
    iterations: int = Field(8, ge=1, description="Rollout + update iterations.")
    checkpoint_every: int = Field(1, ge=1, description="Write a checkpoint every N iterations (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept on disk.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    method: MethodConfig = Field(
        default_factory=SelfPlayConfig,
        description="How the policy learns: kind selfplay or adalign (online: rollout and update every iteration), "
        "igrpo, st-grpo, mt-sft, mt-kto, mt-ppo, archer or archer-lc (each iteration a batch-online deployment "
        "round), with that method's settings.",
    )
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    warm_start: WarmStartConfig | None = Field(
        None, description="Imitate the game's bot before training, and start from the result (see WarmStartConfig)."
    )
    tracking: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where every metrics line, the config and the report go: jsonl (RUN/metrics.jsonl, always), "
        "tensorboard (RUN/tensorboard), wandb (see the wandb section).",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @property
    def method_name(self) -> str:
        """The run's arm: ``arm`` where set, else what trains the policy, an online method's estimator or the round
        method (the run's name, the CLI's and the report's label)."""
        if self.arm is not None:
            return self.arm
        return self.method.kind if self.round_based else getattr(self.method, "estimator", self.method.kind)

    @property
    def round_based(self) -> bool:
        """Whether each iteration is a batch-online deployment round (a round method)."""
        return isinstance(self.method, RoundMethodConfig)

    @property
    def selects_on_validation(self) -> bool:
        """Whether the run evaluates more than one trained policy (0 < ``eval.every`` < ``iterations``), so that a
        best one can be selected: then each of them is also evaluated on validation kernels (``eval.validation``)."""
        evaluation = self.eval
        return evaluation.validation and bool(evaluation.episodes) and 0 < evaluation.every < self.iterations

    @property
    def evaluation_opponent(self) -> str:
        """The line-up of the held-out evaluations: ``eval.opponent``, else the rollout opponent (a pool of
        snapshots: the live policy itself), except that a fixed-seat game trained in self-play is measured
        against its partner bot."""
        spec = self.eval.opponent or self.rollout.opponent
        spec = "self" if spec == "pool" else spec
        env = env_class(self.rollout.env)
        return env.default_partner if spec == "self" and self.eval.opponent is None and env.fixed_seat else spec

    @model_validator(mode="after")
    def _role_adapters(self) -> TrainConfig:
        if self.model.adapters != "shared":
            try:
                RoleAdapters.of(self.rollout.env, self.model.adapters)
            except RepertoryError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _feature_rules(self) -> TrainConfig:
        broken = broken_rule(self)
        if broken is not None:
            raise ValueError(broken)
        return self

    @model_validator(mode="after")
    def _warm_start_bot(self) -> TrainConfig:
        bots = list(env_class(self.rollout.env).bots)
        if self.warm_start is None:
            return self
        for field in ("bot", "partner"):
            chosen = getattr(self.warm_start, field)
            if bots and chosen in (None, *bots):
                continue
            allowed = ", ".join(bots) if bots else f"none: {self.rollout.env} has no bot, remove warm_start"
            raise ValueError(f"warm_start.{field}: {chosen!r} is no bot of {self.rollout.env}; allowed: {allowed}")
        return self


def register_method_config(cls: type[BaseModel]) -> type[BaseModel]:
    """Class decorator adding a method's config to the ``method`` section (its ``kind`` default names it): a
    round method's extends :class:`RoundMethodConfig`. The built-in ones are the union's members already."""
    METHOD_CONFIGS.add(method_kind(cls), cls)
    _rebuild_method_union()
    return cls


def _rebuild_method_union() -> None:
    """Make ``TrainConfig.method`` the discriminated union of :data:`METHOD_CONFIGS` again."""
    union = Annotated[Union[tuple(METHOD_CONFIGS.values())], Field(discriminator="kind")]  # noqa: UP007
    field = TrainConfig.model_fields["method"]
    TrainConfig.model_fields["method"] = FieldInfo.merge_field_infos(field, annotation=union)
    TrainConfig.model_rebuild(force=True)


class SuiteConfig(_Section):
    """A grid of runs (a recipe file whose top-level key is ``suite``): every method x environment x seed starts
    from ``recipe`` with ``set`` applied, then the table of docs/algorithms.md 5.7 is built from the runs."""

    recipe: str = Field(description="The recipe every run starts from (a shipped name or a file).")
    methods: list[str | dict[str, Any]] = Field(
        min_length=1,
        description="Methods, one run each: a kind (igrpo), or a kind with its settings ({kind: igrpo, candidates: "
        "4}, {kind: selfplay, estimator: grpo}); each keeps the recipe's settings its kind shares. An entry's "
        "`set` holds overrides for its own runs only ({kind: adalign, set: [rollout.opponent=pool]}). A method is "
        "named by its `name` ({kind: igrpo, name: igrpo-steps-4, states_per_step: 4}), else its estimator, else its "
        "kind: the names of the runs and the table's rows.",
    )
    envs: list[str] = Field(min_length=1, description="Environments (rollout.env), one run each.")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="Seeds, one run each.")
    set: list[str] = Field(default_factory=list, description="key=value overrides applied to every run.")
    env_set: dict[str, list[str]] = Field(
        default_factory=dict,
        description="key=value overrides for one environment's runs only, after `set` ({job-interview: "
        "[rollout.max_new_tokens=192]}).",
    )
    output_dir: str = Field("runs/suite", description="Where the runs and table.md / table.csv / contrasts.csv go.")
    metric: Literal["discounted_return", "outcome"] | None = Field(
        None,
        description="The table's held-out score: the expected discounted return J at the method's discount (5.7), "
        "or the mean normalised outcome; default J, or the outcome where a run's method.gamma is 0 (J is then 0 "
        "for every policy).",
    )
    effect: float | None = Field(
        None,
        gt=0,
        description="The smallest effect of interest on the table's metric, as pre-registered: each paired contrast "
        "then says what it decides at ±effect (a difference, level, or one side's effect excluded) and how many "
        "seeds would decide what it leaves open.",
    )
    warm_start: WarmStartConfig | None = Field(
        None, description="Every run starts from its environment's warm start (see WarmStartConfig), built once."
    )
    records: str | None = Field(
        None,
        description="A directory for each finished run's small records (RUN/config.yaml, RUN/metrics.jsonl and the "
        "probes' probes/RUN.json), kept in a repository: a run finished there is not trained again and the table reads "
        "it, so a suite continues on another machine.",
    )
    probes: ProbesConfig | None = Field(
        None, description="What each finished run's policy is probed for besides its score (see ProbesConfig)."
    )

    @field_validator("methods")
    @classmethod
    def _known_distinct_methods(cls, methods: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        names: set[str] = set()
        for entry in methods:
            kind = entry if isinstance(entry, str) else entry.get("kind")
            if kind not in METHOD_CONFIGS:
                raise ValueError(f"unknown method {kind!r}; allowed: {', '.join(METHOD_CONFIGS)}")
            extra = [] if isinstance(entry, str) else entry.get("set", [])
            if not (isinstance(extra, list) and all(isinstance(item, str) for item in extra)):
                raise ValueError(f"{kind}: set must be a list of key=value strings (got {extra!r})")
            name = _method_name(entry)
            if not re.fullmatch(ARM_NAME, name):
                raise ValueError(f"method name {name!r}: letters, digits, '.', '_' and '-' only (it names runs)")
            if name in names:
                raise ValueError(f"two methods named {name!r}: their runs would share a directory")
            names.add(name)
        return methods

    @model_validator(mode="after")
    def _env_set_names_suite_envs(self) -> SuiteConfig:
        unknown = sorted(set(self.env_set) - set(self.envs))
        if unknown:
            raise ValueError(f"env_set names {', '.join(unknown)}, not among envs ({', '.join(self.envs)})")
        if self.records is not None and Path(self.records).resolve() == Path(self.output_dir).resolve():
            raise ValueError(f"records is output_dir ({self.records}): records are copies kept apart from the runs")
        return self

    def method_overrides(self, entry: str | dict[str, Any]) -> tuple[str, list[str]]:
        """A ``methods`` entry's name and the overrides that select it on top of ``set``."""
        if isinstance(entry, str):
            return entry, [f"method.kind={entry}"]

        def leaves(node: dict[str, Any], prefix: str) -> list[str]:
            return [
                item
                for key, value in node.items()
                for item in (
                    leaves(value, f"{prefix}{key}.")
                    if isinstance(value, dict)
                    else [f"{prefix}{key}={json.dumps(value)}"]
                )
            ]

        settings = leaves({k: v for k, v in entry.items() if k not in ("kind", "name", "set")}, "method.")
        arm = [f"arm={json.dumps(str(entry['name']))}"] if "name" in entry else []
        return _method_name(entry), [f"method.kind={entry['kind']}", *settings, *entry.get("set", []), *arm]


def _method_name(entry: str | dict[str, Any]) -> str:
    """A suite entry's name: its ``name`` where it gives one (two settings of one method), else its estimator where
    it names one (online methods share a kind), else its kind."""
    return entry if isinstance(entry, str) else str(entry.get("name", entry.get("estimator", entry["kind"])))


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
    """A validation error as one line per problem: the key path, what is wrong and what is allowed."""
    lines = []
    for item in err.errors():
        loc = item["loc"]
        if loc[:1] == ("method",) and len(loc) > 1 and loc[1] in METHOD_CONFIGS:
            loc = ("method", *loc[2:])  # the union's tag is not a key of the file
            model: type[BaseModel] = METHOD_CONFIGS[str(item["loc"][1])]
            inner: tuple[Any, ...] = loc[1:]
        else:
            model, inner = root, loc
        path = ".".join(str(p) for p in loc)
        if item["type"] == "union_tag_invalid":
            allowed = ", ".join(METHOD_CONFIGS)
            lines.append(f"{path}.kind: unknown method {item['input'].get('kind')!r}; allowed: {allowed}")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key; allowed here: {', '.join(_allowed_keys(inner, model))}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = "" if isinstance(item["input"], dict) else f" (got {item['input']!r})"
            lines.append(f"{path}: {message}{got}" if path else f"{message}{got}")  # a whole-config rule: no key
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


def recipe_name(recipe: str) -> str:
    """How a run names the recipe it was started from: a shipped recipe's name, a recipe file's stem."""
    return Path(recipe).stem if Path(recipe).is_file() else recipe


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
    data = translate(data)
    for item in overrides or []:
        path, value = _parse_override(item)
        for new, new_value in translate_override(path, value, data):
            if new == ["method", "kind"]:
                switch_kind(data, new_value)
            else:
                _apply_override(data, new, new_value)
    if isinstance(data.get("method"), dict):
        data["method"].setdefault("kind", "selfplay")
    if overrides:
        source += " with --set " + " ".join(overrides)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise RepertoryError(describe_error(err, source)) from None


def dump_config(config: TrainConfig) -> str:
    """The fully resolved configuration as YAML (what a run directory's config.yaml holds)."""
    data = config.model_dump(mode="json")
    data["method"] = {"kind": data["method"].pop("kind"), **data["method"]}  # what the section is, first
    return yaml.safe_dump(data, sort_keys=False)


__all__ = [
    "METHOD_CONFIGS",
    "RULES",
    "Rule",
    "broken_rule",
    "AdAlignConfig",
    "AdapterConfig",
    "AlgoConfig",
    "ArcherConfig",
    "ArcherLCConfig",
    "CriticConfig",
    "EvalConfig",
    "IGRPOConfig",
    "JudgeConfig",
    "LoraConfig",
    "MTKTOConfig",
    "MTPPOConfig",
    "MTSFTConfig",
    "MethodConfig",
    "ModelConfig",
    "PoolConfig",
    "QConfig",
    "RoundMethodConfig",
    "RolloutConfig",
    "STGRPOConfig",
    "SelfPlayConfig",
    "SuiteConfig",
    "ProbesConfig",
    "SuiteFile",
    "TrainConfig",
    "WandbConfig",
    "WarmStartConfig",
    "describe_error",
    "dump_config",
    "leaves",
    "load_config",
    "recipe_name",
    "recipe_names",
    "recipe_text",
    "method_kind",
    "register_method_config",
    "round_kinds",
]

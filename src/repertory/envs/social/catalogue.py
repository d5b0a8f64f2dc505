"""The social catalogue: profiles and scenarios as YAML data, their schemas, and the goal checks.

A catalogue file is a YAML mapping with a ``profiles:`` list, a ``scenarios:`` list, or both. The package
ships its own under ``repertory/scenarios``; a user adds more by pointing the ``scenarios`` option at a
directory of such files. Every file is validated with errors that name the file and the field. The
checks of docs/environments.md 12 live here too: an agreement's per-slot conditions (``goal_verified``) and
the secret patterns (``secret_kept``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from repertory.envs.grammar import Syntax, integer, json_object, json_string, literal, one_of, tagged
from repertory.types import RepertoryError

CATEGORIES = ("cooperative", "competitive", "mixed")
RELATIONSHIPS = ("strangers", "know each other by name", "acquaintances", "friends", "romantic partners", "family")
OPS = ("==", "!=", "<=", ">=", "in")
Level = Literal["low", "average", "high"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BigFive(_Strict):
    openness: Level
    conscientiousness: Level
    extraversion: Level
    agreeableness: Level
    neuroticism: Level


class Profile(_Strict):
    """A character: who they are in public, their temperament, and an optional personal secret."""

    id: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")
    first_name: str = Field(min_length=1)
    last_name: str = Field(min_length=1)
    age: int = Field(ge=18, le=110)
    pronoun: str = Field(min_length=1)
    occupation: str = Field(min_length=1)
    bio: str = Field(min_length=1)
    big_five: BigFive
    values: list[str] = Field(min_length=1)
    decision_style: str = Field(min_length=1)
    secret: str = ""
    tags: list[str] = Field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.first_name} {self.last_name}"


class ProfileConstraint(_Strict):
    """Who may fill a slot: an age range and tags the profile must all carry."""

    age_min: int = 0
    age_max: int = 200
    tags: list[str] = Field(default_factory=list)

    def admits(self, profile: Profile) -> bool:
        return self.age_min <= profile.age <= self.age_max and set(self.tags) <= set(profile.tags)


class Slot(_Strict):
    label: str = Field(pattern=r"^[a-z][a-z0-9_ -]*$")
    goal: str = Field(min_length=1)
    secret: str = ""
    profile: ProfileConstraint = Field(default_factory=ProfileConstraint)


class FieldSpec(_Strict):
    """One field of an agreement: an integer range, or an enum of strings."""

    type: Literal["int", "enum"] | None = None
    min: int | None = None
    max: int | None = None
    enum: list[str] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> FieldSpec:
        if self.enum is not None:
            if self.type not in (None, "enum") or self.min is not None or self.max is not None:
                raise ValueError("an enum field has only 'enum'")
            if not self.enum or len(set(self.enum)) != len(self.enum):
                raise ValueError("enum must list distinct values")
        elif self.type == "int" or self.min is not None or self.max is not None:
            if self.min is None or self.max is None or self.min > self.max:
                raise ValueError("an int field needs min <= max")
        else:
            raise ValueError("a field is {type: int, min, max} or {enum: [...]}")
        return self

    @property
    def is_int(self) -> bool:
        return self.enum is None

    def check(self, value: object) -> str:
        """Why ``value`` is not valid for this field ('' when it is)."""
        if self.is_int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
                return "must be an integer"
            assert self.min is not None and self.max is not None
            return "" if self.min <= int(value) <= self.max else f"must be between {self.min} and {self.max}"
        return "" if value in (self.enum or []) else f"must be one of {', '.join(self.enum or [])}"

    @property
    def syntax(self) -> Syntax:
        """The grammar of a valid value, as JSON."""
        return json_string(self.enum) if self.enum is not None else integer(self.min or 0, self.max or 0)

    def describe(self) -> str:
        if self.is_int:
            return f"an integer from {self.min} to {self.max}"
        return "one of " + ", ".join(f'"{v}"' for v in self.enum or [])


Condition = tuple[str, Literal["==", "!=", "<=", ">=", "in"], Any]


class Agreement(_Strict):
    fields: dict[str, FieldSpec] = Field(min_length=1)
    conditions: dict[str, list[Condition]]


class Check(_Strict):
    agreement: Agreement | None = None
    secret_patterns: dict[str, list[str]] = Field(default_factory=dict)


class Scenario(_Strict):
    """A situation with private goals per slot and, where it allows, a verifiable check."""

    id: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")
    category: Literal["cooperative", "competitive", "mixed"]
    split: Literal["train", "heldout", "validation"] = "train"
    relationship: int = Field(ge=0, le=5)
    text: str = Field(min_length=1)
    slots: list[Slot] = Field(min_length=2, max_length=3)
    check: Check = Field(default_factory=Check)

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        labels = [s.label for s in self.slots]
        if len(set(labels)) != len(labels):
            raise ValueError(f"slot labels repeat: {labels}")
        agreement = self.check.agreement
        if agreement is not None:
            if set(agreement.conditions) != set(labels):
                raise ValueError(f"check.agreement.conditions must have exactly the slots {labels}")
            for label, conditions in agreement.conditions.items():
                for name, op, value in conditions:
                    where = f"check.agreement.conditions.{label}: [{name}, {op}, {value}]"
                    spec = agreement.fields.get(name)
                    if spec is None:
                        raise ValueError(f"{where}: unknown field {name!r}")
                    if op in ("<=", ">=") and not spec.is_int:
                        raise ValueError(f"{where}: {op} needs an integer field")
                    for v in value if op == "in" else [value]:
                        if op == "in" and not isinstance(value, list):
                            raise ValueError(f"{where}: 'in' needs a list")
                        if spec.check(v):
                            raise ValueError(f"{where}: {v!r} {spec.check(v)}")
        for label, patterns in self.check.secret_patterns.items():
            slot = next((s for s in self.slots if s.label == label), None)
            if slot is None:
                raise ValueError(f"check.secret_patterns: unknown slot {label!r}")
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"check.secret_patterns.{label}: bad regex {pattern!r}: {exc}") from None
        return self


class Catalogue(_Strict):
    profiles: tuple[Profile, ...]
    scenarios: tuple[Scenario, ...]

    def pool(self, split: str) -> list[Scenario]:
        """The scenarios of one split, in id order."""
        return sorted((s for s in self.scenarios if s.split == split), key=lambda s: s.id)

    def eligible(self, slot: Slot) -> list[Profile]:
        """The profiles that may fill ``slot``, in id order."""
        return [p for p in sorted(self.profiles, key=lambda p: p.id) if slot.profile.admits(p)]


class _File(_Strict):
    profiles: list[Profile] = Field(default_factory=list)
    scenarios: list[Scenario] = Field(default_factory=list)


def _where(data: Any, loc: tuple[Any, ...]) -> str:
    """A field path such as ``scenarios[3] (used-guitar).slots[0].goal``."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, int):
            label = f"[{key}]"
            node = node[key] if isinstance(node, list) and key < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("id"), str):
                label += f" ({node['id']})"
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(key))
            node = node.get(key) if isinstance(node, dict) else None
    return "".join(parts)


def parse_file(text: str, source: str) -> _File:
    """One catalogue file's profiles and scenarios; RepertoryError naming ``source`` and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RepertoryError(f"{source}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise RepertoryError(f"{source}: expected a mapping with 'profiles:' and/or 'scenarios:'")
    try:
        return _File.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RepertoryError(f"{source}: {_where(data, tuple(first['loc']))}: {first['msg']}") from None


def _merge(files: list[tuple[str, _File]]) -> Catalogue:
    profiles: dict[str, tuple[str, Profile]] = {}
    scenarios: dict[str, tuple[str, Scenario]] = {}
    for source, parsed in files:
        for kind, items, seen in (("profile", parsed.profiles, profiles), ("scenario", parsed.scenarios, scenarios)):
            for item in items:
                if item.id in seen:
                    raise RepertoryError(f"{source}: {kind} id {item.id!r} is also defined in {seen[item.id][0]}")
                seen[item.id] = (source, item)  # type: ignore[assignment]
    catalogue = Catalogue(
        profiles=tuple(p for _, p in profiles.values()), scenarios=tuple(s for _, s in scenarios.values())
    )
    for source, scenario in scenarios.values():
        chosen: set[str] = set()
        for i, slot in enumerate(scenario.slots):
            free = [p for p in catalogue.eligible(slot) if p.id not in chosen]
            if not free:
                raise RepertoryError(
                    f"{source}: scenarios ({scenario.id}).slots[{i}].profile: no profile left that fits "
                    f"{slot.profile.model_dump(exclude_defaults=True)}"
                )
            chosen.add(free[0].id)
    return catalogue


@cache
def builtin() -> Catalogue:
    """The catalogue shipped with the package."""
    root = resources.files("repertory") / "scenarios"
    files = sorted((f for f in root.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)
    return _merge([(f"repertory/scenarios/{f.name}", parse_file(f.read_text(encoding="utf-8"), f.name)) for f in files])


def load(directory: str | Path | None = None, with_builtin: bool = True) -> Catalogue:
    """The shipped profiles and (unless ``with_builtin`` is false) scenarios, plus every ``*.yaml``/``*.yml``
    file under ``directory``."""
    shipped = builtin()
    scenarios = list(shipped.scenarios) if with_builtin else []
    files = [("repertory/scenarios", _File(profiles=list(shipped.profiles), scenarios=scenarios))]
    if directory is not None:
        root = Path(directory)
        if not root.is_dir():
            raise RepertoryError(f"scenarios: {root} is not a directory")
        paths = sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
        if not paths:
            raise RepertoryError(f"scenarios: {root} holds no .yaml files")
        files += [(str(p), parse_file(p.read_text(encoding="utf-8"), str(p))) for p in paths]
    catalogue = _merge(files)
    if not catalogue.scenarios:
        raise RepertoryError("the catalogue has no scenarios")
    return catalogue


def meets(offer: dict[str, Any], conditions: list[list[Any]]) -> bool:
    """Whether an agreement ``offer`` meets every condition ``[field, op, target]``."""
    return all(holds(offer.get(f), op, v) for f, op, v in conditions)


def agreement_syntax(fields: dict[str, FieldSpec], can_accept: bool) -> Syntax:
    """Under a grammar a turn with an agreement to reach ends in a proposal with every field, in accepting the
    standing one (where the seat may), or in passing or leaving (so that the conversation can still end)."""
    proposal = tagged("propose", json_object([(name, spec.syntax) for name, spec in fields.items()]))
    moves = ["<accept/>", "<pass/>", "<leave/>"] if can_accept else ["<pass/>", "<leave/>"]
    return one_of([proposal, *map(literal, moves)])


def holds(value: Any, op: str, target: Any) -> bool:
    """One condition ``[field, op, target]`` on an agreed ``value``."""
    if op == "==":
        return value == target
    if op == "!=":
        return value != target
    if op == "<=":
        return value <= target
    if op == ">=":
        return value >= target
    return value in target


def goal_verified(scenario: dict[str, Any], label: str, agreement: dict[str, Any] | None) -> float | None:
    """1.0 if an agreement exists and meets every condition of ``label``, 0.0 if not; None where the
    scenario has no agreement check (judge-only goals)."""
    check = (scenario.get("check") or {}).get("agreement")
    if not check:
        return None
    if agreement is None:
        return 0.0
    return float(all(holds(agreement.get(f), op, v) for f, op, v in check["conditions"][label]))


def leaked(scenario: dict[str, Any], label: str, texts: list[str]) -> bool | None:
    """Whether any of ``label``'s own texts matches its secret patterns; None where it has none."""
    patterns = ((scenario.get("check") or {}).get("secret_patterns") or {}).get(label)
    if not patterns:
        return None
    return any(re.search(p, t, re.IGNORECASE) for p in patterns for t in texts)

"""Environments: a registry of text games with a referee, and their shipped kernels.

``make("ipd")`` returns a fresh environment; ``env_names()`` lists what is available;
``load_kernels("ipd", "heldout")`` returns the 100 frozen scenario instances of a split (train, heldout or
validation). Built-in games are imported on first use, so loading one game never imports the others. A new
game checks itself against the shared rules with ``repertory.envs.checks.check_env(MyGame)``. Names with an
adapter's prefix (``textarena:TicTacToe-v0``) resolve to classes built on demand over another library's games;
they are not listed by ``env_names()``.
"""

from __future__ import annotations

import inspect
from importlib import import_module
from typing import Any

from repertory.envs.base import Bot, Env, IteratedGame, KeyMetric, RoundGame
from repertory.envs.kernels import check_split, generate_kernels, kernels_of, write_kernels
from repertory.envs.phased import PhasedGame
from repertory.types import Kernel, Registry, RepertoryError

_BUILTIN: dict[str, str] = {
    "ipd": "ipd:IteratedPrisonersDilemma",
    "split-no-comm": "split_no_comm:SplitNoComm",
    "trust-and-split": "trust_and_split:TrustAndSplit",
    "craigslist": "craigslist:Craigslist",
    "ultimatum": "ultimatum:Ultimatum",
    "deal-or-no-deal": "deal_or_no_deal:DealOrNoDeal",
    "casino": "casino:Casino",
    "job-interview": "job_interview:JobInterview",
    "alliance": "alliance:Alliance",
    "werewolf": "werewolf:Werewolf",
    "social": "social:Social",
}
_ADAPTERS: dict[str, str] = {"textarena:": "textarena:textarena_env"}
"""Name prefix -> ``module:factory`` that builds the environment class of a prefixed name."""
_REGISTRY: Registry[type[Env]] = Registry("environment")


def register_env(cls: type[Env]) -> type[Env]:
    """Class decorator: make ``cls`` available as ``make(cls.name)`` (a built-in game's name stays its own)."""
    if _REGISTRY.get(cls.name) is cls:
        return cls
    if cls.name in _BUILTIN and cls.name not in _REGISTRY and not _is_builtin(cls):
        raise RepertoryError(f"environment {cls.name!r} is already registered")
    return _REGISTRY.add(cls.name, cls)


def _is_builtin(cls: type[Env]) -> bool:
    module, name = _BUILTIN[cls.name].split(":")
    return cls.__module__ == f"{__name__}.{module}" and cls.__qualname__ == name


def env_names() -> list[str]:
    """Available environment names: the built-in games, then those registered by users."""
    return list(dict.fromkeys([*_BUILTIN, *_REGISTRY]))


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` names another library's game through an adapter prefix (``textarena:...``)."""
    return name.startswith(tuple(_ADAPTERS))


def env_class(name: str) -> type[Env]:
    """The class registered as ``name`` (or built by the adapter of its prefix); unknown names list the known ones."""
    if name not in _REGISTRY and name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        register_env(getattr(import_module(f"{__name__}.{module}"), attr))
    for prefix, target in _ADAPTERS.items():
        if name not in _REGISTRY and name.startswith(prefix):
            module, attr = target.split(":")
            return getattr(import_module(f"{__name__}.{module}"), attr)(name)
    if name not in _REGISTRY:  # the built-in games are named even before they are imported
        raise RepertoryError(f"unknown environment {name!r}; known: {', '.join(env_names())}")
    return _REGISTRY[name]


def make(name: str, **options: Any) -> Env:
    """A fresh instance of the environment registered as ``name``, built with the game's ``options``
    (Werewolf: ``elimination_discount``); an unknown or invalid option is a RepertoryError."""
    cls = env_class(name)
    accepted = env_options(cls)
    unknown = [key for key in options if accepted is not None and key not in accepted]
    if unknown:
        choices = f"its options are {', '.join(accepted)}" if accepted else "it takes no options"
        raise RepertoryError(f"{name} has no option {', '.join(map(repr, unknown))}; {choices}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise RepertoryError(f"{name}: bad environment options {options}: {exc}") from None


def env_options(cls: type[Env]) -> list[str] | None:
    """The options a game's constructor takes by name (None when it takes any keyword)."""
    parameters = list(inspect.signature(cls).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def load_kernels(name: str, split: str, options: dict[str, Any] | None = None) -> list[Kernel]:
    """The kernels of one split of the environment registered as ``name``, in index order: those the game's
    ``options`` define (a user's social scenarios), else the shipped file, or (for an environment that ships
    none) the deterministic generation."""
    cls = env_class(name)
    check_split(split)
    if options:
        try:
            custom = cls.custom_kernels(split, options)
        except ValueError as exc:
            raise RepertoryError(f"{name}: {exc}") from None
        if custom is not None:
            return custom
    return kernels_of(cls, split)


__all__ = [
    "Bot",
    "Env",
    "KeyMetric",
    "PhasedGame",
    "IteratedGame",
    "RoundGame",
    "env_class",
    "env_names",
    "generate_kernels",
    "is_adapter_name",
    "load_kernels",
    "make",
    "register_env",
    "write_kernels",
]

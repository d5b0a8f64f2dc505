"""Environments: a registry of text games with a referee, and their shipped kernels.

``make("ipd")`` returns a fresh environment; ``env_names()`` lists what is registered;
``load_kernels("ipd", "heldout")`` returns the 100 frozen scenario instances of a split.
"""

from __future__ import annotations

from repertory.envs.base import Bot, Env, RoundGame
from repertory.envs.ipd import IteratedPrisonersDilemma
from repertory.envs.kernels import generate_kernels, load_kernels, write_kernels
from repertory.envs.split_no_comm import SplitNoComm
from repertory.envs.trust_and_split import TrustAndSplit
from repertory.types import RepertoryError

_REGISTRY: dict[str, type[Env]] = {}


def register_env(cls: type[Env]) -> type[Env]:
    """Class decorator: make ``cls`` available as ``make(cls.name)``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"environment {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def env_names() -> list[str]:
    """Registered environment names, in registration order."""
    return list(_REGISTRY)


def env_class(name: str) -> type[Env]:
    """The class registered as ``name``; unknown names list the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise RepertoryError(f"unknown environment {name!r}; known: {', '.join(_REGISTRY)}") from None


def make(name: str) -> Env:
    """A fresh instance of the environment registered as ``name``."""
    return env_class(name)()


for _cls in (IteratedPrisonersDilemma, SplitNoComm, TrustAndSplit):
    register_env(_cls)

__all__ = [
    "Bot",
    "Env",
    "RoundGame",
    "env_class",
    "env_names",
    "generate_kernels",
    "load_kernels",
    "make",
    "register_env",
    "write_kernels",
]

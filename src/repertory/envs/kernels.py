"""Kernels: deterministic generation from (env, split, index), and the frozen shipped files.

Kernel i of split s of environment e is drawn with ``random.Random(derive("repertory", e, s, i))``;
the splits are generated in the order of :data:`~repertory.types.SPLITS` (train, held-out, validation), and a
kernel whose game content repeats an earlier one of any split is redrawn with
``derive("repertory", e, s, i, "retry", r)`` (docs/environments.md 1.5), so the splits are disjoint and a split
depends only on those before it. The shipped ``kernels/<env>/{train,heldout,validation}.jsonl`` files are
authoritative; a test regenerates them byte for byte. Regenerate them with ``python -m repertory.envs [ENV ...]``.

This module sits below the environment registry: every function takes the environment class, so
``repertory.envs`` (which resolves names to classes) imports it and never the other way round.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from repertory.types import SPLITS, Kernel, RepertoryError, canonical_json, derive

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


class KernelSource(Protocol):
    """What kernels need of an environment class (every ``Env`` subclass is one)."""

    name: str
    unique_kernels: bool
    missing_splits: dict[str, str]

    @classmethod
    def draw_kernel(cls, rng: random.Random, split: str) -> dict[str, Any]: ...

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]: ...


KERNELS_PER_SPLIT = 100
MAX_RETRIES = 1000


def splits_of(env: type[KernelSource]) -> tuple[str, ...]:
    """The splits ``env`` has kernels of, in generation order: :data:`SPLITS` less its ``missing_splits``."""
    return tuple(split for split in SPLITS if split not in env.missing_splits)


def generate_kernels(
    env: type[KernelSource],
    n: int = KERNELS_PER_SPLIT,
    draw: Callable[[random.Random, str], dict[str, Any]] | None = None,
    splits: tuple[str, ...] | None = None,
) -> dict[str, list[Kernel]]:
    """``splits`` of ``env`` (by default every one it has), ``n`` kernels each, with the uniqueness retries of
    1.5; ``draw`` replaces ``env.draw_kernel`` (a game drawing from a catalogue of the user's)."""
    draw = draw or env.draw_kernel
    splits = splits_of(env) if splits is None else splits
    seen: set[str] = set()
    out: dict[str, list[Kernel]] = {}
    for split in splits:
        kernels = []
        for i in range(n):
            seed = derive("repertory", env.name, split, i)
            retry = 0
            while True:
                data = draw(random.Random(seed), split)
                content = canonical_json(data)
                if not env.unique_kernels or content not in seen:
                    break
                retry += 1
                if retry > MAX_RETRIES:
                    raise RepertoryError(
                        f"{env.name}: kernel {split}/{i} repeats earlier content after {MAX_RETRIES} retries; the "
                        f"generator has too few distinct kernels for {n} in each of {', '.join(splits)} (set "
                        "unique_kernels = False if repeats are fine, or name a split it cannot fill in missing_splits)"
                    )
                seed = derive("repertory", env.name, split, i, "retry", retry)
            seen.add(content)
            kernels.append(Kernel(f"{env.name}/{split}/{i:03d}", env.name, split, i, seed, data))
        out[split] = kernels
    return out


def kernel_file_text(kernels: list[Kernel]) -> str:
    """The shipped file's content: one canonical JSON line per kernel."""
    return "".join(k.to_json() + "\n" for k in kernels)


def write_kernels(env: type[KernelSource], root: Path) -> list[Path]:
    """Write ``root/<env>/<split>.jsonl`` for every split ``env`` has; returns the paths written."""
    paths = []
    for split, kernels in generate_kernels(env).items():
        path = root / env.name / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(kernel_file_text(kernels), encoding="utf-8")
        paths.append(path)
    return paths


def shipped_file(env_name: str, split: str) -> Traversable:
    """Where the package ships ``env_name``'s kernels of ``split`` (the file may not exist)."""
    return resources.files("repertory") / "kernels" / env_name / f"{split}.jsonl"


def check_split(split: str) -> None:
    """RepertoryError naming the splits where ``split`` is none of them."""
    if split not in SPLITS:
        raise RepertoryError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")


@cache
def _load(env: type[KernelSource], split: str) -> tuple[Kernel, ...]:
    check_split(split)
    if split in env.missing_splits:
        raise RepertoryError(f"{env.name} has no {split} kernels: {env.missing_splits[split]}")
    resource = shipped_file(env.name, split)
    if not resource.is_file():
        # the splits up to this one: a game too small for a validation split still has train and held-out kernels
        order = splits_of(env)
        return tuple(generate_kernels(env, splits=order[: order.index(split) + 1])[split])
    kernels = tuple(
        Kernel.from_json(line) for line in resource.read_text(encoding="utf-8").splitlines() if line.strip()
    )
    for kernel in kernels:
        problems = env.validate_kernel(kernel.data)
        if problems:
            raise RepertoryError(f"shipped kernel {kernel.id} is invalid: {'; '.join(problems)}")
    return kernels


def kernels_of(env: type[KernelSource], split: str) -> list[Kernel]:
    """The kernels of one split of ``env`` in index order: the shipped file, or (for an environment
    that ships none, such as one registered by a user) the deterministic generation of 1.5."""
    return list(_load(env, split))

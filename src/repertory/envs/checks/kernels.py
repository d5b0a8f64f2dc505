"""The ``kernels`` property of :func:`repertory.envs.checks.check_env`: shipped kernels are valid, seeded as
docs/environments.md 1.5 says, unique where required, and regenerate byte for byte."""

from __future__ import annotations

import random
from typing import Any, NoReturn

from repertory.envs.base import Env
from repertory.envs.checks.errors import EnvCheckError, short
from repertory.envs.kernels import (
    KERNELS_PER_SPLIT,
    MAX_RETRIES,
    generate_kernels,
    kernel_file_text,
    shipped_file,
    splits_of,
)
from repertory.types import Kernel, canonical_json, derive


def check_kernels(env_class: type[Env]) -> dict[str, list[Kernel]]:
    """The ``kernels`` property; returns every split the game has (the shipped files where the package has them),
    in generation order."""
    name = env_class.name

    def fail(detail: str) -> NoReturn:
        raise EnvCheckError(name, "kernels", detail)

    try:
        generated = generate_kernels(env_class)
    except Exception as exc:
        raise EnvCheckError(name, "kernels", f"generating the kernels raised {exc!r}") from exc
    out: dict[str, list[Kernel]] = {}
    for split in splits_of(env_class):
        resource = shipped_file(name, split)
        kernels = generated[split]
        if resource.is_file():
            shipped = resource.read_bytes()
            expected = kernel_file_text(kernels).encode("utf-8")
            if shipped != expected:
                have, want = shipped.decode("utf-8", "replace").splitlines(), expected.decode().splitlines()
                line = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
                fail(
                    f"shipped {split}.jsonl does not regenerate byte for byte: line {line + 1} is "
                    f"{short(have[line] if line < len(have) else None)}, generation gives "
                    f"{short(want[line] if line < len(want) else None)} (python -m repertory.envs {name})"
                )
            kernels = [Kernel.from_json(line) for line in shipped.decode("utf-8").splitlines()]
        if len(kernels) != KERNELS_PER_SPLIT:
            fail(f"{split} has {len(kernels)} kernels, not {KERNELS_PER_SPLIT}")
        for i, k in enumerate(kernels):
            if (k.id, k.env, k.split, k.index) != (f"{name}/{split}/{i:03d}", name, split, i):
                fail(f"kernel {i} of {split} is labelled {k.id} ({k.env}, {k.split}, {k.index})")
            if Kernel.from_json(k.to_json()) != k:
                fail(f"kernel {k.id} does not survive a JSON round trip")
            problems = _kernel_problems(env_class, k.data, k.id)
            if problems:
                fail(f"kernel {k.id} is invalid: {'; '.join(problems)}")
            if env_class.draw_kernel(random.Random(k.seed), split) != k.data:
                fail(f"kernel {k.id}: draw_kernel(Random(seed), {split!r}) does not give its data")
        out[split] = kernels
    # The seed is the first draw whose content is new in any split (docs/environments.md 1.5; train, then
    # held-out, then validation), so unique kernels never repeat across the splits either.
    every = [k for kernels in out.values() for k in kernels]
    seen: dict[str, str] = {}
    for k in every:
        retry = next((r for r in range(MAX_RETRIES + 1) if k.seed == _seed(name, k.split, k.index, r)), None)
        if retry is None:
            fail(f"kernel {k.id} has seed {k.seed}, neither derive('repertory', ...) nor one of its retries")
        if retry and not env_class.unique_kernels:
            fail(f"kernel {k.id} was redrawn (retry {retry}) although unique_kernels is off")
        for r in range(retry):
            redrawn = env_class.draw_kernel(random.Random(_seed(name, k.split, k.index, r)), k.split)
            if canonical_json(redrawn) not in seen:
                fail(f"kernel {k.id} took retry {retry}, but draw {r} was already new")
        earlier = seen.setdefault(canonical_json(k.data), k.id)
        if env_class.unique_kernels and earlier != k.id:
            fail(f"kernels {earlier} and {k.id} have the same content (unique_kernels is set)")
    # Fields every kernel has are required, and those never null must not be null.
    good = every[0].data
    required = [key for key in good if all(key in k.data for k in every)]
    broken = [("{}", {})]
    broken += [(f"the kernel without {key!r}", {k: v for k, v in good.items() if k != key}) for key in required]
    never_null = [key for key in required if all(k.data[key] is not None for k in every)]
    broken += [(f"the kernel with {key!r} = None", {**good, key: None}) for key in never_null]
    for what, data in broken:
        if not _kernel_problems(env_class, data, what):
            fail(f"validate_kernel finds no problem with {what} (built from {every[0].id})")
    return out


def _kernel_problems(env_class: type[Env], data: dict[str, Any], what: str) -> list[str]:
    try:
        problems = env_class.validate_kernel(data)
    except Exception as exc:
        raise EnvCheckError(env_class.name, "kernels", f"validate_kernel({what}) raised {exc!r}") from exc
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise EnvCheckError(env_class.name, "kernels", f"validate_kernel({what}) returned {short(problems)}")
    return problems


def _seed(name: str, split: str, i: int, retry: int) -> int:
    """Kernel i's seed for its first draw (retry 0) or its uniqueness retry ``retry``."""
    return derive("repertory", name, split, i, "retry", retry) if retry else derive("repertory", name, split, i)

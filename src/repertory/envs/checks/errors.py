"""What a failed conformance check reports: the property (a key of :data:`PROPERTIES`), the environment and how
to reproduce it."""

from __future__ import annotations

from typing import Any

from repertory.types import Kernel

PROPERTIES: dict[str, str] = {
    "kernels": "kernels are valid, seeded, unique where required and regenerate byte for byte; "
    "the validator reports broken kernels without raising",
    "never-raises": "no text makes reset, step, validate, observe, view, result or metrics raise",
    "validate-pure": "validate changes no state",
    "view-pure": "view changes no state",
    "validate-agrees": "validate accepts exactly what step counts as a valid action, always with a reason "
    "when it refuses, and refuses roles that are not acting",
    "action-choices": "every listed action choice validates",
    "accounting": "acting roles are distinct roles; n_turns and n_invalid count the steps; outcomes lie in "
    "[0, 1]; there is an end reason; metrics are JSON numbers",
    "rewards-sum": "each role's rewards add up to its outcome; the step that ends the episode rewards every role",
    "bots-valid": "bots never raise and never write an invalid action",
    "prompts": "each role's chat opens with its system prompt",
    "privacy": "no role's system prompt lines, private view text or simultaneous-phase text reach another role",
    "termination": "episodes end within max_steps; then nobody acts, validate refuses and step raises RuntimeError",
    "determinism": "replaying the same texts gives the same observations, step results and result",
}

REPORTED_STEPS = 6


class EnvCheckError(AssertionError):
    """A conformance property failed. ``str(error)`` says which, on which environment, and how to
    reproduce it; the attributes hold the same in full (``history``: the texts of every step so far,
    the failing step last)."""

    def __init__(
        self,
        env: str,
        prop: str,
        detail: str,
        kernel: Kernel | None = None,
        episode_seed: int | None = None,
        history: list[dict[str, str]] | None = None,
    ):
        self.env, self.property, self.detail = env, prop, detail
        self.kernel_id = kernel.id if kernel is not None else None
        self.episode_seed, self.history = episode_seed, list(history or [])
        lines = [f"{env}: {prop}: {detail}"]
        if kernel is not None:
            steps = len(self.history)
            lines.append(
                f"  reproduce: kernel {kernel.id}, episode_seed {episode_seed}, {steps} step{'s' * (steps != 1)}"
            )
            skipped = len(self.history) - REPORTED_STEPS
            if skipped > 0:
                lines.append(f"    ... {skipped} earlier steps (see .history)")
            for i, texts in enumerate(self.history[-REPORTED_STEPS:], max(skipped, 0) + 1):
                lines.append(f"    step {i}: {short(texts)}")
        super().__init__("\n".join(lines))


def short(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length noted."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"

"""Conformance checks for environment authors: ``check_env(MyEnv)``, as PettingZoo ships ``api_test``.

``check_env`` checks the properties of environments.md 1 that every game must have, whatever its
turn order (simultaneous rounds, alternating messages, phases in which any subset of seats acts):
its kernels, ``validate`` against ``step``, robustness to arbitrary text, reward bookkeeping and
privacy. It plays the class's own bots and fuzzed text (``random.Random``; no test dependency) and
raises :class:`EnvCheckError` at the first failure, naming the environment, the property (a key of
:data:`PROPERTIES`) and how to reproduce it. :func:`check_episode` is the per-episode checker, for
tests that draw the texts themselves (with hypothesis, say).
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from repertory.envs.base import Env
from repertory.envs.kernels import KERNELS_PER_SPLIT, MAX_RETRIES, generate_kernels, kernel_file_text, shipped_file
from repertory.envs.parsing import clean
from repertory.types import SPLITS, Kernel, Message, Result, StepResult, canonical_json, derive

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
    "rewards-sum": "each role's rewards add up to its outcome",
    "bots-valid": "bots never raise and never write an invalid action",
    "prompts": "each role's chat opens with its system prompt",
    "privacy": "no role's system prompt lines, private view text or simultaneous-phase text reach another role",
    "termination": "episodes end within max_steps; then nobody acts, validate refuses and step raises RuntimeError",
    "determinism": "replaying the same texts gives the same observations, step results and result",
}

Policy = Callable[[Env, str], str]
"""Who writes the text of an acting role: ``policy(env, role) -> text``."""

MIN_SECRET_CHARS = 16
"""Shorter private strings (names, numbers, single words) may legitimately recur in public text."""
TOL = 1e-9
REPORTED_STEPS = 6

PROBES = (
    "",
    "I choose A",
    "<choose>A</choose>",
    "<choose>C</choose>",
    "<choose>B",
    '<propose>{"hats": 1, "books": 2, "balls": 3}</propose>',
    '<propose>{"hats": 11}</propose>',
    '<propose>{"keep": 5}</propose>',
    '<propose>{"keep": 11}</propose>',
    "<propose>{}</propose>",
    '<propose>{"books": 1,}</propose>',
    "<propose>[1, 2]</propose>",
    "<think>x</think>hello",
    "<propose>" + "[" * 5000 + "</propose>",
    "<accept/>",
    "<reject/>",
    "<walkaway/>",
    "<pass/>",
)
"""Texts ``validate`` sees for every role at every step of the bot episodes (a sample in fuzzed ones)."""

FRAGMENTS = (
    *("<choose>", "</choose>", "A", "B", "a", "<propose>", "</propose>", "<PROPOSE>", "<think>", "</think>"),
    *("<accept/>", "<accept>", "</accept>", "<ACCEPT >", "<reject/>", "<walkaway/>", "<pass/>", "<leave/>"),
    *("<vote>", "</vote>", "<kill>", "<inspect>", "<save>", "<poison>", "<act>", "<nonverbal>", "</act>", "<"),
    *("{", "}", "[", "]", '"hats":', '"Books":', '"balls":', '"keep":', '"price":', '"shoes":', ",", ":"),
    *(" ", "\n", "0", "3", "5", "10", "11", "-1", "3.0", "3.5", "1e3", "NaN", "Infinity", "true", "null"),
    *('"3"', "rock", "paper", "scissors"),
)
NUMBERS = ("0", "1", "2", "3", "5", "10", "11", "60", "-1", "-0", "3.0", "3.5", "1e2", "NaN", "true", '"3"', "null")
JUNK_PAYLOADS = (
    *("", " ", "{", "}", "[]", "[1, 2]", "null", "{}", '{"a": 1}', '{"x": NaN}', '{"x": 1,}', "{'x': 1}"),
    *("[" * 3000, "{" * 50, '"text"', "3", '{"x": {"y": []}}', '{"x": 1e999}'),
)
_TAG_EXAMPLE = re.compile(r"<([A-Za-z][\w-]*)>[^<>\n]*</\1>|<[A-Za-z][\w-]*\s*/>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_KEY = re.compile(r'"([^"\\]+)"\s*:')


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
                lines.append(f"    step {i}: {_short(texts)}")
        super().__init__("\n".join(lines))


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


@dataclass(frozen=True)
class CheckSummary:
    """How much ``check_env`` exercised: kernels checked, episodes played, steps taken."""

    env: str
    kernels: int
    episodes: int
    steps: int


@dataclass
class Played:
    """One checked episode: the texts sent each step, what each role saw, the step results, the result."""

    kernel: Kernel
    episode_seed: int
    texts: list[dict[str, str]] = field(default_factory=list)
    observations: dict[str, list[Message]] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)
    result: Result | None = None


def check_env(
    env_class: type[Env], *, episodes: int = 5, examples: int = 50, seed: int = 0, max_steps: int = 1000
) -> CheckSummary:
    """Check ``env_class`` against every property of :data:`PROPERTIES`; raise :class:`EnvCheckError` at
    the first failure.

    Plays the first ``episodes`` kernels of each split with each bot lineup (every seat the first bot;
    seats alternating first and last bot, both ways; every seat the last bot), then ``examples``
    episodes of fuzzed text on random kernels of both splits. ``seed`` varies the episode seeds and
    the fuzz; ``max_steps`` bounds an episode. Returns a :class:`CheckSummary`.
    """
    kernels = check_kernels(env_class)
    played = []
    for lineup in _lineups(env_class):
        policy = _bot_policy(dict(zip(env_class.roles, lineup)))
        for split in SPLITS:
            for i, kernel in enumerate(kernels[split][:episodes]):
                episode_seed = derive("check_env", seed, *lineup, split, i)
                episode = check_episode(env_class, kernel, episode_seed, policy, max_steps=max_steps, bots_valid=True)
                if i == 0:
                    _check_replay(env_class, episode)
                played.append(episode)
    pool = kernels["train"] + kernels["heldout"]
    for j in range(examples):
        rng = random.Random(derive("check_env", env_class.name, seed, j))
        fuzz = _Fuzzer(rng)
        episode = check_episode(
            env_class, rng.choice(pool), rng.getrandbits(63), fuzz, max_steps=max_steps, probes=rng.sample(PROBES, 3)
        )
        if j % 10 == 0:
            _check_replay(env_class, episode)
        played.append(episode)
    return CheckSummary(env_class.name, len(pool), len(played), sum(len(p.texts) for p in played))


# -- kernels ----------------------------------------------------------------------------------------------


def check_kernels(env_class: type[Env]) -> dict[str, list[Kernel]]:
    """The ``kernels`` property; returns both splits (the shipped files where the package has them)."""
    name = env_class.name

    def fail(detail: str) -> None:
        raise EnvCheckError(name, "kernels", detail)

    try:
        generated = generate_kernels(env_class)
    except Exception as exc:
        raise EnvCheckError(name, "kernels", f"generating the kernels raised {exc!r}") from exc
    out: dict[str, list[Kernel]] = {}
    for split in SPLITS:
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
                    f"{_short(have[line] if line < len(have) else None)}, generation gives "
                    f"{_short(want[line] if line < len(want) else None)} (python -m repertory.envs {name})"
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
            if _retry_of(name, split, i, k.seed) is None:
                fail(f"kernel {k.id} has seed {k.seed}, neither derive('repertory', ...) nor one of its retries")
            if env_class.generate_kernel(random.Random(k.seed)) != k.data:
                fail(f"kernel {k.id}: generate_kernel(Random(seed)) does not give its data")
        out[split] = kernels
    if env_class.unique_kernels:
        seen: dict[str, str] = {}
        for k in out["train"] + out["heldout"]:
            earlier = seen.setdefault(canonical_json(k.data), k.id)
            if earlier != k.id:
                fail(f"kernels {earlier} and {k.id} have the same content (unique_kernels is set)")
    good = out["train"][0].data
    broken = [("{}", {})]
    broken += [(f"the kernel without {key!r}", {k: v for k, v in good.items() if k != key}) for key in good]
    broken += [(f"the kernel with {key!r} = None", {**good, key: None}) for key in good]
    for what, data in broken:
        if not _kernel_problems(env_class, data, what):
            fail(f"validate_kernel finds no problem with {what} (built from {out['train'][0].id})")
    return out


def _kernel_problems(env_class: type[Env], data: dict[str, Any], what: str) -> list[str]:
    try:
        problems = env_class.validate_kernel(data)
    except Exception as exc:
        raise EnvCheckError(env_class.name, "kernels", f"validate_kernel({what}) raised {exc!r}") from exc
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        raise EnvCheckError(env_class.name, "kernels", f"validate_kernel({what}) returned {_short(problems)}")
    return problems


def _retry_of(name: str, split: str, i: int, seed: int) -> int | None:
    """0 for the first-draw seed, r for retry r, None for any other seed."""
    if seed == derive("repertory", name, split, i):
        return 0
    return next((r for r in range(1, MAX_RETRIES + 1) if seed == derive("repertory", name, split, i, "retry", r)), None)


# -- episodes ---------------------------------------------------------------------------------------------


class _Checker:
    """Raises EnvCheckError with the episode's reproducer; runs env calls so that any exception is one."""

    def __init__(self, env_class: type[Env], played: Played):
        self.name, self.played = env_class.name, played

    def fail(self, prop: str, detail: str, pending: dict[str, str] | None = None) -> None:
        history = self.played.texts + ([pending] if pending is not None else [])
        raise EnvCheckError(self.name, prop, detail, self.played.kernel, self.played.episode_seed, history)

    def call(self, what: str, fn: Callable[..., Any], *args: Any, pending: dict[str, str] | None = None) -> Any:
        try:
            return fn(*args)
        except EnvCheckError:
            raise
        except Exception as exc:
            self.fail("never-raises", f"{what} raised {exc!r}", pending)


def check_episode(
    env_class: type[Env],
    kernel: Kernel,
    episode_seed: int,
    policy: Policy,
    *,
    max_steps: int = 1000,
    bots_valid: bool = False,
    probes: tuple[str, ...] | list[str] = PROBES,
) -> Played:
    """Play one episode with ``policy`` writing every acting role's text, checking each step and the end.

    Before each step every role's ``validate`` sees the policy's text (acting roles) and ``probes``,
    and ``view`` is called for every role, against an unchanged state; in steps with several acting
    roles each text gets a unique marker that no other role may ever see. ``bots_valid`` requires
    every action to be valid. Returns what was played.
    """
    played = Played(kernel, episode_seed, observations={r: [] for r in env_class.roles})
    check = _Checker(env_class, played)
    env = env_class()
    check.call(f"reset({kernel.id}, {episode_seed})", env.reset, kernel, episode_seed)
    roles = list(env.roles)
    rewards = {r: 0.0 for r in roles}
    turns = {r: 0 for r in roles}
    invalid = {r: 0 for r in roles}
    markers: list[tuple[str, str]] = []
    delivered: list[tuple[str, str]] = []
    view_text: dict[str, set[str]] = {r: set() for r in roles}
    while not check.call("done", lambda: env.done):
        acting = check.call("acting_roles()", env.acting_roles)
        if not acting or len(set(acting)) != len(acting) or not set(acting) <= set(roles):
            check.fail("accounting", f"acting_roles() is {acting!r} while the episode is not over")
        if len(played.texts) >= max_steps:
            check.fail("termination", f"the episode is not over after {max_steps} steps")
        for role in acting:
            played.observations[role] += check.call(f"observe({role!r})", env.observe, role)
        try:
            texts = {role: policy(env, role) for role in acting}
        except _BotError as exc:
            check.fail("bots-valid", str(exc))
        if len(acting) > 1:
            for role in acting:
                marker = f"zq{derive(kernel.id, len(played.texts), role)}"
                markers.append((role, marker))
                texts[role] = f"{texts[role]} {marker}"
        delivered += [(role, clean(text, env.max_chars(role))) for role, text in texts.items()]
        ok = _check_pure_calls(env, check, texts, acting, probes, view_text)
        result = check.call(f"step({_short(texts)})", env.step, texts, pending=texts)
        if not isinstance(result, StepResult) or sorted(result.parsed) != sorted(acting):
            check.fail("accounting", f"step returned {_short(result)}, not a StepResult parsing {acting}", texts)
        for role in acting:
            bad = result.parsed[role].invalid
            if ok[role] == bad:
                check.fail(
                    "validate-agrees",
                    f"validate({role!r}, {_short(texts[role])}) said {ok[role]} but step "
                    f"counted the text as {'invalid' if bad else 'valid'} ({result.parsed[role].error})",
                    texts,
                )
            if bots_valid and bad:
                check.fail(
                    "bots-valid",
                    f"the bot in {role!r} wrote an invalid action: {_short(texts[role])} ({result.parsed[role].error})",
                    texts,
                )
            turns[role] += 1
            invalid[role] += bool(bad)
        for role, reward in result.rewards.items():
            if role not in rewards or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                check.fail("accounting", f"step emitted reward {reward!r} for {role!r}", texts)
            rewards[role] += reward
        played.texts.append(texts)
        played.steps.append(result)
    for role in roles:
        played.observations[role] += check.call(f"observe({role!r})", env.observe, role)
    played.result = _check_end(env, check, rewards, turns, invalid)
    for role in roles:
        opening = played.observations[role][:1]
        if opening != [Message("system", env.system_prompt(role))]:
            check.fail("prompts", f"{role}'s first message is {_short(opening)}, not its system prompt")
    _check_privacy(env, check, played, markers, delivered, view_text)
    return played


def _check_pure_calls(
    env: Env,
    check: _Checker,
    texts: dict[str, str],
    acting: list[str],
    probes: tuple[str, ...] | list[str],
    view_text: dict[str, set[str]],
) -> dict[str, bool]:
    """validate and view for every role before a step: pure, well-formed, refusing non-acting roles.
    Returns validate's verdict on each acting role's text."""
    before = copy.deepcopy(vars(env))
    calls = [(role, text) for role in env.roles for text in ([texts[role]] if role in texts else []) + list(probes)]
    verdict = {}
    for role, text in calls:
        ok, reason = _validate(env, check, role, text, texts)
        if role not in acting and ok:
            check.fail(
                "validate-agrees",
                f"validate({role!r}, {_short(text)}) accepted a role that is not acting (acting: {acting})",
                texts,
            )
        verdict.setdefault(role, ok)
    for role in acting:
        choices = check.call(f"action_choices({role!r})", env.action_choices, role, pending=texts)
        for choice in random.Random(len(check.played.texts)).sample(choices, min(3, len(choices))) if choices else []:
            if not _validate(env, check, role, choice, texts)[0]:
                check.fail(
                    "action-choices", f"action_choices({role!r}) lists {_short(choice)}, which validate refuses", texts
                )
    after_validate = _diff(before, vars(env))
    for role in env.roles:
        view_text[role] |= set(_strings(check.call(f"view({role!r})", env.view, role, pending=texts)))
    if after_validate is not None:
        check.fail("validate-pure", _culprit(env, check, calls, texts) or f"validate changed {after_validate}", texts)
    changed = _diff(before, vars(env))
    if changed is not None:
        check.fail("view-pure", f"view changed {changed}", texts)
    return verdict


def _validate(env: Env, check: _Checker, role: str, text: str, texts: dict[str, str]) -> tuple[bool, str]:
    answer = check.call(f"validate({role!r}, {_short(text)})", env.validate, role, text, pending=texts)
    if not (
        isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool) and isinstance(answer[1], str)
    ):
        check.fail(
            "validate-agrees", f"validate({role!r}, {_short(text)}) returned {_short(answer)}, not (bool, str)", texts
        )
    if not answer[0] and not answer[1].strip():
        check.fail("validate-agrees", f"validate({role!r}, {_short(text)}) refused without a reason", texts)
    return answer


def _culprit(env: Env, check: _Checker, calls: list[tuple[str, str]], texts: dict[str, str]) -> str | None:
    """Which validate call changed the state: replay the episode so far and repeat the calls one by one."""
    try:
        fresh = _replay(type(env), check.played.kernel, check.played.episode_seed, check.played.texts)
        for role in fresh.acting_roles():
            fresh.observe(role)
        for role, text in calls:
            before = copy.deepcopy(vars(fresh))
            fresh.validate(role, text)
            changed = _diff(before, vars(fresh))
            if changed is not None:
                return f"validate({role!r}, {_short(text)}) changed {changed}"
    except Exception:  # a replay that goes differently cannot point at the call; the caller reports the change
        return None
    return None


def _check_end(
    env: Env, check: _Checker, rewards: dict[str, float], turns: dict[str, int], invalid: dict[str, int]
) -> Result:
    if check.call("acting_roles()", env.acting_roles):
        check.fail("termination", f"acting_roles() is {env.acting_roles()!r} after the end")
    before = copy.deepcopy(vars(env))
    for role in env.roles:
        for probe in PROBES:
            if _validate(env, check, role, probe, {})[0]:
                check.fail("termination", f"validate({role!r}, {probe!r}) accepted after the end")
    changed = _diff(before, vars(env))
    if changed is not None:
        check.fail("validate-pure", f"validate after the end changed {changed}")
    try:
        env.step({})
    except RuntimeError:
        pass
    except Exception as exc:
        check.fail("termination", f"step({{}}) after the end raised {exc!r}, not RuntimeError")
    else:
        check.fail("termination", "step({}) after the end did not raise RuntimeError")
    result = check.call("result()", env.result)
    if sorted(result.roles) != sorted(env.roles):
        check.fail("accounting", f"result() scores {sorted(result.roles)}, not the roles {sorted(env.roles)}")
    if not isinstance(result.end_reason, str) or not result.end_reason:
        check.fail("accounting", f"result() has end_reason {result.end_reason!r}")
    for role, rr in result.roles.items():
        if not 0.0 <= rr.outcome <= 1.0:
            check.fail("accounting", f"{role}'s outcome {rr.outcome} is outside [0, 1]")
        if (rr.n_turns, rr.n_invalid) != (turns[role], invalid[role]):
            check.fail(
                "accounting",
                f"{role} has n_turns {rr.n_turns} and n_invalid {rr.n_invalid}; the steps "
                f"give {turns[role]} and {invalid[role]}",
            )
        if not math.isclose(rewards[role], rr.outcome, rel_tol=TOL, abs_tol=TOL):
            check.fail("rewards-sum", f"{role}'s rewards add up to {rewards[role]!r}, its outcome is {rr.outcome!r}")
    metrics = check.call("metrics()", env.metrics)
    try:
        json.dumps(metrics, allow_nan=False)
        numeric = all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items())
    except (TypeError, ValueError, AttributeError):
        numeric = False
    if not numeric:
        check.fail("accounting", f"metrics() is {_short(metrics)}, not a dict of finite numbers")
    return result


def _check_privacy(
    env: Env,
    check: _Checker,
    played: Played,
    markers: list[tuple[str, str]],
    delivered: list[tuple[str, str]],
    view_text: dict[str, set[str]],
) -> None:
    """A role's system prompt (whole, and each line long enough to be telling), the long strings of its
    views and its simultaneous-phase texts never reach another role. Text that other roles wrote is
    taken out first: delivering it verbatim is no leak."""
    prompts = {r: env.system_prompt(r) for r in env.roles}
    seen = {r: "\n".join(m.content for m in played.observations[r]) for r in env.roles}
    for author, marker in markers:
        for role in env.roles:
            if role != author and marker in seen[role]:
                check.fail("privacy", f"{author}'s simultaneous-phase text (marked {marker}) reached {role}")
    written = [text for _, text in delivered]
    for role in env.roles:
        heard = seen[role]
        # Longest first: a short text inside a longer one must not break the longer one's removal.
        others = {form for author, text in delivered if author != role for form in (text, text.strip())}
        for form in sorted(others, key=len, reverse=True):
            if len(form) >= MIN_SECRET_CHARS:
                heard = heard.replace(form, "")
        for owner in env.roles:
            if owner == role:
                continue
            if prompts[owner] not in prompts[role] and prompts[owner] in heard:
                check.fail("privacy", f"{owner}'s system prompt reached {role}")
            lines = {line.strip() for line in prompts[owner].splitlines()}
            # What a seat wrote (a partner's message in a view, say) is nobody's secret.
            views = {s for s in view_text[owner] if not any(s in text for text in written)}
            private = {s for s in lines | views if len(s) >= MIN_SECRET_CHARS} - view_text[role]
            for secret in sorted(private, key=len, reverse=True):
                if secret not in prompts[role] and secret in heard:
                    check.fail("privacy", f"{owner}'s private text {_short(secret, 120)} reached {role}")


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a view (keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            yield from _strings(v)


def _replay(env_class: type[Env], kernel: Kernel, episode_seed: int, texts: list[dict[str, str]]) -> Env:
    """A fresh environment driven through ``texts``, observing as check_episode does."""
    env = env_class()
    env.reset(kernel, episode_seed)
    for step in texts:
        for role in env.acting_roles():
            env.observe(role)
        env.step(step)
    return env


def _check_replay(env_class: type[Env], played: Played) -> None:
    """The ``determinism`` property: the same texts again give the same observations, steps and result."""
    again = Played(played.kernel, played.episode_seed, observations={r: [] for r in env_class.roles})
    env = env_class()
    env.reset(played.kernel, played.episode_seed)
    for step in played.texts:
        for role in env.acting_roles():
            again.observations[role] += env.observe(role)
        again.steps.append(env.step(step))
    for role in env.roles:
        again.observations[role] += env.observe(role)
    diffs = [
        what
        for what, a, b in (
            ("observations", played.observations, again.observations),
            ("step results", played.steps, again.steps),
            ("result", played.result, env.result()),
        )
        if a != b
    ]
    if diffs:
        raise EnvCheckError(
            env_class.name,
            "determinism",
            f"a replay of the same texts changed the {diffs[0]}",
            played.kernel,
            played.episode_seed,
            played.texts,
        )


def _diff(a: Any, b: Any, path: str = "env", depth: int = 0) -> str | None:
    """Where two snapshots differ (None if nowhere). Objects without their own ``==`` (random
    generators, plain classes) are compared by content, not identity."""
    if type(a) is not type(b):
        return f"{path} ({type(a).__name__} became {type(b).__name__})"
    if depth > 40:
        return None if a == b else f"{path}"
    if isinstance(a, dict):
        where = {key: f"{path}.{key}" if path == "env" else f"{path}[{key!r}]" for key in [*a, *b]}
        extra = next(iter(a.keys() ^ b.keys()), None)
        if extra is not None:
            return f"{where[extra]} ({'added' if extra in b else 'removed'})"
        return next((d for key in a if (d := _diff(a[key], b[key], where[key], depth + 1))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length {len(a)} became {len(b)})"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _diff(x, y, f"{path}[{i}]", depth + 1))), None)
    if isinstance(a, random.Random):
        return None if a.getstate() == b.getstate() else f"{path} (its random state advanced)"
    if hasattr(a, "__dict__") and type(a).__eq__ is object.__eq__:
        return _diff(vars(a), vars(b), path, depth + 1)
    return None if a == b else f"{path} ({_short(a, 80)} became {_short(b, 80)})"


# -- who writes the text ----------------------------------------------------------------------------------


def _lineups(env_class: type[Env]) -> list[tuple[str, ...]]:
    """Bot per seat: all first, alternating first/last, alternating last/first, all last (deduplicated)."""
    names = list(env_class.bots)
    if not names:
        return []
    first, last, n = names[0], names[-1], len(env_class.roles)
    lineups = [
        (first,) * n,
        tuple(first if i % 2 == 0 else last for i in range(n)),
        tuple(last if i % 2 == 0 else first for i in range(n)),
        (last,) * n,
    ]
    return list(dict.fromkeys(lineups))


class _BotError(Exception):
    """A bot raised or returned something other than text; check_episode reports it as ``bots-valid``."""


def _bot_text(env: Env, bot: str, role: str) -> str:
    try:
        text = env.bots[bot](env.view(role))
    except Exception as exc:
        raise _BotError(f"bot {bot!r} in {role!r} raised {exc!r}") from exc
    if not isinstance(text, str):
        raise _BotError(f"bot {bot!r} in {role!r} returned {_short(text)}, not text")
    return text


def _bot_policy(bot_of: dict[str, str]) -> Policy:
    return lambda env, role: _bot_text(env, bot_of[role], role)


class _Fuzzer:
    """Arbitrary text for a role: unicode noise, tag soup, and the role's valid moves (the tag examples
    of its system prompt, its bots' moves, its action choices), as they are or mutated."""

    KINDS = ("noise", "soup", "valid", "mutated", "edge")

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.examples: dict[str, list[str]] = {}
        # Each episode mixes the kinds differently: mostly valid moves reach deep states, mostly noise
        # the error paths.
        self.weights = [rng.random() for _ in self.KINDS]

    def __call__(self, env: Env, role: str) -> str:
        rng = self.rng
        kind = rng.choices(self.KINDS, self.weights)[0]
        if kind == "noise":
            return self.noise(rng.randint(0, 80))
        if kind == "soup":
            return self.soup()
        move = self.move(env, role)
        if kind == "valid":
            return move
        if kind == "mutated":
            for _ in range(rng.randint(1, 3)):
                move = self.mutate(move, env, role)
            return move
        return rng.choice(("", " ", "\n\n", "<think>", "<" * 3000, "\x00", "\ud800", self.noise(3) * 2000))

    def noise(self, n: int) -> str:
        rng = self.rng
        pools = (
            (0x20, 0x7E),
            (0x20, 0x7E),
            (0x09, 0x0D),
            (0xA0, 0x24F),
            (0x370, 0x6FF),
            (0x3000, 0x9FFF),
            (0x200B, 0x202E),
            (0x1F300, 0x1FAFF),
            (0x80, 0x10FFFF),
            (0xD800, 0xDFFF),
        )
        weights = (8, 8, 1, 2, 1, 1, 1, 1, 1, 0.2)
        return "".join(chr(rng.randint(*rng.choices(pools, weights)[0])) for _ in range(n))

    def soup(self) -> str:
        rng = self.rng
        return "".join(
            rng.choice(FRAGMENTS) if rng.random() < 0.8 else self.noise(rng.randint(0, 4))
            for _ in range(rng.randint(0, 25))
        )

    def move(self, env: Env, role: str) -> str:
        rng = self.rng
        key = f"{env.kernel.id if env.kernel else ''}|{role}"
        if key not in self.examples:
            self.examples[key] = [m.group(0) for m in _TAG_EXAMPLE.finditer(env.system_prompt(role))]
        sources = ["example"] * bool(self.examples[key]) + ["bot"] * bool(env.bots) + ["choice"]
        source = rng.choice(sources)
        if source == "bot":
            return _bot_text(env, rng.choice(list(env.bots)), role)
        if source == "choice":
            choices = env.action_choices(role)
            return rng.choice(choices) if choices else self.soup()
        return rng.choice(self.examples[key])

    MUTATIONS = (
        *("numbers", "same-number", "same-number", "payload", "payload", "keys", "case", "unclose", "empty-tag"),
        *("cut", "think", "wrap", "append", "pad"),
    )

    def mutate(self, text: str, env: Env, role: str) -> str:
        rng = self.rng
        op = rng.choice(self.MUTATIONS)
        if op == "numbers":
            return _NUMBER.sub(lambda m: rng.choice(NUMBERS), text)
        if op == "same-number":  # all-zero and all-max shares are the classic edge cases
            number = rng.choice(("0", "0", "1", "-1", "10", "100"))
            return _NUMBER.sub(lambda m: number, text)
        if op == "payload":
            start, end = text.find(">"), text.rfind("</")
            junk = rng.choice(JUNK_PAYLOADS + (self.noise(rng.randint(0, 12)),))
            return text[: start + 1] + junk + text[end:] if 0 <= start < end else text + junk
        if op == "keys":
            return _KEY.sub(lambda m: f'"{self.key(m.group(1))}":', text)
        if op == "case":
            return re.sub(r"<(/?)([A-Za-z]\w*)", lambda m: f"<{m.group(1)}{self.case(m.group(2))}", text)
        if op == "unclose":
            end = text.rfind("</")
            return text[:end] + text[text.find(">", end) + 1 :] if end >= 0 and ">" in text[end:] else text + "</"
        if op == "empty-tag":
            return text.replace("/>", rng.choice(("", ">", " />", "></x>")))
        if op == "cut":
            return text[: rng.randint(0, len(text))]
        if op == "think":
            return rng.choice((f"<think>{text}</think>", f"<think>{text}", f"{text}<think>", f"<THINK>x</think>{text}"))
        if op == "wrap":
            return f"{self.noise(rng.randint(0, 10))}{text}{self.noise(rng.randint(0, 10))}"
        if op == "append":
            other = self.move(env, role)
            return f"{text} {other}" if rng.random() < 0.5 else f"{other} {text}"
        # Padding that puts the tag just inside or just past the truncation limit.
        return "x" * max(0, env.max_chars(role) - len(text) + rng.randint(-1, 1)) + text

    def case(self, name: str) -> str:
        return "".join(c.upper() if self.rng.random() < 0.5 else c.lower() for c in name)

    def key(self, key: str) -> str:
        return self.rng.choice((key.upper(), key + "s", f" {key} ", key.rstrip("s"), "unknown", key + key))

"""Conformance checks for environment authors: ``check_env(MyEnv)``, as PettingZoo ships ``api_test``.

``check_env`` checks the properties of docs/environments.md 1 that every game must have, whatever its
turn order (simultaneous rounds, alternating messages, phases in which any subset of seats acts):
its kernels, ``validate`` against ``step``, robustness to arbitrary text, reward bookkeeping and
privacy. It plays the class's own bots and fuzzed text (:mod:`repertory.envs.fuzz`) and raises
:class:`EnvCheckError` at the first failure, naming the environment, the property (a key of
:data:`PROPERTIES`) and how to reproduce it. :func:`check_episode` is the per-episode checker, for
tests that draw the texts themselves (with hypothesis, say).
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from repertory.envs.base import Env
from repertory.envs.checks.errors import PROPERTIES, EnvCheckError, short
from repertory.envs.checks.kernels import check_kernels
from repertory.envs.fuzz import BotError, Policy, TextFuzzer, bot_policy, default_lineups
from repertory.envs.parsing import clean
from repertory.types import Kernel, Message, Result, StepResult, derive

__all__ = [
    "PROBES",
    "PROPERTIES",
    "CheckSummary",
    "EnvCheckError",
    "Played",
    "check_env",
    "check_episode",
    "check_kernels",
]

MIN_SECRET_CHARS = 16
"""Shorter private strings (names, numbers, single words) may legitimately recur in public text."""
TOL = 1e-9

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


@dataclass(frozen=True)
class CheckSummary:
    """How much ``check_env`` exercised: kernels checked, episodes played, steps taken."""

    env: str
    kernels: int
    episodes: int
    steps: int


@dataclass
class Played:
    """One checked episode: the texts sent each step, what each role saw, the step results, the result
    and the environment as the last step left it."""

    kernel: Kernel
    episode_seed: int
    texts: list[dict[str, str]] = field(default_factory=list)
    observations: dict[str, list[Message]] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)
    result: Result | None = None
    env: Env | None = None


def check_env(
    env_class: type[Env],
    *,
    episodes: int = 5,
    examples: int = 50,
    seed: int = 0,
    max_steps: int = 1000,
    lineups: Sequence[Sequence[str]] | None = None,
) -> CheckSummary:
    """Check ``env_class`` against every property of :data:`PROPERTIES`; raise :class:`EnvCheckError` at
    the first failure.

    Plays the first ``episodes`` kernels of each split with each bot lineup, then ``examples``
    episodes of fuzzed text on random kernels of every split. A lineup names a bot per seat, in seat
    order; by default every seat the first bot, seats alternating first and last bot (both ways),
    every seat the last bot; pass ``lineups`` where bots only fit some seats. ``seed`` varies the
    episode seeds and the fuzz; ``max_steps`` bounds an episode. Returns a :class:`CheckSummary`.
    """
    chosen = [tuple(lineup) for lineup in lineups] if lineups is not None else default_lineups(env_class)
    for lineup in chosen:
        if len(lineup) != len(env_class.roles) or not set(lineup) <= set(env_class.bots):
            raise ValueError(f"lineup {lineup} must name one of {sorted(env_class.bots)} for each of {env_class.roles}")
    kernels = check_kernels(env_class)
    played = []
    for lineup in chosen:
        policy = bot_policy(lineup)
        for split, of_split in kernels.items():
            for i, kernel in enumerate(of_split[:episodes]):
                episode_seed = derive("check_env", seed, *lineup, split, i)
                episode = check_episode(env_class, kernel, episode_seed, policy, max_steps=max_steps, bots_valid=True)
                if i == 0:
                    _check_replay(env_class, episode)
                played.append(episode)
    # The fuzzer borrows moves only from bots that fit the seat.
    seat_bots = {i: sorted({lineup[i] for lineup in chosen}) for i in range(len(env_class.roles))}
    pool = [kernel for of_split in kernels.values() for kernel in of_split]
    for j in range(examples):
        rng = random.Random(derive("check_env", env_class.name, seed, j))
        fuzz = TextFuzzer(rng, seat_bots)
        episode = check_episode(
            env_class, rng.choice(pool), rng.getrandbits(63), fuzz, max_steps=max_steps, probes=rng.sample(PROBES, 3)
        )
        if j % 10 == 0:
            _check_replay(env_class, episode)
        played.append(episode)
    return CheckSummary(env_class.name, len(pool), len(played), sum(len(p.texts) for p in played))


# -- kernels ----------------------------------------------------------------------------------------------


# -- episodes ---------------------------------------------------------------------------------------------


class _Checker:
    """Raises EnvCheckError with the episode's reproducer; runs env calls so that any exception is one."""

    def __init__(self, env_class: type[Env], played: Played):
        self.name, self.played = env_class.name, played

    def fail(self, prop: str, detail: str, pending: dict[str, str] | None = None) -> NoReturn:
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
    played = Played(kernel, episode_seed)
    check = _Checker(env_class, played)
    played.env = env = env_class()
    check.call(f"reset({kernel.id}, {episode_seed})", env.reset, kernel, episode_seed)
    roles = list(env.roles)
    played.observations = {r: [] for r in roles}
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
        except BotError as exc:
            check.fail("bots-valid", str(exc))
        if len(acting) > 1:
            for role in acting:
                marker = f"zq{derive(kernel.id, len(played.texts), role)}"
                markers.append((role, marker))
                texts[role] = f"{texts[role]} {marker}"
        delivered += [(role, clean(text, env.max_chars(role))) for role, text in texts.items()]
        ok = _check_pure_calls(env, check, texts, acting, probes, view_text)
        result = check.call(f"step({short(texts)})", env.step, texts, pending=texts)
        _count_step(check, result, texts, ok, bots_valid, (rewards, turns, invalid))
        played.texts.append(texts)
        played.steps.append(result)
    for role in roles:
        played.observations[role] += check.call(f"observe({role!r})", env.observe, role)
    if played.steps and sorted(played.steps[-1].rewards) != sorted(roles):
        check.fail("rewards-sum", f"the last step rewards {sorted(played.steps[-1].rewards)}, not every role")
    played.result = _check_end(env, check, rewards, turns, invalid)
    for role in roles:
        opening = played.observations[role][:1]
        if opening != [Message("system", env.system_prompt(role))]:
            check.fail("prompts", f"{role}'s first message is {short(opening)}, not its system prompt")
    _check_privacy(env, check, played, markers, delivered, view_text)
    return played


def _count_step(
    check: _Checker,
    result: Any,
    texts: dict[str, str],
    ok: dict[str, bool],
    bots_valid: bool,
    tallies: tuple[dict[str, float], dict[str, int], dict[str, int]],
) -> None:
    """Check one step's result against ``validate``'s verdicts and add its rewards, turns and invalid actions
    to ``tallies`` (per role)."""
    rewards, turns, invalid = tallies
    acting = list(texts)
    if not isinstance(result, StepResult) or sorted(result.parsed) != sorted(acting):
        check.fail("accounting", f"step returned {short(result)}, not a StepResult parsing {acting}", texts)
    for role in acting:
        bad, error = result.parsed[role].invalid, result.parsed[role].error
        if ok[role] == bad:
            verdict = "invalid" if bad else "valid"
            message = f"validate({role!r}, {short(texts[role])}) said {ok[role]} but step counted the text as"
            check.fail("validate-agrees", f"{message} {verdict} ({error})", texts)
        if bots_valid and bad:
            check.fail(
                "bots-valid", f"the bot in {role!r} wrote an invalid action: {short(texts[role])} ({error})", texts
            )
        turns[role] += 1
        invalid[role] += bool(bad)
    for role, reward in result.rewards.items():
        if role not in rewards or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            check.fail("accounting", f"step emitted reward {reward!r} for {role!r}", texts)
        rewards[role] += reward


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
    before = _snapshot(env, check)
    calls = [(role, text) for role in env.roles for text in ([texts[role]] if role in texts else []) + list(probes)]
    verdict = {}
    for role, text in calls:
        ok, reason = _validate(env, check, role, text, texts)
        if role not in acting and ok:
            check.fail(
                "validate-agrees",
                f"validate({role!r}, {short(text)}) accepted a role that is not acting (acting: {acting})",
                texts,
            )
        verdict.setdefault(role, ok)
    for role in acting:
        choices = check.call(f"action_choices({role!r})", env.action_choices, role, pending=texts)
        for choice in random.Random(len(check.played.texts)).sample(choices, min(3, len(choices))) if choices else []:
            if not _validate(env, check, role, choice, texts)[0]:
                check.fail(
                    "action-choices", f"action_choices({role!r}) lists {short(choice)}, which validate refuses", texts
                )
    after_validate = _diff(before, vars(env))
    for role in env.roles:
        view_text[role] |= set(_strings(check.call(f"view({role!r})", env.view, role, pending=texts)))
    if after_validate is not None:
        check.fail("validate-pure", _culprit(env, check, calls) or f"validate changed {after_validate}", texts)
    changed = _diff(before, vars(env))
    if changed is not None:
        check.fail("view-pure", f"view changed {changed}", texts)
    return verdict


def _snapshot(env: Env, check: _Checker) -> dict[str, Any]:
    """A deep copy of the environment's state, to compare against after calls that must be pure."""
    try:
        return copy.deepcopy(vars(env))
    except Exception as exc:
        check.fail("validate-pure", f"the state cannot be copied to check purity ({exc!r}); keep it plain data")


def _validate(env: Env, check: _Checker, role: str, text: str, texts: dict[str, str] | None) -> tuple[bool, str]:
    answer = check.call(f"validate({role!r}, {short(text)})", env.validate, role, text, pending=texts)
    if not (
        isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool) and isinstance(answer[1], str)
    ):
        check.fail(
            "validate-agrees", f"validate({role!r}, {short(text)}) returned {short(answer)}, not (bool, str)", texts
        )
    if not answer[0] and not answer[1].strip():
        check.fail("validate-agrees", f"validate({role!r}, {short(text)}) refused without a reason", texts)
    return answer


def _culprit(env: Env, check: _Checker, calls: list[tuple[str, str]]) -> str | None:
    """Which validate call changed the state: replay the episode so far and repeat the calls one by one."""
    try:
        fresh = _replay(type(env), check.played).env
        for role in fresh.acting_roles():
            fresh.observe(role)
        for role, text in calls:
            before = copy.deepcopy(vars(fresh))
            fresh.validate(role, text)
            changed = _diff(before, vars(fresh))
            if changed is not None:
                return f"validate({role!r}, {short(text)}) changed {changed}"
    except Exception:  # a replay that goes differently cannot point at the call; the caller reports the change
        return None
    return None


def _check_end(
    env: Env, check: _Checker, rewards: dict[str, float], turns: dict[str, int], invalid: dict[str, int]
) -> Result:
    if check.call("acting_roles()", env.acting_roles):
        check.fail("termination", f"acting_roles() is {env.acting_roles()!r} after the end")
    before = _snapshot(env, check)
    for role in env.roles:
        for probe in PROBES:
            if _validate(env, check, role, probe, None)[0]:
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
        check.fail("accounting", f"metrics() is {short(metrics)}, not a dict of finite numbers")
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
                    check.fail("privacy", f"{owner}'s private text {short(secret, 120)} reached {role}")


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


def _replay(env_class: type[Env], played: Played) -> Played:
    """The same texts again on a fresh environment, observing as check_episode does (no result yet)."""
    again = Played(played.kernel, played.episode_seed)
    again.env = env = env_class()
    env.reset(played.kernel, played.episode_seed)
    again.observations = {r: [] for r in env.roles}
    for texts in played.texts:
        for role in env.acting_roles():
            again.observations[role] += env.observe(role)
        again.steps.append(env.step(texts))
    return again


def _check_replay(env_class: type[Env], played: Played) -> None:
    """The ``determinism`` property: the same texts again give the same observations, steps and result."""
    again = _replay(env_class, played)
    for role in again.env.roles:
        again.observations[role] += again.env.observe(role)
    for what, first, second in (
        ("observations", played.observations, again.observations),
        ("step results", played.steps, again.steps),
        ("result", played.result, again.env.result()),
    ):
        if first != second:
            detail = f"a replay of the same texts changed the {what}"
            raise EnvCheckError(env_class.name, "determinism", detail, played.kernel, played.episode_seed, played.texts)


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
    return None if a == b else f"{path} ({short(a, 80)} became {short(b, 80)})"

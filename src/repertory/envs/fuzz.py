"""Who writes the text in conformance checks (``repertory.envs.checks``): an environment's own bots,
and a fuzzer of arbitrary text built from ``random.Random`` (no test dependency)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from repertory.envs.base import Env

Policy = Callable[[Env, str], str]
"""Who writes the text of an acting role: ``policy(env, role) -> text``."""

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


def default_lineups(env_class: type[Env]) -> list[tuple[str, ...]]:
    """Bot per seat: all first, alternating first/last, alternating last/first, all last (deduplicated)."""
    names = list(env_class.bots)
    if not names:
        return []
    first, last, n = names[0], names[-1], len(env_class.roles)
    alternating = tuple(first if i % 2 == 0 else last for i in range(n))
    flipped = tuple(last if i % 2 == 0 else first for i in range(n))
    return list(dict.fromkeys([(first,) * n, alternating, flipped, (last,) * n]))


class BotError(Exception):
    """A bot raised, or returned something other than text."""


def bot_text(env: Env, bot: str, role: str) -> str:
    """What the bot named ``bot`` writes for ``role`` now."""
    try:
        text = env.bots[bot](env.view(role))
    except Exception as exc:
        raise BotError(f"bot {bot!r} in {role!r} raised {exc!r}") from exc
    if not isinstance(text, str):
        raise BotError(f"bot {bot!r} in {role!r} returned {text!r:.200}, not text")
    return text


def bot_policy(lineup: Sequence[str]) -> Policy:
    """Each role's text written by the bot ``lineup`` names for its seat."""
    return lambda env, role: bot_text(env, lineup[env.seat_index(role)], role)


class TextFuzzer:
    """Arbitrary text for a role: unicode noise, tag soup, and the role's valid moves (the tag examples
    of its system prompt, its bots' moves, its action choices), as they are or mutated.
    ``seat_bots`` names the bots that fit each seat index (default: every bot fits every seat)."""

    KINDS = ("noise", "soup", "valid", "mutated", "edge")

    def __init__(self, rng: random.Random, seat_bots: dict[int, list[str]] | None = None):
        self.rng = rng
        self.seat_bots = seat_bots
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
        bots = list(env.bots) if self.seat_bots is None else self.seat_bots.get(env.seat_index(role), [])
        sources = ["example"] * bool(self.examples[key]) + ["bot"] * bool(bots) + ["choice"]
        source = rng.choice(sources)
        if source == "bot":
            return bot_text(env, rng.choice(bots), role)
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

"""Action syntax as grammars (docs/environments.md 1.7): what a complete valid response of a seat is, so that a
sampler can mask every token that would leave it (``rollout.constrained: grammar``).

An environment states its action as a :class:`Syntax`, an expression of llguidance's Lark dialect with the most
characters it can match. :func:`turn_grammar` puts talk in front of it: free text without ``<`` (so that the
action is the response's only tag, and its last), bounded in tokens by the sampling budget and in bytes by what
the environment reads. The result, a :class:`TurnGrammar`, is recorded with the turn, so that the learner can
replay it over the sampled tokens. Plain strings: no engine is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from repertory.types import RepertoryError

GRAMMAR = "grammar"
"""The value of ``rollout.constrained`` (and ``--constrained``) that samples every turn under its grammar; True
constrains only finite action sets (token tries), False nothing."""


@dataclass(frozen=True)
class Syntax:
    """A Lark expression and the most bytes of UTF-8 a text it matches can have (so also the most characters,
    and the most tokens: no token is empty); ``opens_tag`` where every text it matches starts with ``<``."""

    lark: str
    max_chars: int
    opens_tag: bool = False


def literal(text: str) -> Syntax:
    """Exactly ``text``."""
    return Syntax(json.dumps(text, ensure_ascii=False), len(text.encode()), text.startswith("<"))


def one_of(options: Sequence[Syntax]) -> Syntax:
    """Any one of ``options``."""
    if not options:
        raise RepertoryError("a grammar choice needs at least one option")
    lark = "(" + " | ".join(o.lark for o in options) + ")"
    return Syntax(lark, max(o.max_chars for o in options), all(o.opens_tag for o in options))


def sequence(*parts: Syntax) -> Syntax:
    """``parts`` one after the other."""
    return Syntax(" ".join(p.lark for p in parts), sum(p.max_chars for p in parts), bool(parts) and parts[0].opens_tag)


def integer(low: int, high: int) -> Syntax:
    """A decimal integer in [low, high], written without leading zeros."""
    if low > high:
        raise RepertoryError(f"an integer grammar needs low <= high, got [{low}, {high}]")
    patterns = integer_patterns(max(low, 0), high) if high >= 0 else []
    if low < 0:
        patterns.append("-(" + "|".join(integer_patterns(max(-high, 1), -low)) + ")")
    return Syntax("/(" + "|".join(patterns) + ")/", max(len(str(low)), len(str(high))))


def integer_patterns(low: int, high: int) -> list[str]:
    """Regular expressions, one per block of the range, whose union matches exactly the integers in [low, high]
    (0 <= low)."""
    patterns = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        start, end = max(low, 10 ** (digits - 1) if digits > 1 else 0), min(high, 10**digits - 1)
        while start <= end:
            step = 1  # the largest power of ten whose aligned block starts at ``start`` and fits
            while step * 10 < 10**digits and start % (step * 10) == 0 and start + step * 10 - 1 <= end:
                step *= 10
            count = min((end - start + 1) // step, 10 - (start // step) % 10)
            first, last = str(start), str(start + count * step - 1)
            free = len(str(step)) - 1  # trailing digits that take any value
            place = len(first) - free - 1
            digit = first[place] if first[place] == last[place] else f"[{first[place]}-{last[place]}]"
            patterns.append(first[:place] + digit + "[0-9]" * free)
            start += count * step
    return patterns


def json_string(options: Sequence[str]) -> Syntax:
    """One of ``options`` as a JSON string."""
    return one_of([literal(json.dumps(o)) for o in options])


def json_object(fields: Sequence[tuple[str, Syntax]]) -> Syntax:
    """A JSON object with exactly ``fields``, in order, written as ``json.dumps`` writes it."""
    parts, sep = [], "{"
    for key, value in fields:
        parts += [literal(f"{sep}{json.dumps(key)}: "), value]
        sep = ", "
    return sequence(*parts, literal("}" if fields else "{}"))


def tagged(name: str, payload: Syntax) -> Syntax:
    """``<name>payload</name>``."""
    return sequence(literal(f"<{name}>"), payload, literal(f"</{name}>"))


def choices_syntax(choices: Sequence[str]) -> Syntax:
    """A finite set of complete actions, each exactly as written: tags, since a turn's talk ends at its first
    ``<`` (an action that is not a tag would be read as talk)."""
    return one_of([literal(c) for c in dict.fromkeys(choices)])


UTF8_TAIL = 3
"""Bytes a talk may pass its bound by: the rest of a character whose first bytes a token left at the bound."""


@dataclass(frozen=True)
class TurnGrammar:
    """A whole response: talk, then the action. ``talk_bytes`` bounds the talk's bytes (the sampler and the
    learner apply it beside the grammar: a counted regex would make every mask some 20 times slower)."""

    lark: str
    talk_bytes: int

    def dumps(self) -> str:
        """The form a turn records."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> TurnGrammar:
        """The grammar :meth:`dumps` wrote; anything else is refused."""
        try:
            fields = json.loads(text)
            grammar = cls(**fields)
        except (TypeError, ValueError) as exc:
            raise RepertoryError(f"not a turn grammar ({exc}): {str(text)[:80]!r}") from None
        if not isinstance(grammar.lark, str) or type(grammar.talk_bytes) is not int or grammar.talk_bytes < 0:
            raise RepertoryError(f"not a turn grammar (lark must be text, talk_bytes a count): {str(text)[:80]!r}")
        return grammar


def turn_grammar(action: Syntax, max_new_tokens: int, max_chars: int) -> TurnGrammar:
    """Talk of at most what is left of ``max_new_tokens`` (after the action and the end-of-turn token) and of
    ``max_chars`` (after the action), then ``action``. Talk never holds ``<``: the action is the only tag."""
    if not action.opens_tag:  # talk ends at the first "<": an action that does not open a tag would be talk
        raise RepertoryError(
            f"an action under a grammar must be a tag, starting with '<' (got the syntax {action.lark[:60]}): state "
            "it with Env.action_syntax, or constrain finite choices with rollout.constrained: true"
        )
    talk_tokens = max_new_tokens - action.max_chars - 1
    talk_bytes = max_chars - action.max_chars - UTF8_TAIL
    if talk_tokens < 0 or talk_bytes + UTF8_TAIL < 0:
        raise RepertoryError(
            f"the action needs up to {action.max_chars + 1} tokens and {action.max_chars} characters, but a turn "
            f"has {max_new_tokens} tokens (max_new_tokens) and the game reads {max_chars} characters; raise "
            "max_new_tokens"
        )
    if talk_tokens == 0 or talk_bytes <= 0:
        return TurnGrammar(f"start: action\naction: {action.lark}\n", 0)
    return TurnGrammar(
        f"start: talk action\ntalk[max_tokens={talk_tokens}]: /[^<]*/\naction: {action.lark}\n", talk_bytes
    )

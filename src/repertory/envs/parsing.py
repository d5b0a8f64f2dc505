"""The one tag convention of every environment (docs/environments.md 1.2).

Models write free text; actions are XML-like tags inside it. These functions never raise on any
input string: a malformed tag is reported as such and the environment decides its consequence.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

DEFAULT_MAX_CHARS = 2000

_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_TAG = re.compile(r"<\s*(/?)\s*([A-Za-z][A-Za-z_-]*)\s*(/?)\s*>")


def clean(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Rules 1-2: delete thinking (an unclosed ``<think>`` deletes the rest), then truncate."""
    text = _THINK.sub("", text)
    unclosed = _THINK_OPEN.search(text)
    if unclosed:
        text = text[: unclosed.start()]
    return text[:max_chars]


@dataclass(frozen=True)
class TagMatch:
    """One action tag found in a text: its lower-case name, payload (None for empty tags), span."""

    name: str
    payload: str | None
    malformed: bool
    start: int
    end: int


def find_tags(
    text: str, content_tags: frozenset[str] = frozenset(), empty_tags: frozenset[str] = frozenset()
) -> list[TagMatch]:
    """All action tags of the current phase in ``text``, in order (rules 3-5).

    Content tags need a closing tag; one whose closing tag never comes (or comes only after
    another opening of the same tag) is malformed. Empty tags may be written ``<a/>``, ``<a />``,
    ``<a></a>`` or a bare ``<a>``. Any other tag, or a stray closing tag, is plain text.
    """
    tokens = [(m.group(2).lower(), bool(m.group(1)), bool(m.group(3)), m.start(), m.end()) for m in _TAG.finditer(text)]
    found: list[TagMatch] = []
    i = 0
    while i < len(tokens):
        name, closing, self_closing, start, end = tokens[i]
        i += 1
        if closing:
            continue
        if name in empty_tags:
            if not self_closing and i < len(tokens):
                nxt = tokens[i]
                if nxt[0] == name and nxt[1] and text[end : nxt[3]].strip() == "":
                    end = nxt[4]
                    i += 1
            found.append(TagMatch(name, None, False, start, end))
        elif name in content_tags:
            if self_closing:
                found.append(TagMatch(name, None, True, start, end))
                continue
            close = None
            for j in range(i, len(tokens)):
                other, other_closing = tokens[j][0], tokens[j][1]
                if other == name:
                    close = j if other_closing else None
                    break
            if close is None:
                found.append(TagMatch(name, None, True, start, end))
            else:
                found.append(TagMatch(name, text[end : tokens[close][3]], False, start, tokens[close][4]))
                i = close + 1
    return found


def last_tag(
    text: str, content_tags: frozenset[str] = frozenset(), empty_tags: frozenset[str] = frozenset()
) -> TagMatch | None:
    """The action tag that counts: the last one, valid or not (rule 6)."""
    found = find_tags(text, content_tags, empty_tags)
    return found[-1] if found else None


def normalize_key(key: str) -> str:
    """Rule 7's key normalisation: lower-case, trimmed, one trailing "s" dropped."""
    key = key.strip().lower()
    return key[:-1] if key.endswith("s") else key


class PayloadError(ValueError):
    """A payload that fails validation; the message is the reason shown to the author."""


def _reject_constant(name: str) -> float:
    raise PayloadError(f"{name} is not allowed in JSON")


def parse_json_object(payload: str) -> dict[str, object]:
    """A strict JSON object (no NaN or Infinity), or PayloadError."""
    try:
        obj = json.loads(payload, parse_constant=_reject_constant)
    except PayloadError:
        raise
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"the proposal is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise PayloadError("the proposal must be a JSON object")
    return obj


def as_integer(value: object, field: str) -> int:
    """An integer, or a float with zero fractional part; booleans and strings are rejected."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PayloadError(f"{field} must be an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise PayloadError(f"{field} must be an integer")
        return int(value)
    return value


def parse_fields(payload: str, fields: tuple[str, ...], required: bool) -> dict[str, object]:
    """Map a proposal's keys onto ``fields`` after normalising both sides.

    With ``required`` every field must be present; otherwise a missing field is absent from the
    result (the caller decides its default). Unknown or repeated keys make the payload invalid.
    """
    obj = parse_json_object(payload)
    by_norm = {normalize_key(f): f for f in fields}
    out: dict[str, object] = {}
    for key, value in obj.items():
        field = by_norm.get(normalize_key(key))
        if field is None:
            raise PayloadError(f"unknown key {key!r} (expected {', '.join(fields)})")
        if field in out:
            raise PayloadError(f"key {field!r} appears twice")
        out[field] = value
    if required:
        missing = [f for f in fields if f not in out]
        if missing:
            raise PayloadError(f"missing key {missing[0]!r}")
    return out


def closest_choice(text: str, choices: list[str]) -> str | None:
    """The constrained answer nearest to a free-text one: a choice whose action tag is the text's last, and
    among proposals the one nearest to the text's (L1 over the JSON payloads' numeric fields, a missing field
    counting 0; any other payload must match exactly). None when no choice shares the text's tag.

    A scripted bot names prices between a grid's steps; its answer projected here is what a constrained
    policy could have written, so a warm start of a constrained run imitates actions it can take."""
    names = {m.group(2).lower(): bool(m.group(1)) for choice in choices for m in _TAG.finditer(choice)}
    content = frozenset(name for name, closed in names.items() if closed)
    empty = frozenset(names) - content
    wanted = last_tag(clean(text), content, empty)
    if wanted is None or wanted.malformed:
        return None
    best, best_distance = None, math.inf
    for choice in choices:
        tag = last_tag(choice, content, empty)
        if tag is not None and tag.name == wanted.name:
            distance = _payload_distance(wanted.payload, tag.payload)
            if distance < best_distance:
                best, best_distance = choice, distance
    return best


def _payload_distance(a: str | None, b: str | None) -> float:
    """0 for equal payloads, the L1 distance of two JSON objects of numbers, else infinity."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    if a.strip() == b.strip():
        return 0.0
    try:
        x, y = parse_json_object(a), parse_json_object(b)
    except PayloadError:
        return math.inf
    numbers = (int, float)
    if not all(isinstance(v, numbers) and not isinstance(v, bool) for v in (*x.values(), *y.values())):
        return math.inf
    return float(sum(abs(float(x.get(k, 0)) - float(y.get(k, 0))) for k in {*x, *y}))  # type: ignore[arg-type]

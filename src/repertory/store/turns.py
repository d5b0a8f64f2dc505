"""Logged turns (docs/algorithms.md 5.3): one record per agent turn of a logged conversation, in Parquet.

The schema a round method learns from, what a deployment writes (``rounds/turns-K.parquet``) and what users
bring as round 0 (``method.logs``). Reading validates the rows; turns logged as text (``messages`` +
``response``) are rendered to token ids by the caller, who knows the policy's chat template.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from repertory.envs.grammar import TurnGrammar
from repertory.store import MESSAGE_TYPE, row_messages, write_table
from repertory.types import Message, RepertoryError, message_dicts


@dataclass
class LoggedTurn:
    """One agent turn of a logged conversation: the state (prompt), the action (response), the
    conversation's outcome R and the discounted return G_t from this turn on."""

    episode_id: str
    kernel_id: str
    t: int
    T: int
    prompt_ids: list[int]
    response_ids: list[int]
    outcome: float
    ret: float
    round: int = 0
    seat_id: str = "p0"
    policy_id: str = "logged"
    logp_sample: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    response: str = ""
    grammar: str | None = None  # the grammar it was sampled under (``rollout.constrained: grammar``), else None


TURN_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("kernel_id", pa.string()),
        ("t", pa.int32()),
        ("T", pa.int32()),
        ("outcome", pa.float64()),
        ("ret", pa.float64()),
        ("round", pa.int32()),
        ("seat_id", pa.string()),
        ("policy_id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("response", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("logp_sample", pa.list_(pa.float64())),
        ("grammar", pa.string()),
    ]
)


REQUIRED_COLUMNS = ("episode_id", "kernel_id", "t", "outcome")


def write_turns(path: str | Path, turns: Iterable[LoggedTurn]) -> Path:
    """Write logged turns to one Parquet file atomically (the schema users' own logs follow)."""
    rows = []
    for turn in turns:
        row = {name: getattr(turn, name) for name in TURN_SCHEMA.names}
        row["messages"] = message_dicts(turn.messages)
        rows.append(row)
    return write_table(path, pa.Table.from_pylist(rows, schema=TURN_SCHEMA))


Render = Callable[[list[Message], str], tuple[list[int], list[int]]]
"""(chat so far, response text) -> (prompt ids, response ids) in the policy's chat template."""


def load_turns(path: str | Path, gamma: float, vocabulary: int, render: Render) -> list[LoggedTurn]:
    """Logged turns from a Parquet file: ours, or a user's with at least ``episode_id``, ``kernel_id``, ``t``,
    ``outcome`` and either ``prompt_ids`` + ``response_ids`` (each below ``vocabulary``) or ``messages`` +
    ``response`` (turned into ids by ``render``). Missing ``T`` is the episode's last t; missing ``ret`` is
    gamma^(T-t) * outcome."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise RepertoryError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as exc:
        raise RepertoryError(f"{path}: not a readable Parquet file ({exc})") from None
    return turns_from_rows(table.to_pylist(), set(table.column_names), str(path), gamma, vocabulary, render)


def turns_from_rows(
    rows: list[dict], columns: set[str], path: str, gamma: float, vocabulary: int, render: Render
) -> list[LoggedTurn]:
    """Logged turns from rows with the columns :func:`load_turns` describes, validated; ``path`` names their
    source in errors."""
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    has_ids = {"prompt_ids", "response_ids"} <= columns
    has_text = {"messages", "response"} <= columns
    if missing or not (has_ids or has_text):
        need = ", ".join(missing) if missing else "prompt_ids + response_ids, or messages + response"
        raise RepertoryError(
            f"{path}: not a logged-turns file (missing columns: {need}); see its schema in docs/cli.md (Bring your own "
            "logs)"
        )
    if not rows:
        raise RepertoryError(f"{path}: no logged turns")
    for n, row in enumerate(rows):
        for column in REQUIRED_COLUMNS:
            if row[column] is None:
                raise RepertoryError(f"{path}, row {n}: {column} is empty")
    episodes: dict[tuple[str, str], list[int]] = {}
    for n, row in enumerate(rows):
        episodes.setdefault((str(row["episode_id"]), row.get("seat_id") or "p0"), []).append(n)
    for (episode_id, seat_id), members in episodes.items():
        where = f"{path}: episode {episode_id!r}" + (f" seat {seat_id!r}" if "seat_id" in columns else "")
        for column in ("kernel_id", "outcome"):
            if len({rows[n][column] for n in members}) > 1:
                raise RepertoryError(f"{where} has more than one {column}")
        ts = [int(rows[n]["t"]) for n in members]
        if len(set(ts)) < len(ts):
            raise RepertoryError(f"{where} logs the same turn t twice")
    out = []
    for n, row in enumerate(rows):
        own = episodes[str(row["episode_id"]), row.get("seat_id") or "p0"]
        last = int(row["T"]) if row.get("T") is not None else max(int(rows[k]["t"]) for k in own)
        out.append(_turn(row, last, f"{path}, row {n}", has_ids, gamma, vocabulary, render))
    return out


def _turn(row: dict, T: int, where: str, has_ids: bool, gamma: float, vocabulary: int, render: Render) -> LoggedTurn:
    """One validated row as a logged turn whose conversation's last turn is ``T``; ``where`` names it in errors."""
    outcome = row["outcome"]
    if not isinstance(outcome, (int, float)) or not math.isfinite(outcome):
        raise RepertoryError(f"{where}: outcome must be a finite number (got {outcome!r})")
    t = int(row["t"])
    if not 0 <= t <= T:
        raise RepertoryError(f"{where}: t = {t} is outside 0..T = {T}")
    messages = row_messages(row.get("messages") or [])
    if has_ids and row.get("prompt_ids") and row.get("response_ids"):
        prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
        if not all(0 <= i < vocabulary for i in prompt + response):
            raise RepertoryError(f"{where}: token ids outside the policy's vocabulary (0..{vocabulary - 1})")
    elif messages and row.get("response") is not None:
        prompt, response = render(messages, row["response"])
    else:
        raise RepertoryError(f"{where}: no prompt_ids/response_ids and no messages/response")
    ret = row.get("ret")
    if ret is not None and (not isinstance(ret, (int, float)) or not math.isfinite(ret)):
        raise RepertoryError(f"{where}: ret must be a finite number (got {ret!r})")
    if row.get("grammar") is not None:
        try:
            TurnGrammar.loads(row["grammar"])
        except RepertoryError as exc:
            raise RepertoryError(f"{where}: grammar is {exc}") from None
    return LoggedTurn(
        episode_id=str(row["episode_id"]),
        kernel_id=str(row["kernel_id"]),
        t=t,
        T=T,
        prompt_ids=prompt,
        response_ids=response,
        outcome=float(outcome),
        ret=float(ret) if ret is not None else gamma ** (T - t) * float(outcome),
        round=int(row.get("round") or 0),
        seat_id=row.get("seat_id") or "p0",
        policy_id=row.get("policy_id") or "logged",
        logp_sample=list(row.get("logp_sample") or []),
        messages=messages,
        response=row.get("response") or "",
        grammar=row.get("grammar"),
    )

"""The log of a served policy (``repertory serve``): every chat completion it returned, and the outcomes
a deployment posts afterwards, as a directory that a round method reads as ``method.logs``.

Layout of a log directory::

    served.json                 what wrote it: the format, the served model, its policy id and vocabulary
    turns/part-*.parquet        one row per completion (SERVED_SCHEMA), one file per batch of the server
    outcomes/part-*.parquet     one row per posted outcome (OUTCOME_SCHEMA)

Parts are written atomically (temporary file, fsync, rename) and never rewritten, so a killed server leaves
every part it finished readable and at most its requests in flight unlogged. Part names carry the time, the
process and a counter, so a restarted server (or two servers) append to the same directory without clashing.

A completion's ``t`` is the number of assistant messages in its request: the client resends the chat so far,
so the model's earlier answers count its earlier turns. Two completions of the same (conversation, t) — a
client that regenerated an answer — keep the one that finished last. Reading joins each conversation with its
latest posted outcome; conversations without one are counted and left out.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from repertory.store import MESSAGE_TYPE, write_table
from repertory.types import Message, RepertoryError, message_dicts

FORMAT = "repertory-served-log"
MARKER = "served.json"

SERVED_SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),
        ("t", pa.int32()),
        ("kernel_id", pa.string()),
        ("seat_id", pa.string()),
        ("policy_id", pa.string()),
        ("model", pa.string()),
        ("request_id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("response", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("logp_sample", pa.list_(pa.float64())),
        ("finish_reason", pa.string()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("max_tokens", pa.int32()),
        ("seed", pa.int64()),
        ("received", pa.float64()),
        ("finished", pa.float64()),
    ]
)
OUTCOME_SCHEMA = pa.schema([("conversation_id", pa.string()), ("outcome", pa.float64()), ("received", pa.float64())])


@dataclass
class ServedTurn:
    """One completion the server returned, as logged."""

    conversation_id: str
    t: int
    kernel_id: str
    seat_id: str
    policy_id: str
    model: str
    request_id: str
    messages: list[Message]
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    logp_sample: list[float]
    finish_reason: str
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    received: float
    finished: float


def is_served_log(path: str | Path) -> bool:
    """Whether ``path`` is a served-log directory (it holds the marker ``served.json``)."""
    return (Path(path) / MARKER).is_file()


class ServedLog:
    """Appends a server's completions and outcomes to a log directory; safe to call from several threads."""

    def __init__(self, directory: str | Path, model: str, policy_id: str, vocabulary: int):
        """Open ``directory`` (created if missing). A directory that already holds a log of another vocabulary,
        or something that is not a served log, is refused rather than mixed."""
        self.directory = Path(directory)
        marker = self.directory / MARKER
        if marker.is_file():
            existing = _marker(self.directory)
            if existing.get("vocabulary") != vocabulary:
                raise RepertoryError(
                    f"{self.directory} logs a model with a vocabulary of {existing.get('vocabulary')} tokens, not "
                    f"{vocabulary}; serve into another --log-dir"
                )
        elif self.directory.exists() and any(self.directory.iterdir()):
            raise RepertoryError(f"{self.directory} is not empty and holds no served log; choose another --log-dir")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            content = {"format": FORMAT, "version": 1, "model": model, "policy_id": policy_id, "vocabulary": vocabulary}
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, marker)
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self.conversations = served_conversations(self.directory)

    def _part(self, kind: str) -> Path:
        with self._lock:
            n = next(self._counter)
        return self.directory / kind / f"part-{time.time_ns():020d}-{os.getpid()}-{n:06d}.parquet"

    def append_turns(self, turns: list[ServedTurn]) -> Path | None:
        """Write ``turns`` as one new part (nothing for an empty list); returns once it is durable."""
        if not turns:
            return None
        rows = []
        for turn in turns:
            row = {name: getattr(turn, name) for name in SERVED_SCHEMA.names}
            row["messages"] = message_dicts(turn.messages)
            rows.append(row)
        path = write_table(self._part("turns"), pa.Table.from_pylist(rows, schema=SERVED_SCHEMA))
        with self._lock:
            self.conversations.update(turn.conversation_id for turn in turns)
        return path

    def append_outcome(self, conversation_id: str, outcome: float) -> Path:
        """Record a conversation's outcome as one new part; the latest posted outcome of a conversation wins."""
        row = {"conversation_id": conversation_id, "outcome": float(outcome), "received": time.time()}
        return write_table(self._part("outcomes"), pa.Table.from_pylist([row], schema=OUTCOME_SCHEMA))


def _marker(directory: Path) -> dict[str, Any]:
    try:
        content = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RepertoryError(f"{directory / MARKER}: unreadable ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise RepertoryError(f"{directory / MARKER}: not a repertory served log")
    return content


def _parts(directory: Path, kind: str) -> list[Path]:
    return sorted((directory / kind).glob("part-*.parquet"))


def _read_parts(directory: Path, kind: str, schema: pa.Schema, columns: list[str] | None = None) -> list[dict]:
    rows: list[dict] = []
    for part in _parts(directory, kind):
        try:
            table = pq.read_table(part, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise RepertoryError(f"{part}: not a readable Parquet part ({exc})") from None
        missing = [name for name in (columns or schema.names) if name not in table.column_names]
        if missing:
            raise RepertoryError(f"{part}: missing columns {', '.join(missing)}")
        rows.extend(table.to_pylist())
    return rows


def served_conversations(directory: str | Path) -> set[str]:
    """The conversation ids a log directory holds completions of."""
    rows = _read_parts(Path(directory), "turns", SERVED_SCHEMA, ["conversation_id"])
    return {row["conversation_id"] for row in rows}


@dataclass
class ServedRead:
    """What a served log holds, joined: the rows of the conversations with an outcome (each row with its
    ``outcome``), and the counts a trainer reports."""

    rows: list[dict[str, Any]]
    completions: int = 0
    conversations: int = 0
    replaced: int = 0  # completions superseded by a later one of the same (conversation, t)
    outcomes_unmatched: int = 0  # outcomes posted for conversations the log does not hold
    skipped_ids: list[str] = field(default_factory=list)  # conversations kept in the log but not learned from

    @property
    def skipped_no_outcome(self) -> int:
        """How many conversations have no outcome yet."""
        return len(self.skipped_ids)


def read_served(directory: str | Path) -> ServedRead:
    """Every completion of a served log with its conversation's latest outcome (see the module docstring)."""
    directory = Path(directory)
    _marker(directory)
    turns = _read_parts(directory, "turns", SERVED_SCHEMA)
    outcome_rows = _read_parts(directory, "outcomes", OUTCOME_SCHEMA)
    outcomes: dict[str, tuple[float, float]] = {}
    for row in outcome_rows:
        previous = outcomes.get(row["conversation_id"])
        if previous is None or row["received"] >= previous[1]:
            outcomes[row["conversation_id"]] = (row["outcome"], row["received"])
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for row in turns:
        key = (row["conversation_id"], row["t"])
        if key not in latest or row["finished"] >= latest[key]["finished"]:
            latest[key] = row
    conversation_ids = {row["conversation_id"] for row in turns}
    skipped = sorted(c for c in conversation_ids if c not in outcomes)
    kept = []
    for (conversation_id, _), row in sorted(latest.items()):
        if conversation_id in outcomes:
            kept.append({**row, "outcome": outcomes[conversation_id][0]})
    return ServedRead(
        rows=kept,
        completions=len(turns),
        conversations=len(conversation_ids),
        replaced=len(turns) - len(latest),
        outcomes_unmatched=len(set(outcomes) - conversation_ids),
        skipped_ids=skipped,
    )

"""The episode store: episodes as Parquet files, one row per episode, turns as a nested list.

A store is a directory of ``part-NNNNNN.parquet`` files. ``append`` writes a new file atomically
(temporary file, then rename) and never touches earlier ones. ``load`` reads every file; a
truncated or corrupt file is reported by name and the others still load. The files open in
pandas, polars, DuckDB and Hugging Face datasets; free-form fields (kernel data, action values,
result info) are JSON strings.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from repertory.types import (
    Action,
    Episode,
    Kernel,
    Message,
    RepertoryError,
    Result,
    RoleResult,
    Seat,
    Turn,
    message_dicts,
)

SCHEMA_VERSION = "1"

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("channel", pa.string())])
_TURN = pa.struct(
    [
        ("seat_id", pa.string()),
        ("turn_index", pa.int32()),
        ("global_step", pa.int32()),
        ("game_round", pa.int32()),
        ("observation", pa.list_(MESSAGE_TYPE)),
        ("text", pa.string()),
        ("action_tag", pa.string()),
        ("action_value", pa.string()),
        ("error", pa.string()),
        ("invalid", pa.bool_()),
        ("reward", pa.float64()),
        ("finish", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("logp_sample", pa.list_(pa.float64())),
        ("policy_version", pa.int64()),
        ("grammar", pa.string()),
    ]
)
SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("env", pa.string()),
        ("kernel_id", pa.string()),
        ("split", pa.string()),
        ("kernel", pa.string()),
        ("episode_seed", pa.uint64()),
        ("group_id", pa.string()),
        ("iteration", pa.int64()),
        (
            "seats",
            pa.list_(
                pa.struct(
                    [
                        ("seat_id", pa.string()),
                        ("name", pa.string()),
                        ("role", pa.string()),
                        ("agent", pa.string()),
                        ("policy_id", pa.string()),
                        ("trainable", pa.bool_()),
                    ]
                )
            ),
        ),
        ("turns", pa.list_(_TURN)),
        (
            "result_roles",
            pa.list_(
                pa.struct(
                    [
                        ("name", pa.string()),
                        ("points", pa.float64()),
                        ("outcome", pa.float64()),
                        ("n_turns", pa.int32()),
                        ("n_invalid", pa.int32()),
                    ]
                )
            ),
        ),
        ("end_reason", pa.string()),
        ("result_info", pa.string()),
        ("metrics", pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))),
        ("final_observations", pa.list_(pa.struct([("seat_id", pa.string()), ("messages", pa.list_(MESSAGE_TYPE))]))),
    ],
    metadata={"repertory.schema_version": SCHEMA_VERSION},
)


CREDIT_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("seat_id", pa.string()),
        ("turn_index", pa.int32()),
        ("advantage", pa.float64()),
        ("return", pa.float64()),
    ],
    metadata={"repertory.schema_version": SCHEMA_VERSION},
)
"""What the estimator credited each trained turn with: the mean of the turn's per-token advantages as the loss
used them (after whitening), and the critic's target at the turn's last token (null for critic-free estimators)."""


class StoreError(RepertoryError):
    """A file of the store that cannot be read; the message names it."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path


def _episode_row(ep: Episode) -> dict[str, Any]:
    return {
        "episode_id": ep.episode_id,
        "env": ep.env,
        "kernel_id": ep.kernel.id,
        "split": ep.kernel.split,
        "kernel": ep.kernel.to_json(),
        "episode_seed": ep.episode_seed,
        "group_id": ep.group_id,
        "iteration": ep.iteration,
        "seats": [vars(s).copy() for s in ep.seats],
        "turns": [
            {
                "seat_id": t.seat_id,
                "turn_index": t.turn_index,
                "global_step": t.global_step,
                "game_round": t.game_round,
                "observation": message_dicts(t.observation),
                "text": t.text,
                "action_tag": t.action.tag if t.action else None,
                "action_value": json.dumps(t.action.value) if t.action else None,
                "error": t.error,
                "invalid": t.invalid,
                "reward": t.reward,
                "finish": t.finish,
                "prompt_ids": t.prompt_ids,
                "response_ids": t.response_ids,
                "logp_sample": t.logp_sample,
                "policy_version": t.policy_version,
                "grammar": t.grammar,
            }
            for t in ep.turns
        ],
        "result_roles": [{"name": name, **vars(r)} for name, r in ep.result.roles.items()],
        "end_reason": ep.result.end_reason,
        "result_info": json.dumps(ep.result.info, sort_keys=True),
        "metrics": [{"name": k, "value": v} for k, v in ep.metrics.items()],
        "final_observations": [{"seat_id": s, "messages": message_dicts(m)} for s, m in ep.final_observations.items()],
    }


def row_messages(rows: list[dict[str, str]]) -> list[Message]:
    """The messages of a ``MESSAGE_TYPE`` column's rows (files written before channels were recorded have none)."""
    return [Message(r["role"], r["content"], r.get("channel") or "") for r in rows]  # type: ignore[arg-type]


def _row_episode(row: dict[str, Any]) -> Episode:
    return Episode(
        episode_id=row["episode_id"],
        env=row["env"],
        kernel=Kernel.from_json(row["kernel"]),
        episode_seed=row["episode_seed"],
        seats=[Seat(**s) for s in row["seats"]],
        turns=[
            Turn(
                seat_id=t["seat_id"],
                turn_index=t["turn_index"],
                global_step=t["global_step"],
                game_round=t["game_round"],
                observation=row_messages(t["observation"]),
                text=t["text"],
                action=Action(t["action_tag"], json.loads(t["action_value"])) if t["action_tag"] is not None else None,
                error=t["error"],
                invalid=t["invalid"],
                reward=t["reward"],
                finish=t["finish"],
                prompt_ids=t["prompt_ids"],
                response_ids=t["response_ids"],
                logp_sample=t["logp_sample"],
                policy_version=t.get("policy_version") or 0,  # files written before versions were recorded
                grammar=t.get("grammar"),
            )
            for t in row["turns"]
        ],
        result=Result(
            roles={
                r["name"]: RoleResult(r["points"], r["outcome"], r["n_turns"], r["n_invalid"])
                for r in row["result_roles"]
            },
            end_reason=row["end_reason"],
            info=json.loads(row["result_info"]),
        ),
        metrics={m["name"]: m["value"] for m in row["metrics"]},
        final_observations={f["seat_id"]: row_messages(f["messages"]) for f in row["final_observations"]},
        group_id=row["group_id"],
        iteration=row["iteration"],
    )


def write_episodes(path: str | Path, episodes: Iterable[Episode]) -> Path:
    """Write episodes to one Parquet file atomically: a reader never sees a partial file."""
    return write_table(path, pa.Table.from_pylist([_episode_row(ep) for ep in episodes], schema=SCHEMA))


def write_table(path: str | Path, table: pa.Table) -> Path:
    """Write a table to one Parquet file atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the permissions open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_episodes(path: str | Path) -> list[Episode]:
    """Every episode of one Parquet file; StoreError (naming the file) if it cannot be read."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise StoreError(path, "no such file") from None
    except (OSError, pa.ArrowException) as exc:
        raise StoreError(path, f"not a readable Parquet file ({exc})") from None
    missing = [name for name in SCHEMA.names if name not in table.column_names]
    if missing:
        raise StoreError(path, f"not a repertory episode file (missing columns: {', '.join(missing)})")
    try:
        return [_row_episode(row) for row in table.select(SCHEMA.names).to_pylist()]
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(path, f"malformed episode record ({exc.__class__.__name__}: {exc})") from None


def write_credit(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write one iteration's per-turn credit (rows of ``CREDIT_SCHEMA``) atomically."""
    return write_table(path, pa.Table.from_pylist(rows, schema=CREDIT_SCHEMA))


def read_credit(path: str | Path) -> dict[tuple[str, str, int], tuple[float, float | None]]:
    """(advantage, return) per (episode id, seat id, turn index) of one credit file; StoreError if unreadable."""
    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
        return {(r["episode_id"], r["seat_id"], r["turn_index"]): (r["advantage"], r["return"]) for r in rows}
    except (OSError, pa.ArrowException, KeyError) as exc:
        raise StoreError(path, f"not a readable credit file ({exc})") from None


_PART = re.compile(r"part-(\d{6,})\.parquet")


class EpisodeStore:
    """A directory of episode files that only ever grows."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise RepertoryError(f"{self.root} exists and is not a directory")

    def prepare(self) -> EpisodeStore:
        """Create the directory now, so that a path that cannot hold episodes is refused before any game is
        played rather than after."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RepertoryError(f"cannot create the episode store {self.root}: {exc.strerror or exc}") from None
        if not os.access(self.root, os.W_OK):
            raise RepertoryError(f"cannot write episodes to {self.root}: permission denied")
        return self

    def files(self) -> list[Path]:
        """The store's Parquet files in the order they were written."""
        if not self.root.is_dir():
            return []
        parts = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _PART.fullmatch(p.name))]
        return [p for _, p in sorted(parts)]

    def append(self, episodes: Iterable[Episode]) -> Path:
        """Write the episodes to a new file after the existing ones; returns its path."""
        files = self.files()
        number = int(_PART.fullmatch(files[-1].name).group(1)) + 1 if files else 0  # type: ignore[union-attr]
        return write_episodes(self.root / f"part-{number:06d}.parquet", episodes)

    def load(self) -> tuple[list[Episode], list[StoreError]]:
        """All readable episodes, and one error per file that could not be read."""
        episodes: list[Episode] = []
        errors: list[StoreError] = []
        for path in self.files():
            try:
                episodes.extend(read_episodes(path))
            except StoreError as exc:
                errors.append(exc)
        return episodes, errors

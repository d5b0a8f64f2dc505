"""Episode store: exact round trips, append-only files, and clear errors for damaged files."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import play

from repertory.store import EpisodeStore, StoreError, read_episodes, write_episodes
from repertory.types import Seat


def _with_tokens(episodes):
    """Fill the LM fields so the round trip covers every column."""
    for ep in episodes:
        ep.group_id = "g/1"
        ep.iteration = 7
        ep.seats[0] = Seat("p0", "Alice", "player", "model", "live", True)
        for k, turn in enumerate(ep.turns):
            turn.prompt_ids = [1, 2, 3, k]
            turn.response_ids = [40000 + k, 2]
            turn.logp_sample = [-0.1 * k, -math.pi]
            turn.finish = "length" if k % 3 == 0 else "stop"
    return episodes


@pytest.mark.parametrize(
    "env,agents",
    [
        ("ipd", ["random", "grim-trigger"]),
        ("split-no-comm", ["greedy", "welfare-maximizing"]),
        ("trust-and-split", ["honest-cooperative", "reciprocal"]),
        ("werewolf", ["heuristic", "random-legal"] * 3),
    ],
)
def test_round_trip_equals_every_field(tmp_path, env, agents):
    episodes = _with_tokens(play(env, agents, episodes=3, seed=5))
    path = write_episodes(tmp_path / "e.parquet", episodes)
    back = read_episodes(path)
    assert back == episodes
    assert back[0].turns[3].logp_sample == [-0.1 * 3, -math.pi]
    assert back[0].seats[0].trainable is True
    assert back[0].kernel.data == episodes[0].kernel.data


def test_channels_are_stored_and_files_without_them_still_load(tmp_path):
    episodes = play("werewolf", ["heuristic"] * 6, episodes=2, seed=1)
    path = write_episodes(tmp_path / "e.parquet", episodes)
    channels = {m.channel for ep in read_episodes(path) for t in ep.turns for m in t.observation}
    assert channels == {"", "public", "team", "private"}  # "" is the system prompt
    # A file written before channels were recorded: the message struct has no channel field.
    table = pq.read_table(path)
    old = pa.Table.from_pylist(
        [
            {**row, "turns": [{**t, "observation": [{k: m[k] for k in ("role", "content")} for m in t["observation"]]}
                              for t in row["turns"]]}
            for row in table.to_pylist()
        ]
    )  # fmt: skip
    pq.write_table(old, tmp_path / "old.parquet")
    back = read_episodes(tmp_path / "old.parquet")
    assert [t.text for t in back[0].turns] == [t.text for t in episodes[0].turns]
    assert {m.channel for t in back[0].turns for m in t.observation} == {""}


def test_invalid_turns_and_unicode_round_trip(tmp_path):
    script = tmp_path / "moves.txt"
    script.write_text("héllo ✓ <choose>maybe</choose>\nI choose A\n<choose>a</choose>\n", encoding="utf-8")
    episodes = play("ipd", [f"script:{script}", "tit-for-tat"])
    turns = episodes[0].trajectory("p0")
    assert [t.invalid for t in turns[:3]] == [True, True, False]
    assert turns[0].error and "not A or B" in turns[0].error
    back = read_episodes(write_episodes(tmp_path / "x.parquet", episodes))
    assert back == episodes
    assert back[0].turns[0].text.startswith("héllo ✓")


def test_append_never_rewrites_earlier_files(tmp_path):
    store = EpisodeStore(tmp_path / "episodes")
    first = store.append(play("ipd", ["always-cooperate", "always-defect"], episodes=2))
    before = first.read_bytes()
    mtime = first.stat().st_mtime_ns
    second = store.append(play("ipd", ["tit-for-tat", "random"], episodes=3, seed=1))
    assert [p.name for p in store.files()] == ["part-000000.parquet", "part-000001.parquet"]
    assert first.read_bytes() == before and first.stat().st_mtime_ns == mtime
    assert second != first
    episodes, errors = store.load()
    assert errors == [] and len(episodes) == 5
    assert [e.seats[0].agent for e in episodes] == ["always-cooperate"] * 2 + ["tit-for-tat"] * 3
    assert not list((tmp_path / "episodes").glob("*.tmp"))


def test_corrupt_and_truncated_files_are_named_and_others_load(tmp_path):
    store = EpisodeStore(tmp_path)
    good = store.append(play("ipd", ["always-cooperate", "always-defect"], episodes=2))
    truncated = store.append(play("ipd", ["tit-for-tat", "random"], episodes=2))
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "part-000002.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    last = store.append(play("ipd", ["grim-trigger", "random"], episodes=1))
    episodes, errors = store.load()
    assert len(episodes) == 3
    assert [e.path for e in errors] == [truncated, garbage]
    assert all(str(e.path) in str(e) for e in errors)
    assert "not a readable Parquet file" in str(errors[0])
    with pytest.raises(StoreError, match="part-000001.parquet"):
        read_episodes(truncated)
    assert good.exists() and last.name == "part-000003.parquet"


def test_foreign_parquet_file_is_reported(tmp_path):
    import pyarrow as pa

    path = tmp_path / "part-000000.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), path)
    with pytest.raises(StoreError, match="missing columns: episode_id"):
        read_episodes(path)


def test_store_root_that_is_a_file_is_rejected(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(Exception, match="not a directory"):
        EpisodeStore(target)


def test_same_seed_writes_identical_bytes(tmp_path):
    a = write_episodes(tmp_path / "a.parquet", play("ipd", ["random", "random"], episodes=4, seed=3))
    b = write_episodes(tmp_path / "b.parquet", play("ipd", ["random", "random"], episodes=4, seed=3))
    c = write_episodes(tmp_path / "c.parquet", play("ipd", ["random", "random"], episodes=4, seed=4))
    assert a.read_bytes() == b.read_bytes()
    assert read_episodes(a) != read_episodes(c)


def test_files_open_as_plain_tables(tmp_path):
    path = write_episodes(tmp_path / "e.parquet", play("trust-and-split", ["greedy", "honest-cooperative"], episodes=2))
    table = pq.read_table(path)
    assert table.num_rows == 2
    assert table.column("env").to_pylist() == ["trust-and-split"] * 2
    turns = table.column("turns").to_pylist()[0]
    assert len(turns) == 40 and turns[0]["observation"][0]["role"] == "system"

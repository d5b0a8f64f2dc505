"""Logged turns from played episodes and users' logs, grouped into conversations (docs/algorithms.md 5.3)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from repertory import algos
from repertory.envs import Env
from repertory.generation.grammar import GrammarMasks
from repertory.models.chat import render_logged
from repertory.store import EpisodeStore, read_episodes
from repertory.store.served import ServedRead, is_served_log, read_served
from repertory.store.turns import LoggedTurn, Render, load_turns, turns_from_rows
from repertory.types import Episode, RepertoryError, derive


def logged_turns(episodes: list[Episode], round_index: int, gamma: float) -> list[LoggedTurn]:
    """The turns of every trainable seat that produced tokens, with G_t = sum_{t'>=t} gamma^(t'-t) r_t'."""
    out = []
    for ep in episodes:
        for seat in ep.seats:
            if not seat.trainable:
                continue
            turns = ep.trajectory(seat.seat_id)
            returns = algos.discounted_returns([turn.reward for turn in turns], gamma)
            outcome = ep.result.roles[seat.name].outcome
            for t, (turn, ret) in enumerate(zip(turns, returns)):
                if not turn.response_ids:
                    continue
                out.append(
                    LoggedTurn(
                        episode_id=ep.episode_id,
                        kernel_id=ep.kernel_id,
                        t=t,
                        T=len(turns) - 1,
                        prompt_ids=list(turn.prompt_ids),
                        response_ids=list(turn.response_ids),
                        outcome=outcome,
                        ret=ret,
                        round=round_index,
                        seat_id=seat.seat_id,
                        policy_id=f"pi_{round_index}",
                        logp_sample=list(turn.logp_sample),
                        messages=ep.prompt_messages(seat.seat_id, turn.turn_index),
                        response=turn.text,
                        grammar=turn.grammar,
                    )
                )
    return out


def demonstration_turns(
    episodes: list[Episode],
    env: type[Env],
    tokenizer: Any,
    gamma: float,
    every_seat: bool = False,
    agent: str | None = None,
) -> list[LoggedTurn]:
    """Logged turns from any played episodes (bots, people, other models): the turns of the seat the policy
    is trained in (the game's trained seat, or every seat where the game fixes none or ``every_seat``), of
    those only the seats ``agent`` played when given, each text rendered with the policy's chat template, G_t
    from the turn rewards."""
    out = []
    for ep in episodes:
        if ep.env != env.name:
            raise RepertoryError(f"episode {ep.episode_id} is a game of {ep.env}, not {env.name}")
        fixed = env.fixed_seat and not every_seat
        seats = [env.roles.index(env.default_trained_role)] if fixed else range(len(ep.seats))
        for index in seats:
            seat = ep.seats[index]
            if agent is not None and seat.agent != agent:
                continue
            own = ep.trajectory(seat.seat_id)
            returns = algos.discounted_returns([turn.reward for turn in own], gamma)
            for t, (turn, ret) in enumerate(zip(own, returns)):
                messages = ep.prompt_messages(seat.seat_id, turn.turn_index)
                prompt, response = render_logged(tokenizer, messages, turn.text)
                out.append(
                    LoggedTurn(
                        ep.episode_id,
                        ep.kernel_id,
                        t,
                        len(own) - 1,
                        prompt,
                        response,
                        ep.result.roles[seat.name].outcome,
                        ret,
                        0,
                        seat.seat_id,
                        seat.agent,
                        messages=messages,
                        response=turn.text,
                    )
                )
    return out


def read_turns(path: str | Path, tokenizer: Any, gamma: float) -> list[LoggedTurn]:
    """Logged turns from a Parquet file (:func:`repertory.store.turns.load_turns`), text turns rendered with the
    policy's chat template."""
    return load_turns(path, gamma, len(tokenizer), _renderer(tokenizer))


def _renderer(tokenizer: Any) -> Render:
    return lambda messages, text: render_logged(tokenizer, messages, text)


def read_logs(
    path: str | Path,
    env: type[Env],
    tokenizer: Any,
    gamma: float,
    every_seat: bool = False,
    agent: str | None = None,
) -> tuple[list[LoggedTurn], list[Episode], ServedRead | None]:
    """Round 0's logs: a served log directory (``repertory serve``; also returned, for its counts), a
    logged-turns Parquet file, or played episodes — an episode file or an episode store directory
    (``repertory play --out``) — whose trained seat's turns (every seat's with ``every_seat``; of those,
    ``agent``'s only when given) become the logged turns."""
    path = Path(path)
    if is_served_log(path):
        served = read_served(path)
        return served_turns(served, str(path), tokenizer, gamma), [], served
    if path.is_dir():
        episodes, errors = EpisodeStore(path).load()
        if errors:
            raise RepertoryError("; ".join(map(str, errors)))
        if not episodes:
            raise RepertoryError(f"{path}: no episodes in this store")
    elif path.is_file() and _is_episode_file(path):
        episodes = read_episodes(path)
    else:
        return read_turns(path, tokenizer, gamma), [], None
    turns = demonstration_turns(episodes, env, tokenizer, gamma, every_seat, agent)
    if not turns and agent is not None:
        played = sorted({seat.agent for ep in episodes for seat in ep.seats})
        raise RepertoryError(f"{path}: no seat played by {agent!r} (log_agent); the agents logged: {played}")
    return turns, episodes, None


def check_grammars(turns: list[LoggedTurn], masks: GrammarMasks, where: str) -> None:
    """Refuse a logged turn whose response could not have been sampled under the grammar it names: a run under
    ``rollout.constrained: grammar`` replays that grammar's masks over it, where such a token has no probability."""
    for n, turn in enumerate(turns):
        reason = masks.misfit(turn.grammar, turn.response_ids) if turn.grammar is not None else None
        if reason is not None:
            raise RepertoryError(f"{where}, row {n}: the response does not fit its grammar: {reason}")


def served_turns(served: ServedRead, where: str, tokenizer: Any, gamma: float) -> list[LoggedTurn]:
    """The logged turns of a served log's conversations that have an outcome (each conversation one episode)."""
    if not served.rows:
        raise RepertoryError(
            f"{where}: none of its {served.conversations} conversations has an outcome yet; post them to "
            "/v1/outcomes (docs/guide.md, Serving a policy)"
        )
    rows = [{**row, "episode_id": row["conversation_id"]} for row in served.rows]
    return turns_from_rows(rows, set(rows[0]), where, gamma, len(tokenizer), _renderer(tokenizer))


def _is_episode_file(path: Path) -> bool:
    try:
        return "turns" in pq.read_schema(path).names
    except (OSError, pa.ArrowException):
        return False  # read_turns reports what is wrong with it


def kernel_split(kernel_ids: Iterable[str], val_fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """(Q-train, Q-val) kernels: every turn of a kernel on one side, and each kernel on the same side in every
    round whatever else was logged (Q-val iff a hash of seed and kernel id falls below ``val_fraction``)."""
    kernels = set(kernel_ids)
    val = {k for k in kernels if derive(seed, "q-split", k) % 1_000_000 < val_fraction * 1_000_000}
    if val == kernels:  # nothing left to fit on: no validation this round
        val = set()
    return kernels - val, val


def first_return(convo: list[LoggedTurn], gamma: float) -> float:
    """G_0 of a conversation: its first turn's return, discounted back to t = 0 when the log starts later (a
    first turn without tokens is not logged; its reward, if any, is unknown)."""
    return gamma ** convo[0].t * convo[0].ret


def group_key(turn: LoggedTurn) -> str:
    """Conversations compared with each other (ST-GRPO groups, KTO's kernel means): same kernel, same seat."""
    return f"{turn.kernel_id}/{turn.seat_id}"


Conversation = tuple[str, str]
"""One seat's side of one logged episode: (episode id, seat id). Both seats of a self-play game are logged,
each its own conversation with its own outcome."""


def conversation_of(turn: LoggedTurn) -> Conversation:
    """The conversation a logged turn belongs to."""
    return turn.episode_id, turn.seat_id


def conversations(turns: list[LoggedTurn]) -> dict[Conversation, list[LoggedTurn]]:
    """Turns grouped by conversation, in turn order."""
    out: dict[Conversation, list[LoggedTurn]] = {}
    for turn in sorted(turns, key=lambda x: (x.episode_id, x.seat_id, x.t)):
        out.setdefault(conversation_of(turn), []).append(turn)
    return out

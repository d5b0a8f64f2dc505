"""A logged state rebuilt by the referee: the environment as a seat saw it before one of its logged turns."""

from __future__ import annotations

from repertory.envs import Env, make
from repertory.types import Episode, RepertoryError


def replay(episode: Episode, seat_id: str, t: int) -> tuple[Env, str]:
    """The environment as the seat saw it before its ``t``-th turn of a logged conversation, and the seat's
    role: rebuilt from the kernel and seed and stepped with the logged texts. Only the referee runs; no
    partner is asked and nothing beyond the log is played, so ``validate`` and ``action_choices`` on it are
    the state's own."""
    env = make(episode.env)
    env.reset(episode.kernel, episode.episode_seed)
    role = env.roles[int(seat_id[1:])]
    steps: dict[int, dict[str, str]] = {}
    for turn in episode.turns:
        steps.setdefault(turn.global_step, {})[env.roles[int(turn.seat_id[1:])]] = turn.text
    own = 0
    for step in sorted(steps):
        actions = steps[step]
        if role in actions:
            if own == t:
                return env, role
            own += 1
        env.step(actions)
    raise RepertoryError(f"episode {episode.episode_id} has no turn {t} of seat {seat_id}")

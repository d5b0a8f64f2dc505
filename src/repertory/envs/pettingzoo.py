"""PettingZoo's AEC API over any repertory environment (docs/ecosystem.md, PettingZoo).

``aec_env("werewolf")`` returns a :class:`pettingzoo.AECEnv` whose agents are the seats of the episode's
kernel. Observations and actions are text: a seat observes the whole chat it has seen so far (its system
prompt, what the game told it with the channel of each message, and its own texts), and acts with the raw
text a model would write. Simultaneous phases are played one seat at a time: the actions are collected in
seat order and the game steps once the last acting seat has answered, so no seat sees another's move early.

Needs the optional extra: ``pip install 'repertory[pettingzoo]'``.
"""

from __future__ import annotations

import random
import re
import string
from functools import cache
from typing import Any, ClassVar

from repertory.envs import Env, load_kernels, make
from repertory.envs.base import append_joined
from repertory.envs.parsing import DEFAULT_MAX_CHARS
from repertory.types import Judge, Kernel, Message, RepertoryError, derive, message_dicts

try:
    import gymnasium
    import numpy as np
    from pettingzoo import AECEnv
except ImportError as exc:
    raise RepertoryError(
        f"repertory.envs.pettingzoo needs PettingZoo and Gymnasium ({exc}); install them with "
        "pip install 'repertory[pettingzoo]'"
    ) from None

OBSERVATION_MAX_CHARS = 2**20
"""Longest observation; a longer transcript keeps its last ``OBSERVATION_MAX_CHARS`` characters."""
ACTION_MAX_CHARS = DEFAULT_MAX_CHARS
"""Longest action the action space samples; longer texts are accepted and cut by the referee as usual."""
ACTION_CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"
"""What the action space samples from (printable ASCII); any text is accepted as an action."""
REPLACEMENT = "\ufffd"
"""Stands in an observation for a character outside the Basic Multilingual Plane (the Text charset)."""

_OUTSIDE_CHARSET = re.compile("[\ud800-\udfff\U00010000-\U0010ffff]")


class Observation(str):
    """A seat's transcript: a ``str`` that also carries the Text space's ``dtype``, which PettingZoo's
    ``api_test`` compares with the space's, as it would for a numpy observation."""

    dtype: ClassVar[np.dtype] = np.dtype(str)


@cache
def observation_space() -> gymnasium.spaces.Text:
    """The observation space every seat shares: text of up to ``OBSERVATION_MAX_CHARS`` characters of the Basic
    Multilingual Plane. Built once per process, since the charset alone takes about 25 MB."""
    charset = "".join(chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000)
    return gymnasium.spaces.Text(OBSERVATION_MAX_CHARS, min_length=0, charset=charset)


def transcript(messages: list[dict[str, str]]) -> str:
    """A chat as text: each message under a marker, ``[system]`` (the rules), ``[you]`` (the seat's own text),
    ``[public]``, ``[team]`` or ``[private]`` (what the game told it on that channel) or ``[game]`` (unlabelled)."""
    return "\n\n".join(f"[{_marker(m)}]\n{m['content']}" for m in messages)


def _marker(message: dict[str, str]) -> str:
    if message["role"] == "system":
        return "system"
    if message["role"] == "assistant":
        return "you"
    return message["channel"] or "game"


class RepertoryAECEnv(AECEnv):
    """One repertory game as a PettingZoo AEC environment; build it with :func:`aec_env`.

    ``infos[seat]`` holds ``messages`` (the seat's chat as ``{role, content, channel}`` dicts, exactly as the
    rollout engine shows it to a model), ``new_messages`` (those since the seat's last action), ``channels``
    (the labelled channels it has been told on), ``acting`` (it still owes an action in this phase),
    ``choices`` (every valid action where the game has a finite set, else None), ``max_chars``, ``seat``,
    ``role_label``, ``round``, ``kernel_id`` and ``episode_seed``; once the episode is over also ``points``,
    ``outcome`` and ``end_reason``.
    """

    def __init__(
        self,
        game: Env,
        kernels: list[Kernel],
        kernel: Kernel | None,
        judge: Judge | None,
        render_mode: str | None,
    ) -> None:
        super().__init__()
        self.game = game
        self.judge = judge
        self.render_mode = render_mode
        self.metadata = {
            "name": f"repertory/{game.name}",
            "render_modes": ["human", "ansi"],
            "is_parallelizable": False,
        }
        self._kernels = kernels
        self._kernel = kernel
        seatings = {game.seat_names(k.data) for k in ([kernel] if kernel is not None else kernels)}
        # Games that draw their seats from the kernel (Werewolf, social) know them only once reset picks one.
        self.possible_agents = list(seatings.pop()) if len(seatings) == 1 else []
        self.agents = []
        self._seeds = random.Random()
        self._action_spaces: dict[str, gymnasium.spaces.Text] = {}
        self._chats: dict[str, list[Message]] = {}
        self._queue: list[str] = []
        self._pending: dict[str, str] = {}
        self._log: list[str] = []

    def observation_space(self, agent: str) -> gymnasium.spaces.Text:
        """The shared text space of :func:`observation_space`."""
        return observation_space()

    def action_space(self, agent: str) -> gymnasium.spaces.Text:
        """Text of up to ``ACTION_MAX_CHARS`` printable ASCII characters; one space per seat, so each samples
        from its own generator."""
        if agent not in self._action_spaces:
            self._action_spaces[agent] = gymnasium.spaces.Text(ACTION_MAX_CHARS, min_length=0, charset=ACTION_CHARSET)
        return self._action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Start an episode. Its kernel is ``options["kernel"]`` (an index or id), else the one fixed by
        :func:`aec_env`, else ``kernels[derive(seed, "kernel") % len(kernels)]``; its episode seed is
        ``derive(seed, "episode")``. Without a seed, one is drawn from the last seed given (or from the system's
        entropy), as Gymnasium does. Other keys of ``options`` are ignored."""
        if seed is None:
            seed = self._seeds.getrandbits(63)
        else:
            self._seeds.seed(seed)
        chosen = (options or {}).get("kernel")
        if chosen is not None:
            kernel = _pick_kernel(self._kernels, chosen, self.game.name)
        elif self._kernel is not None:
            kernel = self._kernel
        else:
            kernel = self._kernels[derive(seed, "kernel") % len(self._kernels)]
        self.game.reset(kernel, derive(seed, "episode"))
        self.possible_agents = list(self.game.roles)
        self.agents = list(self.game.roles)
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self._chats = {a: [] for a in self.agents}
        self._log = [f"{self.game.name} {kernel.id}, episode seed {self.game.episode_seed}: {', '.join(self.agents)}"]
        self._pull()
        self._open_phase()
        self._refresh_infos()

    def observe(self, agent: str) -> Observation:
        """The seat's transcript so far (:func:`transcript`)."""
        text = _OUTSIDE_CHARSET.sub(REPLACEMENT, transcript(message_dicts(self._chats[agent])))
        return Observation(text[-OBSERVATION_MAX_CHARS:])

    def step(self, action: str | None) -> None:
        """Give the selected seat's text; None once it is terminated. The game steps when the last seat acting in
        the phase has answered."""
        if self.game.kernel is None:
            raise RepertoryError("reset() the environment before step()")
        if not self.agents:
            raise RepertoryError("the episode is over and every seat has left; reset() to play another")
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        if not isinstance(action, str):
            raise TypeError(f"{agent}'s action must be its text (a str), not {type(action).__name__}")
        self._cumulative_rewards[agent] = 0.0
        self._clear_rewards()
        self._queue.remove(agent)
        text = str(action)  # numpy's str_ and other subclasses become a plain str
        self._pending[agent] = text
        self._chats[agent].append(Message("assistant", text))
        if self._queue:
            self.agent_selection = self._queue[0]
        else:
            self._advance()
        self._accumulate_rewards()
        self._refresh_infos()

    def render(self) -> str | None:
        """A spectator's log of the episode: every seat's text, the referee's events and the rewards. ``human``
        also prints it."""
        if self.render_mode is None:
            gymnasium.logger.warn("You are calling render method without specifying any render mode.")
            return None
        text = "\n".join(self._log)
        if self.render_mode == "human":
            print(text)
        return text

    def close(self) -> None:
        """Nothing to release: a game holds no resources beyond memory."""

    def _advance(self) -> None:
        result = self.game.step(self._pending)
        self._log += [f"{role}: {text}" for role, text in self._pending.items()]
        self._log += [f"  {event}" for event in result.events]
        for role, reward in result.rewards.items():
            self.rewards[role] += float(reward)
        self._pull()
        if not self.game.done:
            self._open_phase()
            return
        for role, reward in self._judged().items():
            self.rewards[role] += float(reward)
        self.terminations = {a: True for a in self.agents}
        self._queue, self._pending = [], {}
        self.agent_selection = self.agents[0]
        outcomes = self.game.result()
        self._log.append(
            f"end ({outcomes.end_reason}): " + ", ".join(f"{r} {x.outcome:.3f}" for r, x in outcomes.roles.items())
        )

    def _judged(self) -> dict[str, float]:
        """The judge's terminal rewards, as the rollout engine asks for them (an unjudged game asks nothing)."""
        if self.judge is None:
            return {}
        requests = self.game.judge_requests(self.judge.fine_grained)
        return self.game.judged(self.judge.score(requests)) if requests else {}

    def _pull(self) -> None:
        # Every seat's inbox is drained after each step, so seats that do not act still keep a full transcript.
        # The engine drains a seat only when it acts, and ``tell`` joins the notices of one channel that wait
        # unread; joining them here the same way keeps each chat identical to the engine's.
        for role in self.agents:
            for m in self.game.observe(role):
                append_joined(self._chats[role], m)

    def _open_phase(self) -> None:
        self._queue = list(self.game.acting_roles())
        self._pending = {}
        if not self._queue:
            raise RuntimeError(f"{self.game.name}: the episode is not over but no seat is to act")
        self.agent_selection = self._queue[0]

    def _refresh_infos(self) -> None:
        game = self.game
        result = game.result() if game.done else None
        self.infos = {}
        for role in self.agents:
            chat = message_dicts(self._chats[role])
            last_own = max((i for i, m in enumerate(chat) if m["role"] == "assistant"), default=-1)
            acting = role in self._queue
            info: dict[str, Any] = {
                "messages": list(chat),
                "new_messages": chat[last_own + 1 :],
                "channels": sorted({m["channel"] for m in chat if m["channel"]}),
                "acting": acting,
                "choices": game.action_choices(role) if acting else None,
                "max_chars": game.max_chars(role) if acting else None,
                "seat": game.seat_index(role),
                "role_label": game.role_labels[game.seat_index(role)],
                "round": game.game_round,
                "kernel_id": game.kernel.id if game.kernel else "",
                "episode_seed": game.episode_seed,
            }
            if result is not None:
                info.update(
                    points=result.roles[role].points, outcome=result.roles[role].outcome, end_reason=result.end_reason
                )
            self.infos[role] = info


def _pick_kernel(kernels: list[Kernel], kernel: int | str, env: str) -> Kernel:
    """``kernels[kernel]`` for an index, or the kernel whose id is ``kernel``; a RepertoryError otherwise."""
    if isinstance(kernel, int) and not isinstance(kernel, bool):
        if not 0 <= kernel < len(kernels):
            raise RepertoryError(f"{env}: kernel index must be in 0..{len(kernels) - 1} (got {kernel})")
        return kernels[kernel]
    if isinstance(kernel, str):
        for k in kernels:
            if k.id == kernel:
                return k
        raise RepertoryError(
            f"{env}: no kernel {kernel!r} in the {kernels[0].split} split (ids run {kernels[0].id} .. {kernels[-1].id})"
        )
    raise RepertoryError(f"{env}: a kernel is an index or a kernel id, not {type(kernel).__name__}")


def aec_env(
    name: str,
    split: str = "train",
    kernel: int | str | None = None,
    *,
    judge: Judge | None = None,
    render_mode: str | None = None,
    **options: Any,
) -> RepertoryAECEnv:
    """A PettingZoo AEC environment playing ``name`` on the kernels of ``split``: always ``kernel`` (an index or
    a kernel id) when given, else one drawn from each reset's seed. ``options`` are the game's (social:
    ``reward``); a game whose reward waits for a judge (social with reward judge or hybrid) needs ``judge``, any
    judge of :mod:`repertory.judges`. With a judge, every finished episode is scored as the rollout engine scores
    it and the judge's rewards land in the final step's rewards. ``render_mode``: None, ``human`` or ``ansi``."""
    game = make(name, **options)
    kernels = load_kernels(name, split, options)
    if not kernels:
        raise RepertoryError(f"{name} has no kernels in the {split} split")
    fixed = None if kernel is None else _pick_kernel(kernels, kernel, name)
    if game.needs_judge and judge is None:
        raise RepertoryError(
            f"{name}: the reward {options.get('reward')!r} needs a judge; pass judge= (a judge of repertory.judges), "
            "or use reward='verifiable'"
        )
    if render_mode not in (None, "human", "ansi"):
        raise RepertoryError(f"render_mode must be None, 'human' or 'ansi' (got {render_mode!r})")
    return RepertoryAECEnv(game, kernels, fixed, judge, render_mode)


__all__ = ["ACTION_MAX_CHARS", "OBSERVATION_MAX_CHARS", "RepertoryAECEnv", "aec_env", "transcript"]

"""TextArena's games as repertory environments: ``make("textarena:TicTacToe-v0")`` (docs/ecosystem.md, TextArena).

``textarena_env("textarena:<EnvId>")`` builds (once per id) an :class:`TextArenaGame` subclass over TextArena's
raw game, without the observation and action wrappers ``textarena.make`` adds: repertory keeps the chat itself.
Seats are "Player 0", "Player 1", ...; the seat count is the first of :data:`PLAYER_COUNTS` the game accepts.
A kernel is the TextArena id, the seat count and a game seed; the seed drives all of the game's randomness.

Each seat's system prompt is the prompt TextArena writes for that player; what TextArena then sends a player
becomes that seat's user messages, ``[GAME] ...`` or ``[Player 1] ...`` as TextArena's own LLM wrapper writes
them, on channel "" when sent to every player and "private" when sent to that player alone (a seat's own
moves are its assistant messages, so their echo is dropped). A move TextArena refuses is an invalid action
whose error is TextArena's reason; TextArena's own rules apply (in two-player games a second invalid move in a
row loses). Final rewards become outcomes in [0, 1], all paid at the last step: ``(reward + 1) / 2`` in games of
several players (win 1, draw 0, loss -1), the progress in [0, 1] in one-player puzzles.

TextArena keeps its randomness in the global ``random`` (and some games in ``numpy.random``) and reports
observations and invalid moves only through its state objects. Every call into TextArena therefore runs
under one lock with the game's own random states swapped in and those state methods recorded, so episodes
run side by side in the rollout engine stay independent and replay exactly (as long as no other thread draws
from the global generators meanwhile: the lock serialises TextArena, not the process). Games that download NLTK data at
run time are refused with a clear error: repertory never downloads during play.

Needs the optional extra: ``pip install 'repertory[textarena]'``.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import random
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from fractions import Fraction
from functools import cache
from types import ModuleType
from typing import Any, ClassVar

from repertory.envs.base import Bot, Env
from repertory.envs.parsing import clean
from repertory.types import Action, Kernel, Parsed, RepertoryError, Result, StepResult, derive

PREFIX = "textarena:"
INSTALL = "pip install 'repertory[textarena]'"
PLAYER_COUNTS = (2, 1, 3, 4, 5, 6, 7, 8)
"""Seat counts tried in order when a game is first used; the first the game accepts is its seat count."""
MAX_STEPS = 1000
"""A game still running after this many steps ends as a draw (TextArena bounds most games itself)."""
GAME_ID = -1
"""TextArena's sender id of the referee's own messages."""
UNPROCESSABLE = "unprocessable"
"""The action tag of a text on which TextArena's step raised (its ``move`` tag otherwise)."""

_LOCK = threading.RLock()
_OPTION = re.compile(r"\[[^\[\]\n]{1,80}\]")
_QUOTED_OPTION = re.compile(r"(?<=')\[[^\[\]\n]{1,80}\](?=')")
_NLTK_DIRS = ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment", "stemmers", "grammars")


def textarena() -> ModuleType:
    """The ``textarena`` package, imported on first use; a RepertoryError says how to install it."""
    state = random.getstate()  # importing TextArena (rich, at import time) draws from the global generator
    try:
        import textarena as ta
    except ImportError as exc:
        raise RepertoryError(f"TextArena games need the textarena package ({exc}); install it with {INSTALL}") from None
    finally:
        random.setstate(state)
    return ta


def _registry() -> dict[str, Any]:
    return textarena().envs.registration.ENV_REGISTRY


class _Record:
    """What TextArena reported during one call: observations as (recipient or -1, sender, text, type),
    invalid moves as (player, reason), and NLTK data it asked for that this machine lacks."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, int, str, str]] = []
        self.invalid: list[tuple[int, str]] = []
        self.missing: list[str] = []


@cache
def _state_methods() -> tuple[tuple[type, str, Callable[..., Any]], ...]:
    """The TextArena state methods that report observations and invalid moves, with their originals."""
    ta = textarena()
    classes, todo = [], [ta.State]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    found = [(ta.State, "add_observation", ta.State.add_observation)]
    found += [(c, "set_invalid_move", vars(c)["set_invalid_move"]) for c in classes if "set_invalid_move" in vars(c)]
    return tuple(found)


def _nltk_installed(package: str) -> bool:
    import nltk

    for folder in _NLTK_DIRS:
        try:
            nltk.data.find(f"{folder}/{package}")
            return True
        except LookupError:
            continue
    return False


class _Muted:
    """Standard output that drops what the thread holding the TextArena lock writes (the games' debugging
    prints) and passes every other thread's writes through."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.owner = threading.get_ident()

    def write(self, text: str) -> int:
        return len(text) if threading.get_ident() == self.owner else self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def _recorded(record: _Record) -> Iterator[None]:
    """Record the state methods' reports into ``record``, stand in for ``nltk.download`` (which would reach
    the network, or hang where it is blocked) with a check of what is installed, and keep the games' debugging
    prints off stdout (which carries ``repertory play --json``)."""

    def observed(original: Callable[..., Any]) -> Callable[..., Any]:
        def add_observation(state: Any, message: str, observation_type: Any, from_id: int = -1, to_id: int = -1):
            original(state, message=message, observation_type=observation_type, from_id=from_id, to_id=to_id)
            # The stored copy, after TextArena's own filtering of role tags out of player messages. Some games
            # pass the arguments out of order; what they send is kept, as text from the referee.
            stored = state.observations[0 if to_id == -1 else to_id][-1][1]
            kind = getattr(observation_type, "name", "GAME_MESSAGE")
            sender = from_id if isinstance(from_id, int) else GAME_ID
            record.messages.append((to_id, sender, str(stored), kind))

        return add_observation

    def refused(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_invalid_move(state: Any, *args: Any, **kwargs: Any) -> Any:
            # Some games pass (reward, reason) in that order: the reason is the text among the arguments.
            texts = [a for a in (kwargs.get("reason"), *args) if isinstance(a, str) and a.strip()]
            record.invalid.append((state.current_player_id, texts[0] if texts else "invalid move"))
            return original(state, *args, **kwargs)

        return set_invalid_move

    def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        wanted = [info_or_id] if isinstance(info_or_id, str) else list(info_or_id or [])
        lacking = [p for p in wanted if isinstance(p, str) and not _nltk_installed(p)]
        record.missing += [p for p in lacking if p not in record.missing]
        return not lacking

    try:
        import nltk
    except ImportError:
        nltk = None
    methods = _state_methods()
    for cls, name, original in methods:
        setattr(cls, name, (observed if name == "add_observation" else refused)(original))
    saved_download = nltk.download if nltk is not None else None
    if nltk is not None:
        nltk.download = download
    try:
        with redirect_stdout(_Muted(sys.stdout)):
            yield
    finally:
        for cls, name, original in methods:
            setattr(cls, name, original)
        if nltk is not None:
            nltk.download = saved_download


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


class _Randomness:
    """A game's own states of ``random`` and ``numpy.random``, as plain tuples (so that copies compare)."""

    def __init__(self, seed: int) -> None:
        self.python = random.Random(seed).getstate()
        self.numpy: tuple[Any, ...] | None = None
        np_random = _numpy_random()
        if np_random is not None:
            self.numpy = _plain(np_random.RandomState(seed % 2**32).get_state(legacy=True))

    @contextmanager
    def active(self) -> Iterator[None]:
        """Swap this game's random states in for the duration, and keep what the game drew."""
        np_random = _numpy_random()
        outer, np_outer = random.getstate(), np_random.get_state() if np_random is not None else None
        random.setstate(self.python)
        if np_random is not None and self.numpy is not None:
            np_random.set_state(self.numpy)
        try:
            yield
        finally:
            self.python = random.getstate()
            random.setstate(outer)
            if np_random is not None:
                self.numpy = _plain(np_random.get_state(legacy=True))
                np_random.set_state(np_outer)


def _plain(state: tuple[Any, ...]) -> tuple[Any, ...]:
    name, keys, pos, has_gauss, cached = state
    return (name, tuple(keys.tolist()), pos, has_gauss, cached)


def _call(randomness: _Randomness, fn: Callable[[], Any]) -> tuple[Any, _Record]:
    """``fn()`` under the lock, with the game's random states and the state methods recorded."""
    record = _Record()
    with _LOCK, randomness.active(), _recorded(record):
        result = fn()
    return result, record


def _construct(env_id: str) -> Any:
    """TextArena's game for ``env_id``, without the wrappers ``textarena.make`` adds."""
    spec = _registry()[env_id]
    entry = spec.entry_point
    if isinstance(entry, str):
        module, attr = entry.split(":")
        entry = getattr(importlib.import_module(module), attr)
    game = entry(**spec.kwargs)
    game.env_id = env_id
    return game


def _open(env_id: str, num_players: int, seed: int) -> tuple[Any, _Randomness, _Record]:
    """A freshly reset game, its random states and what the reset reported. A game that cannot run on this
    machine is a RepertoryError; other failures of the reset (a seat count the game refuses) propagate."""
    randomness, record = _Randomness(seed), _Record()
    with _LOCK, randomness.active(), _recorded(record):
        try:
            game = _construct(env_id)
        except Exception as exc:
            raise _unavailable(env_id, exc, record) from None
        try:
            game.reset(num_players=num_players, seed=seed)
        except (LookupError, ImportError, OSError) as exc:  # NLTK's missing data is a LookupError
            raise _unavailable(env_id, exc, record) from None
    if record.missing:
        raise _unavailable(env_id, None, record)
    return game, randomness, record


def _unavailable(env_id: str, exc: Exception | None, record: _Record) -> RepertoryError:
    """Why a game cannot run here, in words."""
    spec = f"{PREFIX}{env_id}"
    if record.missing or type(exc) is LookupError:
        missing = " ".join(record.missing) or "PACKAGE"
        return RepertoryError(
            f"{spec} does not run offline: it needs NLTK data that is not installed ({missing}), which TextArena "
            f"downloads at run time and repertory never does; download it once with python -m nltk.downloader "
            f"{missing} (needs the network)"
        )
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename.rsplit('site-packages/', 1)[-1]}, line {exc.lineno}" if exc.filename else "?"
        return RepertoryError(
            f"{spec}: TextArena's code for this game does not compile on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({exc.msg}; {where}); it needs a newer Python"
        )
    if isinstance(exc, ImportError):
        return RepertoryError(f"{spec} needs a package that is not installed: {exc}")
    if isinstance(exc, FileNotFoundError):
        return RepertoryError(f"{spec}: the installed TextArena lacks a file the game reads ({exc})")
    if isinstance(exc, OSError):
        return RepertoryError(f"{spec} does not run offline: it needs the network ({exc})")
    return RepertoryError(f"{spec}: TextArena cannot build the game here: {type(exc).__name__}: {exc}")


def _seat_count(env_id: str) -> int:
    """The first seat count of PLAYER_COUNTS the game starts with (seed 0)."""
    first: Exception | None = None
    for n in PLAYER_COUNTS:
        try:
            _open(env_id, n, 0)
        except RepertoryError:
            raise
        except Exception as exc:
            first = first or exc
            continue
        return n
    raise RepertoryError(
        f"{PREFIX}{env_id} does not start with any of {', '.join(map(str, PLAYER_COUNTS))} players "
        f"(with {PLAYER_COUNTS[0]}: {type(first).__name__}: {first})"
    )


@cache
def textarena_env(name: str) -> type[TextArenaGame]:
    """The environment class of ``textarena:<EnvId>`` (built once; the game is started once to learn its seat
    count and to check that it runs here). Unknown ids name the closest TextArena ids."""
    env_id = name.removeprefix(PREFIX)
    registry = _registry()
    if env_id not in registry:
        lowered = {i.lower(): i for i in registry}
        close = [lowered[m] for m in difflib.get_close_matches(env_id.lower(), list(lowered), n=5, cutoff=0.6)]
        examples = "TicTacToe-v0, KuhnPoker-v0, SimpleNegotiation-v0"
        hint = f"did you mean {', '.join(close)}?" if close else f"TextArena has {len(registry)} ids, e.g. {examples}"
        raise RepertoryError(f"unknown TextArena environment {env_id!r}; {hint}")
    if "/" in env_id:
        raise RepertoryError(f"{name}: ids with '/' cannot name kernels (env/split/index); use another variant")
    n = _seat_count(env_id)
    roles = tuple(f"Player {i}" for i in range(n))
    attrs = {
        "name": name,
        "env_id": env_id,
        "num_players": n,
        "description": f"TextArena's {env_id} ({n} player{'s' * (n != 1)}), played on TextArena's own rules.",
        "roles": roles,
        "role_labels": tuple(f"player_{i}" for i in range(n)),
        "default_trained_role": roles[0],
        "__module__": __name__,
    }
    return type(f"TextArena_{re.sub(r'[^0-9A-Za-z]', '_', env_id)}", (TextArenaGame,), attrs)


def _options(view: dict[str, Any]) -> list[str]:
    """The moves of the latest referee message that offers some, else of the prompt: TextArena quotes the
    moves it offers ('[4]', '[check]'); bare brackets count where no text quotes any."""
    texts = [*reversed(view["game_messages"]), view["prompt"]]
    for pattern in (_QUOTED_OPTION, _OPTION):
        for text in texts:
            found = pattern.findall(text)
            if found:
                return found
    return ["[pass]"]


def random_option(view: dict[str, Any]) -> str:
    """A seeded random pick among the bracketed moves the referee offered last (see ``_options``)."""
    rng = random.Random(derive(view["kernel_id"], view["episode_seed"], "random-option", view["seat"], view["turn"]))
    return rng.choice(_options(view))


def first_option(view: dict[str, Any]) -> str:
    """The first bracketed move the referee offered last."""
    return _options(view)[0]


class TextArenaGame(Env):
    """One TextArena game behind repertory's interface; :func:`textarena_env` makes the subclass of an id."""

    env_id: ClassVar[str]
    num_players: ClassVar[int]
    bots: ClassVar[dict[str, Bot]] = {"first-option": first_option, "random-option": random_option}

    def __init__(self) -> None:
        super().__init__()
        self._game: Any = None
        self._randomness: _Randomness | None = None
        self._prompts: dict[str, str] = {}
        self._opening: _Record = _Record()
        self._heard: dict[str, list[str]] = {}
        self._game_messages: dict[str, list[str]] = {}
        self._steps = 0
        self._over = False
        self._reason = ""
        self._rewards: dict[str, float] = {}

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"env_id": cls.env_id, "num_players": cls.num_players, "game_seed": rng.randrange(2**31)}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        problems = []
        if data.get("env_id") != cls.env_id:
            problems.append(f"env_id must be {cls.env_id!r}")
        if data.get("num_players") != cls.num_players:
            problems.append(f"num_players must be {cls.num_players}")
        seed = data.get("game_seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            problems.append("game_seed must be a non-negative integer")
        return problems

    def reset(self, kernel: Kernel, episode_seed: int) -> None:
        """Start TextArena's game on the kernel's seed (the same game for every episode of a kernel), then
        the bookkeeping; the system prompts are TextArena's, so the game starts first."""
        if kernel.env == self.name and not self.validate_kernel(kernel.data):
            self._game, self._randomness, self._opening = _open(self.env_id, self.num_players, kernel.data["game_seed"])
            self._prompts = {
                role: "\n".join(text for to, _, text, kind in self._opening.messages if kind == "PROMPT" and to == i)
                or f"You are {role} in TextArena's {self.env_id}."
                for i, role in enumerate(self.roles)
            }
        super().reset(kernel, episode_seed)

    def _start(self) -> None:
        self._heard = {r: [] for r in self.roles}
        self._game_messages = {r: [] for r in self.roles}
        self._steps = 0
        self._over = False
        self._reason = ""
        self._rewards = {}
        self._deliver(self._opening.messages, opening=True)
        self._clear_observations()

    def system_prompt(self, role: str) -> str:
        return self._prompts[role]

    @property
    def done(self) -> bool:
        return self._over

    def acting_roles(self) -> list[str]:
        return [] if self._over else [self.roles[self._game.state.current_player_id]]

    def parse(self, role: str, text: str) -> Parsed:
        """Play ``text`` on a copy of the game: TextArena alone knows whether it accepts a move."""
        move = clean(text, self.max_chars(role))
        game, randomness = copy.deepcopy((self._game, self._randomness))
        try:
            _, record = _call(randomness, lambda: game.step(move))
        except Exception as exc:  # a TextArena bug on odd text: the move is refused, not the episode lost
            return Parsed(Action(UNPROCESSABLE, move), f"TextArena could not process the move ({exc!r})", invalid=True)
        refused = [reason for player, reason in record.invalid if player == self.seat_index(role)]
        return Parsed(Action("move", move), refused[0], invalid=True) if refused else Parsed(Action("move", move))

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        (role,) = parsed
        move = parsed[role].action.value  # type: ignore[union-attr]
        seat = self.seat_index(role)
        if parsed[role].action.tag == UNPROCESSABLE:  # type: ignore[union-attr]
            # Stepping would fail half-way through the game's update; TextArena's usual penalty applies instead.
            _, record = _call(self._randomness, lambda: self._refuse(parsed[role].error or "invalid move"))  # type: ignore[arg-type]
        else:
            _, record = _call(self._randomness, lambda: self._game.step(move))  # type: ignore[arg-type]
        self._steps += 1
        self._deliver(record.messages)
        self._clear_observations()
        events = [f"{role}'s move was refused: {r}" for p, r in record.invalid if p == seat]
        events += [text for to, sender, text, _ in record.messages if to == -1 and sender == GAME_ID]
        if self._game.state.done:
            # Ended by an invalid move only if this step's own move was refused: in free-for-all games an
            # earlier refusal eliminates a player and the game goes on.
            ended_by_invalid = any(p == seat for p, _ in record.invalid)
            return self._finish(parsed, events, "invalid_move" if ended_by_invalid else "game_over")
        if self._steps >= MAX_STEPS:
            return self._finish(parsed, events, "step_limit")
        return StepResult(parsed, {}, events)

    def _refuse(self, reason: str) -> None:
        self._game.state.set_invalid_move(reason=reason)
        self._game.state.step()

    def _finish(self, parsed: dict[str, Parsed], events: list[str], end_reason: str) -> StepResult:
        """End the episode: TextArena's rewards (none at the step limit: a draw) become points and outcomes."""
        self._over = True
        self.end_reason = end_reason
        state = self._game.state
        given = (state.rewards or {}) if end_reason != "step_limit" else {}
        info = getattr(state, "game_info", {}) or {}
        reasons = [str(v.get("reason")) for v in info.values() if isinstance(v, dict) and v.get("reason")]
        self._reason = "; ".join(dict.fromkeys(reasons)) or (
            f"stopped after {MAX_STEPS} steps" if end_reason == "step_limit" else "the game is over"
        )
        rewards = {}
        for i, role in enumerate(self.roles):
            raw = given.get(i, 0.0)
            # A game that garbles its rewards (those swapping set_invalid_move's arguments) scores a loss.
            raw = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else -1.0
            self._rewards[role] = raw
            self.points[role] = Fraction(raw)
            rewards[role] = self.outcome(role)
            self.tell(role, f"[GAME] The game is over: {self._reason} Your reward: {raw:g}.")
        return StepResult(parsed, rewards, [*events, f"game over: {self._reason}"])

    def outcome(self, role: str) -> float:
        """TextArena's final reward mapped to [0, 1]. Games of several players pay -1, 0, 1 (loss, draw, win), so
        the outcome is ``(reward + 1) / 2``; one-player puzzles pay their progress in [0, 1] (solved 1, failed 0)
        and -1 for losing on invalid moves, so the outcome is the progress, 0 for that loss."""
        if not self._over:
            return 0.0
        reward = self._rewards.get(role, 0.0)
        scaled = reward if self.num_players == 1 else (reward + 1.0) / 2.0
        return min(1.0, max(0.0, scaled))

    def result(self) -> Result:
        """The episode's result; ``info["reason"]`` is TextArena's account of how the game ended."""
        result = super().result()
        result.info["reason"] = self._reason
        result.info["textarena_rewards"] = dict(self._rewards)
        return result

    def metrics(self) -> dict[str, float]:
        return {
            "game_steps": float(self._steps),
            "invalid_end": float(self.end_reason == "invalid_move"),
            "draw": float(self._over and len(self.roles) > 1 and len(set(self._rewards.values())) == 1),
        }

    def view(self, role: str) -> dict[str, Any]:
        return {
            **self._base_view(role),
            "turn": self.n_turns[role],
            "prompt": self._prompts[role],
            "messages": list(self._heard[role]),
            "game_messages": list(self._game_messages[role]),
        }

    def _deliver(self, messages: list[tuple[int, int, str, str]], opening: bool = False) -> None:
        """Tell each recipient the recorded messages, as TextArena's LLM wrapper labels them; the opening prompts
        are the system prompts, and the author's own move comes back from TextArena too, and is dropped (it is
        already the seat's assistant message)."""
        mapping = self._game.state.role_mapping
        for to, sender, text, kind in messages:
            if opening and kind == "PROMPT":
                continue
            label = "GAME" if sender == GAME_ID else mapping.get(sender, f"Player {sender}")
            content = f"[{label}] {text}"
            for i, role in enumerate(self.roles):
                if to not in (-1, i) or (sender == i and kind == "PLAYER_ACTION"):
                    continue
                self.tell(role, content, "" if to == -1 else "private")
                self._heard[role].append(content)
                if sender == GAME_ID:
                    self._game_messages[role].append(text)

    def _clear_observations(self) -> None:
        # Delivered through the record already; TextArena would otherwise keep every message for good.
        for pending in self._game.state.observations.values():
            pending.clear()

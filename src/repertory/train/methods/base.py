"""What a training method is: a registered class with its own config (``method.kind``), its own state, and the
small context it works in, never the trainer.

Online methods (:class:`OnlineMethod`) assign advantages to each iteration's scored batch; the trainer rolls out
and runs the learner's update. Round methods (:class:`RoundMethod`) improve the policy offline from a round's
logged turns through a :class:`RoundContext`: the learner, a sampler of fresh responses at logged states, the run
directory and the seed. A checkpoint is the learner's state plus each method's :meth:`Method.save`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from pydantic import BaseModel

from repertory.config import METHOD_CONFIGS, AlgoConfig, CriticConfig, MethodConfig, method_kind, register_method_config
from repertory.envs import Env
from repertory.envs.grammar import GRAMMAR, TurnGrammar, turn_grammar
from repertory.envs.replay import replay
from repertory.generation import Backend, Generation, GenerationRequest, SamplingParams, TokenTrie
from repertory.models import LoadedModel
from repertory.runs import RunDir
from repertory.store import read_episodes
from repertory.store.turns import LoggedTurn
from repertory.train.batch import Batch
from repertory.train.learner import Learner
from repertory.train.turns import read_turns
from repertory.types import Episode, Registry, RepertoryError, derive

if TYPE_CHECKING:
    from repertory.agents.lm import LMAgent
    from repertory.train.pool import OpponentPool


class Method:
    """A training method: ``kind`` names it in ``method.kind``; an instance holds its config and its state."""

    kind: ClassVar[str]
    online: ClassVar[bool]

    def __init__(self, config: Any, seed: int):
        self.config = config
        self.seed = seed

    @property
    def needs_critic(self) -> bool:
        """Whether the learner carries a value model for this method."""
        return False

    @property
    def critic_settings(self) -> CriticConfig:
        """The learner's value model's settings (read only when :attr:`needs_critic`)."""
        return getattr(self.config, "critic", None) or CriticConfig()

    @property
    def gamma(self) -> float:
        """gamma of the held-out expected discounted return J: the method's discount per agent turn."""
        return float(self.config.gamma)

    def opponents(self, peft: Any, run_dir: RunDir, live: LMAgent) -> OpponentPool | None:
        """The method's own opponents for the seats the live policy does not train (``rollout.opponent: pool``):
        none unless the method keeps them."""
        return None

    def save(self, directory: Path) -> None:
        """Write the method's own state (besides the learner's) into a checkpoint directory."""

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""


class OnlineMethod(Method):
    """Rollout and update every iteration; the method turns the scored batch's rewards into advantages."""

    online = True

    def credit(self, batch: Batch, algo: AlgoConfig) -> dict[str, float]:
        """Assign every trained sample of the scored ``batch`` its advantages (and critic targets); the metrics."""
        raise NotImplementedError


class Candidates(NamedTuple):
    """Fresh responses at logged states (a state's ``n`` one after the other), each state's replayed referee
    (None without its conversation) and the grammar its responses were sampled under, and are scored under
    (``TurnGrammar.dumps``; None: free text or a trie)."""

    generations: list[Generation]
    replayed: list[tuple[Env, str] | None]
    grammars: list[str | None]


@dataclass
class RoundContext:
    """What a round method may use while it improves the policy offline: the learner, the sampler of the live
    policy (fresh responses at logged states), the run directory, the seed and the learner's settings."""

    learner: Learner
    backend: Backend
    params: SamplingParams
    constrained: bool | str
    run_dir: RunDir
    seed: int
    algo: AlgoConfig
    tokenizer: Any
    gamma: float
    publish: Callable[[], None]
    write_credit: Callable[[int, Batch], None]

    def history(
        self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> tuple[list[LoggedTurn], dict[str, Episode]]:
        """Every round's logged turns and deployed conversations up to this one (read back from the run)."""
        all_turns, all_episodes = [], {}
        for k in range(round_index):
            if self.run_dir.turns(k).is_file():
                all_turns += read_turns(self.run_dir.turns(k), self.tokenizer, self.gamma)
            deployed = self.run_dir.episodes(k)
            if deployed.is_file():
                all_episodes.update({ep.episode_id: ep for ep in read_episodes(deployed)})
        return all_turns + turns, {**all_episodes, **episodes}

    def sample(self, states: list[LoggedTurn], episodes: dict[str, Episode], n: int, key: tuple) -> Candidates:
        """``n`` fresh responses of the live policy per logged state, sampled as deployed: under the state's
        grammar (``rollout.constrained: grammar``), or constrained to its valid actions where
        ``rollout.constrained`` is true and the action set is finite."""
        replayed = [
            replay(episodes[x.episode_id], x.seat_id, x.t) if x.episode_id in episodes else None for x in states
        ]
        grammars = [self._sampling_grammar(x, state) for x, state in zip(states, replayed)]
        rows = [
            GenerationRequest(
                x.prompt_ids,
                derive(self.seed, *key, x.episode_id, x.t, c, "sample"),
                TurnGrammar.loads(grammar) if grammar is not None else self._trie(state),
            )
            for x, state, grammar in zip(states, replayed, grammars)
            for c in range(n)
        ]
        return Candidates(self.backend.generate(rows, self.params), replayed, grammars)

    def grammar(self, logged: LoggedTurn) -> str | None:
        """The grammar a logged response is scored under: the one it was sampled under, where the run deploys
        under grammars (users' logged turns have none: they are scored unmasked)."""
        return logged.grammar if self.constrained == GRAMMAR else None

    def _sampling_grammar(self, logged: LoggedTurn, state: tuple[Env, str] | None) -> str | None:
        """The grammar fresh responses at a logged state are sampled under: the one the state was deployed under,
        else (a turn from logs) its replayed referee's; None outside ``rollout.constrained: grammar``, in a
        talk-only phase, or for a state without its conversation."""
        if self.constrained != GRAMMAR or logged.grammar is not None or state is None:
            return self.grammar(logged)
        env, role = state
        syntax = env.action_syntax(role)
        return turn_grammar(syntax, self.params.max_new_tokens, env.max_chars(role)).dumps() if syntax else None

    def _trie(self, state: tuple[Env, str] | None) -> TokenTrie | None:
        """The trie of the state's valid actions, where ``rollout.constrained`` is true and they are finite."""
        if state is None or self.constrained is not True:
            return None
        env, role = state
        choices = env.action_choices(role)
        return self.backend.constraint(choices) if choices is not None else None


class RoundMethod(Method):
    """Improve the policy offline from one deployment round's log (docs/algorithms.md 5-6)."""

    online = False

    def __init__(self, config: Any, seed: int, initial: LoadedModel, device: str | None):
        """``initial`` is the policy before any adapter (a method's critic copies it); ``device`` the model's."""
        super().__init__(config, seed)

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        """The round's offline policy improvement; its metrics."""
        raise NotImplementedError


METHODS: Registry[type[Method]] = Registry("method")
M = TypeVar("M", bound=type[Method])


def register_method(config: type[BaseModel]) -> Callable[[M], M]:
    """Class decorator ``@register_method(ItsConfig)``: the method of the kind ``ItsConfig`` names, which joins the
    ``method`` section unless it is a built-in config (a round method's extends ``RoundMethodConfig``)."""
    kind = method_kind(config)

    def decorate(cls: M) -> M:
        if kind in METHODS:
            raise RepertoryError(f"method {kind!r} is already registered")
        if METHOD_CONFIGS.get(kind) is not config:
            register_method_config(config)
        cls.kind = kind
        return METHODS.add(kind, cls)

    return decorate


def build_method(config: MethodConfig, seed: int, initial: LoadedModel, device: str | None) -> Method:
    """The registered method of ``config.kind``, with its own modules built (before the learner wraps the model)."""
    cls = METHODS[config.kind]
    if issubclass(cls, RoundMethod):
        return cls(config, seed, initial, device)
    return cls(config, seed)


def chunks(items: list[int], size: int) -> Iterator[list[int]]:
    """Consecutive slices of ``items`` of at most ``size`` (the optimiser batches of the round methods)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Laps:
    """Seconds a round spends in each named part (``time/{name}_s``), summed over the times it is entered: where a
    round method's time goes, beside the trainer's ``time/train_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": seconds for name, seconds in self.seconds.items()}

"""The rollout engine: many episodes at once, one batched call per agent per tick.

Each tick gathers the pending requests of every acting seat of every running episode, groups
them by agent, calls each agent once, then steps every episode with its answers. In self-play
one agent fills every seat, so one call (one forward pass of a model) serves all roles of all
episodes. Each episode owns its environment instance; nothing is shared between episodes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from repertory.agents import Agent, Request, Response, is_model
from repertory.envs import Env, env_class, load_kernels, make
from repertory.types import Episode, Judge, Kernel, Message, RepertoryError, Seat, Turn, derive


@dataclass
class EpisodeSpec:
    """One episode to play: environment, kernel, seed and the agent of each seat (in seat order)."""

    episode_id: str
    env: str
    kernel: Kernel
    episode_seed: int
    agents: list[Agent]
    group_id: str = ""
    iteration: int = 0
    trainable: list[bool] = field(default_factory=list)
    guarded: list[bool] = field(default_factory=list)
    env_options: dict[str, Any] = field(default_factory=dict)


GUARD_RESAMPLES = 2


class _Running:
    """Live state of one episode inside the engine."""

    def __init__(self, spec: EpisodeSpec, judge: Judge | None = None):
        self.env = make(spec.env, **spec.env_options)
        self.env.reset(spec.kernel, spec.episode_seed)
        n = len(self.env.roles)
        if len(spec.agents) == len(type(self.env).roles) > n:
            # A line-up for the game's most seats: a smaller scenario seats its first n agents.
            spec = replace(spec, agents=spec.agents[:n], trainable=spec.trainable[:n], guarded=spec.guarded[:n])
        if len(spec.agents) != n:
            raise RepertoryError(
                f"{spec.env} has {n} seats ({', '.join(self.env.roles)}), but {len(spec.agents)} agents were given"
            )
        if self.env.needs_judge and judge is None:
            raise RepertoryError(
                f"{spec.env}: the reward {spec.env_options.get('reward')!r} needs a judge (judge: in the config, "
                "--judge on the command line), or use reward verifiable"
            )
        self.spec = spec
        self.chats: dict[str, list[Message]] = {r: [] for r in self.env.roles}
        self.turns: list[Turn] = []
        self.last_turn: dict[str, Turn] = {}
        self.unattached: dict[str, float] = {}
        self.guard_counts = {"guard/resampled": 0, "guard/stripped": 0}
        self.tick = 0

    def guarded(self, role: str) -> bool:
        """Whether the partner guard (docs/environments.md 1.6) watches this role's seat."""
        seat = self.env.seat_index(role)
        return bool(self.spec.guarded) and self.spec.guarded[seat]

    def requests(self) -> list[tuple[Agent, Request]]:
        out = []
        for role in self.env.acting_roles():
            seat = self.env.seat_index(role)
            self.chats[role].extend(self.env.observe(role))
            request = Request(
                self.spec.episode_id,
                seat,
                role,
                list(self.chats[role]),
                self.env.view(role),
                turn_index=self.env.n_turns[role],
                choices=self.env.action_choices(role),
                max_chars=self.env.max_chars(role),
            )
            out.append((self.spec.agents[seat], request))
        return out

    def step(self, answers: dict[str, tuple[Request, Response]]) -> list[Turn]:
        """Apply the tick's answers; returns the turns they made, in seat order of the answers."""
        game_round = self.env.game_round
        made = []
        texts = {role: response.text for role, (_, response) in answers.items()}
        result = self.env.step(texts)
        for role, (request, response) in answers.items():
            seat = request.seat
            parsed = result.parsed[role]
            turn = Turn(
                seat_id=f"p{seat}",
                turn_index=request.turn_index,
                global_step=self.tick,
                game_round=game_round,
                observation=request.observation,
                text=response.text,
                action=parsed.action,
                error=parsed.error,
                invalid=parsed.invalid,
                finish=response.finish,
                prompt_ids=list(response.prompt_ids),
                response_ids=list(response.response_ids),
                logp_sample=list(response.logp_sample),
                policy_version=response.policy_version,
                reward=self.unattached.pop(role, 0.0),
            )
            self.turns.append(turn)
            made.append(turn)
            self.last_turn[role] = turn
            self.chats[role].append(Message("assistant", response.text))
        for role, reward in result.rewards.items():
            if role in self.last_turn:
                self.last_turn[role].reward += reward
            else:
                # A reward before a seat's first turn lands on that turn; a seat that never acts has
                # no trajectory, and its score lives in the result alone.
                self.unattached[role] = self.unattached.get(role, 0.0) + reward
        self.tick += 1
        return made

    def episode(self) -> Episode:
        env, spec = self.env, self.spec
        trainable = spec.trainable or [False] * len(env.roles)
        seats = [
            Seat(f"p{i}", name, env.role_labels[i], agent.name, agent.policy_id, trainable[i])
            for i, (name, agent) in enumerate(zip(env.roles, spec.agents))
        ]
        return Episode(
            episode_id=spec.episode_id,
            env=spec.env,
            kernel=spec.kernel,
            episode_seed=spec.episode_seed,
            seats=seats,
            turns=self.turns,
            result=env.result(),
            metrics={**env.metrics(), **(self.guard_counts if any(spec.guarded) else {})},
            final_observations={f"p{env.seat_index(r)}": env.observe(r) for r in env.roles},
            group_id=spec.group_id,
            iteration=spec.iteration,
        )


def run_episodes(
    specs: Iterable[EpisodeSpec],
    max_concurrent: int = 256,
    on_episode: Callable[[Episode], None] | None = None,
    judge: Judge | None = None,
    on_turn: Callable[[EpisodeSpec, Turn], None] | None = None,
) -> list[Episode]:
    """Play every spec, up to ``max_concurrent`` at a time; episodes come back in spec order. With a ``judge``,
    the episodes that finish in a tick are scored in one call before they are returned. ``on_turn`` sees each
    turn as soon as the referee has applied it (its reward may still grow: later rewards land on a seat's last
    turn); ``on_episode`` each finished episode."""
    if max_concurrent < 1:
        raise RepertoryError("max_concurrent must be at least 1")
    pending: Iterator[tuple[int, EpisodeSpec]] = enumerate(specs)
    running: dict[int, _Running] = {}
    finished: dict[int, Episode] = {}
    exhausted = False
    while running or not exhausted:
        while not exhausted and len(running) < max_concurrent:
            nxt = next(pending, None)
            if nxt is None:
                exhausted = True
            else:
                running[nxt[0]] = _Running(nxt[1], judge)
        by_agent: dict[int, tuple[Agent, list[tuple[int, Request]]]] = {}
        for index, run in running.items():
            for agent, request in run.requests():
                by_agent.setdefault(id(agent), (agent, []))[1].append((index, request))
        answers: dict[int, dict[str, tuple[Request, Response]]] = {i: {} for i in running}
        for agent, batch in by_agent.values():
            for (index, request), response in zip(batch, _act(agent, [request for _, request in batch])):
                answers[index][request.role] = (request, response)
        _guard(running, by_agent, answers)
        for index in list(running):
            if answers[index]:
                for turn in running[index].step(answers[index]):
                    if on_turn is not None:
                        on_turn(running[index].spec, turn)
        done = [i for i in running if running[i].env.done]
        if judge is not None:
            _judge([running[i] for i in done], judge)
        for index in done:
            episode = running.pop(index).episode()
            finished[index] = episode
            if on_episode is not None:
                on_episode(episode)
    return [finished[i] for i in sorted(finished)]


def _judge(runs: list[_Running], judge: Judge) -> None:
    """One judge call for the scoring requests of every episode that finished this tick; the rewards of the
    verdicts land on each seat's last turn."""
    asked = [(run, run.env.judge_requests(judge.fine_grained)) for run in runs]
    asked = [(run, requests) for run, requests in asked if requests]
    if not asked:
        return
    verdicts = iter(judge.score([r for _, requests in asked for r in requests]))
    for run, requests in asked:
        rewards = run.env.judged([next(verdicts) for _ in requests])
        for role, reward in rewards.items():
            if role in run.last_turn:
                run.last_turn[role].reward += reward


def agent_seats(env: type[Env], kernel: Kernel, index: int) -> list[int]:
    """The seats one agent facing an opponent takes in game ``index``: the trained seat where the game fixes
    one (negotiations); in a team game every seat of team ``index`` mod teams (on ``kernel``'s deal);
    elsewhere seat ``index`` mod seats. Consecutive games thus cover every seat or team in turn."""
    if env.fixed_seat:
        return [env.roles.index(env.default_trained_role)]
    if env.teams:
        team = env.teams[index % len(env.teams)]
        return [s for s, t in enumerate(env.seat_teams(kernel.data)) if t == team]
    return [index % len(env.seat_names(kernel.data))]


def guarded_seats(env: type[Env], agents: list[Agent], trained: Collection[int]) -> list[bool]:
    """The seats the partner guard watches (docs/environments.md 1.6): in games with a private limit to
    protect, every seat but the trained ones that a model fills; never a bot, script or person."""
    if not env.guarded_limit:
        return []
    return [seat not in trained and is_model(agent) for seat, agent in enumerate(agents)]


def _act(agent: Agent, requests: list[Request]) -> list[Response]:
    responses = agent.act(requests)
    if len(responses) != len(requests):
        raise RuntimeError(f"agent {agent.name} answered {len(responses)} of {len(requests)} requests")
    return responses


def _guard(
    running: dict[int, _Running],
    by_agent: dict[int, tuple[Agent, list[tuple[int, Request]]]],
    answers: dict[int, dict[str, tuple[Request, Response]]],
) -> None:
    """The partner guard: a guarded seat whose answer breaks its private limit is asked again, up to
    ``GUARD_RESAMPLES`` times (batched per agent); then the offending tags are deleted and the rest
    is sent as a plain message, with no token record (it is not what the model sampled)."""
    for attempt in range(1, GUARD_RESAMPLES + 2):
        again: dict[int, tuple[Agent, list[tuple[int, Request]]]] = {}
        for agent, batch in by_agent.values():
            for index, request in batch:
                run = running[index]
                if not run.guarded(request.role):
                    continue
                stripped = run.env.guard(request.role, answers[index][request.role][1].text)
                if stripped is None:
                    continue
                if attempt > GUARD_RESAMPLES:
                    run.guard_counts["guard/stripped"] += 1
                    answers[index][request.role] = (request, Response(stripped, finish="guarded"))
                else:
                    run.guard_counts["guard/resampled"] += 1
                    retry = replace(request, attempt=attempt)
                    again.setdefault(id(agent), (agent, []))[1].append((index, retry))
        if not again:
            return
        for agent, batch in again.values():
            for (index, request), response in zip(batch, _act(agent, [request for _, request in batch])):
                answers[index][request.role] = (answers[index][request.role][0], response)
        by_agent = again


def schedule(
    env: str,
    agents: list[Agent],
    episodes: int,
    seed: int,
    split: str = "train",
    kernel_index: int | None = None,
    iteration: int = 0,
    env_options: dict[str, Any] | None = None,
) -> list[EpisodeSpec]:
    """Episodes of ``env`` with the same line-up: kernels drawn without replacement per pass
    through the split (shuffled by ``seed``), or all on ``kernel_index``; seeds derived from ``seed``.
    ``env_options`` are the game's options (and may define its kernels: a user's social scenarios).
    """
    cls = env_class(env)
    if episodes < 1:
        raise RepertoryError(f"the number of episodes must be at least 1 (got {episodes})")
    if len(agents) != len(cls.roles):
        raise RepertoryError(
            f"{env} needs {len(cls.roles)} agents, one per seat ({', '.join(cls.roles)}); got {len(agents)}"
        )
    kernels = load_kernels(env, split, env_options)
    if kernel_index is not None and not 0 <= kernel_index < len(kernels):
        raise RepertoryError(f"kernel index must be in 0..{len(kernels) - 1} (got {kernel_index})")
    order: list[int] = []
    shuffler = random.Random(derive(seed, iteration, "kernels", env, split))
    specs = []
    for i in range(episodes):
        if kernel_index is not None:
            k = kernel_index
        else:
            if not order:
                order = list(range(len(kernels)))
                shuffler.shuffle(order)
            k = order.pop(0)
        specs.append(
            EpisodeSpec(
                episode_id=f"{env}/s{seed}/i{iteration}/{i:05d}",
                env=env,
                kernel=kernels[k],
                episode_seed=derive(seed, iteration, i, "env"),
                agents=list(agents),
                iteration=iteration,
                env_options=dict(env_options or {}),
            )
        )
    return specs

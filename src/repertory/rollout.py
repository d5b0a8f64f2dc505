"""The rollout engine: many episodes at once, every model seat of every episode in one batch.

The pending requests of every acting seat of every running episode are grouped by agent. A language-model
agent keeps one batch in flight (continuous batching): an episode steps as soon as its acting seats have
answered, and its next requests join that batch between two decode steps, so no episode waits for another's
longest answer. Bots, scripts, people and remote models answer each batch at once. In self-play one agent
fills every seat, so each decode step (one forward pass of a model) serves all roles of all episodes.
``schedule="tick"`` instead waits for every answer before any episode steps (one batched call per agent per
tick); per-row seeds make both schedules play the same episodes. Each episode owns its environment instance;
nothing is shared between episodes.
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
        self.asked: dict[str, Request] = {}  # this step's requests, by role (the first attempt's)
        self.answers: dict[str, tuple[Request, Response]] = {}  # the accepted answers so far, by role
        self.attempts: dict[str, int] = {}  # the partner guard's new samples so far, by role

    def guarded(self, role: str) -> bool:
        """Whether the partner guard (docs/environments.md 1.6) watches this role's seat."""
        seat = self.env.seat_index(role)
        return bool(self.spec.guarded) and self.spec.guarded[seat]

    def requests(self) -> list[tuple[Agent, Request]]:
        out = []
        teams = self.env.seat_teams(self.spec.kernel.data)
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
                syntax=self.env.action_syntax(role),
                max_chars=self.env.max_chars(role),
                label=self.env.role_labels[seat],
                team=teams[seat] if teams else "",
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
                grammar=response.grammar,
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


SCHEDULES = ("continuous", "tick")
JUDGE_BATCH = 16  # finished episodes scored in one judge call under continuous scheduling


def run_episodes(
    specs: Iterable[EpisodeSpec],
    max_concurrent: int = 256,
    on_episode: Callable[[Episode], None] | None = None,
    judge: Judge | None = None,
    on_turn: Callable[[EpisodeSpec, Turn], None] | None = None,
    schedule: str = "continuous",
) -> list[Episode]:
    """Play every spec, up to ``max_concurrent`` at a time; episodes come back in spec order.

    ``schedule`` "continuous": an episode steps as soon as its acting seats have answered, and its next requests
    join the batch a model agent has in flight; "tick": every episode's requests go out together and the
    episodes step once every agent has answered them all (each tick waits for its slowest row). Both play the
    same episodes, token for token. With a ``judge``, finished episodes are scored in batched calls before they
    are returned. ``on_turn`` sees each turn as soon as the referee has applied it (its reward may still grow:
    later rewards land on a seat's last turn); ``on_episode`` each finished episode."""
    if max_concurrent < 1:
        raise RepertoryError("max_concurrent must be at least 1")
    if schedule not in SCHEDULES:
        raise RepertoryError(f"rollout.schedule must be one of {', '.join(SCHEDULES)} (got {schedule!r})")
    engine = _Engine(on_turn, drain=schedule == "tick")
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
        for run in running.values():
            if not run.asked and not run.env.done:
                engine.ask_turn(run)
        engine.send()
        engine.advance()
        done = [i for i in running if running[i].env.done]
        if judge is None or engine.drain or len(done) >= min(JUDGE_BATCH, len(running)):
            if judge is not None:
                _judge([running[i] for i in done], judge)
            for index in done:
                episode = running.pop(index).episode()
                finished[index] = episode
                if on_episode is not None:
                    on_episode(episode)
    return [finished[i] for i in sorted(finished)]


class _Engine:
    """Routes requests to agents and answers back to episodes. Agents that can ``submit`` (language models)
    keep a batch in flight that ``advance`` moves one decode step at a time (to the end under ``drain``); the
    others answer each batch at once. An episode steps when every seat it asked has an answer that the partner
    guard accepts."""

    def __init__(self, on_turn: Callable[[EpisodeSpec, Turn], None] | None, drain: bool):
        self.on_turn, self.drain = on_turn, drain
        self.outbox: dict[int, tuple[Agent, list[tuple[_Running, Request]]]] = {}
        self.in_flight: dict[int, Agent] = {}
        self.owners: dict[int, _Running] = {}  # id of a submitted request -> its episode

    def ask_turn(self, run: _Running) -> None:
        for agent, request in run.requests():
            run.asked[request.role] = request
            self.ask(run, agent, request)

    def ask(self, run: _Running, agent: Agent, request: Request) -> None:
        self.outbox.setdefault(id(agent), (agent, []))[1].append((run, request))

    def send(self) -> None:
        """Every queued request to its agent: submitted to a streaming one, answered at once by the others."""
        while self.outbox:
            batches, self.outbox = self.outbox, {}
            for agent, batch in batches.values():
                requests = [request for _, request in batch]
                if streams(agent):
                    for run, request in batch:
                        self.owners[id(request)] = run
                    agent.submit(requests)  # type: ignore[attr-defined]
                    self.in_flight[id(agent)] = agent
                    continue
                for (run, request), response in zip(batch, _act(agent, requests)):
                    self.deliver(run, request, response)

    def advance(self) -> None:
        """One decode step of every agent with rows in flight (all of them under ``drain``); answers delivered."""
        for key, agent in list(self.in_flight.items()):
            while True:
                for request, response in agent.poll():  # type: ignore[attr-defined]
                    self.deliver(self.owners.pop(id(request)), request, response)
                if not agent.busy or not self.drain:  # type: ignore[attr-defined]
                    break
            if not agent.busy:  # type: ignore[attr-defined]
                del self.in_flight[key]
        if self.drain:
            self.send()  # the partner guard's new samples, before any episode moves on
            if self.in_flight:
                self.advance()

    def deliver(self, run: _Running, request: Request, response: Response) -> None:
        run.answers[request.role] = (run.asked[request.role], response)
        if len(run.answers) < len(run.asked) or self._guard(run):
            return
        for turn in run.step(run.answers):
            if self.on_turn is not None:
                self.on_turn(run.spec, turn)
        run.asked, run.answers, run.attempts = {}, {}, {}

    def _guard(self, run: _Running) -> bool:
        """The partner guard (docs/environments.md 1.6): a guarded seat whose answer breaks its private limit is
        asked again, up to ``GUARD_RESAMPLES`` times; then the offending tags are deleted and the rest is sent as
        a plain message, with no token record (it is not what the model sampled). Whether a seat was asked again."""
        again = False
        for role, (request, response) in list(run.answers.items()):
            if not run.guarded(role) or response.finish == "guarded":
                continue
            stripped = run.env.guard(role, response.text)
            if stripped is None:
                continue
            attempt = run.attempts.get(role, 0) + 1
            if attempt > GUARD_RESAMPLES:
                run.guard_counts["guard/stripped"] += 1
                run.answers[role] = (request, Response(stripped, finish="guarded"))
                continue
            run.guard_counts["guard/resampled"] += 1
            run.attempts[role] = attempt
            del run.answers[role]
            self.ask(run, run.spec.agents[request.seat], replace(request, attempt=attempt))
            again = True
        return again


def streams(agent: Agent) -> bool:
    """Whether ``agent`` takes requests into a batch in flight (``submit``/``poll``/``busy``)."""
    return callable(getattr(agent, "submit", None))


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


def seatable(
    cls: type[Env], kernels: list[Kernel], n_agents: int, kernel_index: int | None = None, hint: str = ""
) -> list[int]:
    """The indices of the kernels ``n_agents`` agents can play: all of them with one agent per seat of the game's
    largest table; with fewer agents (a game whose kernels seat different numbers), those that seat no more.
    ``hint`` ends the message of a line-up of the wrong size."""
    seats = [len(cls.seat_names(k.data)) for k in kernels]
    fewest = min(seats)
    if not fewest <= n_agents <= len(cls.roles):
        needed = str(len(cls.roles)) if fewest == len(cls.roles) else f"{fewest} to {len(cls.roles)}"
        message = f"{cls.name} needs {needed} agents, one per seat ({', '.join(cls.roles)}); got {n_agents}"
        raise RepertoryError(message + (f"; {hint}" if hint else ""))
    if kernel_index is not None and not 0 <= kernel_index < len(kernels):
        raise RepertoryError(f"kernel index must be in 0..{len(kernels) - 1} (got {kernel_index})")
    if kernel_index is not None and seats[kernel_index] > n_agents:
        raise RepertoryError(f"kernel {kernel_index} of {cls.name} seats {seats[kernel_index]}; give as many agents")
    return [k for k, n in enumerate(seats) if n <= n_agents]


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
    through the split (shuffled by ``seed``), or all on ``kernel_index``; seeds derived from ``seed``. A line-up
    shorter than the game's largest table plays the kernels that seat it (two agents: two-person scenarios).
    ``env_options`` are the game's options (and may define its kernels: a user's social scenarios).
    """
    cls = env_class(env)
    if episodes < 1:
        raise RepertoryError(f"the number of episodes must be at least 1 (got {episodes})")
    kernels = load_kernels(env, split, env_options)
    playable = seatable(cls, kernels, len(agents), kernel_index)
    order: list[int] = []
    shuffler = random.Random(derive(seed, iteration, "kernels", env, split))
    specs = []
    for i in range(episodes):
        if kernel_index is not None:
            k = kernel_index
        else:
            if not order:
                order = list(playable)
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

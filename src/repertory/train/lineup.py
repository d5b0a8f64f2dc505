"""Who plays a run's episodes: the live policy in the seats it trains, the rollout's other agent (a bot, the base
model, a checkpoint, or the method's own opponents: Advantage Alignment's pool of snapshots), the held-out
evaluation's agent, and each iteration's episode specs, drawn by (seed, iteration)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from repertory.agents import Agent, LMOptions
from repertory.agents.live import LIVE, LivePolicy
from repertory.agents.lm import LMAgent
from repertory.agents.resolve import make_agent
from repertory.config import TrainConfig
from repertory.envs import Env, env_class, load_kernels
from repertory.envs.roles import RoleAdapters
from repertory.generation import Backend, SamplingParams
from repertory.models import LoadedModel
from repertory.rollout import EpisodeSpec, agent_seats, guarded_seats
from repertory.runs import RunDir
from repertory.train.learner import Learner
from repertory.train.methods import Method
from repertory.train.pool import OpponentPool
from repertory.types import Kernel, RepertoryError, derive


@dataclass
class LineUp:
    """The agents of a run and the specs of its episodes. ``opponent`` None: the live policy plays every seat (or,
    with ``pool``, the method's opponents play the seats it does not train)."""

    config: TrainConfig
    env: type[Env]
    live_policy: LivePolicy
    opponent: Agent | None
    eval_opponent: Agent | None
    kernels: list[Kernel]
    pool: OpponentPool | None = None

    @classmethod
    def build(cls, config: TrainConfig, learner: Learner, backend: Backend, method: Method, run_dir: RunDir) -> LineUp:
        """The line-up ``config`` names around the live policy: the one ``learner`` trains and ``backend``
        samples."""
        env = env_class(config.rollout.env)
        roles = RoleAdapters.of(config.rollout.env, config.model.adapters)
        params = SamplingParams(config.rollout.temperature, 1.0, config.rollout.max_new_tokens)
        live = LMAgent(
            backend, LIVE, params, config.rollout.constrained, derive(config.seed, "sampler"), LIVE, roles=roles
        )
        tokenizer, name, reference = backend.tokenizer, backend.name, learner.reference
        live_policy = LivePolicy(
            live,
            LoadedModel(learner.model, tokenizer, name, learner.peft),
            LoadedModel(reference, tokenizer, name) if reference is not None else None,
            engine=config.rollout.backend,
        )
        # rollout.opponent pool: the method's own opponents (the config allows it for adalign only)
        pool = method.opponents(learner.peft, run_dir, live) if config.rollout.opponent == "pool" else None
        if pool is not None:
            live_policy.load_snapshot = pool.load
        kernels = load_kernels(config.rollout.env, "train", config.rollout.env_options)
        line_up = cls(config, env, live_policy, None, None, kernels, pool)
        line_up.opponent = line_up.agent(config.rollout.opponent)
        if config.eval.episodes:
            line_up.eval_opponent = line_up.evaluation_agent()
        return line_up

    @property
    def live(self) -> LMAgent:
        """The live policy's agent."""
        return self.live_policy.agent

    def options(self) -> LMOptions:
        """How the line-up's other language models sample."""
        config = self.config
        return LMOptions(
            model=config.model.name,
            temperature=config.rollout.temperature,
            max_new_tokens=config.rollout.max_new_tokens,
            constrained=config.rollout.constrained,
            seed=derive(config.seed, "opponent"),
            device=config.model.device,
        )

    def agent(self, spec: str) -> Agent | None:
        """The line-up's other agent: None for the live policy itself (``self``, ``pool``), else the resolved spec."""
        if spec in ("self", "pool"):
            return None
        return make_agent(spec, self.env, self.options(), self.live_policy)

    def evaluation_agent(self) -> Agent | None:
        """The held-out line-up's agent, named as such when it does not resolve: a recipe's line-up may not exist
        in another game (the default recipe's always-cooperate is an IPD bot)."""
        spec = self.config.evaluation_opponent
        try:
            return self.agent(spec)
        except RepertoryError as exc:
            raise RepertoryError(f"the evaluations' line-up (eval.opponent) {spec!r}: {exc}") from None

    def spec_of(self, agent: Agent) -> str:
        """The spec a rollout worker resolves to this line-up agent."""
        if agent is self.live:
            return LIVE
        if agent is self.opponent:
            return self.config.rollout.opponent
        if isinstance(agent, LMAgent) and agent.name.startswith("snapshot@"):
            return agent.name
        raise RepertoryError(f"agent {agent.name!r} cannot be sent to a rollout worker")

    def specs(self, iteration: int) -> list[EpisodeSpec]:
        """The iteration's episodes: kernels drawn by (seed, iteration); each kernel's crn group of
        ``episodes_per_kernel`` episodes shares its environment seed."""
        rollout, seed = self.config.rollout, self.config.seed
        rng = random.Random(derive(seed, iteration, "kernels", rollout.env))
        n, n_kernels = rollout.kernels_per_iteration, len(self.kernels)
        picks = [rng.sample(range(n_kernels), min(n - start, n_kernels)) for start in range(0, n, n_kernels)]
        kernels = [self.kernels[k] for chunk in picks for k in chunk]
        served = self.pool.serve(iteration) if self.pool is not None else []
        specs: list[EpisodeSpec] = []
        for g, kernel in enumerate(kernels):
            for _ in range(rollout.episodes_per_kernel):
                i = len(specs)
                agents, trainable, guarded = self._seats(kernel, iteration, g, i, served)
                specs.append(
                    EpisodeSpec(
                        episode_id=f"{rollout.env}/s{seed}/i{iteration}/{i:05d}",
                        env=rollout.env,
                        kernel=kernel,
                        episode_seed=derive(seed, iteration, g, "env"),
                        agents=agents,
                        group_id=f"{kernel.id}/{iteration}/{g}",
                        iteration=iteration,
                        trainable=trainable,
                        guarded=guarded,
                        env_options=dict(rollout.env_options),
                    )
                )
        return specs

    def _seats(
        self, kernel: Kernel, iteration: int, group: int, match: int, served: list[LMAgent]
    ) -> tuple[list[Agent], list[bool], list[int]]:
        """Episode ``match``'s agents by seat, which seats train, and which are guarded."""
        n_seats = len(self.env.roles)
        if self.opponent is None and self.pool is None:
            return [self.live] * n_seats, [True] * n_seats, []
        if self.pool is not None:
            # 7.5: the trained seat (a team, in team games) alternates between crn groups.
            live = agent_seats(self.env, kernel, group) if self.env.teams else [group % n_seats]
            opponent = self.pool.draw(served, iteration, match)
        else:
            live, opponent = agent_seats(self.env, kernel, match), self.opponent
        agents = [self.live if s in live else opponent for s in range(n_seats)]
        return agents, [s in live for s in range(n_seats)], guarded_seats(self.env, agents, live)

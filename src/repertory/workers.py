"""Rollout and evaluation workers on Ray (``rollout.workers: N``, ``eval --workers N``).

The episodes of one call are cut into N contiguous shards, one per Ray actor; each actor holds its own
backend, environments and agents and plays its shard with the ordinary engine (:func:`run_episodes`).
Agents travel as their specs (``tit-for-tat``, ``base``, ``model:PATH``, ``snapshot@K``...), which every
actor resolves itself with :func:`~repertory.agents.resolve.make_agent`; ``live`` is the trainer's
:class:`~repertory.agents.live.LivePolicy`, rebuilt in the actor from its portable form and brought up to date
by :meth:`RolloutActors.publish` after every learner update (the live adapter under LoRA, all weights
otherwise), tagged with its version.

Sampling seeds depend on episode, seat and turn only, so with the ``hf`` backend a sharded call plays the
very episodes the in-process call plays. An actor that dies fails the whole call with its shard named, and
nothing of the call is returned: the caller writes nothing, and a resumed run plays the iteration again.
Snapshots (``snapshot@K``) are read from the run directory, which the actors must see (one machine, or a
shared file system).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import torch

from repertory.agents import Agent, LMOptions
from repertory.agents.live import LIVE, LivePolicy, LiveSource
from repertory.agents.resolve import make_agent
from repertory.envs import env_class
from repertory.rollout import EpisodeSpec, run_episodes
from repertory.types import Episode, Judge, RepertoryError

RAY_CLIENT_PORT = 10001  # Ray Client's port when a ray:// address names none


class RolloutWorker:
    """One actor: its own copy of the policy and its own agents; plays the shards it is sent."""

    def __init__(
        self,
        env: str,
        options: LMOptions,
        live: LiveSource | None,
        lineup: Callable[[], dict[str, Agent]] | None = None,
        cwd: str | None = None,
    ):
        """``cwd``: the caller's working directory, which the actor adopts where its node has it (a shared file
        system mounted at the same path), so relative paths in specs and the run directory mean the same."""
        if cwd is not None and os.path.isdir(cwd):
            os.chdir(cwd)
        self.env, self.options = env_class(env), options
        self.live: LivePolicy | None = None
        self.agents: dict[str, Agent] = dict(lineup()) if lineup is not None else {}
        if live is not None:
            self.live = LivePolicy.rebuild(live)
            self.agents[LIVE] = self.live.agent

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take the live policy's new weights (after a learner update) as version ``version``."""
        if self.live is None:
            raise RepertoryError("this worker has no live policy to update")
        self.live.load_weights(version, tensors)

    def agent(self, spec: str) -> Agent:
        if spec not in self.agents:
            self.agents[spec] = make_agent(spec, self.env, self.options, self.live)
        return self.agents[spec]

    def play(
        self, shard: list[tuple[EpisodeSpec, list[str]]], max_concurrent: int, schedule: str = "continuous"
    ) -> list[Episode]:
        """Play a shard: each episode's spec (without agents) and its seats' agent specs."""
        specs = [replace(spec, agents=[self.agent(name) for name in names]) for spec, names in shard]
        return run_episodes(specs, max_concurrent, schedule=schedule)

    def node(self) -> str:
        """The id of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


class RolloutActors:
    """N Ray actors playing the shards of each call, on the cluster at ``address`` (else ``RAY_ADDRESS``; a
    process connects once), or on a local one Ray starts. ``lineup`` (picklable, called in every actor) builds
    agents under names of the caller's choosing, for line-ups whose agents are not plain specs (evaluation's
    sampling options per agent)."""

    def __init__(
        self,
        n: int,
        env: str,
        options: LMOptions | None = None,
        live: LiveSource | None = None,
        lineup: Callable[[], dict[str, Agent]] | None = None,
        cpus_per_worker: float = 1,
        address: str | None = None,
    ):
        try:
            import ray
        except ImportError as error:
            raise RepertoryError("workers need Ray: pip install 'repertory[ray]'") from error
        if n < 1:
            raise RepertoryError(f"workers must be at least 1 (got {n})")
        self.ray = ray
        if not ray.is_initialized():
            _connect(ray, address or os.environ.get("RAY_ADDRESS"))
        actor = ray.remote(num_cpus=cpus_per_worker)(RolloutWorker)
        source = ray.put(live) if live is not None else None
        self.actors = [actor.remote(env, options or LMOptions(), source, lineup, os.getcwd()) for _ in range(n)]
        # built, or the error of the first that failed; then the node each one landed on
        self.nodes: list[str] = self._gather([a.node.remote() for a in self.actors], "starting", [])

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Send the live policy's new weights to every actor."""
        ref = self.ray.put({k: v.detach().cpu() for k, v in tensors.items()})
        self._gather([a.load_weights.remote(version, ref) for a in self.actors], "updating the policy", [])

    def play(
        self,
        specs: list[EpisodeSpec],
        spec_of: Callable[[Agent], str],
        max_concurrent: int = 256,
        schedule: str = "continuous",
    ) -> list[Episode]:
        """Play ``specs`` sharded over the actors (``spec_of(agent)`` names each seat's agent); episodes in spec
        order. A dead actor raises with its shard named, and nothing of the call is returned."""
        n = len(self.actors)
        bounds = [len(specs) * k // n for k in range(n + 1)]
        shards = [specs[bounds[k] : bounds[k + 1]] for k in range(n)]
        refs = [
            actor.play.remote(by_name(shard, spec_of), max_concurrent, schedule)
            for actor, shard in zip(self.actors, shards)
        ]
        results = self._gather(refs, "playing", shards)
        return [episode for shard in results for episode in shard]

    def _gather(self, refs: list[Any], doing: str, shards: list[list[EpisodeSpec]]) -> list[Any]:
        out = []
        for k, ref in enumerate(refs):
            try:
                out.append(self.ray.get(ref))
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as error:
                shard = shards[k] if shards else []
                episodes = f" episodes {shard[0].episode_id} to {shard[-1].episode_id}" if shard else ""
                first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise RepertoryError(
                    f"worker {k} of {len(refs)} failed {doing}{episodes}: {first_line}; nothing of this call was kept"
                ) from error
        return out

    def close(self) -> None:
        """End the actors."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []


def _connect(ray: Any, address: str | None) -> None:
    """Join the Ray cluster at ``address`` (None: start a local one). An address where nothing listens fails here
    at once, where Ray itself would retry for minutes."""
    if address not in (None, "", "auto", "local"):
        client = address.startswith("ray://")
        try:
            parts = urlsplit(address if client else f"//{address}")
            port = parts.port or (RAY_CLIENT_PORT if client else None)
            if parts.hostname is None or port is None:
                raise ValueError("expected HOST:PORT, [IPv6]:PORT or ray://HOST[:PORT]")
            socket.create_connection((parts.hostname, port), timeout=10).close()
        except (OSError, ValueError) as error:
            raise RepertoryError(
                f"no Ray cluster answers at {address!r} ({error}): start one with `ray start --head` and pass the "
                "address it prints (rollout.ray_address or RAY_ADDRESS)"
            ) from None
    ray.init(address=address or None, include_dashboard=False, log_to_driver=False)


def by_name(specs: list[EpisodeSpec], spec_of: Callable[[Agent], str]) -> list[tuple[EpisodeSpec, list[str]]]:
    """Episode specs as a worker takes them: without agents, each seat's agent named by its spec."""
    return [(replace(spec, agents=[]), [spec_of(agent) for agent in spec.agents]) for spec in specs]


@dataclass
class LocalSampler:
    """A rollout worker in this process (its own copy of the policy) as an asynchronous pipeline's sampler."""

    worker: RolloutWorker
    spec_of: Callable[[Agent], str]
    max_concurrent: int
    schedule: str

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.worker.load_weights(version, tensors)

    def play(self, specs: list[EpisodeSpec]) -> list[Episode]:
        return self.worker.play(by_name(specs, self.spec_of), self.max_concurrent, self.schedule)


@dataclass
class ActorSampler:
    """The Ray workers as an asynchronous pipeline's sampler."""

    actors: RolloutActors
    spec_of: Callable[[Agent], str]
    max_concurrent: int
    schedule: str

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.actors.publish(version, tensors)

    def play(self, specs: list[EpisodeSpec]) -> list[Episode]:
        return self.actors.play(specs, self.spec_of, self.max_concurrent, self.schedule)


def play(
    specs: list[EpisodeSpec],
    workers: RolloutActors | None,
    names: dict[str, Agent],
    max_concurrent: int = 64,
    on_episode: Callable[[Episode], None] | None = None,
    judge: Judge | None = None,
) -> list[Episode]:
    """Play ``specs`` in this process (``judge`` scoring them), or over ``workers`` whose line-up calls these
    agents by ``names``."""
    if workers is None:
        return run_episodes(specs, max_concurrent, on_episode, judge)
    spec_of = {id(agent): name for name, agent in names.items()}
    played = workers.play(specs, lambda agent: spec_of[id(agent)], max_concurrent)
    for episode in played if on_episode is not None else []:
        on_episode(episode)
    return played

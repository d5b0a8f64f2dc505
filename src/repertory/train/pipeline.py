"""Asynchronous rollouts (``rollout.max_staleness: k``, k >= 1): the next iterations are played in a
background thread, with a copy of the policy, while the learner trains on this one.

The schedule is fixed, never raced: iteration j is sampled by the policy after ``max(start, j - k)``
iterations (``start``: the iterations done when the run started or resumed). So what an iteration plays does
not depend on which side runs faster, a run is reproducible at any k, and no sample is ever more than k
versions older than the learner that trains on it: the bound is kept by making the sampler wait for the
version it needs, not by dropping or re-sampling stale episodes (which would waste the samples whose
generation is the expensive half). The one waste is at a stop: iterations played ahead and not yet learned
are discarded (a resumed run plays them again with its restored policy, so within the bound but not the same
episodes); :meth:`AsyncRollouts.close` counts them.

The sampler is anything with ``update(version, weights)`` and ``play(specs)``: a rollout worker in this
process (its own copy of the policy, so the learner's module is never read while it is written) or the Ray
workers of ``rollout.workers``. The learner corrects for the version gap with the sampler's recorded
log-probs (``algo.rollout_correction``; auto is tis under async rollouts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from repertory.rollout import EpisodeSpec
from repertory.types import Episode

Weights = dict[str, torch.Tensor]


class Sampler(Protocol):
    """What plays the episodes ahead of the learner, with weights it is sent."""

    def publish(self, version: int, tensors: Weights) -> None: ...

    def play(self, specs: list[EpisodeSpec]) -> list[Episode]: ...


@dataclass
class Played:
    """One iteration's episodes, played ahead: by which policy version, in how long."""

    iteration: int
    episodes: list[Episode]
    version: int
    rollout_s: float


def sampled_by(iteration: int, start: int, staleness: int) -> int:
    """The iterations done by the policy that samples ``iteration``: ``max(start, iteration - staleness)``."""
    return max(start, iteration - staleness)


def staleness_metrics(episodes: list[Episode], learner_version: int) -> dict[str, float]:
    """How many versions behind the learner (``learner_version``) the trained turns were sampled: mean, max
    and the share of turns at each gap."""
    gaps = [
        learner_version - turn.policy_version
        for ep in episodes
        for turn in ep.turns
        if ep.seat(turn.seat_id).trainable and turn.response_ids
    ]
    if not gaps:
        return {}
    line = {"async/staleness": sum(gaps) / len(gaps), "async/staleness_max": float(max(gaps))}
    for gap in sorted(set(gaps)):
        line[f"async/turns_at_gap/{gap}"] = gaps.count(gap) / len(gaps)
    return line


class AsyncRollouts:
    """Plays iterations ``start .. stop - 1`` in a background thread on the fixed schedule of
    :func:`sampled_by`; the learner :meth:`publish`-es its weights after each update and :meth:`take`-s each
    iteration's episodes in order."""

    def __init__(
        self,
        sampler: Sampler,
        specs: Callable[[int], list[EpisodeSpec]],
        staleness: int,
        start: int,
        stop: int,
        version: int,
        weights: Weights,
    ):
        if staleness < 1:
            raise ValueError(f"asynchronous rollouts need a staleness of at least 1 (got {staleness})")
        self.sampler, self.specs, self.staleness = sampler, specs, staleness
        self.start, self.stop = start, stop
        self._published: dict[int, tuple[int, Weights]] = {start: (version, _copy(weights))}
        self._played: dict[int, Played] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="repertory-rollouts", daemon=True)
        self._thread.start()

    def publish(self, done: int, version: int, weights: Weights) -> None:
        """The learner's policy after ``done`` iterations, as ``version``; versions no iteration still needs are
        dropped."""
        with self._cond:
            self._published[done] = (version, _copy(weights))
            oldest = min(sampled_by(j, self.start, self.staleness) for j in range(done, max(done + 1, self.stop)))
            for key in [k for k in self._published if k < oldest]:
                del self._published[key]
            self._cond.notify_all()

    def take(self, iteration: int) -> tuple[Played, float]:
        """``iteration``'s episodes (waiting for them) and the seconds waited; the sampler's error, if it
        failed."""
        begin = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: iteration in self._played or self._error is not None)
            if iteration not in self._played:
                raise self._error  # type: ignore[misc]
            played = self._played.pop(iteration)
        return played, time.perf_counter() - begin

    def close(self) -> int:
        """Stop after the iteration in play (if any); returns how many episodes were played and never taken."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            return sum(len(p.episodes) for p in self._played.values())

    def _run(self) -> None:
        loaded: int | None = None
        try:
            for iteration in range(self.start, self.stop):
                need = sampled_by(iteration, self.start, self.staleness)
                with self._cond:
                    self._cond.wait_for(lambda need=need: need in self._published or self._closing)
                    if self._closing:
                        return
                    version, weights = self._published[need]
                if need != loaded:
                    self.sampler.publish(version, weights)
                    loaded = need
                begin = time.perf_counter()
                episodes = self.sampler.play(self.specs(iteration))
                played = Played(iteration, episodes, version, time.perf_counter() - begin)
                with self._cond:
                    self._played[iteration] = played
                    self._cond.notify_all()
        except BaseException as error:  # handed to the learner's take(), which raises it
            with self._cond:
                self._error = error
                self._cond.notify_all()


def _copy(weights: Weights) -> Weights:
    """A detached CPU copy: the learner keeps updating its tensors in place."""
    return {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}

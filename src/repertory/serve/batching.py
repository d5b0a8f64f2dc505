"""The generation thread of ``repertory serve``: requests are batched the way the rollout engine batches seats.

Handlers put jobs on a queue, and one thread drains it each tick, samples every job of the tick with as few
backend calls as there are distinct sampling settings, writes the tick's completions to the log as one Parquet
part (:mod:`repertory.store.served`), and only then answers. A killed server therefore loses at most the
requests in flight; a completion that could not be logged is not returned (the log is the product)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from repertory.envs.parsing import clean
from repertory.generation import SYNCED, Backend, Generation, GenerationRequest, SamplingParams
from repertory.serve.protocol import ServeError, cut_at_stop
from repertory.store.served import ServedLog, ServedTurn

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One request waiting for the generation thread; ``turn`` is filled in and logged before ``future`` is set."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    cache_key: object
    max_chars: int | None
    turn: ServedTurn
    on_text: Callable[[str], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def enough(self, text: str) -> bool:
        """Called by the backend every few tokens with the text so far: streams it, and ends the row early
        once the client is gone or the game reads no more."""
        if self.cancelled.is_set():
            return True
        if self.on_text is not None:
            self.on_text(text)
        return self.max_chars is not None and len(clean(text, self.max_chars + 1)) > self.max_chars

    def request(self, adapter: str | None) -> GenerationRequest:
        """The backend's row for this job, sampled by ``adapter`` (None: the backend's synced policy)."""
        return GenerationRequest(
            self.prompt_ids, self.seed, cache_key=self.cache_key, enough=self.enough, adapter=adapter or SYNCED
        )


class Batcher:
    """The generation thread: drains the queue each tick, samples, logs the tick as one part, answers."""

    def __init__(self, backend: Backend, served_log: ServedLog, max_pending: int, adapter: str | None = None):
        """``adapter``: the LoRA adapter every row runs through (a per-role run's); None: the backend's own."""
        self.backend, self.log, self.adapter = backend, served_log, adapter
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_pending)
        self.ticks = self.completions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repertory-serve-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        while not self.queue.empty():
            self.queue.get_nowait().future.set_exception(
                ServeError(503, "the server is shutting down", "shutting_down")
            )

    def submit(self, job: Job) -> None:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise ServeError(
                503, "too many requests are waiting; retry shortly", "overloaded", "server_error", {"Retry-After": "1"}
            ) from None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = [self.queue.get(timeout=0.05)]
            except queue.Empty:
                continue
            while True:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._tick(jobs)

    def _tick(self, jobs: list[Job]) -> None:
        answered = self._answer(self._sample(jobs))
        try:
            self.log.append_turns([job.turn for job in answered])
        except Exception as exc:  # unlogged completions are not returned: the log is the product
            log.exception("writing the log failed")
            for job in answered:
                job.future.set_exception(
                    ServeError(500, f"could not write the log: {type(exc).__name__}", "log_error", "server_error")
                )
            return
        self.ticks += 1
        self.completions += len(answered)
        for job in answered:
            job.future.set_result(job.turn)

    def _sample(self, jobs: list[Job]) -> list[tuple[Job, Generation]]:
        """One backend call per distinct sampling setting; a call that fails fails its requests only."""
        groups: dict[SamplingParams, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.params, []).append(job)
        done: list[tuple[Job, Generation]] = []
        for params, group in groups.items():
            try:
                generations = self.backend.generate([j.request(self.adapter) for j in group], params)
            except Exception as exc:  # one bad batch fails its requests, never the server
                log.exception("generation failed")
                for job in group:
                    job.future.set_exception(
                        ServeError(500, f"generation failed: {type(exc).__name__}", "generation_error", "server_error")
                    )
                continue
            done.extend(zip(group, generations))
        return done

    def _answer(self, done: list[tuple[Job, Generation]]) -> list[Job]:
        """Fill in each sampled job's turn (its text cut at a stop string); jobs whose client left are dropped."""
        finished = time.time()
        answered = []
        for job, generation in done:
            if job.cancelled.is_set():
                job.future.cancel()
                continue
            text, stopped = cut_at_stop(self.backend.decode(generation.response_ids), job.params.stop)
            turn = job.turn
            turn.response, turn.response_ids, turn.logp_sample = text, generation.response_ids, generation.logp_sample
            turn.finish_reason = "stop" if stopped or generation.finish == "stop" else "length"
            turn.finished = finished
            answered.append(job)
        return answered

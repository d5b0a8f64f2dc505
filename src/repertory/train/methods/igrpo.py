"""Iterative GRPO (``method.kind: igrpo``; docs/algorithms.md 5.4, 5.5): each round fits a step-level Q-function
on the round's logged turns (kernel-split validation, early stopping, warm start from the last round), then runs
single-turn GRPO over the logged states with candidates sampled from the live policy and scored by Q. The
Q-function (its own LoRA on a copy of the initial model, or on ``q.model``, and a scalar head) is this method's
state."""

from __future__ import annotations

import copy
import random
import statistics
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from repertory.algos import offline
from repertory.config import IGRPOConfig
from repertory.models import LoadedModel, load_model
from repertory.store.turns import LoggedTurn
from repertory.train.batch import Batch, single_turn_batch
from repertory.train.heads import QFunction, fit_q, q_examples
from repertory.train.methods.base import Laps, RoundContext, RoundMethod, chunks, register_method
from repertory.train.turns import kernel_split
from repertory.types import Episode, RepertoryError, derive

Q_FILE = "q.safetensors"


class _Tally:
    """A round's running sums: the update's statistics per step, and the candidates' Q values, per-state spread
    and gate."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.steps = self.gated = 0
        self.rewards: list[float] = []
        self.spreads: list[float] = []

    def add_candidates(self, groups: list[list[float]], valid: list[bool]) -> None:
        self.rewards += [r for group in groups for r in group]
        self.spreads += [statistics.stdev(group) if len(group) > 1 else 0.0 for group in groups]
        self.gated += valid.count(False)

    def add_step(self, stats: dict[str, float]) -> None:
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1

    def metrics(self, states: int) -> dict[str, float]:
        metrics = {key: value / self.steps for key, value in self.sums.items()} if self.steps else {}
        metrics["igrpo/steps"] = float(self.steps)
        metrics["igrpo/states"] = float(states)
        metrics["igrpo/candidate_q"] = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
        # Advantages divide by this spread: near 0, they amplify the Q-function's noise to unit scale.
        metrics["igrpo/candidate_q_std"] = sum(self.spreads) / len(self.spreads) if self.spreads else 0.0
        metrics["igrpo/gated_rate"] = self.gated / len(self.rewards) if self.rewards else 0.0
        return metrics


@register_method(IGRPOConfig)
class IGRPO(RoundMethod):
    """Q-function fit, then single-turn GRPO over the logged states with Q as the reward."""

    config: IGRPOConfig

    def __init__(self, config: Any, seed: int, initial: LoadedModel, device: str | None):
        super().__init__(config, seed, initial, device)
        backbone = copy.deepcopy(initial.model) if config.q.model is None else load_model(config.q.model, device).model
        pad = initial.tokenizer.pad_token_id if initial.tokenizer.pad_token_id is not None else 0
        self.q = QFunction(backbone, config.q, seed, pad)

    def save(self, directory: Path) -> None:
        save_file(self.q.state(), str(directory / Q_FILE))

    def load(self, directory: Path) -> None:
        if not (directory / Q_FILE).is_file():
            raise RepertoryError(f"checkpoint {directory} has no Q-function ({Q_FILE}) to warm-start from")
        self.q.load(load_file(str(directory / Q_FILE)))

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        laps = Laps()
        with laps("q_fit"):
            metrics = self.train_q(ctx, round_index, turns)
        tally = _Tally()
        for epoch in range(self.config.epochs):
            order = list(range(len(turns)))
            random.Random(derive(self.seed, round_index, epoch, "igrpo")).shuffle(order)
            for chunk in chunks(order, self.config.states_per_step):
                key = (round_index, epoch, "candidate")
                batch, adv = self.scored_candidates(ctx, [turns[i] for i in chunk], episodes, key, laps, tally)
                if not batch.sequences:
                    continue
                with laps("update"):
                    ctx.backend.offload()
                    ctx.learner.score(batch)
                    batch.assign(adv)
                    stats = ctx.learner.update(batch, f"igrpo/{round_index}/{epoch}/{tally.steps}", 1, 1)
                    ctx.publish()  # the next step samples its candidates from the updated policy
                tally.add_step(stats)
        return {**metrics, **tally.metrics(len(turns) * self.config.epochs), **laps.metrics()}

    def scored_candidates(
        self,
        ctx: RoundContext,
        states: list[LoggedTurn],
        episodes: dict[str, Episode],
        key: tuple,
        laps: Laps,
        tally: _Tally,
    ) -> tuple[Batch, dict[int, torch.Tensor]]:
        """The batch of one optimiser step: ``candidates`` fresh responses per state, scored by Q (0 where the
        format gate rejects them), their advantages centred (and scaled) within each state's group."""
        n = self.config.candidates
        with laps("candidates"):
            generations, replayed, state_grammars = ctx.sample(states, episodes, n, key)
        with laps("q_score"):
            rewards = self.q.score_groups(
                [list(x.prompt_ids) for x in states],
                [[g.response_ids for g in generations[j * n : (j + 1) * n]] for j in range(len(states))],
                ctx.algo.micro_batch_tokens,
            )
        valid = self.gate(ctx, [g.response_ids for g in generations], replayed)
        groups = [rewards[j * n : (j + 1) * n] for j in range(len(states))]
        tally.add_candidates(groups, valid)
        advantages = [
            a
            for j, group in enumerate(groups)
            for a in offline.candidate_advantages(group, valid[j * n : (j + 1) * n], self.config.scale_advantages)
        ]
        prompts = [x.prompt_ids for x in states for _ in range(n)]
        grammars = [grammar for grammar in state_grammars for _ in range(n)]
        return single_turn_batch(prompts, [g.response_ids for g in generations], advantages, grammars)

    def train_q(self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn]) -> dict[str, float]:
        """Fit Q on the round's turns (or every round's, ``q.data``), warm from the last round after round 0."""
        q = self.config.q
        data = turns if q.data == "round" else ctx.history(round_index, turns, {})[0]
        q_train, q_val = kernel_split([t.kernel_id for t in data], q.val_fraction, self.seed)
        return fit_q(
            self.q,
            q_examples([t for t in data if t.kernel_id in q_train]),
            q_examples([t for t in data if t.kernel_id in q_val]),
            q,
            self.seed,
            round_index,
            warm=round_index > 0,
            micro_tokens=ctx.algo.micro_batch_tokens,
        )

    def gate(self, ctx: RoundContext, candidates: list[list[int]], replayed: list[Any]) -> list[bool]:
        """Whether each candidate is a move the replayed referee accepts (all, without ``format_gate`` or for
        users' logs, which carry no game state to check)."""
        n = self.config.candidates
        valid = [True] * len(candidates)
        for j, state in enumerate(replayed):
            if self.config.format_gate and state is not None:
                env, role = state
                texts = [ctx.backend.decode(ids) for ids in candidates[j * n : (j + 1) * n]]
                valid[j * n : (j + 1) * n] = [env.validate(role, text)[0] for text in texts]
        return valid
